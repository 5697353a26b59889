"""Faults, SIGKILL: a part of a run killed for real while the run is in flight — the guest,
its parent (the sandbox's init: bwrap's, or the forked sandbox's, engine/forkserver.py), the
outer bwrap (for a forked sandbox, its template's: every sandbox forked from it dies), and
an upstream MCP server in the middle of a tool call. Each run ends in a clear status or
error, the same Sandbox serves the next run, and nothing is left behind.

(The host process itself killed mid-run is test_faults_host.py.)
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests._upstreams import attempt_code

from codecage import Options, Sandbox
from codecage.bridge import upstreams
from codecage.bridge.broker import Broker
from codecage.models import ExecutionResult
from conftest import leak_snapshot
from reliability._faults import (
    SLEEPER,
    SLEEPER_IMPORTS,
    alive,
    ancestry,
    comm,
    new_leaks,
    sleeping_guests,
    wait_for,
)

FLAKY = Path(__file__).resolve().parent.parent / "fixtures" / "flaky_server.py"


class Background:
    """`sandbox.run(code)` on a thread of its own: the run the test injects a fault into."""

    def __init__(self, sandbox: Sandbox, code: str, **limits: Any) -> None:
        self.result: ExecutionResult | None = None
        self.ended_at = 0.0
        self._thread = threading.Thread(target=self._run, args=(sandbox, code, limits))
        self._thread.start()

    def _run(self, sandbox: Sandbox, code: str, limits: dict[str, Any]) -> None:
        self.result = sandbox.run(code, limits={"timeout": 60, **limits})
        self.ended_at = time.monotonic()

    def join(self, seconds: float = 30) -> ExecutionResult:
        self._thread.join(seconds)
        assert self.result is not None, f"the run did not end within {seconds} s of the fault"
        return self.result


def victim(which: str, guest: int) -> int:
    """The process `which` of the run whose guest is `guest`: the chain up from the guest is
    guest, init (the forked sandbox's, or bwrap's), then bwrap's own processes."""
    chain = ancestry(guest, os.getpid())
    bwraps = [pid for pid in chain if comm(pid) == "bwrap"]
    assert bwraps, f"no bwrap above the guest: {[(p, comm(p)) for p in chain]}"
    return {"guest": guest, "init": chain[1], "bwrap": bwraps[-1]}[which]


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "started"])
@pytest.mark.parametrize("which", ["guest", "init", "bwrap"])
def test_a_sigkilled_sandbox_process_ends_its_run_as_killed_and_the_next_run_works(
    forked: bool, which: str
) -> None:
    """Forked: the run's sandbox comes from a fork server's template (the default); started:
    bwrap starts each sandbox anew. The Sandbox is closed before the leftovers are counted
    (its pool and templates are its own, not the fault's)."""
    before = leak_snapshot()
    with Sandbox(allowed_imports=SLEEPER_IMPORTS, options=Options(fork_server=forked)) as sandbox:
        _kill_mid_run(sandbox, which)
    assert not new_leaks(before)


def _kill_mid_run(sandbox: Sandbox, which: str) -> None:
    run = Background(sandbox, SLEEPER)
    guest = wait_for(lambda: sleeping_guests(os.getpid()), "the guest to start")[0]
    target = victim(which, guest)
    killed_at = time.monotonic()
    os.kill(target, signal.SIGKILL)
    result = run.join()
    print(f"{which}: {result.status} {result.signal} after {run.ended_at - killed_at:.3f} s")
    assert result.status == "killed", (result.status, result.error, result.stderr)
    assert result.signal == "SIGKILL"
    assert result.stdout.startswith("sleeping")  # what it printed before is kept
    assert not alive(guest)
    assert sandbox.run("6 * 7").return_value == 42


# --- an upstream MCP server killed mid tool call ----------------------------------------


ATTEMPT = attempt_code("flaky")


HANG_THEN_ECHO = '[attempt("hang"), attempt("echo", text="again")]'


@pytest.fixture
def flaky(tmp_path: Path) -> Iterator[Broker]:
    """The broker of tests/fixtures/flaky_server.py, with a timeout long enough that only the
    kill can end a hung call early."""
    marker = f"flaky-{uuid.uuid4().hex[:8]}"
    server = {
        "command": sys.executable,
        "args": [str(FLAKY), marker],
        "env": {"PATH": os.environ.get("PATH", "")},
        "timeout": 60,
    }
    config = {"mcpServers": {"flaky": server}}
    with Broker(upstreams.parse(config, source="test", environ={})) as broker:
        yield broker


def test_an_upstream_server_sigkilled_mid_call_is_an_upstream_error_and_is_restarted(
    flaky: Broker,
) -> None:
    with Sandbox(tools=flaky, pool=False, options=Options(scrub=False)) as sandbox:
        first = sandbox.run(ATTEMPT + 'attempt("echo", text="up")')
        assert first.status == "ok", first.error
        pid = int(str(first.return_value[1]).rsplit("pid ", 1)[1].split(")")[0])
        run = Background(sandbox, ATTEMPT + HANG_THEN_ECHO)
        time.sleep(1.0)  # the call reaches the server (it never answers `hang`)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        result = run.join()
        print(f"upstream killed: run {result.status} after {run.ended_at - killed_at:.3f} s")
        assert result.status == "ok", (result.error, result.stderr)
        (kind, message), after = result.return_value
        print(f"  the call: {kind}: {message[:200]}")
        assert kind == "upstream_error"
        assert "flaky.hang" in message
        assert after[0] == "ok" and f"pid {pid})" not in str(after[1])  # restarted
