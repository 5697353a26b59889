"""The audit trail as the faces fill it: a library run, a CLI run and an MCP call each leave
one record in a real SQLite file, with who asked, what ran (its hash; the code scrubbed),
what happened and what it left."""

from __future__ import annotations

import contextlib
import hashlib
import sqlite3
import subprocess
from pathlib import Path

import pytest
from tests._session_audit import SESSION_STORE

from codecage import AuditError, Options, Sandbox
from codecage.audit import Query, open_store
from test_server import CODECAGE, call_over_stdio, server_env

CODE = """
print("mail alice@example.com")
open("out.txt", "w").write("abc")
1 / 0
"""


def rows(db: Path, sql: str) -> list[tuple[object, ...]]:
    with contextlib.closing(sqlite3.connect(db)) as conn:  # `with conn` alone does not close
        return conn.execute(sql).fetchall()


def test_a_library_run_is_on_record_with_its_caller_hash_files_and_scrubbed_code(
    tmp_path: Path,
) -> None:
    db = tmp_path / "audit.db"
    with Sandbox(pool=False, options=Options(audit=db)) as sandbox:
        result = sandbox.run(CODE)
    assert result.status == "error"
    store = open_store(db)
    record = store.get(result.execution_id)
    store.close()
    assert record is not None
    assert record.caller_kind == "library" and record.caller_name
    assert record.status == "error" and record.error_type == "ZeroDivisionError"
    assert record.code_sha256 == hashlib.sha256(CODE.encode()).hexdigest()
    assert record.code is not None and "alice@example.com" not in record.code
    assert "[EMAIL]" in record.code
    assert [(f.path, f.size) for f in record.files] == [("out.txt", 3)]
    assert record.bytes_written == 3
    assert record.backend == result.backend and record.limits == result.limits.model_dump()
    assert record.wall_ms == result.usage.wall_ms
    assert record.started_at <= record.finished_at


def test_the_library_keeps_no_record_unless_asked(clean_env: dict[str, str]) -> None:
    with Sandbox(pool=False) as sandbox:
        assert sandbox.host.audit is None


def test_keep_code_off_keeps_only_the_hash(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("[audit]\nkeep_code = false\n")
    db = tmp_path / "audit.db"
    with Sandbox(pool=False, config=config, options=Options(audit=db)) as sandbox:
        result = sandbox.run("print('secret plan')")
    assert rows(db, "SELECT code, code_sha256 FROM executions") == [
        (None, hashlib.sha256(b"print('secret plan')").hexdigest())
    ]
    assert result.status == "ok"


def test_an_unopenable_store_is_a_clear_error(tmp_path: Path) -> None:
    target = tmp_path / "file-not-dir"
    target.write_text("x")
    with pytest.raises(AuditError, match="cannot be opened"):
        Sandbox(pool=False, options=Options(audit=target / "audit.db"))


def test_the_cli_run_records_under_the_cli_caller(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    done = subprocess.run(
        [CODECAGE, "run", "--audit", str(db), "--code", "print(6 * 7)"],
        capture_output=True,
        text=True,
        env=server_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    found = rows(db, "SELECT caller_kind, face, status FROM executions")
    assert found == [("cli", "cli", "ok")]


def test_a_test_run_writes_its_own_store_never_the_host_wide_default(tmp_path: Path) -> None:
    """The default store (/var/lib/codecage/audit.db for root) is every codecage's on the
    host: the tests' records go to this run's own (conftest), in this process (an MCP
    face's default trail) and in the codecage processes they start (`server_env`)."""
    with Sandbox(pool=False, options=Options(face="mcp")) as sandbox:
        assert sandbox.host.audit is not None
        assert sandbox.host.audit.store.location == str(SESSION_STORE)
    done = subprocess.run(
        [CODECAGE, "run", "--audit", "on", "--code", "print('session store')"],
        capture_output=True,
        text=True,
        env=server_env(),
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    found = rows(SESSION_STORE, "SELECT code FROM executions WHERE face = 'cli'")
    assert ("print('session store')",) in found


def test_an_mcp_call_is_on_record_with_the_client_it_named(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    answers = call_over_stdio(tmp_path, "--audit", str(db), code="print('hi')", timeout=60)
    assert answers[-1]["id"] == 2 and not answers[-1]["result"].get("isError")
    found = rows(db, "SELECT caller_kind, caller_name, caller_version, face FROM executions")
    assert found == [("mcp", "test", "0", "mcp")]


def test_query_filters_by_status_caller_and_event_kind(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    with Sandbox(pool=False, profile="basic", options=Options(audit=db)) as sandbox:
        ok = sandbox.run("1")
        refused = sandbox.run("import socket")
    store = open_store(db)
    try:
        assert [r.execution_id for r in store.query(Query(status="ok"))] == [ok.execution_id]
        blocked = store.query(Query(event_kind="import_blocked"))
        assert [r.execution_id for r in blocked] == [refused.execution_id]
        assert store.query(Query(caller="nobody-of-that-name")) == []
        assert len(store.query(Query())) == 2
    finally:
        store.close()


def test_a_trimmed_mcp_reply_is_on_the_record_too(tmp_path: Path) -> None:
    """The reply is made after the record: the trail adds its reply_trimmed event."""
    db = tmp_path / "audit.db"
    answers = call_over_stdio(
        tmp_path,
        "--audit",
        str(db),
        "--reply-max-tokens",
        "2000",
        code="print('x' * 200_000)",
        timeout=60,
    )
    kinds = [e["kind"] for e in answers[-1]["result"]["structuredContent"]["events"]]
    assert "reply_trimmed" in kinds
    recorded = rows(db, "SELECT kind FROM events")
    assert ("reply_trimmed",) in recorded


def test_info_says_whether_runs_are_on_record_and_where(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    with Sandbox(pool=False, options=Options(audit=db)) as sandbox:
        state = sandbox.info().audit
    assert state is not None and state.enabled and state.store == str(db)
    assert state.failure is None
    with Sandbox(pool=False, options=Options(audit=False)) as sandbox:
        off = sandbox.info().audit
    assert off is not None and not off.enabled


def test_a_tool_calls_duration_is_kept_though_the_bridge_gives_a_float() -> None:
    from codecage.audit.record import _tool_call

    call = _tool_call(
        {"server": "s", "tool": "t", "status": "ok", "duration_ms": 12.6, "request_bytes": 10}
    )
    assert call.duration_ms == 13 and call.bytes == 10
    assert _tool_call({"duration_ms": float("nan"), "result_bytes": True}).duration_ms is None
