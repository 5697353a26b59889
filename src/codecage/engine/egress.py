"""A sandbox's egress: its own socket on the host proxy, what it binds and its environment;
a run's grant on that socket, and what the proxy saw, as the result's events.

A sandbox made for egress (`SandboxSpec.egress`) still has its own network namespace with
only loopback: seccomp lets it make IP sockets, but nothing leaves except through the
relay (guest/relay.py) to the Unix socket bound at `contract.EGRESS_SOCKET`. The host
proxy knows the run by that socket (one per sandbox), and refuses everything on it until
the run's request grants its hosts (`grant`), and again once the run is over (`revoke`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from codecage.egress.environment import proxy_env
from codecage.guest import contract
from codecage.isolation import rootfs
from codecage.isolation.identity import Identity
from codecage.models import Event

if TYPE_CHECKING:
    from codecage.egress.proxy import RunEgress
    from codecage.egress.records import ConnectionRecord
    from codecage.egress.setup import EgressSetup

_PIP_ROOT = f"{contract.GUEST_ROOT}/opt/pip"
MAX_NETWORK_EVENTS = 40
"""Connections recorded one event each; past this, one event counts the rest."""


def open_socket(
    setup: EgressSetup,
    run_dir: Path,
    cleanup: contextlib.ExitStack,
    owner: Identity,
    *,
    launcher: Identity | None = None,
) -> RunEgress:
    """This sandbox's socket on the proxy, in `run_dir/egress` (closed by `cleanup`),
    connectable by the sandbox's own host id (`owner`) only, and by `launcher`'s when the
    backend's own process connects for it (`EgressSetup.open_socket`)."""
    listener = setup.open_socket(run_dir / "egress", owner, launcher=launcher)
    cleanup.callback(listener.close)
    return listener


def mounts(run_dir: Path, pip: Path | None) -> tuple[rootfs.Mount, ...]:
    """The egress directory, read-only (a socket is connectable on a read-only mount), and
    pip (the host's package, `pip_package`), read-only, so that `python -m pip install
    --target DIR PKG` works through the proxy (into the run's own writable places: the
    workspace, /tmp). Pure."""
    found = [rootfs.Mount("ro-bind", contract.EGRESS_DIR, str(run_dir / "egress"))]
    if pip is not None:
        found.append(rootfs.Mount("ro-bind", f"{_PIP_ROOT}/pip", str(pip)))
    return tuple(found)


@functools.cache
def pip_package() -> Path | None:
    """The host's pip package (the one codecage's own environment has); None without one."""
    spec = importlib.util.find_spec("pip")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def env(setup: EgressSetup, *, pip: bool) -> dict[str, str]:
    """What points the code's HTTP clients (urllib, requests, httpx, pip, curl) at the relay
    (`pip`: the host's pip is bound, `mounts`). Pure."""
    found = proxy_env(with_ca=setup.ca_bundle is not None)
    found["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    found["PIP_CACHE_DIR"] = "/tmp/pip-cache"  # noqa: S108 - the sandbox's private /tmp
    if pip:
        found["PYTHONPATH"] = _PIP_ROOT  # for `python -m pip`; the guest itself runs with -I
    found.update(setup.extra_env)
    return found


def finish(listener: RunEgress | None) -> list[Event]:
    """End the run's grant and make its connections the result's events."""
    if listener is None:
        return []
    listener.revoke()
    return [*events(listener.records()), usage_event(listener)]


def usage_event(listener: RunEgress) -> Event:
    """What the proxy spent on this run: its work is done in the host process, outside
    the run's cgroup, so it is charged here, on the run's record."""
    used = listener.usage()
    return Event(
        kind="network_usage",
        detail=(
            f"egress proxy: {used.connections} connections ({used.refused_at_accept} more "
            f"refused at accept), {used.bytes_out} B out, {used.bytes_in} B in, "
            f"{used.cpu_ms:.1f} ms CPU"
        ),
        data=dataclasses.asdict(used),
    )


def events(records: list[ConnectionRecord]) -> list[Event]:
    """One event per connection, up to `MAX_NETWORK_EVENTS`, then one counting the rest."""
    found = [_event(r) for r in records[:MAX_NETWORK_EVENTS]]
    rest = records[MAX_NETWORK_EVENTS:]
    if rest:
        refused = sum(not r.allowed for r in rest)
        found.append(
            Event(
                kind="network_denied" if refused else "network_allowed",
                detail=f"{len(rest)} more connections ({refused} refused) not listed one by one",
                data={"more": len(rest), "refused": refused},
            )
        )
    return found


def _event(record: ConnectionRecord) -> Event:
    where = f"{record.host}:{record.port}"
    data: dict[str, Any] = {
        "host": record.host,
        "port": record.port,
        "address": record.address,
        "method": record.method,
        "status": record.status,
        "bytes_out": record.bytes_out,
        "bytes_in": record.bytes_in,
        "duration_ms": record.duration_ms,
        "reason": record.reason,
    }
    if not record.allowed:
        return Event(kind="network_denied", detail=f"{where} refused: {record.reason}", data=data)
    detail = f"{record.method} {where} ({record.bytes_out} B out, {record.bytes_in} B in)"
    if record.reason:
        detail += f", cut off: {record.reason}"
    return Event(kind="network_allowed", detail=detail, data=data)
