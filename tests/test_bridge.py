"""The tool bridge when things go wrong: a real upstream server that crashes, hangs, fails
or floods, and sandboxed code that floods or abuses the channel.

Every test runs real code in a real sandbox against tests/fixtures/flaky_server.py (an
MCP server on the official SDK, started over stdio by the broker). Each failure must
reach the code as a `ToolCallError` of the documented kind, the run goes on, and the host
(the broker, its sessions, the next run) stays healthy.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests._forking import in_forked_child
from tests.containment._support import host_pids_with

from codecage import Options, Sandbox
from codecage.bridge import upstreams
from codecage.bridge.broker import Broker
from codecage.bridge.channel import BridgeLimits
from codecage.models import ExecutionResult

FLAKY = Path(__file__).resolve().parent / "fixtures" / "flaky_server.py"
SECRET = "flaky-credential-" + uuid.uuid4().hex[:12]
UPSTREAM_TIMEOUT_S = 2.0

# Agent code's way to call a tool and keep going: the outcome as [kind, value-or-message].
ATTEMPT = """
from codecage.runtime import ToolCallError, call_tool_sync
def attempt(tool, server="flaky", **arguments):
    try:
        return ["ok", call_tool_sync(server, tool, arguments)]
    except ToolCallError as exc:
        return [exc.kind, exc.message]
