"""Shared fixtures: a real Sandbox, canaries, a null runner, and a leak guard.

Containment tests take the `runner` fixture, which runs each test twice: once in a real
sandbox, and once on the null runner (plain `python3` in a subprocess, no isolation),
where the test is *expected to fail* (strict xfail). A containment test that passes
without the sandbox proves nothing, and the suite reports it as XPASS(strict) = failure.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tests._proc import cmdline
from tests._session_audit import SESSION_STORE
from tests._tiers import LONG, SERIAL

from codecage import Options, Sandbox
from codecage.audit import journal as audit_journal
from codecage.audit import store as audit_store
from codecage.bridge import channel as bridge_channel
from codecage.cli import audit as audit_cli
from codecage.engine import forkserver, guardian
from codecage.engine import workspace as workspaces
from codecage.isolation import cgroups
from containment._support import (
    Outcome,
    against_baseline,
    answering,
    outcome_of,
    run_unsandboxed,
)


@pytest.fixture(scope="session", autouse=True)
def session_audit_store() -> Iterator[Path]:
    """The audit store this test run writes where it would write the default one (an MCP
    face's trail, `codecage audit` without --store): its own file, not the host-wide
    /var/lib/codecage/audit.db that every codecage process of the host shares (a test run
    left its records there, beside other runs' of other versions). Subprocesses get it as
    CODECAGE_AUDIT (`test_server.server_env`)."""
    with pytest.MonkeyPatch.context() as patch:
        for module in (audit_store, audit_journal, audit_cli):  # each took it by name
            patch.setattr(module, "default_location", lambda environ=None: SESSION_STORE)
        yield SESSION_STORE
    shutil.rmtree(SESSION_STORE.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def sandbox() -> Sandbox:
    """A real bwrap Sandbox with the import policy off: the containment and engine tests
    prove the OS layers, which must hold whatever the code imports (ctypes, os, socket).
    The policy itself is tested in test_profiles.py. The self-test must pass here.
    Scrubbing is off too: a leaked canary that looks like a secret would otherwise come
    back as [SECRET] and a containment test would pass for the wrong reason."""
    return Sandbox(options=Options(import_policy=False, scrub=False))


# --- tiers: long and serial (tests/_tiers.py, docs/testing.md) --------------------------


def tier_names(item: pytest.Item) -> tuple[str, str, str]:
    """The names a tier entry may give this test: its file, `file::function`, its node id."""
    path = item.nodeid.split("::", 1)[0]
    return path, f"{path}::{getattr(item, 'originalname', item.name)}", item.nodeid


_SERIAL = {name: why for why, names in SERIAL.items() for name in names}
COLLECTED: set[str] = set()
"""Every name a tier entry could give a test of this session, before `-m` deselects any
(tests/test_tiers.py checks the entries against it)."""


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the tests tests/_tiers.py names: `long` (scripts/test-long runs them, not
    scripts/test) and `serial` (scripts/test runs them alone, before the workers)."""
    for item in items:
        names = tier_names(item)
        COLLECTED.update(names)
        if any(name in LONG for name in names):
            item.add_marker(pytest.mark.long)
        why = next((_SERIAL[name] for name in names if name in _SERIAL), None)
        if why is not None:
            item.add_marker(pytest.mark.serial(why))


# --- the runner: sandbox vs no isolation -----------------------------------------------


Runner = Callable[..., Outcome]


def _run_sandboxed(sandbox: Sandbox) -> Runner:
    def run(code: str, **limits: Any) -> Outcome:
        return outcome_of(sandbox.run(code, limits=limits))

    return run


def _run_unsandboxed(code: str, **limits: Any) -> Outcome:
    """Plain python3 in a subprocess, with only the wall timeout: no isolation at all."""
    with tempfile.TemporaryDirectory() as cwd:
        return run_unsandboxed(code, cwd, float(limits.get("timeout", 30)))


@pytest.fixture(
    params=against_baseline(
        "sandbox", "null", "null runner has no isolation: the test must fail there"
    )
)
def runner(request: pytest.FixtureRequest, sandbox: Sandbox) -> Runner:
    if request.param == "sandbox":
        return _run_sandboxed(sandbox)
    return _run_unsandboxed


# --- canaries --------------------------------------------------------------------------


@dataclass
class HostCanary:
    token: str
    paths: list[Path]


@pytest.fixture
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The defaults as shipped: no CODECAGE_* variable and no config of the user's (an empty
    XDG_CONFIG_HOME of its own, `tmp_path / "xdg"`); this process gets it too, and the
    environment is yielded for subprocesses."""
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    for key in [k for k in os.environ if k.startswith("CODECAGE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(xdg))
    yield dict(os.environ)


@pytest.fixture
def host_canary() -> Iterator[HostCanary]:
    """A random token in world-readable files under the host's /tmp and $HOME."""
    token = "canary-" + secrets.token_hex(12)
    paths = [Path(tempfile.gettempdir()) / f"codecage-canary-{token}.txt"]
    home = Path.home() / f".codecage-canary-{token}"
    paths.append(home)
    for p in paths:
        p.write_text(token, encoding="utf-8")
        p.chmod(0o644)
    yield HostCanary(token, paths)
    for p in paths:
        p.unlink(missing_ok=True)


@pytest.fixture
def env_canary(monkeypatch: pytest.MonkeyPatch) -> str:
    """A random token in a host environment variable (named like a credential)."""
    token = "canary-" + secrets.token_hex(12)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", token)
    monkeypatch.setenv("CODECAGE_TEST_CANARY", token)
    return token


@dataclass
class NetCanary:
    port: int
    token: str
    connections: list[str]


@pytest.fixture
def net_canary() -> Iterator[NetCanary]:
    """A TCP listener on 127.0.0.1 that answers a token and counts who connected."""
    token = "canary-" + secrets.token_hex(12)
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    canary = NetCanary(server.getsockname()[1], token, [])
    with answering(server, token.encode(), canary.connections):
        yield canary


# --- leak guard ------------------------------------------------------------------------


def _children() -> set[int]:
    kids: set[int] = set()
    task_dir = Path(f"/proc/{os.getpid()}/task")
    for task in task_dir.iterdir():
        try:
            kids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            continue
    return kids


# Run dirs and cgroups carry the host pid in their name: looking only at this process's
# keeps the guard exact when another codecage process (another test run) shares the host.
_OWN = f"{os.getpid()}-"


def _run_dirs() -> set[str]:
    return {p.name for p in workspaces.private_parent().glob(f"codecage-run-{_OWN}*")}


def _cgroups() -> set[str]:
    support = cgroups.detect()
    if support is None:
        return set()
    found: set[str] = set()
    for parent in support.parents.values():
        if parent.is_dir():
            found.update(
                f"{parent}/{d.name}"
                for d in parent.iterdir()
                if d.is_dir() and d.name.startswith(_OWN)
            )
    return found


def _mounts() -> set[str]:
    text = Path("/proc/self/mountinfo").read_text()
    return {line.split()[4] for line in text.splitlines() if f"codecage-run-{_OWN}" in line}


def _fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def leak_snapshot() -> dict[str, Any]:
    return {
        "children": _children(),
        "run_dirs": _run_dirs(),
        "cgroups": _cgroups(),
        "mounts": _mounts(),
        "fds": _fds(),
    }


# Pools' reapers and sessions' run threads destroy sandboxes a moment after their callers
# return (by design: the answer goes out first). What is still there after this long was left.
_TEARDOWN_GRACE_S = 5.0


def _new_leaks(before: dict[str, Any]) -> dict[str, list[str]]:
    after = leak_snapshot()
    return {
        key: sorted(map(str, after[key] - before[key]))
        for key in before
        if after[key] - before[key]
    }


def _described(leaks: dict[str, list[str]]) -> dict[str, list[str]]:
    """The leftover processes with their command lines: which sandbox it was."""
    described = dict(leaks)
    if "children" in leaks:
        described["children"] = [f"{pid}: {cmdline(pid)}" for pid in leaks["children"]]
    return described


@pytest.fixture(autouse=True, scope="module")
def leak_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """Nothing a module's runs created may outlive them: processes, fds, dirs, cgroups."""
    bridge_channel.watcher()  # made once per process and kept (its epoll fd is no leak)
    guardian.ensure()  # this process's guardian lives as long as it does
    before = leak_snapshot()
    yield
    # A Sandbox keeps its fork server's templates until it is closed (or the process
    # ends); a module's unclosed ones are stopped here (tests/test_forkserver.py checks
    # that close() stops them).
    forkserver.stop_all()
    deadline = time.monotonic() + _TEARDOWN_GRACE_S
    while (leaks := _new_leaks(before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    module = request.module.__name__
    assert not leaks, f"{module} left behind: {json.dumps(_described(leaks))}"
