"""Human approval of a run ([approval]): a person decides before a run starts, by what the
run is granted (hosts, tools with side effects, a lent workspace, ...), never by how its
code reads; on each face in its own way, and every decision is an `approval` event of the
result and of its audit record. Real runs, the real MCP SDK client over stdio, a real
upstream MCP server with annotated tools, a real pty for the CLI.

Changed with issue 33 item 7: these tests used to expect code with a high-severity finding
(`import ctypes`) to wait and plain code to run; now a run waits because of a grant (here
mostly a lent workspace, or allow_hosts on MCP) and the same code without one runs, its
findings only shown as advice."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import pty
import select
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp_types import CallToolResult, ElicitRequestParams, ElicitResult, ErrorData, TextContent

from codecage import ApprovalRequest, ConfigError, ExecutionResult, Options, Sandbox
from codecage.bridge import broker as broker_module
from codecage.bridge import upstreams
from codecage.bridge.broker import Broker
from codecage.config import load as load_config
from codecage.models import ApprovalSettings
from codecage.policy import approval as approvals
from test_server import CODECAGE, server_env

RISKY = "import ctypes\nctypes.sizeof(ctypes.c_int) * 10"  # CC105, high: advice only
RISKY_SHA = hashlib.sha256(RISKY.encode()).hexdigest()
MEDIUM = "import mmap\n7"  # CC105, medium
PLAIN = "6 * 7"
MODES = ["legacy", "2026-07-28"]  # the two protocol eras: elicitation/create, InputRequired
ANNOTATED = Path(__file__).resolve().parent / "fixtures" / "annotated_server.py"
GROWING = Path(__file__).resolve().parent / "fixtures" / "growing_server.py"

# One payload three ways: plainly, obfuscated (no finding can see it), and written to a
# file then imported (validation sees only the writing). All three do the same thing.
PAYLOADS = {
    "plain": "import ctypes\nctypes.sizeof(ctypes.c_int) * 10",
    "obfuscated": "m = __import__(''.join(map(chr, [99, 116, 121, 112, 101, 115])))\n"
    "getattr(m, 'sizeof')(getattr(m, 'c_int')) * 10",
    "imported": "import sys\nopen('/tmp/p.py', 'w').write("
    "'import ctypes\\nvalue = ctypes.sizeof(ctypes.c_int) * 10\\n')\n"
    "sys.path.insert(0, '/tmp')\nimport p\np.value",
}


def config(tmp_path: Path, require: str = "grants", timeout: float = 30, extra: str = "") -> Path:
    path = tmp_path / "config.toml"
    path.write_text(f'[approval]\nrequire = "{require}"\ntimeout = {timeout}\n{extra}')
    return path


@pytest.fixture
def lent(tmp_path: Path) -> Path:
    """A host directory to lend read-write: a grant that waits by default."""
    path = tmp_path / "lent"
    path.mkdir()
    return path


def approval_of(result: ExecutionResult) -> dict[str, Any]:
    found = [e for e in result.events if e.kind == "approval"]
    assert len(found) == 1, result.events
    assert found[0].data is not None
    return found[0].data


def recorded_events(db: Path) -> list[tuple[str, str, list[dict[str, Any]]]]:
    """(execution id, status, events) of every record, as the SQLite store keeps them."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        runs = conn.execute("SELECT execution_id, status FROM executions").fetchall()
        events = conn.execute("SELECT execution_id, kind, data FROM events ORDER BY seq").fetchall()
    return [
        (
            run_id,
            status,
            [
                {"kind": k, "data": json.loads(d) if d else None}
                for e_id, k, d in events
                if e_id == run_id
            ],
        )
        for run_id, status in runs
    ]


def recorded_decision(db: Path, status: str) -> dict[str, Any]:
    (record,) = recorded_events(db)
    assert record[1] == status
    (event,) = [e for e in record[2] if e["kind"] == "approval"]
    data: dict[str, Any] = event["data"]
    return data


# --- which runs wait: what they are granted ------------------------------------------------


