"""Sessions (issue 21, item 1): one long-lived sandbox whose runs share an interpreter.

Real sandboxes throughout; the MCP tests use a real client over stdio. What a session
keeps (globals, imports, /workspace), what ends it (a run that kills the interpreter, its
TTL, close), what it never shares (another session, a pooled run), and what is refused
(unknown ids, another client's id, too many sessions, limits that are the session's).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from tests._anyio import anyio_backend  # noqa: F401 - a fixture
from tests._cli import serve_configured
from tests._forking import in_forked_child

from codecage import ConfigError, Options, Sandbox, SessionError
from codecage import host as hosts
from codecage import sandbox as sandboxes
from codecage.engine.session import Sessions, SessionTerms
from codecage.models import Limits, SessionSettings


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    with Sandbox(pool=False) as box:
        yield box


def _bwrap_children() -> int:
    """Sandboxes (bwrap processes) this test process has started and not reaped."""
    me = str(os.getpid())
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if fields.get("PPid", "").strip() == me and fields.get("Name", "").strip() in {
            "bwrap",
            "setpriv",
        }:
            count += 1
    return count


# --- state --------------------------------------------------------------------------------


def test_globals_imports_and_files_persist_between_runs(sandbox: Sandbox) -> None:
    with sandbox.session() as session:
        first = session.run(
            "import json\nx = 42\nopen('/workspace/notes.txt', 'w').write('kept')\n"
        )
        second = session.run("x + 1, json.dumps([x]), open('/workspace/notes.txt').read()")
    assert first.status == "ok", first
    assert second.status == "ok", second
    assert second.return_value == [43, "[42]", "kept"]
    assert first.session_id == second.session_id == session.id
    assert [f.path for f in second.files] == ["notes.txt"]


def test_files_are_read_from_the_sessions_workspace_never_through_a_link(
    sandbox: Sandbox,
) -> None:
    with sandbox.session() as session:
        session.run(
            "import os\nopen('/workspace/out.csv', 'w').write('a,b\\n1,2\\n')\n"
            "os.symlink('/etc/passwd', '/workspace/link')"
        )
        assert session.read_file("out.csv") == b"a,b\n1,2\n"
        with pytest.raises(ConfigError):
            session.read_file("link")
        with pytest.raises(ConfigError):
            session.read_file("../../etc/passwd")


def test_uploading_a_file_again_replaces_it_never_through_a_link(sandbox: Sandbox) -> None:
    with sandbox.session(limits={"workspace_mb": 8}) as session:
        first = session.run("open('data.csv').read()", files={"data.csv": "v1"})
        session.run(
            "import os\nos.remove('data.csv')\nos.symlink('/tmp/target', 'data.csv')\n"
            "open('/tmp/target', 'w').write('kept')"
        )
        second = session.run(
            "open('data.csv').read(), os.path.islink('data.csv'), open('/tmp/target').read()",
            files={"data.csv": "v2"},
        )
        with pytest.raises(ConfigError):
            session.run("1", files={"big.bin": b"x" * (9 * 1024 * 1024)})
        assert session.ended is None  # a refused upload leaves the session as it was
        after = session.run("open('data.csv').read()")
    assert first.return_value == "v1"
    assert second.return_value == ["v2", False, "kept"]
    assert after.return_value == "v2"


def test_display_outputs_and_their_caps_are_each_runs_own(sandbox: Sandbox) -> None:
    with sandbox.session() as session:
        first = session.run("for i in range(50):\n    display(f'item {i}')")
        second = session.run("display('again')")
    assert len(first.displays) == 50  # the most one run keeps
    assert [(d.index, d.data["text/plain"]) for d in second.displays] == [(0, "'again'")]
    assert not [e for e in second.events if e.kind == "display_truncated"]


def test_a_traceback_shows_the_line_of_the_run_that_defined_the_function(
    sandbox: Sandbox,
) -> None:
    with sandbox.session() as session:
        session.run("def ratio(a, b):\n    return a / b\n")
        failed = session.run("ratio(1, 0)")
    assert failed.status == "error"
    assert failed.error is not None and failed.error.type == "ZeroDivisionError"
    assert "return a / b" in failed.error.traceback
    assert "run2.py" in failed.error.traceback and "run1.py" in failed.error.traceback


def test_output_and_return_value_are_each_runs_own(sandbox: Sandbox) -> None:
    with sandbox.session() as session:
        one = session.run("print('one')")
        two = session.run("print('two')\n'done'")
    assert one.stdout == "one\n" and one.return_value is None
    assert two.stdout == "two\n" and two.return_value == "done"


def test_a_session_takes_more_runs_than_it_may_have_processes(sandbox: Sandbox) -> None:
    """Each run arms the timeout's interrupt: that must not cost a thread per run (they
    would pile up against RLIMIT_NPROC, max_processes)."""
    with sandbox.session(limits={"max_processes": 8}) as session:
        results = [session.run(f"n = {i}\nn") for i in range(40)]
    assert [r.status for r in results] == ["ok"] * 40
    assert results[-1].return_value == 39


def test_a_session_run_is_as_fast_as_a_function_call_needs(sandbox: Sandbox) -> None:
    """Not a timing assertion: the session really reuses its interpreter (the same pid,
    the module imported once)."""
    with sandbox.session() as session:
        first = session.run("import os, sys\nos.getpid(), 'decimal' in sys.modules")
        session.run("import decimal")
        second = session.run("os.getpid(), 'decimal' in sys.modules")
    assert first.return_value[0] == second.return_value[0]
    assert first.return_value[1] is False and second.return_value[1] is True


# --- what ends a session --------------------------------------------------------------------


def test_os_exit_ends_the_session_and_the_next_call_says_why(sandbox: Sandbox) -> None:
    session = sandbox.session()
    session.run("x = 1")
    ended = session.run("import os\nos._exit(3)")
    assert ended.status == "error" and ended.exit_code == 3
    assert [e.kind for e in ended.events if e.kind == "session_ended"] == ["session_ended"]
    with pytest.raises(SessionError) as refused:
        session.run("x")
    assert "ended" in str(refused.value) and "run 2" in str(refused.value)
    assert "session()" in refused.value.hint
    session.close()  # closing an ended session is harmless


def test_the_memory_limit_ends_the_session_with_memory_limit(sandbox: Sandbox) -> None:
    with sandbox.session(limits={"memory_mb": 128}) as session:
        session.run("data = []")
        hog = session.run("while True:\n    data.append(bytearray(16 * 1024 * 1024))")
        assert hog.status == "memory_limit", hog
        assert session.ended is not None
        with pytest.raises(SessionError):
            session.run("len(data)")


def test_a_timeout_interrupts_the_run_and_the_session_keeps_its_state(sandbox: Sandbox) -> None:
    with sandbox.session() as session:
        session.run("x = 41")
        slow = session.run("import time\nprint('started')\ntime.sleep(30)", limits={"timeout": 1})
        assert slow.status == "timeout", slow
        assert slow.signal == "SIGALRM" and slow.stdout == "started\n"
        assert slow.error is not None and slow.error.type == "KeyboardInterrupt"
        assert session.ended is None
        assert session.run("x + 1").return_value == 42


def test_code_that_ignores_the_interrupt_is_killed_and_ends_the_session(
    sandbox: Sandbox,
) -> None:
    with sandbox.session() as session:
        stubborn = session.run(
            "import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
            "print('started')\ntime.sleep(30)",
            limits={"timeout": 1},
        )
        assert stubborn.status == "timeout" and stubborn.signal == "SIGKILL"
        assert stubborn.stdout == "started\n"
        assert session.ended is not None and "timeout" in session.ended
        assert [e.kind for e in stubborn.events].count("session_ended") == 1


def test_a_forked_child_does_not_end_the_session(sandbox: Sandbox) -> None:
    with sandbox.session() as session:
        forked = session.run(
            "import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\n"
            "os.waitpid(pid, 0)\n'parent'"
        )
        after = session.run("'still here'")
    assert forked.return_value == "parent", forked
    assert after.return_value == "still here"


def test_closing_a_session_during_a_run_kills_the_run_then_destroys_it(
    sandbox: Sandbox,
) -> None:
    before = _bwrap_children()
    session = sandbox.session()
    session.run("1")
    results: list[Any] = []
    runner = threading.Thread(
        target=lambda: results.append(session.run("import time\nprint('in')\ntime.sleep(30)"))
    )
    runner.start()
    deadline = time.monotonic() + 10
    while not session._session.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # the run is in its sleep
    session.close()
    runner.join(timeout=20)
    assert not runner.is_alive()
    assert results[0].status == "killed", results[0]
    assert "session_ended" in [e.kind for e in results[0].events]
    deadline = time.monotonic() + 10
    while _bwrap_children() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _bwrap_children() == before


def test_close_destroys_the_sandbox(sandbox: Sandbox) -> None:
    before = _bwrap_children()
    session = sandbox.session()
    session.run("1")
    assert _bwrap_children() == before + 1
    session.close()
    deadline = time.monotonic() + 10
    while _bwrap_children() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _bwrap_children() == before
    with pytest.raises(SessionError, match="closed"):
        session.run("1")


def test_the_idle_ttl_closes_an_unused_session(sandbox: Sandbox) -> None:
    session = sandbox.session(ttl=1)
    session.run("x = 1")
    deadline = time.monotonic() + 10
    while session.ended is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session.ended is not None and "idle" in session.ended
    with pytest.raises(SessionError, match="idle"):
        session.run("x")


def test_the_session_cpu_budget_holds_across_runs() -> None:
    settings = SessionSettings(cpu_seconds=2)
    registry = Sessions(settings)
    with _over_registry(registry) as box, box.session() as session:
        burn = "import time\nend = time.process_time() + 1.5\nwhile time.process_time() < end: pass"
        first = session.run(burn)
        second = session.run(burn)
        assert first.status == "ok", first
        assert second.status == "cpu_limit", second
        with pytest.raises(SessionError):
            session.run("1")


def test_the_session_cpu_budget_holds_while_no_run_is_going() -> None:
    """Processes a run leaves behind burn CPU between runs: the budget is held then too
    (the reaper reads the session's cgroup), the session ends with its processes killed,
    and the next call says why. Before, it was checked only when the next run started."""
    registry = Sessions(SessionSettings(cpu_seconds=3))
    with _over_registry(registry) as box:
        before = _bwrap_children()
        session = box.session()
        left = session.run(
            "import subprocess, sys\n"
            "burn = [sys.executable, '-c', 'while True: pass']\n"
            "[subprocess.Popen(burn).pid for _ in range(2)]"
        )
        assert left.status == "ok", left
        deadline = time.monotonic() + 60  # 3 CPU-s of two busy processes, on a busy host
        while session.ended is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert session.ended is not None, "the session outlived its CPU budget while idle"
        assert "CPU budget of 3 s" in session.ended and "no run was going" in session.ended
        with pytest.raises(SessionError, match="CPU budget of 3 s"):
            session.run("1")
        deadline = time.monotonic() + 10
        while _bwrap_children() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _bwrap_children() == before  # the sandbox and its processes are gone


# --- isolation between sessions and runs ----------------------------------------------------


def test_sessions_share_nothing_with_each_other_or_with_runs(sandbox: Sandbox) -> None:
    with sandbox.session() as one, sandbox.session() as two:
        one.run(
            "secret = 'one'\nopen('/workspace/mine', 'w').write('1')\n"
            "open('/tmp/mine', 'w').write('1')"
        )
        seen = two.run(
            "import os\n('secret' in globals(), os.listdir('/workspace'),"
            " os.path.exists('/tmp/mine'))"
        )
        run = sandbox.run("import os\n(os.listdir('/workspace'), os.path.exists('/tmp/mine'))")
    assert seen.return_value == [False, [], False]
    assert run.return_value == [[], False]


def test_pooled_sessions_start_from_the_pool_and_stay_apart_from_pooled_runs() -> None:
    with Sandbox(pool=True) as box:
        assert box.warm(60)
        with box.session() as session:
            session.run("import os\nopen('/workspace/s', 'w').write('x')\nx = 5")
            run = box.run("import os\nos.listdir('/workspace'), 'x' in globals()")
            again = session.run("x")
    assert run.return_value == [[], False]
    assert again.return_value == 5


def test_runs_in_one_session_happen_one_at_a_time(sandbox: Sandbox) -> None:
    with sandbox.session() as session:
        session.run("import time\nlog = []")
        results: list[Any] = []

        def add(tag: str) -> None:
            results.append(
                session.run(f"log.append('{tag}+')\ntime.sleep(0.3)\nlog.append('{tag}-')")
            )

        threads = [threading.Thread(target=add, args=(t,)) for t in "ab"]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        order = session.run("log").return_value
    assert all(r.status == "ok" for r in results)
    assert order in (["a+", "a-", "b+", "b-"], ["b+", "b-", "a+", "a-"])


# --- refusals -----------------------------------------------------------------------------


def test_an_unknown_session_id_is_refused_saying_what_to_do(sandbox: Sandbox) -> None:
    with pytest.raises(SessionError) as refused:
        sandbox.host.sessions.get("ses_nope")
    assert "no session" in str(refused.value) and "session()" in refused.value.hint


def test_a_run_may_not_change_the_sessions_own_limits(sandbox: Sandbox) -> None:
    with sandbox.session() as session:
        with pytest.raises(ConfigError, match="memory_mb"):
            session.run("1", limits={"memory_mb": 256})
        assert session.run("1", limits={"timeout": 5}).status == "ok"


def test_too_many_sessions_are_refused_and_nothing_leaks() -> None:
    registry = Sessions(SessionSettings(max_per_client=2, max_total=3))
    with _over_registry(registry) as box:
        before = _bwrap_children()
        opened = [box.session(), box.session()]
        refusals = 0
        for _ in range(1000):
            try:
                box.session()
            except SessionError as exc:
                refusals += 1
                assert "max_per_client=2" in str(exc)
        assert refusals == 1000
        for session in opened:
            session.close()
    deadline = time.monotonic() + 10
    while _bwrap_children() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _bwrap_children() == before


def test_an_absurd_ttl_is_refused(sandbox: Sandbox) -> None:
    with pytest.raises(ConfigError, match="ttl"):
        sandbox.session(ttl=-1)


def test_a_session_belongs_to_the_client_that_opened_it() -> None:
    registry = Sessions(SessionSettings())
    try:
        with _over_registry(registry) as box:
            limits = box.limits
            terms = SessionTerms(limits=limits, owner="alice")
            session = registry.open(terms, lambda: box.host._session_sandbox(terms))
            with pytest.raises(SessionError, match="no session"):
                registry.get(session.id, "mallory")
            assert registry.get(session.id, "alice") is session
            assert registry.owned_by("mallory") == []
    finally:
        registry.close_all()


def test_limits_of_the_session_are_checked_before_it_opens(sandbox: Sandbox) -> None:
    with pytest.raises(ConfigError):
        sandbox.session(limits={"memory_mb": 10**9})
    assert isinstance(sandbox.limits, Limits)


# --- MCP ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def client(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Client]:
    workdir = tmp_path_factory.mktemp("serve-sessions")
    async with serve_configured(workdir, "[sessions]\nmax_per_client = 2\n") as c:
        yield c


def _text(result: Any) -> str:
    return "\n".join(getattr(block, "text", "") for block in result.content)


@pytest.mark.anyio
async def test_mcp_a_session_keeps_state_between_execute_code_calls(client: Client) -> None:
    opened = await client.call_tool("open_session", {})
    assert not opened.is_error, _text(opened)
    session_id = opened.structured_content["session_id"]
    first = await client.call_tool("execute_code", {"code": "x = 42", "session_id": session_id})
    second = await client.call_tool("execute_code", {"code": "x + 1", "session_id": session_id})
    assert second.structured_content["return_value"] == 43, _text(second)
    assert second.structured_content["session_id"] == session_id
    listed = await client.call_tool("list_sessions", {})
    assert [s["session_id"] for s in listed.structured_content["sessions"]] == [session_id]
    closed = await client.call_tool("close_session", {"session_id": session_id})
    assert not closed.is_error
    after = await client.call_tool("execute_code", {"code": "x", "session_id": session_id})
    assert after.is_error and "ended" in _text(after) and "open_session" in _text(after)
    assert first.structured_content["status"] == "ok"


@pytest.mark.anyio
async def test_mcp_unknown_session_and_session_arguments_are_refused(client: Client) -> None:
    unknown = await client.call_tool("execute_code", {"code": "1", "session_id": "ses_nope"})
    assert unknown.is_error and "open_session" in _text(unknown)
    opened = await client.call_tool("open_session", {"memory_limit_mb": 256})
    session_id = opened.structured_content["session_id"]
    assert opened.structured_content["memory_limit_mb"] == 256
    mixed = await client.call_tool(
        "execute_code", {"code": "1", "session_id": session_id, "profile": "basic"}
    )
    assert mixed.is_error and "open_session" in _text(mixed)
    await client.call_tool("close_session", {"session_id": session_id})


@pytest.mark.anyio
async def test_mcp_too_many_sessions_is_a_clear_refusal(client: Client) -> None:
    ids = []
    for _ in range(2):
        opened = await client.call_tool("open_session", {})
        ids.append(opened.structured_content["session_id"])
    third = await client.call_tool("open_session", {})
    assert third.is_error and "close_session" in _text(third)
    for _ in range(1000):  # a client hammering: each refused at once, nothing started
        again = await client.call_tool("open_session", {})
        assert again.is_error
    listed = await client.call_tool("list_sessions", {})
    assert sorted(s["session_id"] for s in listed.structured_content["sessions"]) == sorted(ids)
    for session_id in ids:
        await client.call_tool("close_session", {"session_id": session_id})
    fourth = await client.call_tool("open_session", {})
    assert not fourth.is_error
    await client.call_tool("close_session", {"session_id": fourth.structured_content["session_id"]})


def test_a_forked_child_refuses_sessions_instead_of_hanging(sandbox: Sandbox) -> None:
    with sandbox.session() as session:

        def work() -> bytes:
            answers = []
            for attempt in (sandbox.session, lambda: session.run("1")):
                try:
                    attempt()
                except SessionError as exc:
                    answers.append("forked" in str(exc))
            return b"ok" if answers == [True, True] else repr(answers).encode()

        assert in_forked_child(work, timeout=20) == b"ok"
        assert session.run("'parent still works'").return_value == "parent still works"


def test_info_reports_the_session_bounds_and_how_many_are_open(sandbox: Sandbox) -> None:
    before = sandbox.info().open_sessions
    with sandbox.session():
        info = sandbox.info()
    assert info.open_sessions == before + 1
    assert info.sessions is not None and info.sessions.max_per_client == 4


def _over_registry(registry: Sessions) -> Sandbox:
    """A Sandbox (no pool) whose host keeps its sessions in `registry`."""
    return sandboxes.over(hosts.build(Options(pool=False).resolve(), sessions=registry))
