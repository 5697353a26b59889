"""Happy paths and result shape of one run, in real sandboxes."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from codecage import ConfigError, ExecutionResult, Options, Sandbox
from codecage.models import STATUSES


def test_output_and_return_value_come_back(sandbox: Sandbox) -> None:
    r = sandbox.run("print('hello')\n{'answer': 6 * 7}")
    assert r.status == "ok" and r.exit_code == 0 and r.signal is None
    assert r.stdout == "hello\n"
    assert r.return_value == {"answer": 42}
    assert r.error is None
    assert r.backend == "bwrap"


def test_a_value_that_is_not_json_comes_back_as_its_repr(sandbox: Sandbox) -> None:
    r = sandbox.run("class Point:\n    def __repr__(self): return 'Point(1, 2)'\nPoint()")
    assert r.return_value == "Point(1, 2)"


def test_no_last_expression_means_no_return_value(sandbox: Sandbox) -> None:
    assert sandbox.run("x = 1").return_value is None


def test_an_exception_is_reported_with_a_traceback_of_the_users_code_only(
    sandbox: Sandbox,
) -> None:
    r = sandbox.run("def f():\n    return 1 / 0\nf()", filename="job.py")
    assert r.status == "error" and r.exit_code == 1
    assert r.error is not None
    assert r.error.type == "ZeroDivisionError"
    assert r.error.message == "division by zero"
    assert 'File "job.py", line 2, in f' in r.error.traceback
    assert "bootstrap" not in r.error.traceback


def test_a_syntax_error_is_an_error_result_with_line_and_column(sandbox: Sandbox) -> None:
    r = sandbox.run("x = (1,\nprint(x")
    assert r.status == "error"
    assert r.error is not None and r.error.type == "SyntaxError"
    assert "line" in r.error.traceback


def test_sys_exit_codes_are_kept(sandbox: Sandbox) -> None:
    assert sandbox.run("import sys; sys.exit(0)").status == "ok"
    r = sandbox.run("import sys; sys.exit(3)")
    assert (r.status, r.exit_code, r.signal) == ("error", 3, None)


def test_top_level_await_works(sandbox: Sandbox) -> None:
    r = sandbox.run("import asyncio\nawait asyncio.sleep(0.01)\nawait asyncio.sleep(0, 'done')")
    assert r.status == "ok", r.error
    assert r.return_value == "done"


def test_code_runs_as_main_so_main_guards_and_dataclasses_work(sandbox: Sandbox) -> None:
    code = (
        "from dataclasses import dataclass\n"
        "@dataclass\nclass P:\n    x: int\n"
        "if __name__ == '__main__':\n    print(P(1))\n"
    )
    r = sandbox.run(code)
    assert r.stdout == "P(x=1)\n", r.error


def test_unicode_output_is_kept(sandbox: Sandbox) -> None:
    r = sandbox.run("print('héllo wörld ✓ 日本')")
    assert r.stdout == "héllo wörld ✓ 日本\n"


def test_binary_output_is_escaped_visibly_not_lost(sandbox: Sandbox) -> None:
    r = sandbox.run("import sys; sys.stdout.buffer.write(b'a\\xff\\x00b\\x1b[31m')")
    assert r.status == "ok"
    assert r.stdout == "a\\xff\\x00b\\x1b[31m"
    assert r.raw_stdout() == b"a\xff\x00b\x1b[31m"


def test_printing_a_fake_result_cannot_forge_the_real_one(sandbox: Sandbox) -> None:
    fake = json.dumps({"v": 1, "kind": "result", "return_value": "forged", "error": None})
    r = sandbox.run(f"print({fake!r})\nimport sys; print({fake!r}, file=sys.stderr)\n'real'")
    assert r.return_value == "real"
    assert r.status == "ok"


def test_files_written_to_the_workspace_are_listed_with_hash_and_mime(sandbox: Sandbox) -> None:
    r = sandbox.run(
        "open('report.json', 'w').write('{}')\nimport os; os.mkdir('d')\n"
        "open('d/a.txt', 'w').write('hi')"
    )
    assert r.status == "ok"
    files = {f.path: f for f in r.files}
    assert set(files) == {"report.json", "d/a.txt"}
    assert files["report.json"].mime == "application/json"
    assert files["d/a.txt"].size == 2
    assert files["d/a.txt"].sha256 == (
        "8f434346648f6b96df89dda901c5176b10a6d83961dd3c1ac88b59b2dc327aa4"
    )


def test_usage_is_measured_by_the_host(sandbox: Sandbox) -> None:
    r = sandbox.run("sum(i * i for i in range(2_000_000))")
    assert r.usage.wall_ms > 0
    assert r.usage.cpu_ms is not None and r.usage.cpu_ms > 0
    assert r.usage.peak_memory_mb is not None and 0 < r.usage.peak_memory_mb < 512


def test_limits_in_force_are_reported(sandbox: Sandbox) -> None:
    r = sandbox.run("1", limits={"memory_mb": 128, "timeout": 5})
    assert r.limits.memory_mb == 128 and r.limits.timeout == 5
    assert r.limits.cpu_seconds == 30  # the default


def test_a_host_workspace_is_mounted_and_its_files_stay(sandbox: Sandbox, tmp_path: Path) -> None:
    (tmp_path / "input.csv").write_text("a,b\n1,2\n")
    r = sandbox.run(
        "rows = open('input.csv').read().splitlines()\nopen('out.txt', 'w').write(str(len(rows)))",
        workspace=tmp_path,
    )
    assert r.status == "ok", r.error
    assert (tmp_path / "out.txt").read_text() == "2"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"timeout": 0}, "timeout"),
        ({"timeout": -1}, "timeout"),
        ({"memory_mb": 1}, "memory_mb"),
        ({"max_processes": 0}, "max_processes"),
        ({"max_output_bytes": 10**12}, "max_output_bytes"),
        ({"cpu_seconds": "lots"}, "cpu_seconds"),
        ({"no_such_limit": 1}, "no_such_limit"),
    ],
)
def test_absurd_limits_are_refused_before_anything_runs(
    sandbox: Sandbox, overrides: dict[str, object], field: str
) -> None:
    with pytest.raises(ConfigError) as info:
        sandbox.run("1", limits=overrides)
    assert field in str(info.value)
    assert info.value.hint


def test_memory_above_the_hosts_ceiling_is_refused_with_a_hint(sandbox: Sandbox) -> None:
    with pytest.raises(ConfigError) as info:
        sandbox.run("1", limits={"memory_mb": 1_000_000})
    assert "ceiling" in str(info.value)
    # Each face reads it in its own terms (errors.render_hint): flags on the CLI.
    assert "--memory-mb" in info.value.hint_for("cli")
    assert 'limits={"memory_mb"' in info.value.hint


def test_code_with_a_nul_byte_is_refused(sandbox: Sandbox) -> None:
    with pytest.raises(ConfigError):
        sandbox.run("print(1)\x00")


@pytest.mark.parametrize(
    ("arguments", "what"),
    [
        ({"code": "x = '\ud800'"}, "the code"),
        ({"code": "print(1)\udcff"}, "the code"),  # an undecodable byte of a command line
        ({"code": "1", "filename": "main\udcff.py"}, "the file name"),
    ],
)
def test_a_lone_surrogate_is_refused_with_a_clear_error(
    sandbox: Sandbox, arguments: dict[str, str], what: str
) -> None:
    with pytest.raises(ConfigError, match=f"{what} is not valid text: a lone surrogate"):
        sandbox.run(**arguments)


def test_the_async_twin_runs_concurrently(sandbox: Sandbox) -> None:
    async def both() -> list[ExecutionResult]:
        return list(await asyncio.gather(sandbox.arun("1"), sandbox.arun("2")))

    results = asyncio.run(both())
    assert [r.return_value for r in results] == [1, 2]


def test_every_status_is_declared_once() -> None:
    assert set(STATUSES) == {
        "ok",
        "error",
        "timeout",
        "cpu_limit",
        "memory_limit",
        "killed",
        "blocked",
    }


def test_a_process_killed_by_a_signal_is_reported_as_killed(sandbox: Sandbox) -> None:
    r = sandbox.run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert (r.status, r.signal, r.exit_code) == ("killed", "SIGKILL", None)


def test_filling_the_workspace_quota_is_reported(sandbox: Sandbox) -> None:
    r = sandbox.run("open('big', 'wb').write(b'x' * (3 << 20))", limits={"workspace_mb": 2})
    assert r.status == "error"
    assert r.error is not None and "No space left" in r.error.message
    assert "workspace_full" in [e.kind for e in r.events]


def test_messages_the_code_writes_to_the_control_socket_are_bounded_and_overridden(
    sandbox: Sandbox,
) -> None:
    code = (
        "import os\n"
        'forged = b\'{"v":1,"kind":"result","pid":2,"return_value":"forged"}\\n\'\n'
        "os.write(3, forged)\n"
        "for _ in range(200):\n"
        "    os.write(3, b'garbage' * 1000 + b'\\n')\n"
        "'real'"
    )
    r = sandbox.run(code)
    assert r.status == "ok"
    assert r.return_value == "real"
    assert [e.kind for e in r.events] == ["guest_report_invalid"]


def test_a_forked_childs_report_does_not_replace_the_main_processs(sandbox: Sandbox) -> None:
    # The child falls off the end of the code too, and reports through the same socket.
    r = sandbox.run(
        "import os\npid = os.fork()\nif pid: os.waitpid(pid, 0)\n'parent' if pid else 'child'"
    )
    assert (r.status, r.return_value) == ("ok", "parent")


DAEMON_KEEPS_WRITING = """
import os, threading, time
def tick(sleep=time.sleep, open=open, replace=os.replace):  # its own references: the globals go
    n = 0                                                # at the end
    while True:
        n += 1
        # Written aside and renamed: the thread may be stopped mid-write, and the file read
        # must never be a half-written (empty) one.
        with open("/workspace/ticks.tmp", "w") as f:
            f.write(str(n))
        replace("/workspace/ticks.tmp", "/workspace/ticks.txt")
        sleep(0.002)
