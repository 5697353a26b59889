"""Named HTTP clients of `codecage serve --http`: who a bearer token belongs to, and what that
client may do (`[serve.clients.NAME]`).

Each client's token is read from the environment variable its table names (never from the
config file); `--token` / CODECAGE_TOKEN is the client "default". A request's token is
compared with every client's in constant time, all of them every time (no early exit that
would time which one matched), and no token is ever logged. The gate (`mcp.http`) puts the
name in the request's scope (`callers.SCOPE_CLIENT_KEY`): the audit record names it, and
`ClientLimits` bound its runs: per minute (a sliding window), at once, and the largest
memory and timeout a call may ask for. One `ClientLimits` serves every face of the server
(execute_code, open_session, SandboxFusion's POST /run_code), keyed by the verified client
name, so a client's runs count together wherever they come from. A refusal says when to
retry (`ClientRefused.retry_after_s`): over MCP a tool error (content the model reads in
every client; docs/mcp.md weighs it against an HTTP 429), on /run_code an HTTP 429 with
Retry-After; either is told to `on_refused` (the alerts' `client_blocked`).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from codecage.errors import ConfigError
from codecage.models import ClientSettings

DEFAULT_CLIENT = "default"
WINDOW_S = 60.0


class ClientRefused(ConfigError):
    """A client over its rate or at its concurrent runs: busy, not wrong; retry later."""

    def __init__(self, message: str, hint: str, retry_after_s: int) -> None:
        super().__init__(message, hint=hint)
        self.retry_after_s = retry_after_s
        """Seconds after which the same call may be admitted (at least 1)."""


@dataclass(frozen=True, slots=True)
class ClientTokens:
    """Every accepted bearer token and its client's name."""

    by_name: Mapping[str, bytes]

    @classmethod
    def load(
        cls,
        clients: Mapping[str, ClientSettings],
        default_token: str | None,
        environ: Mapping[str, str] | None = None,
    ) -> ClientTokens | None:
        """The tokens of `clients` (from their variables) and `default_token`; None when
        there are none (the server then runs without a token, if it may).

        Raises:
            ConfigError: a variable is unset or empty, or two clients share a token.
        """
        env = os.environ if environ is None else environ
        tokens: dict[str, bytes] = {}
        if default_token:
            tokens[DEFAULT_CLIENT] = default_token.encode()
        for name, settings in clients.items():
            value = env.get(settings.token_env, "").strip()
            if not value:
                raise ConfigError(
                    f"serve.clients.{name}: its token variable {settings.token_env} is unset "
                    "or empty",
                    hint=f"export {settings.token_env}=<a long random token> before serve",
                )
            tokens[name] = value.encode()
        if len(set(tokens.values())) != len(tokens):
            raise ConfigError(
                "two HTTP clients have the same token: the audit trail could not tell them apart",
                hint="give each [serve.clients.NAME] a token of its own",
            )
        return cls(tokens) if tokens else None

    def identify(self, authorization: bytes) -> str | None:
        """The client whose token `authorization` ("Bearer <token>") carries, or None.
        Digests are compared, not the tokens: compare_digest's time may tell a length."""
        kind, _, given = authorization.partition(b" ")
        presented = given.strip() if kind.lower() == b"bearer" else b""
        digest = hashlib.sha256(presented).digest()
        found: str | None = None
        for name, token in self.by_name.items():  # every one, every time: no timing tell
            if hmac.compare_digest(digest, hashlib.sha256(token).digest()) and presented:
                found = name
        return found


@dataclass
class _Usage:
    started: collections.deque[float] = field(default_factory=collections.deque)
    running: int = 0