def test_which_runs_wait_is_decided_by_grants_and_the_configured_capabilities() -> None:
    declared = approvals.Declared(
        hosts=("api.example.com",),
        tools=(
            approvals.ToolReach("s.read", read_only=True, destructive=False, open_world=False),
            approvals.ToolReach("s.drop", destructive=True, open_world=False),
        ),
        workspace="/srv/project",
    )
    grants = approvals.declared_grants(declared)
    kinds = [g.capability for g in grants]
    assert kinds == ["network", "tools", "destructive_tools", "workspace"]  # s.read: none
    grants_rule = ApprovalSettings(require="grants")
    assert [g.capability for g in approvals.waiting_for(grants, grants_rule) or []] == [
        "network",
        "tools",
        "workspace",
    ]
    only_destructive = ApprovalSettings(require="grants", capabilities=("destructive_tools",))
    (waits,) = approvals.waiting_for(grants, only_destructive) or []
    assert str(waits) == "destructive_tools: s.drop"
    nothing = approvals.declared_grants(approvals.Declared())
    assert approvals.waiting_for(nothing, grants_rule) is None
    assert approvals.waiting_for(nothing, ApprovalSettings(require="always")) == []
    assert approvals.waiting_for(grants, ApprovalSettings()) is None  # no [approval]


def test_the_old_text_based_levels_are_read_as_grants() -> None:
    """Changed: 'high' and 'medium' judged the code's text; an old config now asks a person
    by what a run is granted (and still asks: it is never read as "no approval")."""
    assert ApprovalSettings(require="high").require == "grants"
    assert ApprovalSettings(require="medium").require == "grants"


@pytest.mark.parametrize("way", list(PAYLOADS))
def test_the_same_payload_gets_the_same_verdict_however_it_is_written(
    tmp_path: Path, lent: Path, way: str
) -> None:
    """Before: the plain payload waited (CC105), the obfuscated one and the one written to a
    file then imported ran without anyone asked. Now: none waits without a grant, and each
    waits with one, whatever its findings."""
    asked: list[ApprovalRequest] = []

    def approve(request: ApprovalRequest) -> bool:
        asked.append(request)
        return True

    code = PAYLOADS[way]
    with Sandbox(config=config(tmp_path), approve=approve, pool=False) as sandbox:
        ungranted = sandbox.run(code)
        granted = sandbox.run(code, workspace=lent)
    assert (ungranted.status, ungranted.return_value) == ("ok", 40), ungranted.error
    assert not [e for e in ungranted.events if e.kind == "approval"]
    assert (granted.status, granted.return_value) == ("ok", 40), granted.error
    (request,) = asked
    assert request.capabilities == ["workspace"]
    assert str(lent) in request.grants[0].detail
    assert approval_of(granted)["capabilities"] == ["workspace"]


# --- the library ---------------------------------------------------------------------------


def test_without_a_callback_a_required_approval_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[approval\] require = 'grants'") as refused:
        Sandbox(config=config(tmp_path), pool=False)
    assert "approve=" in refused.value.hint


def test_an_approved_run_runs_and_its_event_is_in_the_result_and_the_audit_record(
    tmp_path: Path, lent: Path
) -> None:
    asked: list[ApprovalRequest] = []
    db = tmp_path / "audit.db"

    def approve(request: ApprovalRequest) -> bool:
        asked.append(request)
        return True

    with Sandbox(
        config=config(tmp_path), approve=approve, pool=False, options=Options(audit=db)
    ) as sandbox:
        result = sandbox.run(RISKY, workspace=lent)
        plain = sandbox.run(RISKY)  # the same code, granted nothing
    assert result.status == "ok" and result.return_value == 40
    (request,) = asked  # the run granted nothing was not asked about
    assert request.code == RISKY and request.code_sha256 == RISKY_SHA
    assert request.capabilities == ["workspace"] and request.require == "grants"
    assert request.rule_ids == ["CC105"]  # advice, shown to the person
    data = approval_of(result)
    assert data["decision"] == "approved" and data["code_sha256"] == RISKY_SHA
    assert data["capabilities"] == ["workspace"] and data["rule_ids"] == ["CC105"]
    assert "library callback" in data["who"]
    assert data["when"]
    assert plain.status == "ok" and not [e for e in plain.events if e.kind == "approval"]
    on_record = {run_id: events for run_id, _, events in recorded_events(db)}
    decisions = [
        e["data"]["decision"] for e in on_record[result.execution_id] if e["kind"] == "approval"
    ]
    assert decisions == ["approved"]
    assert not [e for e in on_record[plain.execution_id] if e["kind"] == "approval"]


