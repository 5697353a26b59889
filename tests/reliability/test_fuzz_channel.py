"""Hostile bytes on the two channels the host reads from a sandbox (issue 25).

The control stream (fd 3: "ready", "result", "display", "end") is parsed by
`engine.judge.ControlStream`; the tool bridge (fd 4) by `bridge.channel.Channel`. Code in
the sandbox can write anything to both. Whatever it writes, the host must end the run with
a result (never another exception), keep what it holds bounded, and let the main process's
own last messages decide the run. The bridge is driven here over a real socketpair with its
real reader and writer threads; both channels also from inside a real sandbox on every
backend.

Findings (fixed in engine/judge.py, with the regression tests below):
- a control line that is JSON but not an object (`[1]`, `7`, `"x"`), or nested too deeply
  for the parser, raised out of `Sandbox.run` (AttributeError / RecursionError);
- every malformed control line's reason was kept: ~730k lines of 15 bytes within the
  control cap held ~405 MB of host memory (now the first `MAX_PROBLEMS`, and a count);
  the same for display lines refused past the caps;
- every line was parsed: the control cap's worth of 2-byte lines cost ~21 s of host CPU
  per run (now: a line that cannot be a message is refused unparsed; what is left, lines
  shaped like messages, costs ~1-1.7 s per run at worst, within the control cap).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests._bridge_flood import NEXT_CALL

from codecage.bridge.channel import MAX_REQUEST_BYTES, BridgeLimits, Channel, NoServers
from codecage.engine import judge
from codecage.engine.judge import MAX_PROBLEMS, ControlStream
from codecage.engine.run import _CONTROL_CAP_BYTES
from codecage.guest import contract

from ._fuzz_host import BACKENDS, BackendSandboxes, backend_sandboxes

MAIN_PID = 7


@pytest.fixture(scope="module")
def sandboxes() -> Iterator[BackendSandboxes]:
    yield from backend_sandboxes()


# --- the control stream, as the host parses it ------------------------------------------


def _msg(**fields: Any) -> bytes:
    return json.dumps({"v": 1, **fields}).encode() + b"\n"


REAL_RESULT = _msg(kind="result", pid=MAIN_PID, exit_code=0, return_value=42)
REAL_END = _msg(kind="end", pid=MAIN_PID, exit_code=0)

json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
forged = st.builds(
    lambda kind, pid, rest: _msg(kind=kind, pid=pid, **rest),
    st.sampled_from(["ready", "result", "end", "display", "run", "stop", "x"]),
    st.one_of(st.integers(), st.just(MAIN_PID), st.text(max_size=4)),
    st.dictionaries(
        st.sampled_from(["exit_code", "return_value", "error", "events", "source", "data"]),
        json_values,
        max_size=3,
    ),
)
garbage_lines = st.one_of(
    st.binary(max_size=64).map(lambda b: b.replace(b"\n", b"") + b"\n"),
    json_values.map(lambda v: json.dumps(v).encode() + b"\n"),
    forged,
    st.integers(1, 5000).map(lambda n: b"[" * n + b"\n"),
    st.integers(1, 5000).map(lambda n: b'{"a":' * n + b"\n"),
    st.sampled_from([b"\xff\xfe\n", b'{"v":1,"kind":"display"\n', b"NaN\n", b"\n", b"{}\n"]),
)


def _fed(stream: ControlStream, data: bytes, cuts: list[int]) -> judge.GuestMessages:
    """`data` fed in the pieces `cuts` splits it into, then finished."""
    last = 0
    for cut in sorted({min(c, len(data)) for c in cuts}):
        stream.feed(data[last:cut])
        last = cut
    stream.feed(data[last:])
    return stream.finish()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    garbage=st.lists(garbage_lines, max_size=30),
    cuts=st.lists(st.integers(0, 4000), max_size=6),
)
def test_garbage_before_the_bootstraps_last_messages_never_decides_the_run(
    garbage: list[bytes], cuts: list[int]
) -> None:
    """Whatever the code wrote first, in whatever chunks it arrives, the main process's
    last "result" and "end" decide the run, and the host keeps a bounded note of the rest."""
    data = _msg(kind="ready", pid=MAIN_PID) + b"".join(garbage) + REAL_RESULT + REAL_END
    said = _fed(ControlStream(_CONTROL_CAP_BYTES, ready_pid=None), data, cuts)
    assert said.ready
    assert said.report is not None and said.report.return_value == 42
    assert said.exit_code == 0
    assert len(said.problems) <= MAX_PROBLEMS
    assert len(said.displays) <= contract.MAX_DISPLAYS
    assert len(said.displays_refused) <= MAX_PROBLEMS


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=3000), cuts=st.lists(st.integers(0, 3000), max_size=6))
def test_any_bytes_on_the_control_stream_are_parsed_without_an_exception(
    data: bytes, cuts: list[int]
) -> None:
    """Arbitrary bytes, an unfinished last line included, and any chunking: the stream
    says what it could, and the same whatever the chunks."""
    whole = ControlStream(1 << 20, ready_pid=MAIN_PID)
    whole.feed(data)
    expected = whole.finish()
    said = _fed(ControlStream(1 << 20, ready_pid=MAIN_PID), data, cuts)
    assert said.problem_count == expected.problem_count
    assert (said.report, said.exit_code) == (expected.report, expected.exit_code)


@pytest.mark.parametrize(
    "line",
    [b"[1]", b"7", b'"x"', b"null", b"[" * 100_000, b'{"a":' * 100_000],
    ids=["list", "int", "string", "null", "deep-list", "deep-object"],
)
def test_a_control_line_that_is_json_but_no_object_is_a_problem_not_a_crash(
    line: bytes,
) -> None:
    """Regression: these raised AttributeError / RecursionError out of the parser (and so
    out of `Sandbox.run`)."""
    stream = ControlStream(1 << 20, ready_pid=MAIN_PID)
    stream.feed(line + b"\n" + REAL_RESULT)
    said = stream.finish()
    assert said.problem_count == 1 and said.report is not None


def test_a_flood_of_malformed_control_lines_keeps_only_a_few_reasons() -> None:
    """Regression: each malformed line's reason (~500 bytes for a 15-byte line) was kept;
    the control cap's worth of them held ~405 MB of host memory."""
    stream = ControlStream(_CONTROL_CAP_BYTES, ready_pid=MAIN_PID)
    block = b'{"kind":"end"}\n' * 4096
    for _ in range(40):  # 2.4 MB: enough to count, and the bound is on the count kept
        stream.feed(block)
    said = stream.finish()
    assert said.problem_count == 40 * 4096
    assert len(said.problems) == MAX_PROBLEMS