"""


def flaky_config(marker: str, **extra: Any) -> dict[str, Any]:
    server = {
        "command": sys.executable,
        "args": [str(FLAKY), marker],
        "env": {"FLAKY_SECRET": SECRET, "PATH": os.environ.get("PATH", "")},
        "timeout": UPSTREAM_TIMEOUT_S,
        **extra,
    }
    return {"mcpServers": {"flaky": server}}


def make_broker(marker: str, **extra: Any) -> Broker:
    return Broker(upstreams.parse(flaky_config(marker, **extra), source="test", environ={}))


@pytest.fixture(scope="module")
def marker() -> str:
    return f"flaky-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def broker(marker: str) -> Iterator[Broker]:
    with make_broker(marker) as shared:
        yield shared


@pytest.fixture(scope="module")
def sandbox(broker: Broker) -> Iterator[Sandbox]:
    with Sandbox(
        tools=broker, pool=False, allowed_imports=["os"], options=Options(scrub=False)
    ) as box:
        yield box


def run(sandbox: Sandbox, code: str, timeout: float = 60) -> ExecutionResult:
    return sandbox.run(ATTEMPT + code, limits={"timeout": timeout})


def value(sandbox: Sandbox, code: str) -> Any:
    result = run(sandbox, code)
    assert result.status == "ok", (result.error, result.stderr)
    return result.return_value


def pid_of(echoed: list[Any]) -> str:
    assert echoed[0] == "ok", echoed
    text = echoed[1]["result"] if isinstance(echoed[1], dict) else echoed[1]
    return str(text).rsplit("pid ", 1)[1].rstrip(")")


def test_a_working_call_returns_its_result(sandbox: Sandbox) -> None:
    kind, answer = value(sandbox, 'attempt("echo", text="hello")')
    assert kind == "ok"
    assert "hello (pid " in json.dumps(answer)


def test_a_crash_mid_call_is_an_upstream_error_and_the_server_is_restarted(
    sandbox: Sandbox,
) -> None:
    before, crashed, after = value(
        sandbox,
        '[attempt("echo", text="a"), attempt("crash", reason="test"), attempt("echo", text="b")]',
    )
    assert crashed[0] == "upstream_error"
    assert "flaky.crash" in crashed[1]
    assert "crashing on purpose (test)" in crashed[1]  # the server's last words, from stderr
    assert pid_of(after) != pid_of(before)  # a new process answered the next call


def test_a_hung_call_times_out_and_the_run_goes_on(sandbox: Sandbox) -> None:
    started = time.monotonic()
    hung, after = value(sandbox, '[attempt("hang"), attempt("echo", text="still here")]')
    elapsed = time.monotonic() - started
    assert hung[0] == "timeout"
    assert f"within {UPSTREAM_TIMEOUT_S:g} s" in hung[1]
    assert after[0] == "ok"
    assert elapsed < 30  # the run did not wait for the hung call


def test_a_tool_error_reaches_the_code_as_a_readable_exception(sandbox: Sandbox) -> None:
    failed, after = value(
        sandbox, '[attempt("fail", message="no such customer: 42"), attempt("echo", text="x")]'
    )
    assert failed[0] == "tool_error"
    assert failed[1].startswith("flaky.fail reported an error:")
    assert failed[1].endswith("no such customer: 42")
    assert after[0] == "ok"


def test_an_uncaught_tool_error_is_a_traceback_naming_the_tool(sandbox: Sandbox) -> None:
    result = sandbox.run(
        'from codecage.runtime import call_tool_sync\ncall_tool_sync("flaky", "fail", '
        '{"message": "quota exceeded"})'
    )
    assert result.status == "error"
    assert result.error is not None and result.error.type == "ToolCallError"
    assert "flaky.fail failed (tool_error)" in result.error.message
    assert "quota exceeded" in result.error.message


def test_a_result_over_the_size_limit_is_refused_and_the_next_call_works(
    sandbox: Sandbox,
) -> None:
    huge, after = value(sandbox, '[attempt("huge", megabytes=5), attempt("echo", text="x")]')
    assert huge[0] == "limit"
    assert "4 MiB limit per call" in huge[1]
    assert after[0] == "ok"


def test_unknown_servers_and_tools_are_clear_errors(sandbox: Sandbox) -> None:
    server, tool = value(sandbox, '[attempt("x", server="nope"), attempt("no_such_tool")]')
    assert server == ["unknown_server", "no upstream server 'nope' (known: flaky)"]
    # Refused by the broker: the server did not list it, so it never goes upstream.
    assert tool[0] == "not_allowed"
    assert "lists no tool 'no_such_tool'" in tool[1]


def test_the_servers_allow_list_refuses_other_tools(marker: str) -> None:
    with (
        make_broker(marker + "-allow", allow_tools=["echo"]) as narrow,
        Sandbox(tools=narrow, pool=False, options=Options(scrub=False)) as box,
    ):
        refused, allowed = value(box, '[attempt("crash"), attempt("echo", text="x")]')
    assert refused[0] == "not_allowed"
    assert "flaky.crash is not on the server's allow-list (echo)" in refused[1]
    assert allowed[0] == "ok"


def test_the_runs_allow_list_narrows_the_servers(broker: Broker) -> None:
    with Sandbox(
        tools=broker, allowed_tools=["flaky.e*"], pool=False, options=Options(scrub=False)
    ) as box:
        refused, allowed = value(box, '[attempt("fail", message="m"), attempt("echo", text="x")]')
    assert refused[0] == "not_allowed"
    assert "not among the tools this run may call (flaky.e*)" in refused[1]
    assert allowed[0] == "ok"


def test_calls_past_the_runs_budget_are_refused(broker: Broker) -> None:
    limits = BridgeLimits(max_calls=3)
    with Sandbox(tools=broker, pool=False, options=Options(tool_limits=limits, scrub=False)) as box:
        outcomes = value(box, '[attempt("echo", text=str(i))[0] for i in range(5)]')
        fresh = value(box, 'attempt("echo", text="next run")[0]')
    assert outcomes == ["ok", "ok", "ok", "limit", "limit"]
    assert fresh == "ok"  # the budget is per run


def test_every_call_is_recorded_in_the_events(sandbox: Sandbox) -> None:
    result = run(sandbox, '[attempt("echo", text="x"), attempt("fail", message="m")]')
    calls = [event.data for event in result.events if event.kind == "tool_call"]
    assert [(c["server"], c["tool"], c["status"]) for c in calls] == [
        ("flaky", "echo", "ok"),
        ("flaky", "fail", "tool_error"),
    ]
    for call in calls:
        assert call["duration_ms"] >= 0
        assert call["request_bytes"] > 0 and call["result_bytes"] > 0


@pytest.mark.parametrize(
    ("flood", "reason"),
    [
        ("os.write(4, b'{' * (5 * 1024 * 1024))", "a request over 4 MiB"),
        ("os.write(4, b'not json at all\\n')", "not JSON"),
        ("os.write(4, b'\\xff\\xfe\\x00garbage\\n' * 1000)", "not JSON"),
    ],
)
def test_a_sandbox_that_floods_the_channel_loses_its_bridge_not_the_host(
    sandbox: Sandbox, flood: str, reason: str
) -> None:
    code = f"""
import os
attempt("echo", text="opens the bridge")
try:
    {flood}
except OSError:
    pass  # the host may close it mid-write
