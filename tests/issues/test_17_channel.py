"""Issue 17, the tool bridge's transport: code in a real sandbox attacks its bridge socket.

- 2: code that writes requests and never reads the answers must not grow the host
  (the answers it leaves unread are bounded; the host stops reading from it).
- 10 (metering): `scrub` is a call, its text is bounded, and the host CPU that serving a
  run's bridge costs is bounded by the run's cpu_seconds.
- 13: a request nested too deeply closes the channel with an event, and the code's
  later calls fail at once instead of hanging.
"""

from __future__ import annotations

import json
import logging
import resource
import select
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
from tests._bridge_flood import NEXT_CALL, bridge_flood

from codecage import Options, Sandbox
from codecage.bridge.channel import BridgeLimits, Channel, ToolAnswer
from codecage.models import ExecutionResult


def _host_rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _host_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@pytest.fixture(scope="module")
def box() -> Iterator[Sandbox]:
    # A budget of calls no flood reaches: what bounds the host here is the buffer.
    limits = BridgeLimits(max_calls=10**9)
    with Sandbox(
        pool=False, allowed_imports=["os"], options=Options(scrub=False, tool_limits=limits)
    ) as sandbox:
        yield sandbox


def _closed(result: ExecutionResult) -> list[str]:
    return [event.detail for event in result.events if event.kind == "bridge_closed"]


# Each a request line with `%d` for its id: big answers, and small requests with answers ten
# times their size (an unknown wire version).
SCRUB_60K = """b'{"v":1,"id":%d,"op":"scrub","text":"' + b"a" * 60_000 + b'"}\\n'"""
NO_VERSION = """b'{"id":%d}\\n'"""


@pytest.mark.parametrize("request_line", [SCRUB_60K, NO_VERSION], ids=["scrub_60k", "no_version"])
def test_answers_the_code_never_reads_do_not_grow_the_host(box: Sandbox, request_line: str) -> None:
    box.run("1")  # the sandbox's own first-run costs are not the flood's
    before = _host_rss_mb()
    # What the host allocates during the run, at its peak (RSS alone can hide it when an
    # earlier test's freed memory is reused).
    tracemalloc.start()
    try:
        result = box.run(
            bridge_flood(request_line, seconds=6),
            limits={"timeout": 30, "cpu_seconds": 30},
        )
        peak = tracemalloc.get_traced_memory()[1] / (1024 * 1024)
    finally:
        tracemalloc.stop()
    grown = _host_rss_mb() - before
    assert result.status == "ok", (result.error, result.stderr)
    sent = result.return_value
    assert isinstance(sent, int)
    # Unbounded, the host queued every answer: ~110 MB/s of scrub answers for 60 kB texts.
    assert grown < 40, f"the host grew by {grown:.0f} MB while the code sent {sent} bytes"
    # The bound: 1 MiB of unread answers, a partial line, one request and one answer.
    assert peak < 8, f"the host held {peak:.1f} MiB at once while the code sent {sent} bytes"
    # The host stopped reading once the unread answers reached its bound: the code's
    # writes were refused (would block), not taken by the megabyte.
    assert sent < 16 * 1024 * 1024
    assert box.run("from codecage.runtime import scrub\nscrub('x@example.com')").return_value == (
        "[EMAIL]"
    )


def test_a_flood_of_refused_requests_is_bounded_by_the_calls_budget() -> None:
    limits = BridgeLimits(max_calls=50)
    with Sandbox(
        pool=False, allowed_imports=["os"], options=Options(scrub=False, tool_limits=limits)
    ) as sandbox:
        code = (
            bridge_flood(NO_VERSION, seconds=4)
            + """
from codecage.runtime import ToolCallError, scrub
from codecage.runtime.bridge import _reset
os.set_blocking(4, True)
_reset()  # the runtime's own bridge: the same socket, now read
try:
    scrub("y")
    outcome = "ok"
except ToolCallError as exc:
    outcome = [exc.kind, exc.message]
outcome
"""
        )
        result = sandbox.run(code, limits={"timeout": 30})
    assert result.status == "ok", (result.error, result.stderr)
    # Past the budget every further op is refused, or the channel closed saying why.
    assert result.return_value != "ok"
    kind, message = result.return_value  # type: ignore[misc]
    assert kind == "limit" and "50 tool bridge requests" in message, message