def test_a_denied_run_is_blocked_and_nothing_ran(tmp_path: Path, lent: Path) -> None:
    code = "import ctypes\nopen('/workspace/ran', 'w')"
    db = tmp_path / "audit.db"
    with Sandbox(
        config=config(tmp_path),
        approve=lambda request: False,
        pool=False,
        options=Options(audit=db),
    ) as sandbox:
        result = sandbox.run(code, workspace=lent)
    assert result.status == "blocked" and result.usage.wall_ms == 0
    assert not (lent / "ran").exists()
    assert result.error is not None and result.error.type == "ApprovalDenied"
    assert "granted workspace" in result.error.traceback
    assert "CC105" in result.error.traceback  # the advice shown
    assert approval_of(result)["decision"] == "denied"
    assert recorded_decision(db, "blocked")["decision"] == "denied"


def test_a_callback_that_does_not_answer_in_time_is_a_timeout_and_a_denial(
    tmp_path: Path, lent: Path
) -> None:
    release = asyncio.Event()

    async def never(request: ApprovalRequest) -> bool:
        await release.wait()
        return True

    async def main() -> ExecutionResult:
        with Sandbox(config=config(tmp_path, timeout=1), approve=never, pool=False) as sandbox:
            return await sandbox.arun(RISKY, workspace=lent)

    result = asyncio.run(main())
    assert result.status == "blocked"
    assert approval_of(result)["decision"] == "timeout"


def test_a_coroutine_callback_is_awaited_on_the_arun_callers_loop(
    tmp_path: Path, lent: Path
) -> None:
    loops: list[asyncio.AbstractEventLoop] = []

    async def approve(request: ApprovalRequest) -> bool:
        loops.append(asyncio.get_running_loop())
        return request.capabilities == ["workspace"]

    async def main() -> tuple[ExecutionResult, asyncio.AbstractEventLoop]:
        with Sandbox(config=config(tmp_path), approve=approve, pool=False) as sandbox:
            return await sandbox.arun(RISKY, workspace=lent), asyncio.get_running_loop()

    result, loop = asyncio.run(main())
    assert result.status == "ok" and approval_of(result)["decision"] == "approved"
    assert loops == [loop]


def test_a_callback_that_raises_denies(tmp_path: Path, lent: Path) -> None:
    def broken(request: ApprovalRequest) -> bool:
        raise RuntimeError("no one home")

    with Sandbox(config=config(tmp_path), approve=broken, pool=False) as sandbox:
        result = sandbox.run(RISKY, workspace=lent)
    assert result.status == "blocked" and approval_of(result)["decision"] == "denied"


def test_always_asks_for_every_run_and_findings_alone_never_make_a_run_wait(
    tmp_path: Path,
) -> None:
    """Changed: under 'medium', MEDIUM's finding used to make it wait; now a finding alone
    never does (the old level is read as 'grants', and MEDIUM is granted nothing)."""
    asked: list[str] = []

    def approve(request: ApprovalRequest) -> bool:
        asked.append(request.code)
        return True

    with Sandbox(config=config(tmp_path, "always"), approve=approve, pool=False) as sandbox:
        assert sandbox.run(PLAIN).return_value == 42
    (tmp_path / "m").mkdir()
    with Sandbox(config=config(tmp_path / "m", "medium"), approve=approve, pool=False) as sandbox:
        assert sandbox.run(MEDIUM).return_value == 7
        assert sandbox.run(PLAIN).return_value == 42
    assert asked == [PLAIN]


def test_a_network_grant_waits_and_says_its_hosts(tmp_path: Path) -> None:
    asked: list[ApprovalRequest] = []

    def approve(request: ApprovalRequest) -> bool:
        asked.append(request)
        return False

    cfg = config(tmp_path, extra='[network]\nceiling = ["example.com"]\n')
    with Sandbox(config=cfg, approve=approve, pool=False) as sandbox:
        refused = sandbox.run(PLAIN, allow_hosts=["example.com"])
        plain = sandbox.run(PLAIN)
    assert refused.status == "blocked" and plain.return_value == 42
    (request,) = asked
    assert [str(g) for g in request.grants] == ["network: example.com"]


@contextlib.contextmanager
def annotated_tools() -> Iterator[Broker]:
    config = {"mcpServers": {"notes": {"command": sys.executable, "args": [str(ANNOTATED)]}}}
    with Broker(upstreams.parse(config, source="test", environ={})) as broker:
        yield broker