attempt("echo", text="after the flood")
"""
    result = run(sandbox, code)
    assert result.status == "ok", (result.error, result.stderr)
    assert result.return_value[0] == "channel_closed"  # type: ignore[index]
    closed = [event.detail for event in result.events if event.kind == "bridge_closed"]
    assert len(closed) == 1
    assert closed[0].startswith("the tool bridge was closed: the sandbox sent")
    assert reason in closed[0]
    assert value(sandbox, 'attempt("echo", text="next run")')[0] == "ok"


def test_many_calls_at_once_are_bounded_and_answered(sandbox: Sandbox) -> None:
    code = """
import asyncio
from codecage.runtime import ToolCallError, call_tool
async def one(i):
    try:
        await call_tool("flaky", "echo", {"text": str(i)})
        return "ok"
    except ToolCallError as exc:
        return exc.kind
await asyncio.gather(*(one(i) for i in range(100)))
"""
    # At most 16 are in flight; the others are refused with kind limit; none is lost.
    outcomes = value(sandbox, code)
    assert len(outcomes) == 100
    assert set(outcomes) <= {"ok", "limit"}
    assert outcomes.count("ok") >= 16
    assert value(sandbox, 'attempt("echo", text="x")')[0] == "ok"


def test_the_sandbox_never_sees_the_upstream_credential(sandbox: Sandbox) -> None:
    code = f"""
import os
secret = {SECRET!r}.encode()
seen = [k for k, v in os.environ.items() if secret in v.encode()]
for pid in os.listdir("/proc"):
    if pid.isdigit():
        for name in ("environ", "cmdline"):
            try:
                with open(f"/proc/{{pid}}/{{name}}", "rb") as f:
                    if secret in f.read():
                        seen.append(f"/proc/{{pid}}/{{name}}")
            except OSError:
                pass