SCRUB_LOOP = """
import time
from codecage.runtime import ToolCallError, scrub
text = "mail ana@example.com or call 555-123-4567 " * 24_000  # just under 1 MiB
done, refused, deadline = 0, None, time.monotonic() + 20
while time.monotonic() < deadline:
    try:
        scrub(text)
        done += 1
    except ToolCallError as exc:
        refused = [exc.kind, exc.message]
        break
[done, refused]
"""


def test_scrub_is_metered_by_the_runs_cpu_budget() -> None:
    with Sandbox(pool=False, options=Options(scrub=False)) as sandbox:
        sandbox.run("1")
        before = _host_cpu_s()
        started = time.monotonic()
        result = sandbox.run(SCRUB_LOOP, limits={"timeout": 40, "cpu_seconds": 2})
        host_cpu = _host_cpu_s() - before
        elapsed = time.monotonic() - started
    assert result.status == "ok", (result.error, result.stderr)
    done, refused = result.return_value  # type: ignore[misc]
    # Unmetered, the host scrubbed for the whole 20 s loop (~1 MiB per 0.3 s of host CPU).
    assert refused is not None, f"{done} scrubs, {host_cpu:.1f} s of host CPU, none refused"
    assert refused[0] == "limit"
    assert "host CPU" in refused[1]
    # The run may use 2 s of CPU; its bridge at most as much (one op may pass the line).
    assert host_cpu < 2 + 1.5, f"{host_cpu:.1f} s of host CPU in {elapsed:.1f} s"


def test_scrub_text_is_bounded() -> None:
    with Sandbox(pool=False, options=Options(scrub=False)) as sandbox:
        result = sandbox.run(
            "from codecage.runtime import ToolCallError, scrub\n"
            "try:\n    scrub('a' * (2 * 1024 * 1024))\n    out = 'ok'\n"
            "except ToolCallError as exc:\n    out = [exc.kind, exc.message]\n"
            "[out, scrub('b@example.com')]"
        )
    assert result.status == "ok", (result.error, result.stderr)
    (kind, message), after = result.return_value  # type: ignore[misc]
    assert kind == "limit" and "MiB" in message
    assert after == "[EMAIL]"  # the channel goes on


DEEP = """
import os, time
from codecage.runtime import ToolCallError, scrub
scrub("opens the bridge")
os.write(4, b'{"v":1,"id":99,"op":"call_tool","server":"s","tool":"t","arguments":'
         + b"[" * 200_000 + b"]" * 200_000 + b"}\\n")
"""
DEEP += NEXT_CALL + "[outcome, waited]\n"


def test_a_deeply_nested_request_closes_the_channel_and_later_calls_fail_at_once() -> None:
    with Sandbox(pool=False, allowed_imports=["os"], options=Options(scrub=False)) as sandbox:
        result = sandbox.run(DEEP, limits={"timeout": 20})
        after = sandbox.run("from codecage.runtime import scrub\nscrub('z@example.com')")
    # Without the fix the host's reader died of RecursionError: the call hung until timeout.
    assert result.status == "ok", (result.status, result.error, result.stderr)
    outcome, waited = result.return_value  # type: ignore[misc]
    assert outcome == "channel_closed"
    assert waited < 5
    closed = _closed(result)
    assert len(closed) == 1 and "nested" in closed[0], result.events
    assert after.return_value == "[EMAIL]"  # the next run has a working bridge


def test_a_request_nested_within_parse_depth_but_deep_is_refused_not_fatal() -> None:
    code = """
from codecage.runtime import ToolCallError, call_tool_sync, scrub
deep = []
for _ in range(500):
    deep = [deep]
try:
    call_tool_sync("s", "t", {"a": deep})
    outcome = "ok"
except ToolCallError as exc:
    outcome = [exc.kind, exc.message]
[outcome, scrub("w@example.com")]
"""
    with Sandbox(pool=False, options=Options(scrub=False)) as sandbox:
        result = sandbox.run(code, limits={"timeout": 20})
    assert result.status == "ok", (result.error, result.stderr)
    (kind, message), after = result.return_value  # type: ignore[misc]
    assert kind == "bad_request" and "nested" in message
    assert after == "[EMAIL]"


# --- the host's Channel on a real socketpair: what it holds, what it logs ----------------