def test_short_or_non_object_control_lines_are_refused_without_parsing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: every line was parsed, at ~3 µs a line: the control cap's worth of
    `x` lines cost the host 21 s of CPU, of `{}` lines 10 s (measured; now ~1 s). No
    valid message is shorter than `{"v":1,"kind":"ready","pid":0}`."""
    parsed: list[bytes] = []
    real_loads = json.loads

    def counting(text: Any, **kwargs: Any) -> Any:
        parsed.append(text)
        return real_loads(text, **kwargs)

    monkeypatch.setattr(judge.json, "loads", counting)
    stream = ControlStream(_CONTROL_CAP_BYTES, ready_pid=MAIN_PID)
    stream.feed(b"x\n" * 5000 + b"{}\n" * 5000 + b'{"kind":"end"}\n' * 5000 + REAL_RESULT)
    said = stream.finish()
    assert said.problem_count == 15000 and said.report is not None
    assert parsed == [REAL_RESULT.rstrip(b"\n")]


def test_display_lines_past_the_caps_keep_only_a_few_reasons() -> None:
    """Past MAX_DISPLAYS every further display line is refused unparsed: the count of
    them is kept, and only the first reasons (no list growing with the flood)."""
    stream = ControlStream(_CONTROL_CAP_BYTES, ready_pid=MAIN_PID)
    display = _msg(kind="display", pid=MAIN_PID, source="display", data={"text/plain": "a"})
    display = display.replace(b'{"v": 1, "kind": "display"', b'{"v":1,"kind":"display"')
    stream.feed(display * (contract.MAX_DISPLAYS + 5000))
    said = stream.finish()
    assert len(said.displays) == contract.MAX_DISPLAYS
    assert said.displays_refused_count == 5000
    assert len(said.displays_refused) <= MAX_PROBLEMS


def test_the_control_stream_past_its_cap_is_cut_and_said_so() -> None:
    stream = ControlStream(1000, ready_pid=MAIN_PID)
    stream.feed(b"x" * 5000)
    assert stream.truncated
    assert stream.finish().problem_count == 1


# --- the tool bridge over a real socketpair ------------------------------------------------


class Guest:
    """The guest's end of a real bridge socketpair served by a real `Channel`."""

    def __init__(self, limits: BridgeLimits | None = None) -> None:
        self.sock, host = socket.socketpair()
        self.channel = Channel(host, NoServers(lambda text: text), limits or BridgeLimits())
        self._host = host
        self.channel.start()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def lines_until(self, done_id: int, timeout_s: float = 20.0) -> list[dict[str, Any]]:
        """The host's lines until the answer to `done_id`, a `closed` line, or the end.
        The bound only keeps a broken reader from hanging the test: a live one answers in
        milliseconds (the requests are read in order, so `done_id`'s answer comes last)."""
        self.sock.settimeout(timeout_s)
        lines: list[dict[str, Any]] = []
        buffer = b""
        while True:
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                lines.append(json.loads(line))
                if lines[-1].get("id") == done_id or "closed" in lines[-1]:
                    return lines
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                return lines
            buffer += chunk

    def close(self) -> list[Any]:
        events = self.channel.stop()
        self.sock.close()
        self._host.close()
        return events