attempt("echo", text="the server runs")
seen
"""
    assert value(sandbox, code) == []


def test_a_credential_an_upstream_leaks_is_redacted_from_the_result(broker: Broker) -> None:
    with Sandbox(tools=broker, pool=False) as scrubbing:  # scrubbing on, as by default
        result = run(scrubbing, 'print(attempt("reveal_secret"))')
    assert result.status == "ok"
    assert SECRET not in result.stdout
    assert "[SECRET]" in result.stdout
    assert result.redactions.get("secret", 0) >= 1


def test_the_host_stays_healthy_after_every_failure(sandbox: Sandbox) -> None:
    # A first run starts the threads the host keeps for good (prefork's keeper): counted in.
    assert value(sandbox, 'attempt("echo", text="x")')[0] == "ok"
    threads = threading.active_count()
    for _ in range(3):
        value(sandbox, '[attempt("crash"), attempt("fail", message="m"), attempt("hang")]')
    assert value(sandbox, 'attempt("echo", text="x")')[0] == "ok"
    assert threading.active_count() <= threads + 2  # no thread per failed call is left


def test_closing_the_broker_ends_every_upstream_process(marker: str) -> None:
    mine = marker + "-close"
    with (
        make_broker(mine) as own,
        Sandbox(tools=own, pool=False, options=Options(scrub=False)) as box,
    ):
        value(box, '[attempt("crash"), attempt("echo", text="restarted")]')
        assert len(host_pids_with(mine)) == 1
    deadline = time.monotonic() + 10
    while host_pids_with(mine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert host_pids_with(mine) == []


def test_a_forked_child_gets_a_clear_error_and_the_parents_sessions_go_on(marker: str) -> None:
    """The broker's loop runs in a thread, which a fork does not copy: a call from a child
    would wait for nothing (and its exit, closing the broker, for 10 s)."""
    mine = marker + "-fork"
    with make_broker(mine) as own:
        assert "before" in own.call("flaky", "echo", {"text": "before"}).result(timeout=30).text

        def call_then_close() -> bytes:  # in the child
            started = time.monotonic()
            try:
                own.call("flaky", "echo", {"text": "child"}).result(timeout=20)
                outcome = {"kind": "ok", "message": ""}
            except Exception as exc:  # CallFailed, or a TimeoutError without the fix
                outcome = {"kind": getattr(exc, "kind", type(exc).__name__), "message": str(exc)}
            own.close()  # at once: the sessions are the parent's
            outcome["seconds"] = time.monotonic() - started
            return json.dumps(outcome).encode()

        reported = in_forked_child(call_then_close, timeout=40)
        assert reported, "the forked child did not finish"
        outcome = json.loads(reported)
        assert outcome["kind"] == "upstream_error" and "forked" in outcome["message"]
        assert outcome["seconds"] < 5
        assert "after" in own.call("flaky", "echo", {"text": "after"}).result(timeout=30).text
        assert len(host_pids_with(mine)) == 1  # the parent's session, not a second server


# --- the host's Channel on a real socketpair: served from the guest's first byte -----------


class _Echo:
    """A responder that answers every call with its arguments."""

    def call_tool(self, server: str, tool: str, arguments: dict[str, Any]) -> Any:
        from concurrent.futures import Future

        from codecage.bridge.channel import ToolAnswer

        done: Future[ToolAnswer] = Future()
        done.set_result(ToolAnswer(structured=arguments, text=""))
        return done

    def scrub(self, text: str) -> str:
        return text


def _bridge_threads() -> int:
    return sum(t.name.startswith("codecage-bridge-") for t in threading.enumerate())


def test_a_run_that_never_calls_a_tool_starts_no_bridge_thread() -> None:
    from socket import socketpair

    from codecage.bridge.channel import Channel

    host, guest = socketpair()
    with host, guest:
        channel = Channel(host, _Echo(), BridgeLimits())
        channel.start()
        threads = _bridge_threads()
        assert channel.stop() == []
    assert _bridge_threads() == threads


def test_the_first_byte_from_the_guest_starts_serving() -> None:
    from socket import socketpair

    from codecage.bridge.channel import Channel

    host, guest = socketpair()
    with host, guest:
        channel = Channel(host, _Echo(), BridgeLimits())
        channel.start()
        time.sleep(0.05)  # nothing to serve yet
        request = {
            "v": 1,
            "id": 7,
            "op": "call_tool",
            "server": "s",
            "tool": "t",
            "arguments": {"a": 1},
        }
        guest.sendall(json.dumps(request).encode() + b"\n")
        guest.settimeout(10)
        answer = json.loads(guest.recv(1 << 16))
        events = channel.stop()
    assert answer["id"] == 7 and answer["ok"] is True
    assert answer["result"]["structured"] == {"a": 1}
    assert [event.kind for event in events] == ["tool_call"]


def test_a_forked_host_process_serves_its_own_bridges() -> None:
    """The watcher's thread does not survive fork(): a child process that runs sandboxes
    (a pre-forking server, multiprocessing) must get a watcher of its own."""
    code = "from codecage.runtime import scrub\nscrub('mail ana@example.com')"
    with Sandbox(pool=False, options=Options(scrub=False)) as parent_box:
        assert parent_box.run(code).return_value == "mail [EMAIL]"  # the parent's watcher

    def child() -> bytes:  # report what its run returned (then it leaves at once)
        with Sandbox(pool=False, options=Options(scrub=False)) as child_box:
            result = child_box.run(code, limits={"timeout": 20})
        return json.dumps([result.status, result.return_value]).encode()

    reported = in_forked_child(child, timeout=120)
    assert reported and json.loads(reported) == ["ok", "mail [EMAIL]"]


def test_a_guest_that_hangs_up_without_a_request_starts_no_bridge_thread() -> None:
    """Every guest closes its end when its process ends, often before the host stops the
    channel: that is no reason to start serving."""
    from socket import socketpair

    from codecage.bridge.channel import Channel

    host, guest = socketpair()
    with host:
        channel = Channel(host, _Echo(), BridgeLimits())
        channel.start()
        threads = _bridge_threads()
        guest.close()
        time.sleep(0.2)  # the watcher sees the hang-up
        assert _bridge_threads() == threads
        assert channel.stop() == []


def test_a_request_sent_just_before_the_guest_hangs_up_is_still_served() -> None:
    from socket import socketpair

    from codecage.bridge.channel import Channel

    host, guest = socketpair()
    with host:
        channel = Channel(host, _Echo(), BridgeLimits())
        channel.start()
        request = {"v": 1, "id": 1, "op": "call_tool", "server": "s", "tool": "t", "arguments": {}}
        guest.sendall(json.dumps(request).encode() + b"\n")
        guest.close()
        time.sleep(0.2)
        events = channel.stop()
    assert [event.data["tool"] for event in events if event.kind == "tool_call"] == ["t"]