@dataclass
class ClientLimits:
    """What each named client may run; `admit` before a run, `done` after it."""

    settings: Mapping[str, ClientSettings]
    on_refused: Callable[[str, str], None] | None = None
    clock: Callable[[], float] = time.monotonic
    _usage: dict[str, _Usage] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def bounds(self, client: str | None) -> ClientSettings | None:
        return self.settings.get(client) if client else None

    def check_request(
        self,
        client: str | None,
        *,
        memory_mb: int | None,
        timeout: float | None,
        names: tuple[str, str] = ("memory_limit_mb", "timeout"),
    ) -> None:
        """Refuse a call that asks for more than its client may; `names` are the face's
        spellings of the memory and the timeout (execute_code's by default).

        Raises:
            ConfigError: the memory or the timeout above the client's bound.
        """
        bounds = self.bounds(client)
        if bounds is None:
            return
        memory_name, timeout_name = names
        if memory_mb is not None and bounds.max_memory_mb and memory_mb > bounds.max_memory_mb:
            self._refuse(
                client or "",
                f"{memory_name}={memory_mb} is above client {client!r}'s maximum of "
                f"{bounds.max_memory_mb} MiB",
                f"ask for {bounds.max_memory_mb} MiB or less",
            )
        if timeout is not None and bounds.max_timeout and timeout > bounds.max_timeout:
            self._refuse(
                client or "",
                f"{timeout_name}={timeout:g} is above client {client!r}'s maximum of "
                f"{bounds.max_timeout:g} s",
                "ask for a shorter timeout, or split the work",
            )

    def within(
        self,
        client: str | None,
        *,
        timeout: float | None,
        memory_mb: int | None,
        defaults: tuple[float, int],
        names: tuple[str, str] = ("memory_limit_mb", "timeout"),
    ) -> tuple[float | None, int | None]:
        """A call's timeout and memory (None: not asked) within its client's bounds: above
        them refused (as `check_request`); not asked, and the server's default (`defaults`:
        timeout, memory) above the bound, the bound.

        Raises:
            ConfigError: the call asks for more than its client may.
        """
        bounds = self.bounds(client)
        if bounds is None:
            return timeout, memory_mb
        self.check_request(client, memory_mb=memory_mb, timeout=timeout, names=names)
        default_timeout, default_memory_mb = defaults
        if timeout is None and bounds.max_timeout and default_timeout > bounds.max_timeout:
            timeout = bounds.max_timeout
        if memory_mb is None and bounds.max_memory_mb and default_memory_mb > bounds.max_memory_mb:
            memory_mb = bounds.max_memory_mb
        return timeout, memory_mb

    def admit(self, client: str | None) -> None:
        """Count a run of `client` starting, or refuse it.

        Raises:
            ClientRefused: the client is over its rate or at its concurrent runs.
        """
        bounds = self.bounds(client)
        if bounds is None or client is None:
            return
        with self._lock:
            usage = self._usage.setdefault(client, _Usage())
            now = self.clock()
            while usage.started and now - usage.started[0] >= WINDOW_S:
                usage.started.popleft()
            rate = bounds.runs_per_minute
            if rate is not None and len(usage.started) >= rate:
                retry = math.ceil(WINDOW_S - (now - usage.started[0]))
                wait = max(retry, 1)
                refused = ClientRefused(
                    f"client {client!r} is over its rate of {rate} runs per minute",
                    f"retry in {wait} s",
                    wait,
                )
            elif bounds.max_concurrent is not None and usage.running >= bounds.max_concurrent:
                refused = ClientRefused(
                    f"client {client!r} has {usage.running} runs going, its maximum",
                    "retry when one of them has ended",
                    1,
                )
            else:
                usage.started.append(now)
                usage.running += 1
                return
        if self.on_refused is not None:
            self.on_refused(client, refused.message)
        raise refused

    def done(self, client: str | None) -> None:
        if self.bounds(client) is None or client is None:
            return
        with self._lock:
            usage = self._usage.get(client)
            if usage is not None and usage.running > 0:
                usage.running -= 1

    def _refuse(self, client: str, message: str, hint: str) -> None:
        if self.on_refused is not None:
            self.on_refused(client, message)
        raise ConfigError(message, hint=hint)
