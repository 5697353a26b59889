"""Helpers shared by the containment tests: build a guest program, read the report it
printed, and find host processes by a marker in their argv.

Tests that take the `runner` fixture cannot use `return_value` (the null runner has none),
so their guest programs print one JSON line as their last line of stdout: the report.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Any, Protocol

import pytest

from codecage import ExecutionResult, Sandbox


@dataclass
class Outcome:
    """What a containment test looks at, the same for a sandbox and its baseline."""

    status: str
    stdout: str
    stderr: str
    return_value: Any = None
    error_type: str | None = None
    events: list[str] = field(default_factory=list)


def outcome_of(r: ExecutionResult) -> Outcome:
    """A sandbox's result as an Outcome."""
    return Outcome(
        status=r.status,
        stdout=r.stdout,
        stderr=r.stderr,
        return_value=r.return_value,
        error_type=r.error.type if r.error else None,
        events=[e.kind for e in r.events],
    )


def run_unsandboxed(
    code: str, cwd: Path | str, timeout: float, env: Mapping[str, str] | None = None
) -> Outcome:
    """Plain python3 in a subprocess, in `cwd`, with only the wall timeout: no isolation at
    all (the baseline that every containment test must fail on)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            encoding="utf-8",
            timeout=timeout,
            cwd=cwd,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return Outcome(status="timeout", stdout="", stderr="")
    status = "ok" if proc.returncode == 0 else "error"
    return Outcome(status=status, stdout=proc.stdout, stderr=proc.stderr)


def against_baseline(real: str, baseline: str, reason: str) -> list[Any]:
    """Fixture params: the `real` runner, and a `baseline` that isolates nothing, on which
    every test is expected to fail (strict xfail): one that passes there proves nothing."""
    return [real, pytest.param(baseline, marks=pytest.mark.xfail(strict=True, reason=reason))]


WorkspaceRunner = Callable[[str, Path], Outcome]
"""run(code, workspace) -> Outcome: `code` run with `workspace` as its working directory."""

WORKSPACE_RUNNERS = against_baseline(
    "sandbox", "null", "null runner has no isolation: the test must fail there"
)
"""Params of a fixture that returns `workspace_runner(request.param, ...)`."""


def workspace_runner(which: str, sandbox: Sandbox, timeout: float) -> WorkspaceRunner:
    """The sandbox ("sandbox") or the null baseline ("null", plain python3 with PATH only)
    running code in a workspace it is lent, under `timeout` seconds; skipped for landlock,
    which lends no directory (tests/containment/test_lent.py::test_landlock_lends_none)."""
    if which != "sandbox":
        return lambda code, workspace: run_unsandboxed(
            code, workspace, timeout, env={"PATH": os.defpath}
        )
    if sandbox.host.backend.name == "landlock":
        pytest.skip("landlock lends no directory (test_lent.py::test_landlock_lends_none)")

    def run(code: str, workspace: Path) -> Outcome:
        return outcome_of(sandbox.run(code, workspace=workspace, limits={"timeout": timeout}))

    return run


class Seen(Protocol):
    """What both runners return (an Outcome)."""

    status: str
    stdout: str
    stderr: str
    return_value: Any
    error_type: str | None


Runner = Callable[..., Seen]
"""conftest's `runner` fixture: run(code, **limits) -> Outcome."""


class HostCanary(Protocol):
    """conftest's `host_canary`: a token in files under the host's /tmp and $HOME."""

    token: str
    paths: list[Path]


class NetCanary(Protocol):
    """conftest's `net_canary`: a loopback listener that answers a token."""

    port: int
    token: str
    connections: list[str]


def guest(template: str, **values: Any) -> str:
    """The guest program: `template`, dedented, with each `$name` replaced by the repr of
    `values[name]` (so host paths, tokens and ports go in as Python literals)."""
    return Template(textwrap.dedent(template)).substitute(
        {name: repr(value) for name, value in values.items()}
    )


def report(seen: Seen) -> Any:
    """The JSON report the guest printed as its last line of stdout."""
    lines = seen.stdout.strip().splitlines()
    assert lines, (
        f"the guest printed no report: status={seen.status} error={seen.error_type} "
        f"stderr={seen.stderr[-2000:]!r}"
    )
    return json.loads(lines[-1])


def assert_absent(token: str, seen: Seen) -> None:
    """`token` is nowhere in what came back of the run."""
    assert token not in seen.stdout
    assert token not in seen.stderr
    assert token not in json.dumps(seen.return_value)


def host_pids_with(marker: str) -> list[int]:
    """Host processes (other than this one) whose argv holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(int(entry.name))
    return found


def kill_marked(marker: str) -> None:
    """SIGKILL the host processes a failed test left behind (only ours: they carry `marker`)."""
    for pid in host_pids_with(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def answering(
    server: socket.socket, answer: bytes, peers: list[str] | None = None
) -> Iterator[None]:
    """While the block runs, a thread accepts connections on `server` (listening, with a
    short timeout so that it sees the end), sends each one `answer` and notes its peer in
    `peers`; `server` is closed after the block."""
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, peer = server.accept()
            except OSError:
                continue
            if peers is not None:
                peers.append(str(peer))
            with conn:
                conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=2)
        server.close()


READY_WAIT_S = 90.0  # a bound, not a timing: a busy host may take long to start a sandbox
HELD_S = 120  # a held run's own timeout: it is cancelled long before


@dataclass
class Held:
    """A run held on a thread until `release`: the stdout it streamed so far, its result
    once it ended."""

    thread: threading.Thread
    cancel: threading.Event
    lines: list[str] = field(default_factory=list)
    result: list[ExecutionResult] = field(default_factory=list)

    def release(self) -> ExecutionResult:
        self.cancel.set()
        self.thread.join(timeout=READY_WAIT_S)
        assert self.result, "run A did not end once cancelled"
        return self.result[0]


@contextlib.contextmanager
def held_run(sandbox: Sandbox, code: str, on_files: Any = None, **limits: Any) -> Iterator[Held]:
    """Start `code` (run A: it prints "READY ..." once it has done its part, then waits) on
    a thread and yield once the host has seen that line; cancel it on the way out.
    `on_files` and `limits` go to its run (its timeout is `HELD_S` unless given)."""
    ready = threading.Event()
    held = Held(threading.Thread(), threading.Event())

    def on_output(stream: str, text: str) -> None:
        if stream == "stdout":
            held.lines.append(text)
            if "READY" in "".join(held.lines):
                ready.set()

    def run() -> None:
        limited = {"timeout": HELD_S, **limits}
        run_a = sandbox.run(
            code, cancel=held.cancel, on_output=on_output, on_files=on_files, limits=limited
        )
        held.result.append(run_a)
        ready.set()  # it ended early: the wait below fails with what it said

    held.thread = threading.Thread(target=run, daemon=True)
    held.thread.start()
    try:
        assert ready.wait(READY_WAIT_S), "run A never said it was ready"
        assert not held.result, f"run A ended early: {held.result[0].stderr[-2000:]}"
        yield held
    finally:
        held.release()


def fork_and_reap(n: int) -> str:
    """Guest code that forks `n` children, each of which exits at once, and reaps them; it
    leaves their `pids` (it needs `os` imported)."""
    return f"""
pids = []
for _ in range({n}):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    pids.append(pid)
for pid in pids:
    os.waitpid(pid, 0)
"""