DONE = 10**9  # the id of the last, well-formed request: its answer means all were read


def _scrub(request_id: Any, text: Any = "x", **extra: Any) -> bytes:
    body = {"v": 1, "id": request_id, "op": "scrub", "text": text, **extra}
    return json.dumps(body).encode() + b"\n"


def _is_host_line(line: dict[str, Any]) -> bool:
    """One of the host's three line shapes (docs/tool-bridge.md)."""
    if set(line) == {"v", "closed"}:
        return isinstance(line["closed"], str) and len(line["closed"]) <= 2000
    if line.get("ok") is True:
        return set(line) == {"v", "id", "ok", "result"}
    return set(line) == {"v", "id", "ok", "error"} and set(line["error"]) == {"kind", "message"}


bridge_lines = st.one_of(
    st.binary(max_size=80).map(lambda b: b.replace(b"\n", b"") + b"\n"),
    json_values.map(lambda v: json.dumps(v).encode() + b"\n"),
    st.builds(
        _scrub,
        st.one_of(st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=3), st.none()),
        st.one_of(st.text(max_size=30), st.integers(), st.none()),
    ),
    st.builds(
        lambda rid, op, server, tool, args: (
            json.dumps(
                {"v": 1, "id": rid, "op": op, "server": server, "tool": tool, "arguments": args}
            ).encode()
            + b"\n"
        ),
        st.integers(0, 1000),
        st.sampled_from(["call_tool", "scrub", "other", 3]),
        json_values,
        json_values,
        json_values,
    ),
    st.integers(60, 3000).map(lambda n: b'{"v":1,"id":1,"op":"scrub","text":' + b"[" * n + b"\n"),
    st.sampled_from([b"\xff\xfe\n", b'{"v":2,"id":1,"op":"scrub","text":"x"}\n', b"{}\n"]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(bridge_lines, max_size=12))
def test_any_request_lines_get_answers_or_a_closed_line_never_a_dead_reader(
    lines: list[bytes],
) -> None:
    """Whatever lines come, the host answers each with its id, in order, in one of its
    three line shapes, or ends the channel with a `closed` line and a `bridge_closed`
    event; and the next well-formed request is answered if the channel is still open."""
    guest = Guest()
    try:
        guest.send(b"".join(lines) + _scrub(DONE, "last"))
        got = guest.lines_until(DONE)
    finally:
        events = guest.close()
    assert got, "the host sent nothing back: neither answers nor a closed line"
    assert all(_is_host_line(line) for line in got)
    closed = [line for line in got if "closed" in line]
    if closed:
        assert got[-1] is closed[0], "nothing follows the closed line"
        assert any(e.kind == "bridge_closed" for e in events)
    else:
        assert got[-1] == {"v": 1, "id": DONE, "ok": True, "result": "last"}


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\xff\xfe\xfd\n", "not JSON"),
        (b"[1, 2]\n", "without an integer id"),
        (b'{"v":1,"id":"1","op":"scrub","text":"x"}\n', "without an integer id"),
        (b'{"v":1,"id":1.0,"op":"scrub","text":"x"}\n', "without an integer id"),
        (b"[" * 200_000 + b"\n", "nested too deeply"),
        (b"x" * (MAX_REQUEST_BYTES + 10), "over 4 MiB"),
        (b'{"v":1,"id":1,"op":"scrub","text":"' + b"a" * MAX_REQUEST_BYTES + b'"}\n', "over 4"),
    ],
    ids=["utf8", "list", "str-id", "float-id", "deep", "no-newline-over-cap", "line-over-cap"],
)
def test_a_frame_the_host_cannot_take_closes_the_channel_saying_why(data: bytes, why: str) -> None:
    guest = Guest()
    try:
        guest.send(data)
        got = guest.lines_until(DONE)
    finally:
        events = guest.close()
    assert got and "closed" in got[-1] and why in got[-1]["closed"]
    assert [e for e in events if e.kind == "bridge_closed"]


