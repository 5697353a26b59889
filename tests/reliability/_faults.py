"""What the fault tests share: finding a run's processes from the host, waiting on a
condition, and the leftovers of this process (conftest's `leak_snapshot`) or of a server
subprocess (test_server's `left_behind`)."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import leak_snapshot
from test_server import CODECAGE, INITIALIZE, server_env
from test_server_lifecycle import descendants

# A guest running this has 6+ threads, while every other process of a sandbox (bwrap, its
# init, a template, an idle warm guest) has one: that is how the host-side test finds it.
SLEEPER = """
import threading, time
for _ in range(5):
    threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
print("sleeping", flush=True)
time.sleep(120)
"""
SLEEPER_IMPORTS = ("threading",)

# Variants that add time and little new (the same path as a default one, or covered by an
# older test too) run only when asked: CODECAGE_FAULTS_FULL=1 pytest tests/reliability/.
FULL = os.environ.get("CODECAGE_FAULTS_FULL") == "1"
only_in_full = pytest.mark.skipif(not FULL, reason="a longer variant: CODECAGE_FAULTS_FULL=1")

# Pools' reapers destroy a sandbox a moment after its run returns (conftest's grace too).
TEARDOWN_GRACE_S = 5.0


def threads(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text(encoding="utf-8")
    except OSError:
        return 0
    return int(status.split("Threads:")[1].split()[0])


def parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    return int(stat.rsplit(")", 1)[1].split()[1])


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text(encoding="utf-8").strip()
    except OSError:
        return "(gone)"


def alive(pid: int) -> bool:
    """Running (a zombie has ended: only its parent's wait is missing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def sleeping_guests(root: int) -> list[int]:
    """Processes under `root` running SLEEPER."""
    return [pid for pid in descendants(root) if threads(pid) >= 6]


def ancestry(pid: int, root: int) -> list[int]:
    """`pid`, its parent, ... up to (not including) `root`."""
    chain = [pid]
    while (up := parent(chain[-1])) != root:
        assert up > 1, f"{pid} is not under {root}"
        chain.append(up)
    return chain


def wait_for(predicate: Callable[[], Any], what: str, seconds: float = 30) -> Any:
    """Poll `predicate` until it is truthy (returned), or fail naming `what`."""
    deadline = time.monotonic() + seconds
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"gave up after {seconds} s waiting for {what}"
        time.sleep(0.02)
    return value


def new_leaks(before: dict[str, Any], grace_s: float = TEARDOWN_GRACE_S) -> dict[str, list[str]]:
    """What this process has now that it had not `before` (leak_snapshot), once `grace_s`
    has passed with something still there."""
    deadline = time.monotonic() + grace_s
    while True:
        after = leak_snapshot()
        leaks = {k: sorted(map(str, after[k] - before[k])) for k in before if after[k] - before[k]}
        if not leaks or time.monotonic() > deadline:
            return leaks
        time.sleep(0.05)


# --- a `codecage serve` over raw stdio ---------------------------------------------------

INITIALIZED = {"jsonrpc": "2.0", "method": "notifications/initialized"}


def call(call_id: int, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": call_id,
        "method": "tools/call",
        "params": {"name": "execute_code", "arguments": arguments},
    }


@contextlib.contextmanager
def serve(workdir: Path, *args: str, **env: str) -> Iterator[subprocess.Popen[str]]:
    """`codecage serve ARGS` over raw stdio (test_server's environment and `env`),
    initialized; killed at the end if still alive. Its stderr: workdir/stderr-N.log."""
    errlog = workdir / f"stderr-{len(list(workdir.glob('stderr-*')))}.log"
    with errlog.open("w", encoding="utf-8") as stderr:
        proc = subprocess.Popen(
            [CODECAGE, "serve", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=server_env(**env),
            cwd=workdir,
            text=True,
        )
    try:
        send(proc, INITIALIZE, INITIALIZED)
        assert "result" in reply(proc)
        yield proc
    finally:
        # The end of stdin is the ordinary end of a stdio server; SIGKILL if it lingers.
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def send(proc: subprocess.Popen[str], *messages: dict[str, Any]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("".join(json.dumps(m) + "\n" for m in messages))
    proc.stdin.flush()


def reply(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the server closed its stdout"
    answer: dict[str, Any] = json.loads(line)
    return answer


def answered_runs(proc: subprocess.Popen[str], count: int) -> list[str]:
    """Run `count` quick calls; their execution ids (each answered: it finished)."""
    send(proc, *(call(10 + i, {"code": f"print({i})"}) for i in range(count)))
    answers = [reply(proc) for _ in range(count)]
    return [a["result"]["structuredContent"]["execution_id"] for a in answers]


def recorded_ids(db: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return {row[0] for row in conn.execute("SELECT execution_id FROM executions")}