@pytest.mark.parametrize(
    ("allowed", "waits"),
    [
        (["notes.read_note"], []),  # read-only, closed world: nothing to approve
        (["notes.delete_note"], ["tools", "destructive_tools"]),
        (["notes.search_web"], ["open_world_tools"]),  # read-only, but reaches out
        (["notes.unannotated"], ["tools", "destructive_tools", "open_world_tools"]),
    ],
)
def test_tools_with_side_effects_wait_by_their_annotations(
    tmp_path: Path, allowed: list[str], waits: list[str]
) -> None:
    """A real upstream server lists its tools with their MCP annotations; a run that may
    call one with side effects waits, one that may call only a read-only tool does not.
    A tool that says nothing is taken at MCP's defaults (it may write, destroy, reach out)."""
    asked: list[ApprovalRequest] = []

    def approve(request: ApprovalRequest) -> bool:
        asked.append(request)
        return True

    every = "destructive_tools", "open_world_tools", "tools"
    extra = f"capabilities = {json.dumps(list(every))}\n"
    with (
        annotated_tools() as broker,
        Sandbox(
            config=config(tmp_path, extra=extra),
            approve=approve,
            pool=False,
            tools=broker,
            allowed_tools=allowed,
        ) as sandbox,
    ):
        result = sandbox.run(PLAIN)
    assert result.return_value == 42
    if not waits:
        assert asked == [] and not [e for e in result.events if e.kind == "approval"]
        return
    (request,) = asked
    assert request.capabilities == waits
    assert all(g.detail.startswith(allowed[0]) for g in request.grants)


