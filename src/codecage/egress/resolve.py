"""Names to addresses, on the host: IP literals as they are, a static table first (tests,
hosts without DNS: `[network] resolve`), else the host's resolver, within a bounded time.

The proxy connects to exactly the address returned here (no second lookup), so what the
policy checked is what is reached.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Mapping, Sequence

from codecage.models.hosts import IPAddress, normal_name

RESOLVE_TIMEOUT_S = 5.0


class ResolveError(Exception):
    """A name that could not be resolved; `str()` is the reason, for the client and record."""


class Resolver:
    """Resolves host names for the proxy: static table, then `getaddrinfo` (TCP)."""

    def __init__(
        self,
        static: Mapping[str, Sequence[str]] | None = None,
        *,
        timeout_s: float = RESOLVE_TIMEOUT_S,
    ) -> None:
        self._static = {
            normal_name(name): [ipaddress.ip_address(a) for a in addresses]
            for name, addresses in (static or {}).items()
        }
        self._timeout_s = timeout_s

    async def resolve(self, host: str, port: int) -> list[IPAddress]:
        """The addresses of `host`, in the order to try them (duplicates removed).

        Raises:
            ResolveError: the name is unknown, the lookup failed or took too long.
        """
        name = normal_name(host)
        literal = _literal(name)
        if literal is not None:
            return [literal]
        if name in self._static:
            return list(self._static[name])
        return await self._lookup(name, port)

    async def _lookup(self, name: str, port: int) -> list[IPAddress]:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._timeout_s):
                infos = await loop.getaddrinfo(
                    name, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
                )
        except TimeoutError:
            raise ResolveError(f"resolving {name} took longer than {self._timeout_s:g} s") from None
        except (OSError, UnicodeError) as exc:
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ResolveError(f"{name} could not be resolved: {detail}") from None
        found: dict[IPAddress, None] = {}
        for *_, sockaddr in infos:
            address = _literal(str(sockaddr[0]))
            if address is not None:
                found[address] = None
        if not found:
            raise ResolveError(f"{name} has no IPv4 or IPv6 address")
        return list(found)


def _literal(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None