def test_a_truncated_last_frame_is_dropped_and_the_reader_ends_cleanly() -> None:
    guest = Guest()
    try:
        guest.send(_scrub(1, "a") + b'{"v":1,"id":2,"op":"scr')
        guest.sock.shutdown(socket.SHUT_WR)
        got = guest.lines_until(1)
        reader = guest.channel._threads[0]  # the reader sees the end of the stream
        reader.join(timeout=10)
        assert not reader.is_alive()
    finally:
        events = guest.close()
    assert got == [{"v": 1, "id": 1, "ok": True, "result": "a"}]
    assert not [e for e in events if e.kind == "bridge_closed"]


@settings(max_examples=6, deadline=None)
@given(
    text_kib=st.integers(1, 200),
    unread_kib=st.sampled_from([64, 256, 1024]),
)
def test_a_request_flood_whose_answers_are_never_read_holds_a_bounded_queue(
    text_kib: int, unread_kib: int
) -> None:
    """The guest sends requests and reads nothing: the host's queue of unread answers
    stays within `max_unread_bytes` plus one answer (it stops reading requests there)."""
    limits = BridgeLimits(max_calls=100_000, max_unread_bytes=unread_kib * 1024)
    guest = Guest(limits)
    line = _scrub(1, "a" * (text_kib * 1024))
    # Past the bound and the sockets' buffers (the writer fills those first) by far.
    count = (limits.max_unread_bytes + 16 * 1024 * 1024) // len(line) + 1
    sender = threading.Thread(target=_send_quietly, args=(guest.sock, line * count))
    sender.start()
    try:
        deadline = time.monotonic() + 20  # only against a hang: it fills in milliseconds
        full = limits.max_unread_bytes
        while guest.channel.peak_unread_bytes < full and time.monotonic() < deadline:
            sender.join(timeout=0.01)
        sender.join(timeout=0.2)  # a reader that would go on reading gets the chance
    finally:
        guest.close()  # unblocks the sender (the host end shuts down)
        sender.join(timeout=10)
    assert guest.channel.peak_unread_bytes >= full
    assert guest.channel.peak_unread_bytes <= limits.max_unread_bytes + len(line) + 200


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the host ended the channel: the flood is over
        sock.sendall(data)


# --- both channels from inside a real sandbox, on every backend -------------------------

CONTROL_GARBAGE = r"""
import os
for line in [b"[1]", b"7", b"[" * 100000, b"\xff\xfe", b'{"kind": "result"}',
             b'{"v": 1, "kind": "result", "pid": 1, "exit_code": 0, "return_value": "forged"}',
             b'{"v": 1, "kind": "end", "pid": 99999, "exit_code": 0}',
             b'{"v":1,"kind":"display","pid":1,"source":"display","data":{"text/plain":7}}']:
    os.write(3, line + b"\n")
os.write(3, b"[1]\n" * 200000)   # 800 kB of lines that are no object
print("still here")
6 * 7
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_code_writing_garbage_to_its_control_fd_still_gets_its_own_result(
    sandboxes: BackendSandboxes, backend: str
) -> None:
    """The bootstrap's last messages win over what the code wrote; the garbage is one
    `guest_report_invalid` event; `Sandbox.run` returns a result (it raised before)."""
    result = sandboxes.get(backend).run(CONTROL_GARBAGE, limits={"timeout": 60})
    assert result.status == "ok", result
    assert result.stdout == "still here\n"
    assert result.return_value == 42
    invalid = [e for e in result.events if e.kind == "guest_report_invalid"]
    assert len(invalid) == 1 and "malformed guest message" in invalid[0].detail


BRIDGE_GARBAGE = r"""
import os, time
from codecage.runtime import ToolCallError, scrub
os.write(4, b"\xff\xfe not json\n")
"""
BRIDGE_GARBAGE += NEXT_CALL + "print(outcome, waited < 10)\n"


@pytest.mark.parametrize("backend", BACKENDS)
def test_code_writing_garbage_to_its_bridge_fd_ends_the_bridge_not_the_run(
    sandboxes: BackendSandboxes, backend: str
) -> None:
    """The host closes the bridge (a `bridge_closed` event), the code's next call fails
    at once instead of waiting, and the run itself ends normally."""
    started = time.monotonic()
    result = sandboxes.get(backend).run(BRIDGE_GARBAGE, limits={"timeout": 60})
    assert result.status == "ok", result
    assert result.stdout.split()[1] == "True", result.stdout  # failed, and not by a timeout
    assert result.stdout.split()[0] != "answered"
    assert [e for e in result.events if e.kind == "bridge_closed"]
    assert time.monotonic() - started < 60  # generous: the run is not held to its timeout