def test_a_tool_the_server_adds_during_a_run_is_not_callable_without_its_approval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33, item 7 (review): the run was judged by the tools listed before it started
    (one read-only tool: nothing to approve); the server then added a destructive one, the
    broker listed it again at the code's call, and the run called it with no person asked.
    A run may call only the tools it was judged by. (The broker's relist interval is set to
    0 so the test need not wait 30 s for it: the same relisting, sooner.)"""
    monkeypatch.setattr(broker_module, "_RELIST_S", 0.0)
    asked: list[ApprovalRequest] = []

    def approve(request: ApprovalRequest) -> bool:
        asked.append(request)
        return True

    code = (
        "from codecage.runtime import call_tool_sync, ToolCallError\n"
        "first = call_tool_sync('growing', 'login', {'name': 'x'})\n"
        "try:\n"
        "    then = call_tool_sync('growing', 'wipe', {'name': 'all'})\n"
        "except ToolCallError as exc:\n"
        "    then = exc.kind\n"
        "[first, then]"
    )
    extra = 'capabilities = ["destructive_tools"]\n'
    server = {"mcpServers": {"growing": {"command": sys.executable, "args": [str(GROWING)]}}}
    with (
        Broker(upstreams.parse(server, source="test", environ={})) as broker,
        Sandbox(
            config=config(tmp_path, extra=extra), approve=approve, pool=False, tools=broker
        ) as sandbox,
    ):
        result = sandbox.run(code)
    assert result.status == "ok", result.error
    assert asked == []  # judged by `login` alone: read-only, nothing to approve
    assert result.return_value == [{"result": "hello x"}, "not_allowed"]


def test_the_config_file_names_the_capabilities(tmp_path: Path) -> None:
    extra = 'capabilities = ["destructive_tools"]\n'
    settings = load_config(config(tmp_path, extra=extra))
    assert settings.approval.capabilities == ("destructive_tools",)
    assert settings.approval.require == "grants"


# --- the CLI -------------------------------------------------------------------------------


def test_the_cli_without_a_terminal_refuses_and_says_why_in_flag_terms(
    tmp_path: Path, lent: Path
) -> None:
    db = tmp_path / "audit.db"
    args = ["run", "--config", str(config(tmp_path)), "--audit", str(db)]
    done = subprocess.run(
        [CODECAGE, *args, "--workspace", str(lent), "-c", RISKY],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=server_env(),
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "no terminal" in done.stderr and "granted: workspace" in done.stderr
    assert "codecage run --file" in done.stderr  # the hint: what to do, as commands and flags
    data = recorded_decision(db, "blocked")
    assert data["decision"] == "unavailable" and data["code_sha256"] == RISKY_SHA


def test_the_cli_on_a_terminal_needs_no_approval_for_a_run_granted_nothing(
    tmp_path: Path,
) -> None:
    """Changed: RISKY used to wait for its finding; granted nothing, it runs."""
    output, code = prompted_run(tmp_path, RISKY, answer=None, workspace=None)
    assert code == 0 and json.loads(output)["return_value"] == 40


@pytest.mark.parametrize(("answer", "decision"), [("y", "approved"), ("n", "denied")])
def test_the_cli_asks_on_its_terminal_and_runs_only_on_yes(
    tmp_path: Path, lent: Path, answer: str, decision: str
) -> None:
    output, code = prompted_run(tmp_path, RISKY, answer=answer, workspace=lent)
    result = json.loads(output)
    (event,) = [e for e in result["events"] if e["kind"] == "approval"]
    assert event["data"]["decision"] == decision
    assert "/dev/pts/" in event["data"]["who"]
    if decision == "approved":
        assert code == 0 and result["status"] == "ok" and result["return_value"] == 40
    else:
        assert code == 1 and result["status"] == "blocked"


def prompted_run(
    tmp_path: Path, code: str, answer: str | None, workspace: Path | None
) -> tuple[str, int]:
    """`codecage run --json` (lending `workspace`) with a pty as stdin and stderr: answers
    the prompt when it shows (which must show the grant, the finding as advice and the
    hash), and returns stdout and the exit code."""
    leader, follower = pty.openpty()
    lend = ["--workspace", str(workspace)] if workspace is not None else []
    with subprocess.Popen(
        [CODECAGE, "run", "--config", str(config(tmp_path)), "--json", *lend, "--code", code],
        stdin=follower,
        stderr=follower,
        stdout=subprocess.PIPE,
        env=server_env(),
        text=True,
    ) as proc:
        os.close(follower)
        shown = b""
        deadline = time.monotonic() + 120
        while answer is not None and b"Run it?" not in shown:
            assert time.monotonic() < deadline, shown
            if select.select([leader], [], [], 1)[0]:
                shown += os.read(leader, 4096)
        if answer is not None:
            assert b"CC105" in shown and RISKY_SHA.encode() in shown
            assert b"workspace: " in shown and b"Advice" in shown
            assert b"import ctypes" in shown  # the finding's line of code
            os.write(leader, answer.encode() + b"\n")
        assert proc.stdout is not None
        output = proc.stdout.read()
        proc.wait(timeout=120)
    with contextlib.suppress(OSError):
        while select.select([leader], [], [], 0)[0] and os.read(leader, 4096):
            pass
    os.close(leader)
    return output, proc.returncode


# --- MCP ----------------------------------------------------------------------------------

Answer = Any  # an elicitation callback's behaviour
GRANTED = {"code": RISKY, "allow_hosts": ["example.com"]}  # waits: a network grant


@contextlib.asynccontextmanager
async def serving(
    tmp_path: Path, mode: str, elicit: Answer | None, timeout: float = 30
) -> AsyncIterator[Client]:
    """`codecage serve` over stdio with [approval] require = "grants", a network ceiling
    that lets a call ask for example.com (`GRANTED`), and an audit file, and the SDK's
    client in `mode`; `elicit` is its elicitation callback (None: it declares no
    elicitation capability)."""
    env = {k: v for k, v in server_env().items() if k in ("PYTHONPATH", "PATH", "HOME")}
    cfg = config(tmp_path, timeout=timeout, extra='[network]\nceiling = ["example.com"]\n')
    args = ["serve", "--no-pool", "--config", str(cfg)]
    args += ["--audit", str(tmp_path / "audit.db")]
    params = StdioServerParameters(command=CODECAGE, args=args, cwd=str(tmp_path), env=env)
    with (tmp_path / "stderr.log").open("w", encoding="utf-8") as errlog:
        transport = stdio_client(params, errlog=errlog)
        async with Client(
            transport, mode=mode, elicitation_callback=elicit, read_timeout_seconds=120
        ) as client:
            yield client


def answering(approve: bool, seen: list[str], delay: float = 0) -> Answer:
    async def elicit(context: Any, params: ElicitRequestParams) -> ElicitResult | ErrorData:
        seen.append(params.message)
        await anyio.sleep(delay)
        return ElicitResult(action="accept", content={"approve": approve})

    return elicit


def structured(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, text_of(result)
    assert result.structured_content is not None
    return result.structured_content


def text_of(result: CallToolResult) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, TextContent))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("approve", "status"), [(True, "ok"), (False, "blocked")])
async def test_an_mcp_client_user_approves_or_denies_through_elicitation(
    tmp_path: Path, mode: str, approve: bool, status: str
) -> None:
    seen: list[str] = []
    async with serving(tmp_path, mode, answering(approve, seen)) as client:
        result = await client.call_tool("execute_code", GRANTED)
        plain = await client.call_tool("execute_code", {"code": PLAIN})
    run = structured(result)
    assert run["status"] == status
    (event,) = [e for e in run["events"] if e["kind"] == "approval"]
    assert event["data"]["decision"] == ("approved" if approve else "denied")
    assert event["data"]["who"].startswith("mcp:")
    assert event["data"]["capabilities"] == ["network"]
    assert event["data"]["rule_ids"] == ["CC105"]  # advice
    assert len(seen) == 1 and RISKY_SHA in seen[0]  # asked once
    assert "network: example.com" in seen[0] and "CC105" in seen[0]
    # each era its own way: a deadline only where the server cannot wait (InputRequired)
    assert ("Answer by" in seen[0]) == (mode != "legacy")
    assert structured(plain)["return_value"] == 42
    if approve:
        assert run["return_value"] == 40
    records = {status for _, status, _ in recorded_events(tmp_path / "audit.db")}
    assert records == {status, "ok"}


@pytest.mark.anyio
async def test_an_mcp_client_that_never_answers_is_denied_at_the_timeout(
    tmp_path: Path,
) -> None:
    seen: list[str] = []

    async def never(context: Any, params: ElicitRequestParams) -> ElicitResult | ErrorData:
        seen.append(params.message)
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async with serving(tmp_path, "legacy", never, timeout=2) as client:
        result = await client.call_tool("execute_code", GRANTED)
    run = structured(result)
    assert run["status"] == "blocked" and seen
    assert recorded_decision(tmp_path / "audit.db", "blocked")["decision"] == "timeout"


@pytest.mark.anyio
async def test_a_late_answer_through_input_required_is_a_timeout(tmp_path: Path) -> None:
    """2026-07-28: the server cannot wait on the client; an answer after the deadline it
    gave in the question is a denial, however it answered."""
    seen: list[str] = []
    async with serving(tmp_path, "2026-07-28", answering(True, seen, delay=3), 1) as client:
        result = await client.call_tool("execute_code", GRANTED)
    run = structured(result)
    assert run["status"] == "blocked" and "Answer by" in seen[0]
    assert recorded_decision(tmp_path / "audit.db", "blocked")["decision"] == "timeout"


@pytest.mark.anyio
@pytest.mark.parametrize("mode", MODES)
async def test_a_client_without_elicitation_gets_a_tool_error_saying_why(
    tmp_path: Path, mode: str
) -> None:
    async with serving(tmp_path, mode, None) as client:
        refused = await client.call_tool("execute_code", GRANTED)
        plain = await client.call_tool("execute_code", {"code": PLAIN})
    assert refused.is_error
    text = text_of(refused)
    assert "approval required" in text and "elicitation" in text and "network" in text
    assert "nothing ran" in text
    assert structured(plain)["return_value"] == 42
    blocked = [r for r in recorded_events(tmp_path / "audit.db") if r[1] == "blocked"]
    (event,) = [e for e in blocked[0][2] if e["kind"] == "approval"]
    assert event["data"]["decision"] == "unavailable"


def test_an_mcp_answer_covers_only_the_grants_its_user_was_shown() -> None:
    """Issue 33, item 7 (review): over MCP the user answers before the call runs, and the
    host judges the run again at its start; a tool an upstream added in between was covered
    by the earlier "approve" though the user never saw it. The answer now covers what was
    shown, no more. (A unit test of the approver the MCP face hands the host: the interval
    between an elicitation's answer and the run's start cannot be hit on purpose in a real
    server; the host's second judgment itself is tested above with a real upstream.)"""
    from codecage.mcp.approval import given
    from codecage.models import Grant

    def asked(*tools: str) -> ApprovalRequest:
        grants = [Grant(capability="destructive_tools", detail=t) for t in tools]
        return ApprovalRequest(
            code=PLAIN, code_sha256="0" * 64, grants=grants, findings=[], require="grants",
            timeout=30,
        )  # fmt: skip

    shown = tuple(str(g) for g in asked("notes.delete_note").grants)
    approved = approvals.Verdict("approved", "mcp:test (its user)", shown=shown)
    assert given(approved)(asked("notes.delete_note")).decision == "approved"
    later = given(approved)(asked("notes.delete_note", "growing.wipe"))
    assert later.decision == "unavailable" and "growing.wipe" in later.reason
    denied = approvals.Verdict("denied", "mcp:test (its user)", shown=shown)
    assert given(denied)(asked("notes.delete_note", "growing.wipe")).decision == "denied"
