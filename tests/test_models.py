"""Limits validation and the host<->guest wire format."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from codecage.isolation.rlimits import guest_limits
from codecage.models import ExecutionResult, GuestRequest, GuestResult, Limits, Usage


@given(st.integers(min_value=-(10**9), max_value=10**12))
def test_memory_mb_is_accepted_exactly_within_its_bounds(value: int) -> None:
    try:
        limits = Limits(memory_mb=value)
    except ValidationError:
        assert not 32 <= value <= 1_048_576
    else:
        assert limits.memory_mb == value


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_timeout_must_be_positive_and_finite(value: float) -> None:
    try:
        Limits(timeout=value)
    except ValidationError:
        assert not (0 < value <= 3600)
    else:
        assert 0 < value <= 3600


def test_unknown_limits_are_refused() -> None:
    with pytest.raises(ValidationError):
        Limits.model_validate({"memroy_mb": 10})


def test_merged_ignores_none_and_validates_again() -> None:
    limits = Limits().merged({"memory_mb": 100, "timeout": None})
    assert limits.memory_mb == 100 and limits.timeout == 30
    with pytest.raises(ValidationError):
        Limits().merged({"max_processes": -1})


def test_the_guest_reads_the_request_the_host_writes() -> None:
    """Round trip: the host's GuestRequest is what the stdlib-only bootstrap parses."""
    request = GuestRequest(
        code="print(1)",
        filename="main.py",
        limits=guest_limits(Limits(), by_cgroup=True),
        return_value_max_bytes=100,
    )
    parsed = json.loads(request.model_dump_json())
    assert parsed["v"] == 1 and parsed["kind"] == "run"
    assert set(parsed["limits"]) == {
        "cpu_seconds", "max_open_files", "max_file_size_bytes", "max_processes",
        "address_space_bytes", "session_cpu_seconds",
    }  # fmt: skip


def test_the_host_accepts_the_result_the_guest_writes() -> None:
    """Run the real bootstrap's report builder and validate its output with the model."""
    script = (
        "import sys; sys.path.insert(0, 'src/codecage'); from guest import bootstrap; import json\n"
        "code, report = bootstrap._run_user_code({'filename': 'm.py', 'code': '1/0',"
        " 'return_value_max_bytes': 100}, bootstrap._fresh_main_module('m.py'))\n"
        "print(json.dumps(report))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    report = GuestResult.model_validate_json(out)
    assert report.error is not None and report.error.type == "ZeroDivisionError"


def test_a_guest_report_with_too_many_events_is_refused() -> None:
    events = [{"kind": "network_denied", "detail": "x"}] * 51
    with pytest.raises(ValidationError):
        GuestResult.model_validate({"v": 1, "kind": "result", "pid": 2, "events": events})


def test_a_copy_of_a_result_keeps_its_raw_output() -> None:
    """reply.py and the server update results with model_copy and rely on this."""
    result = ExecutionResult(
        execution_id="x",
        status="ok",
        exit_code=0,
        signal=None,
        stdout="a",
        stderr="",
        stdout_truncated=False,
        stderr_truncated=False,
        return_value=None,
        error=None,
        files=[],
        usage=Usage(wall_ms=1, cpu_ms=None, peak_memory_mb=None),
        limits=Limits(),
        events=[],
        backend="bwrap",
    ).with_raw_output(b"\x1b[1ma", b"e")
    copy = result.model_copy(update={"stdout": "b"})
    assert (copy.raw_stdout(), copy.raw_stderr()) == (b"\x1b[1ma", b"e")
