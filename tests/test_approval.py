"""Human approval of high-risk code ([approval]): a person decides before the code runs, on
each face in its own way, and every decision is an `approval` event of the result and of its
audit record. Real runs, the real MCP SDK client over stdio, a real pty for the CLI."""

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
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp_types import CallToolResult, ElicitRequestParams, ElicitResult, ErrorData, TextContent

from codecage import ApprovalRequest, ConfigError, ExecutionResult, Sandbox
from codecage.models import ValidationReport
from codecage.policy import approval as approvals
from test_server import CODECAGE, server_env

RISKY = "import ctypes\nctypes.sizeof(ctypes.c_int) * 10"  # CC105, high
RISKY_SHA = hashlib.sha256(RISKY.encode()).hexdigest()
MEDIUM = "import mmap\n7"  # CC105, medium
PLAIN = "6 * 7"
MODES = ["legacy", "2026-07-28"]  # the two protocol eras: elicitation/create, InputRequired


def config(tmp_path: Path, require: str = "high", timeout: float = 30) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(f'[approval]\nrequire = "{require}"\ntimeout = {timeout}\n')
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


# --- which code waits ----------------------------------------------------------------------


def test_levels_count_security_findings_at_or_above_them_and_always_counts_every_run(
    tmp_path: Path,
) -> None:
    with Sandbox(pool=False) as sandbox:
        risky, medium, plain = (sandbox.validate(c) for c in (RISKY, MEDIUM, PLAIN))
        broken: ValidationReport = sandbox.validate("def (:")
    assert [f.rule_id for f in approvals.reaching(risky, "high") or []] == ["CC105"]
    assert approvals.reaching(medium, "high") is None
    assert [f.rule_id for f in approvals.reaching(medium, "medium") or []] == ["CC105"]
    assert approvals.reaching(plain, "medium") is None
    assert approvals.reaching(plain, "always") == []
    assert approvals.reaching(broken, "high") is None  # a syntax error cannot do anything


# --- the library ---------------------------------------------------------------------------


def test_without_a_callback_a_required_approval_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[approval\] require = 'high'") as refused:
        Sandbox(config=config(tmp_path), pool=False)
    assert "approve=" in refused.value.hint


def test_an_approved_run_runs_and_its_event_is_in_the_result_and_the_audit_record(
    tmp_path: Path,
) -> None:
    asked: list[ApprovalRequest] = []
    db = tmp_path / "audit.db"

    def approve(request: ApprovalRequest) -> bool:
        asked.append(request)
        return True

    with Sandbox(config=config(tmp_path), approve=approve, pool=False, audit=db) as sandbox:
        result = sandbox.run(RISKY)
        plain = sandbox.run(PLAIN)
    assert result.status == "ok" and result.return_value == 40
    (request,) = asked  # the plain run was not asked about
    assert request.code == RISKY and request.code_sha256 == RISKY_SHA
    assert request.rule_ids == ["CC105"] and request.require == "high"
    data = approval_of(result)
    assert data["decision"] == "approved" and data["code_sha256"] == RISKY_SHA
    assert data["rule_ids"] == ["CC105"] and "library callback" in data["who"]
    assert data["when"]
    assert plain.status == "ok" and not [e for e in plain.events if e.kind == "approval"]
    on_record = {run_id: events for run_id, _, events in recorded_events(db)}
    decisions = [
        e["data"]["decision"] for e in on_record[result.execution_id] if e["kind"] == "approval"
    ]
    assert decisions == ["approved"]
    assert not [e for e in on_record[plain.execution_id] if e["kind"] == "approval"]