class _Responder:
    """Scrub returns its text; a call fails with an exception whose text the guest chose."""

    def call_tool(self, server: str, tool: str, arguments: dict[str, Any]) -> Future[ToolAnswer]:
        failed: Future[ToolAnswer] = Future()
        failed.set_exception(RuntimeError(f"no tool {tool}"))  # a responder bug
        return failed

    def scrub(self, text: str) -> str:
        if text.startswith("raise:"):
            raise ValueError(text)
        return text


def _request(request_id: int, **fields: Any) -> bytes:
    return json.dumps({"v": 1, "id": request_id, **fields}).encode() + b"\n"


def _answers(sock: socket.socket, count: int, deadline: float) -> list[dict[str, Any]]:
    buffer, answers = b"", []
    while len(answers) < count:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(1 << 20)
        assert chunk, f"the channel ended after {len(answers)} of {count} answers"
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        answers += [json.loads(line) for line in lines]
    return answers


def test_the_host_stops_reading_while_its_answers_are_unread_and_resumes_after() -> None:
    bound = 256 * 1024
    host, guest = socket.socketpair()
    with host, guest:
        channel = Channel(host, _Responder(), BridgeLimits(max_calls=10**9, max_unread_bytes=bound))
        channel.start()
        guest.setblocking(False)
        sent, text, deadline = 0, "a" * 60_000, time.monotonic() + 30
        pending = b""
        while time.monotonic() < deadline:
            pending = pending or _request(sent + 1, op="scrub", text=text)
            try:
                written = guest.send(pending)
            except BlockingIOError:
                # Writable again within 2 s: the host still reads. Not: it stopped.
                if not select.select([], [guest], [], 2.0)[1]:
                    break
                continue
            pending = pending[written:]
            sent += not pending
        else:
            pytest.fail(f"the host never stopped reading: {sent} requests taken")
        assert channel.peak_unread_bytes <= bound + len(_request(0, text=text)) + 200
        assert sent < 200  # the kernel's socket buffers and the bound, not a flood
        # Reading the answers lets the host read again: the rest of the request cut short.
        guest.setblocking(True)
        rest = threading.Thread(target=guest.sendall, args=(pending,), daemon=True)
        rest.start()
        answers = _answers(guest, sent + 1, time.monotonic() + 30)
        rest.join(timeout=10)
        channel.stop()
    assert sorted(answer["id"] for answer in answers) == list(range(1, sent + 2))
    assert all(answer["ok"] and answer["result"] == text for answer in answers)


def test_a_failing_responder_is_an_error_answer_and_its_text_reaches_the_log_bounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    forged = "\n2026-01-01 INFO codecage: all good \x1b]52;c;Zm9v\x07" + "x" * 1_000_000
    host, guest = socket.socketpair()
    with host, guest, caplog.at_level(logging.DEBUG, logger="codecage.bridge.channel"):
        channel = Channel(host, _Responder(), BridgeLimits())
        channel.start()
        guest.sendall(_request(1, op="scrub", text="raise:" + forged))
        guest.sendall(_request(2, op="call_tool", server="s", tool=forged, arguments={}))
        guest.sendall(_request(3, op="scrub", text="still served"))
        answers = {answer["id"]: answer for answer in _answers(guest, 3, time.monotonic() + 30)}
        channel.stop()
    assert answers[1]["ok"] is False and answers[1]["error"]["kind"] == "upstream_error"
    assert answers[2]["ok"] is False
    assert answers[3] == {"v": 1, "id": 3, "ok": True, "result": "still served"}
    logged = "\n".join(
        f"{record.getMessage()} {record.__dict__.get('error', '')} {record.exc_text or ''}"
        for record in caplog.records
    )
    assert caplog.records
    assert "\x1b" not in logged and "\n2026-01-01" not in logged
    assert len(logged) < 4000


def test_a_request_the_reader_cannot_parse_ends_the_channel_with_a_reason_for_the_guest() -> None:
    host, guest = socket.socketpair()
    with host, guest:
        channel = Channel(host, _Responder(), BridgeLimits())
        channel.start()
        guest.sendall(_request(1, op="scrub", text="first"))
        guest.sendall(b'{"v":1,"id":2,"op":"scrub","text":' + b"[" * 200_000 + b"\n")
        guest.settimeout(10)
        received = b""
        while chunk := guest.recv(1 << 16):
            received += chunk
        events = channel.stop()
    first, last = (json.loads(line) for line in received.splitlines())
    assert first["result"] == "first"
    assert "nested too deeply" in last["closed"]
    assert [event.kind for event in events] == ["bridge_closed"]
