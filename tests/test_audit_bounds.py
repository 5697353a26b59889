"""One run's audit record is bounded whatever the run does: a hostile run in a real sandbox
leaves 1,100 files (1,000 listed in its result) whose paths are 7.5 KB each (once 8 MB of
record per run), floods its report with the most events a guest may send, each as long as
allowed, and prints past its output bound; its record in a real SQLite store stays under
`MAX_RECORD_BYTES` (besides its code) and says what was left out."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest

from codecage import ExecutionResult, Options, Sandbox
from codecage.audit import Query, open_store
from codecage.audit.record import (
    MAX_EVENTS,
    MAX_FILES,
    MAX_PATH_BYTES,
    MAX_RECORD_BYTES,
    AuditRecord,
    Caller,
    Finished,
    record_of,
    utc_now,
)
from codecage.guest import contract
from codecage.models import ErrorInfo, Event, Limits

DEPTH, NAME = 29, 250  # 29 directories of 250 characters, then the file: 7.5 KB a path
FILES = 1100
LISTED = 1000  # a result lists at most this many files, and says when there were more
HOSTILE_CODE = f"""
import os, sys
os.chdir("/workspace")  # one level at a time: the whole path is over PATH_MAX
for level in range({DEPTH}):
    name = ("\\\\" + chr(0x1F600) + "d%02d" % level) * ({NAME} // 8)
    os.mkdir(name)
    os.chdir(name)
for i in range({FILES}):
    open(("f%04d" % i) * ({NAME} // 5), "w").close()
frame = sys._getframe()
while not isinstance(frame.f_globals.get("_events"), list):
    frame = frame.f_back
for i in range({contract.MAX_EVENTS}):
    frame.f_globals["_events"].append(
        {{"kind": "syscall_blocked", "detail": ("\\\\" + chr(0x1F600)) * 300}}
    )
print("x" * 2_000_000)
"""


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ExecutionResult]:
    db = tmp_path_factory.mktemp("bounds") / "audit.db"
    with Sandbox(pool=False, options=Options(audit=db, import_policy=False)) as sandbox:
        result = sandbox.run(HOSTILE_CODE, limits={"max_output_bytes": 4096, "timeout": 120})
    return db, result


def stored(db: Path) -> AuditRecord:
    store = open_store(db)
    try:
        [record] = store.query(Query(limit=None))
        return record
    finally:
        store.close()


def test_the_hostile_run_did_what_it_meant_to(hostile: tuple[Path, ExecutionResult]) -> None:
    _, result = hostile
    assert result.status == "ok", (result.stderr, result.error)
    assert len(result.files) == LISTED
    assert min(len(f.path.encode()) for f in result.files) > 7_000
    assert sum(e.kind == "syscall_blocked" for e in result.events) == contract.MAX_EVENTS


def test_a_hostile_runs_record_stays_under_its_bound(
    hostile: tuple[Path, ExecutionResult],
) -> None:
    db, result = hostile
    record = stored(db)
    assert record.execution_id == result.execution_id
    code = len((record.code or "").encode())
    whole = len(record.model_dump_json().encode())
    assert whole - code <= MAX_RECORD_BYTES, f"{whole - code} bytes besides the code"
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = [
            conn.execute(
                f"SELECT sum(length(CAST({columns} AS BLOB))) FROM {table}"  # noqa: S608
            ).fetchone()[0]
            or 0
            for table, columns in (
                ("files", "path || coalesce(sha256, '')"),
                ("events", "kind || detail || coalesce(data, '')"),
            )
        ]
    assert sum(rows) <= MAX_RECORD_BYTES


def test_the_record_says_what_was_left_out(hostile: tuple[Path, ExecutionResult]) -> None:
    db, result = hostile
    record = stored(db)
    assert record.truncated
    assert len(record.files) == MAX_FILES
    assert record.omitted["files"] == LISTED - MAX_FILES
    assert all(len(f.path.encode()) <= MAX_PATH_BYTES for f in record.files)
    assert record.omitted["cut"] >= MAX_FILES  # every path, and the events' details
    assert len(record.events) <= MAX_EVENTS
    events = [e for e in result.events if e.kind != "tool_call"]
    assert record.omitted["events"] == len(events) - len(record.events)
    # What the host saw is kept first: the guest's flood cannot push it out.
    host_kinds = {e.kind for e in events if e.source == "host"}
    assert {"output_truncated", "files_truncated"} <= host_kinds
    assert host_kinds <= {e.kind for e in record.events if e.source == "host"}
    assert record.bytes_written == sum(f.size for f in result.files)


def test_a_record_within_its_bounds_is_kept_whole(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    with Sandbox(pool=False, options=Options(audit=db)) as sandbox:
        result = sandbox.run("open('/workspace/out.txt', 'w').write('hi'); print('ok')")
    record = stored(db)
    assert record.execution_id == result.execution_id
    assert not record.truncated and record.omitted == {}
    assert [f.path for f in record.files] == ["out.txt"]


def test_every_bound_filled_at_once_stays_under_the_maximum(
    hostile: tuple[Path, ExecutionResult],
) -> None:
    """The hostile run's result with every other variable-length field at its worst too:
    network events with long data, tool calls, redaction categories, an error type, a
    session id, a caller's name, a profile and 500 allowed modules, all of the longest
    text in JSON bytes (backslashes and 4-byte characters)."""
    _, result = hostile
    long = ("\\" + chr(0x1F600)) * 1000
    data = {f"k{i}{long[:30]}": long for i in range(40)} | {"port": 1}
    events = [Event(kind="network_denied", detail=long, data=data) for _ in range(300)]
    events += [
        Event(kind="tool_call", detail=long, data={"server": long, "tool": long, "status": long})
        for _ in range(300)
    ]
    events += [approval_event(long) for _ in range(5)]  # one gets the approval's bound
    worst = result.model_copy(
        update={
            "events": [*events, *result.events],
            "redactions": {f"{i}{long[:100]}": i for i in range(500)},
            "session_id": long,
            "signal": long,
            "error": ErrorInfo(type=long, message=long, traceback=long),
        }
    )
    finished = Finished(
        result=worst,
        code="1",
        caller=Caller("mcp", name=long, version=long),
        face="mcp",
        profile=long,
        allowed_imports=tuple(f"{i}{long[:200]}" for i in range(500)),
        started_at=utc_now(),
        finished_at=utc_now(),
    )
    record = record_of(finished, keep_code=False, max_code_bytes=0, scrub=str)
    assert len(record.model_dump_json().encode()) <= MAX_RECORD_BYTES
    assert record.truncated
    assert {"events", "tool_calls", "files", "redactions", "allowed_imports"} <= set(record.omitted)


def approval_event(text: str, grants: int = 50) -> Event:
    """An `approval` event as policy/approval.py makes one, every text as long as `text`."""
    return Event(
        kind="approval",
        detail=text,
        data={
            "decision": "approved",
            "who": text,
            "when": "2026-12-07T00:00:00+00:00",
            "code_sha256": "ab" * 32,
            "capabilities": ["tools", "destructive_tools"],
            "grants": [f"destructive_tools: {text}" for _ in range(grants)],
            "rule_ids": ["CC105"] * 50,
            "require": "grants",
        },
    )


def test_a_runs_approval_keeps_who_when_and_which_code_on_record() -> None:
    """Issue 33, items 4 and 7 (review): an approval's data (decision, who, when, the code's
    sha256, 50 grants) is over the 256 bytes of other events' data, and was left out whole:
    the record said a run was approved, not by whom nor for which code. Its one approval
    event keeps them (the sha256 whole), its lists shortened to fit."""
    finished = Finished(
        result=ExecutionResult.blocked(
            error=ErrorInfo(type="ApprovalDenied", message="no", traceback=""),
            events=[approval_event("alice (library callback) " * 10)],
            limits=Limits(),
            backend="bwrap",
        ),
        code="1",
        caller=Caller("library"),
        face="library",
        profile=None,
        allowed_imports=(),
        started_at=utc_now(),
        finished_at=utc_now(),
    )
    (event,) = record_of(finished, keep_code=False, max_code_bytes=0, scrub=str).events
    assert event.data is not None
    assert event.data["decision"] == "approved" and event.data["code_sha256"] == "ab" * 32
    assert event.data["who"].startswith("alice (library callback)")
    assert event.data["when"] == "2026-12-07T00:00:00+00:00"
    assert 0 < len(event.data["grants"]) < 50