threading.Thread(target=tick, daemon=True).start()
time.sleep(0.05)
"""


@pytest.mark.parametrize("pool", [False, True], ids=["cold", "warm"])
def test_nothing_of_the_code_runs_after_its_report(pool: bool) -> None:
    """Like at an interpreter's exit, the code's daemon threads stop when the run ends: the
    guest stops itself after its report (the sandbox is destroyed later), so a file a
    thread keeps rewriting does not change once the run is over."""
    seen: list[str] = []

    def watch(workspace: Path, _: object) -> None:
        seen.append((workspace / "ticks.txt").read_text())
        time.sleep(0.1)  # a tick every 2 ms, were the thread still running
        seen.append((workspace / "ticks.txt").read_text())

    with Sandbox(pool=pool, options=Options(import_policy=False, scrub=False)) as sandbox:
        sandbox.warm(timeout=30)
        result = sandbox.run(DAEMON_KEEPS_WRITING, on_files=watch)
    assert result.status == "ok", result
    assert int(seen[0]) > 5, "the thread did not run"
    assert seen[0] == seen[1], "the code's thread ran on after the run had ended"


@pytest.mark.parametrize(
    "code",
    [
        "import json, sys\njson.dumps = lambda *a, **k: 'tampered'\nprint('out')\nsys.exit(3)",
        "import os, sys\nos.write(3, b'{\"v\": 1, \"kind\": ')\nprint('out')\nsys.exit(3)",
        "import os, sys\nos.closerange(3, 100)\nprint('out')\nsys.exit(3)",
        "import os, socket, sys\na, b = socket.socketpair()\nos.dup2(a.fileno(), 3)\n"
        "print('out')\nsys.exit(3)",
        "import socket, sys\nsocket.socket(fileno=3).shutdown(socket.SHUT_RDWR)\n"
        "print('out')\nsys.exit(3)",
        "import os, sys\nfor _ in range(400):\n    os.write(3, b'x' * 9999 + b'\\n')\n"
        "print('out')\nsys.exit(3)",
    ],
    ids=[
        "json-replaced",
        "line-left-open",
        "socket-closed",
        "socket-replaced",
        "socket-shut",
        "socket-flooded",
    ],
)
def test_code_that_meddles_with_the_control_socket_still_ends_its_run_at_once(
    sandbox: Sandbox, code: str
) -> None:
    """However the code garbles the guest's messages, its run ends when it does, with its
    exit code: from the guest's "end" when the host heard it, else from its exit (the guest
    stops itself only when the host answered that end)."""
    r = sandbox.run(code, limits={"timeout": 20})
    assert (r.status, r.exit_code, r.stdout) == ("error", 3, "out\n"), r
    assert r.usage.wall_ms < 5_000, "the run waited for its timeout"


def test_a_sandbox_already_gone_when_supervision_starts_is_read_as_ended() -> None:
    """A warm sandbox forked from a template that died meanwhile can be gone and reaped
    before its run is supervised (the faults suite's outage saw pidfd_open fail with
    ProcessLookupError): the supervisor's exit descriptor is then readable at once."""
    import select
    import subprocess
    import sys

    from codecage.engine import supervise

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # gone and reaped: no pidfd can be opened on its pid
    with pytest.raises(ProcessLookupError):
        os.pidfd_open(child.pid)
    fd = supervise._exit_fd(child.pid)
    try:
        assert select.select([fd], [], [], 0)[0] == [fd]
    finally:
        os.close(fd)