def test_a_denied_run_is_blocked_and_nothing_ran(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    code = f"import ctypes\nopen({str(marker)!r}, 'w')"  # the host path is not there anyway
    db = tmp_path / "audit.db"
    with Sandbox(
        config=config(tmp_path), approve=lambda request: False, pool=False, audit=db
    ) as sandbox:
        result = sandbox.run(code)
    assert result.status == "blocked" and result.usage.wall_ms == 0
    assert result.error is not None and result.error.type == "ApprovalDenied"
    assert "CC105" in result.error.traceback
    assert approval_of(result)["decision"] == "denied"
    assert recorded_decision(db, "blocked")["decision"] == "denied"


def test_a_callback_that_does_not_answer_in_time_is_a_timeout_and_a_denial(
    tmp_path: Path,
) -> None:
    release = asyncio.Event()

    async def never(request: ApprovalRequest) -> bool:
        await release.wait()
        return True

    async def main() -> ExecutionResult:
        with Sandbox(config=config(tmp_path, timeout=1), approve=never, pool=False) as sandbox:
            return await sandbox.arun(RISKY)

    result = asyncio.run(main())
    assert result.status == "blocked"
    assert approval_of(result)["decision"] == "timeout"


def test_a_coroutine_callback_is_awaited_on_the_arun_callers_loop(tmp_path: Path) -> None:
    loops: list[asyncio.AbstractEventLoop] = []

    async def approve(request: ApprovalRequest) -> bool:
        loops.append(asyncio.get_running_loop())
        return request.rule_ids == ["CC105"]

    async def main() -> tuple[ExecutionResult, asyncio.AbstractEventLoop]:
        with Sandbox(config=config(tmp_path), approve=approve, pool=False) as sandbox:
            return await sandbox.arun(RISKY), asyncio.get_running_loop()

    result, loop = asyncio.run(main())
    assert result.status == "ok" and approval_of(result)["decision"] == "approved"
    assert loops == [loop]


def test_a_callback_that_raises_denies(tmp_path: Path) -> None:
    def broken(request: ApprovalRequest) -> bool:
        raise RuntimeError("no one home")

    with Sandbox(config=config(tmp_path), approve=broken, pool=False) as sandbox:
        result = sandbox.run(RISKY)
    assert result.status == "blocked" and approval_of(result)["decision"] == "denied"


def test_always_asks_for_every_run_and_medium_for_medium_findings(tmp_path: Path) -> None:
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
    assert asked == [PLAIN, MEDIUM]


# --- the CLI -------------------------------------------------------------------------------


def test_the_cli_without_a_terminal_refuses_and_says_why_in_flag_terms(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    done = subprocess.run(
        [CODECAGE, "run", "--config", str(config(tmp_path)), "--audit", str(db), "-c", RISKY],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=server_env(),
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "no terminal" in done.stderr and "CC105" in done.stderr
    assert "codecage run --file" in done.stderr  # the hint: what to do, as commands and flags
    data = recorded_decision(db, "blocked")
    assert data["decision"] == "unavailable" and data["code_sha256"] == RISKY_SHA


def test_the_cli_on_a_terminal_needs_no_approval_for_plain_code(tmp_path: Path) -> None:
    output, code = prompted_run(tmp_path, PLAIN, answer=None)
    assert code == 0 and json.loads(output)["return_value"] == 42


@pytest.mark.parametrize(("answer", "decision"), [("y", "approved"), ("n", "denied")])
def test_the_cli_asks_on_its_terminal_and_runs_only_on_yes(
    tmp_path: Path, answer: str, decision: str
) -> None:
    output, code = prompted_run(tmp_path, RISKY, answer=answer)
    result = json.loads(output)
    (event,) = [e for e in result["events"] if e["kind"] == "approval"]
    assert event["data"]["decision"] == decision
    assert "/dev/pts/" in event["data"]["who"]
    if decision == "approved":
        assert code == 0 and result["status"] == "ok" and result["return_value"] == 40
    else:
        assert code == 1 and result["status"] == "blocked"


def prompted_run(tmp_path: Path, code: str, answer: str | None) -> tuple[str, int]:
    """`codecage run --json` with a pty as stdin and stderr: answers the prompt when it shows
    (which must show the finding and the hash), and returns stdout and the exit code."""
    leader, follower = pty.openpty()
    with subprocess.Popen(
        [CODECAGE, "run", "--config", str(config(tmp_path)), "--json", "--code", code],
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


@contextlib.asynccontextmanager
async def serving(
    tmp_path: Path, mode: str, elicit: Answer | None, timeout: float = 30
) -> AsyncIterator[Client]:
    """`codecage serve` over stdio with [approval] require = "high" and an audit file, and
    the SDK's client in `mode`; `elicit` is its elicitation callback (None: it declares no
    elicitation capability)."""
    env = {k: v for k, v in server_env().items() if k in ("PYTHONPATH", "PATH", "HOME")}
    args = ["serve", "--no-pool", "--config", str(config(tmp_path, timeout=timeout))]
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
        result = await client.call_tool("execute_code", {"code": RISKY})
        plain = await client.call_tool("execute_code", {"code": PLAIN})
    run = structured(result)
    assert run["status"] == status
    (event,) = [e for e in run["events"] if e["kind"] == "approval"]
    assert event["data"]["decision"] == ("approved" if approve else "denied")
    assert event["data"]["who"].startswith("mcp:") and event["data"]["rule_ids"] == ["CC105"]
    assert len(seen) == 1 and "CC105" in seen[0] and RISKY_SHA in seen[0]  # asked once
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
        result = await client.call_tool("execute_code", {"code": RISKY})
    run = structured(result)
    assert run["status"] == "blocked" and seen
    assert recorded_decision(tmp_path / "audit.db", "blocked")["decision"] == "timeout"


@pytest.mark.anyio
async def test_a_late_answer_through_input_required_is_a_timeout(tmp_path: Path) -> None:
    """2026-07-28: the server cannot wait on the client; an answer after the deadline it
    gave in the question is a denial, however it answered."""
    seen: list[str] = []
    async with serving(tmp_path, "2026-07-28", answering(True, seen, delay=3), 1) as client:
        result = await client.call_tool("execute_code", {"code": RISKY})
    run = structured(result)
    assert run["status"] == "blocked" and "Answer by" in seen[0]
    assert recorded_decision(tmp_path / "audit.db", "blocked")["decision"] == "timeout"


@pytest.mark.anyio
@pytest.mark.parametrize("mode", MODES)
async def test_a_client_without_elicitation_gets_a_tool_error_saying_why(
    tmp_path: Path, mode: str
) -> None:
    async with serving(tmp_path, mode, None) as client:
        refused = await client.call_tool("execute_code", {"code": RISKY})
        plain = await client.call_tool("execute_code", {"code": PLAIN})
    assert refused.is_error
    text = text_of(refused)
    assert "approval required" in text and "elicitation" in text and "CC105" in text
    assert "nothing ran" in text
    assert structured(plain)["return_value"] == 42
    blocked = [r for r in recorded_events(tmp_path / "audit.db") if r[1] == "blocked"]
    (event,) = [e for e in blocked[0][2] if e["kind"] == "approval"]
    assert event["data"]["decision"] == "unavailable"
