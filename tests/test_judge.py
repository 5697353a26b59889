"""The engine's judging of a run (engine/judge.py), driven with made-up observations: no
sandbox, no process, no I/O."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from tests._source import top_level_imports

import codecage.engine.judge as judge_module
from codecage.backends.base import ExitStatus
from codecage.engine.judge import (
    ControlStream,
    GuestMessages,
    Measured,
    Observation,
    build_result,
    check_started,
    guest_messages,
    judge_status,
)
from codecage.errors import SandboxError
from codecage.models import ExecutionResult, GuestResult, Limits, Usage
from codecage.output import CappedBuffer

LIMITS = Limits()
NO_USAGE = Usage(wall_ms=5, cpu_ms=1, peak_memory_mb=None)


def line(**message: object) -> bytes:
    return json.dumps({"v": 1, **message}).encode() + b"\n"


READY = line(kind="ready", pid=2)
RESULT = line(kind="result", pid=2, return_value=42)
END = line(kind="end", pid=2, exit_code=0)


def seen_with(
    control: bytes = b"",
    *,
    exit: ExitStatus | None = None,
    ready_pid: int | None = None,
    stdout: bytes = b"",
    cap: int = 1 << 20,
    **flags: bool,
) -> Observation:
    stream = ControlStream(cap, ready_pid=ready_pid)
    stream.feed(control)
    out = CappedBuffer(1000, tail_bytes=500)
    out.append(stdout)
    return Observation(
        stdout=out, stderr=CappedBuffer(1000, tail_bytes=500), control=stream, exit=exit, **flags
    )


def report(**fields: object) -> GuestResult:
    return GuestResult.model_validate({"v": 1, "kind": "result", "pid": 2, **fields})


# --- the control stream -------------------------------------------------------------


def test_the_control_stream_is_the_same_however_it_is_cut() -> None:
    data = READY + RESULT + END
    whole = ControlStream(1 << 20, ready_pid=None)
    whole.feed(data)
    byte_by_byte = ControlStream(1 << 20, ready_pid=None)
    for i in range(len(data)):
        byte_by_byte.feed(data[i : i + 1])
    for stream in (whole, byte_by_byte):
        said = stream.finish()
        assert said.ready and said.exit_code == 0 and said.problems == []
        assert said.report is not None and said.report.return_value == 42


def test_ended_only_once_the_main_processs_end_line_is_whole() -> None:
    stream = ControlStream(1 << 20, ready_pid=None)
    stream.feed(READY + RESULT)
    assert not stream.ended
    stream.feed(END[:-1])
    assert not stream.ended  # the line is not finished
    stream.feed(b"\n")
    assert stream.ended


def test_an_end_from_another_pid_or_before_ready_does_not_end_it() -> None:
    stream = ControlStream(1 << 20, ready_pid=None)
    stream.feed(END)
    assert not stream.ended
    stream = ControlStream(1 << 20, ready_pid=2)  # warm: it said ready before the request
    stream.feed(line(kind="end", pid=7, exit_code=0))
    assert not stream.ended
    stream.feed(END)
    assert stream.ended


def test_a_forked_childs_report_is_ignored_and_the_last_main_report_wins() -> None:
    stream = ControlStream(1 << 20, ready_pid=2)
    stream.feed(line(kind="result", pid=2, return_value="early"))
    stream.feed(line(kind="result", pid=9, return_value="child"))
    stream.feed(RESULT)
    said = stream.finish()
    assert said.report is not None and said.report.return_value == 42


def test_malformed_lines_are_noted_not_trusted() -> None:
    seen = seen_with(READY + b"{nope\n" + line(kind="exit") + RESULT + b'{"unfinished')
    said, events = guest_messages(seen)
    assert said.report is not None and len(said.problems) == 3
    assert [e.kind for e in events] == ["guest_report_invalid"]
    assert "ignored 3 malformed" in events[0].detail


def test_past_the_cap_the_rest_is_dropped_and_said() -> None:
    seen = seen_with(READY + RESULT + END, cap=len(READY) + 10)
    said, events = guest_messages(seen)
    assert said.ready and said.report is None and said.exit_code is None
    assert seen.control.truncated
    assert "over the size bound" in events[0].detail


def test_a_run_ended_at_the_guests_end_takes_its_exit_code() -> None:
    seen = seen_with(READY + RESULT + line(kind="end", pid=2, exit_code=3), reported=True)
    guest_messages(seen)
    assert seen.exit == ExitStatus(code=3)


# --- the status ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exit", "guest_report", "expected"),
    [
        (ExitStatus(code=0), report(), ("ok", 0, None)),
        (ExitStatus(code=1), report(), ("error", 1, None)),
        # A backend that cannot tell 128+N from signal N: the report says it exited.
        (ExitStatus(code=137, signal=9), report(exit_code=137), ("error", 137, None)),
        (ExitStatus(code=137, signal=9), None, ("killed", None, "SIGKILL")),
        (ExitStatus(code=None, signal=signal.SIGTERM), report(), ("killed", None, "SIGTERM")),
        (ExitStatus(code=152, signal=signal.SIGXCPU), None, ("cpu_limit", None, "SIGXCPU")),
        (None, None, ("error", None, None)),
    ],
)
def test_status_from_the_exit(
    exit: ExitStatus | None, guest_report: GuestResult | None, expected: tuple[object, ...]
) -> None:
    seen = seen_with(exit=exit)
    got = judge_status(seen, guest_report, oom=False, limits=LIMITS, usage=NO_USAGE)
    assert got == expected


def test_the_host_decides_limits_whatever_the_guest_said() -> None:
    ok = report()
    timed_out = seen_with(exit=ExitStatus(code=0), killed_by_host=True, timed_out=True)
    cancelled = seen_with(exit=ExitStatus(code=0), killed_by_host=True, cancelled=True)
    for seen, status in ((timed_out, "timeout"), (cancelled, "killed")):
        got = judge_status(seen, ok, oom=False, limits=LIMITS, usage=NO_USAGE)
        assert got == (status, None, "SIGKILL")
    seen = seen_with(exit=ExitStatus(code=None, signal=9), cpu_exceeded=True, killed_by_host=True)
    assert judge_status(seen, ok, oom=False, limits=LIMITS, usage=NO_USAGE)[0] == "cpu_limit"
    seen = seen_with(exit=ExitStatus(code=None, signal=9))
    assert judge_status(seen, None, oom=True, limits=LIMITS, usage=NO_USAGE) == (
        "memory_limit",
        None,
        "SIGKILL",
    )


def test_a_guest_that_never_got_ready_is_a_failed_start() -> None:
    seen = seen_with(exit=ExitStatus(code=1))
    with pytest.raises(SandboxError, match="failed to start: exit 1"):
        check_started(seen, GuestMessages())
    check_started(seen_with(timed_out=True), GuestMessages())  # a limit ended it first


# --- the result ---------------------------------------------------------------------


def result_of(
    seen: Observation, *, by_cgroup: bool = True, degraded: tuple[str, ...] = ()
) -> ExecutionResult:
    said, events = guest_messages(seen)
    return build_result(
        execution_id="x",
        backend="test",
        limits=LIMITS,
        policy=None,
        degraded=degraded,
        seen=seen,
        said=said,
        events=events,
        measured=Measured(
            usage=NO_USAGE,
            oom=False,
            by_cgroup=by_cgroup,
            files=[],
            files_truncated=False,
            workspace_full=None,
        ),
    )


def test_the_result_shows_output_neutralised_once_and_keeps_the_raw_bytes() -> None:
    seen = seen_with(READY + RESULT + END, exit=ExitStatus(code=0), stdout=b"a\x1b[31mb\\x1b\n")
    result = result_of(seen, degraded=("seccomp",))
    assert result.status == "ok" and result.return_value == 42
    assert result.stdout == "a\\x1b[31mb\\x1b\n"  # the backslash already there stays one
    assert result.raw_stdout() == b"a\x1b[31mb\\x1b\n"
    assert [e.kind for e in result.events] == ["degraded_isolation"]


def test_a_memory_error_without_a_memory_cgroup_is_the_memory_limit() -> None:
    error = {"type": "MemoryError", "message": "", "traceback": ""}
    data = READY + line(kind="result", pid=2, exit_code=1, error=error) + END
    with_cgroup = result_of(seen_with(data, exit=ExitStatus(code=1)), by_cgroup=True)
    without = result_of(seen_with(data, exit=ExitStatus(code=1)), by_cgroup=False)
    assert (with_cgroup.status, without.status) == ("error", "memory_limit")


def test_the_judge_does_no_io() -> None:
    """Pure: it imports nothing that reaches a process, a file, a socket or the clock."""
    imported = top_level_imports(Path(judge_module.__file__))
    io = {"os", "subprocess", "socket", "selectors", "time", "threading", "pathlib", "shutil"}
    assert imported & io == set()
    assert "open(" not in Path(judge_module.__file__).read_text(encoding="utf-8")
