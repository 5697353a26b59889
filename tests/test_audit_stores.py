"""The audit store's contract, on both stores: a SQLite file and a database on a real
PostgreSQL server that the tests start (tests/_postgres.py). What one store does, the other
does the same: records read back whole, queries, erasure (of exactly what was named, gone
from the files' bytes), retention by age and size, migrations; and for PostgreSQL, the
URL's password kept out of every message, a server that goes away and comes back."""

from __future__ import annotations

import contextlib
import datetime
import secrets
import sqlite3
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests._postgres import PostgresServer, postgres_server, postgres_url

from codecage import AuditError, ConfigError, Options, Sandbox
from codecage.audit import AuditStore, Erasure, Query, open_store
from codecage.audit.postgres import placeholders, without_password
from codecage.audit.record import (
    AlertRecord,
    AuditRecord,
    RecordedEvent,
    RecordedFile,
    RecordedToolCall,
)
from codecage.audit.schema import SCHEMA_VERSION

__all__ = ["postgres_server", "postgres_url"]  # fixtures, used by name

T0 = datetime.datetime(2026, 11, 1, 12, 0, tzinfo=datetime.UTC)
TABLES = ("executions", "events", "tool_calls", "files", "alerts")


@dataclass
class Backend:
    """A store's location, and a way to its tables that does not go through the store."""

    kind: str
    location: str
    raw: Callable[[str], list[tuple[object, ...]]]
    files: Callable[[], bytes]  # the bytes of the files that hold its tables, flushed


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "sqlite":
        return _sqlite_backend(tmp_path / "audit.db")
    url: str = request.getfixturevalue("postgres_url")
    return _postgres_backend(request.getfixturevalue("postgres_server"), url)


def _sqlite_backend(path: Path) -> Backend:
    def raw(sql: str) -> list[tuple[object, ...]]:
        with contextlib.closing(sqlite3.connect(path)) as db, db:
            return db.execute(sql).fetchall()

    def files() -> bytes:
        return b"".join(p.read_bytes() for p in path.parent.glob(path.name + "*"))

    return Backend("sqlite", str(path), raw, files)


def _postgres_backend(server: PostgresServer, url: str) -> Backend:
    database = url.rsplit("/", 1)[1]

    def raw(sql: str) -> list[tuple[object, ...]]:
        return server.admin(sql, database)

    def files() -> bytes:
        server.admin("CHECKPOINT")  # what is in shared buffers reaches the table files
        query = f"SELECT oid FROM pg_database WHERE datname = '{database}'"  # noqa: S608
        (oid,) = server.admin(query)[0]
        folder = server.data / "base" / str(oid)
        return b"".join(p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file())

    return Backend("postgres", url, raw, files)


@pytest.fixture
def store(backend: Backend) -> Iterator[AuditStore]:
    opened = open_store(backend.location)
    yield opened
    opened.close()


def record(
    n: int,
    *,
    caller: str = "alice",
    status: str = "ok",
    code: str = "print('hi')",
    event: str = "import_blocked",
) -> AuditRecord:
    """Record `n`: started `n` minutes after T0, with an event, a tool call and a file."""
    started = T0 + datetime.timedelta(minutes=n)
    return AuditRecord(
        execution_id=f"exec-{n:04d}",
        started_at=started,
        finished_at=started + datetime.timedelta(milliseconds=1234, microseconds=5),
        caller_kind="mcp",
        caller_name=caller,
        caller_version="1.2.3",
        face="mcp",
        session_id=None if n % 2 else f"session-{n}",
        backend="bwrap",
        profile="standard",
        allowed_imports=["json", "numpy"],
        limits={"timeout": 30, "memory_mb": 512},
        code_sha256="ab" * 32,
        code_bytes=len(code.encode()),
        code=code,
        code_truncated=False,
        status=status,
        exit_code=0 if status == "ok" else 1,
        signal=None if status == "ok" else "SIGKILL",
        error_type=None if status == "ok" else "MemoryError",
        wall_ms=1234,
        cpu_ms=1000 + n,
        peak_memory_mb=5.3,  # PostgreSQL's REAL would read back 5.300000190734863
        bytes_written=3 * 1024**3,  # PostgreSQL's INTEGER stops at 2 GiB
        events=[
            RecordedEvent(kind=event, detail="import of socket refused", data={"module": "x"}),
            RecordedEvent(kind="output_truncated", detail="stdout cut", data=None),
        ],
        tool_calls=[
            RecordedToolCall(
                server="memory", tool="read_graph", status="ok", duration_ms=12, bytes=345
            ),
            RecordedToolCall(server="git", tool="log", status="error"),
        ],
        files=[
            RecordedFile(path="out/ünïcode.txt", size=3 * 1024**3, sha256="cd" * 32),
            RecordedFile(path="empty", size=0),
        ],
        redactions={"email": 2},
    )


def alert(n: int, *, caller: str = "alice", execution_id: str | None = None) -> AlertRecord:
    return AlertRecord(
        alert_id=f"alert-{n:04d}",
        at=T0 + datetime.timedelta(minutes=n),
        kind="network_denied",
        execution_id=execution_id,
        caller_name=caller,
        detail="3 denials in a minute",
        target="hooks.example.org",
        outcome="sent",
    )


def ids(store: AuditStore, query: Query | None = None) -> list[str]:
    return [r.execution_id for r in store.query(query or Query(limit=None))]


def alert_ids(store: AuditStore) -> list[str]:
    return [row[0] for row in store.select("SELECT alert_id FROM alerts ORDER BY alert_id")]


# --- writing and reading ---------------------------------------------------------------------


def test_a_full_record_reads_back_exactly_as_written(store: AuditStore) -> None:
    written = [record(1), record(2, status="memory_limit")]
    store.write(written)
    assert [store.get(r.execution_id) for r in written] == written
    assert store.get("exec-none") is None


def test_an_alert_is_kept_with_its_fields(store: AuditStore) -> None:
    store.write_alert(alert(1, execution_id="exec-0001"))
    row = store.select("SELECT alert_id, at, kind, execution_id, outcome FROM alerts")
    assert row == [
        ("alert-0001", "2026-11-01T12:01:00.000000+00:00", "network_denied", "exec-0001", "sent")
    ]


def test_a_batch_that_fails_writes_none_of_its_records(store: AuditStore) -> None:
    store.write([record(1)])
    broken = record(3).model_copy(update={"status": None})  # NOT NULL in both schemas
    with pytest.raises(AuditError, match="cannot be written"):
        store.write([record(2), broken])
    assert ids(store) == ["exec-0001"]


def test_query_filters_by_status_caller_time_and_event_kind_newest_first(
    store: AuditStore,
) -> None:
    store.write(
        [
            record(1),
            record(2, caller="bob", status="timeout"),
            record(3, event="network_denied"),
            record(4, caller="bob"),
        ]
    )
    assert ids(store) == ["exec-0004", "exec-0003", "exec-0002", "exec-0001"]
    assert ids(store, Query(status="timeout")) == ["exec-0002"]
    assert ids(store, Query(caller="bob")) == ["exec-0004", "exec-0002"]
    assert ids(store, Query(caller="bob", status="ok")) == ["exec-0004"]
    assert ids(store, Query(event_kind="network_denied")) == ["exec-0003"]
    since, until = T0 + datetime.timedelta(minutes=2), T0 + datetime.timedelta(minutes=4)
    assert ids(store, Query(since=since, until=until)) == ["exec-0003", "exec-0002"]
    assert ids(store, Query(limit=1)) == ["exec-0004"]
    assert store.query(Query(caller="nobody")) == []


def test_select_takes_question_marks_and_gives_the_same_rows_on_both_stores(
    store: AuditStore,
) -> None:
    store.write([record(1, code="x = '50%?'"), record(2), record(3, caller="bob")])
    found = store.select(
        "SELECT caller_name, count(*), avg(wall_ms), sum(cpu_ms) FROM executions "
        "WHERE caller_name <> '?' AND code NOT LIKE '%50\\%?%' ESCAPE '\\' AND status = ? "
        "GROUP BY caller_name ORDER BY caller_name",
        ["ok"],
    )
    assert found == [("alice", 1, 1234.0, 1002), ("bob", 1, 1234.0, 1003)]


def test_concurrent_writers_on_one_store_each_land_once(store: AuditStore) -> None:
    def writer(first: int) -> None:
        for n in range(first, first + 10):
            store.write([record(n)])

    threads = [threading.Thread(target=writer, args=(i * 10,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(ids(store)) == [f"exec-{n:04d}" for n in range(60)]


def test_a_closed_store_is_not_written(store: AuditStore) -> None:
    store.close()
    with pytest.raises(AuditError):
        store.write([record(1)])


# --- erasure -----------------------------------------------------------------------------


def _three_callers(store: AuditStore) -> None:
    store.write([record(1), record(2, caller="bob"), record(3), record(4, caller="carol")])
    for n, caller, execution in [
        (1, "alice", "exec-0001"),
        (2, "bob", "exec-0002"),
        (3, "alice", None),
        (4, "carol", "exec-0004"),
        (5, "carol", "exec-0003"),  # about alice's run, raised for another caller
    ]:
        store.write_alert(alert(n, caller=caller, execution_id=execution))


def test_erasing_one_execution_takes_its_children_and_alerts_and_nothing_else(
    store: AuditStore,
) -> None:
    _three_callers(store)
    assert store.erase(Erasure(execution_id="exec-0003")) == 1
    assert ids(store) == ["exec-0004", "exec-0002", "exec-0001"]
    assert alert_ids(store) == ["alert-0001", "alert-0002", "alert-0003", "alert-0004"]
    for table in ("events", "tool_calls", "files"):
        left = store.select(f"SELECT DISTINCT execution_id FROM {table} ORDER BY 1")  # noqa: S608
        assert left == [("exec-0001",), ("exec-0002",), ("exec-0004",)], table


def test_erasing_a_caller_takes_all_its_records_and_alerts_and_nothing_else(
    store: AuditStore,
) -> None:
    _three_callers(store)
    assert store.erase(Erasure(caller="alice")) == 2
    assert ids(store) == ["exec-0004", "exec-0002"]
    assert alert_ids(store) == ["alert-0002", "alert-0004"]
    assert store.select("SELECT count(*) FROM events WHERE execution_id = 'exec-0001'") == [(0,)]


def test_erasing_before_a_time_keeps_what_came_after(store: AuditStore) -> None:
    _three_callers(store)
    assert store.erase(Erasure(before=T0 + datetime.timedelta(minutes=3))) == 2
    assert ids(store) == ["exec-0004", "exec-0003"]
    assert alert_ids(store) == ["alert-0003", "alert-0004", "alert-0005"]


def test_an_erasure_that_names_nothing_is_refused(store: AuditStore) -> None:
    store.write([record(1)])
    with pytest.raises(ConfigError, match="names nothing"):
        store.erase(Erasure())
    assert ids(store) == ["exec-0001"]


def test_an_erased_callers_text_is_gone_from_the_files_bytes(
    backend: Backend, store: AuditStore
) -> None:
    canary = f"canary-{secrets.token_hex(8)}"
    # Others' records before and after it: a page that only marks a row dead, or moves the
    # rows after it over its place, keeps its bytes; a page left empty at the end of the
    # file would be cut off by any vacuum and prove nothing.
    store.write([record(n) for n in range(2, 5)])
    store.write([record(1, caller=canary, code=f"print('{canary}')")])
    store.write([record(n) for n in range(5, 8)])
    store.write_alert(alert(1, caller=canary))
    assert canary.encode() in backend.files()  # else this test could not fail
    assert store.erase(Erasure(caller=canary)) == 1
    assert canary.encode() not in backend.files()
    assert len(ids(store)) == 6


# --- retention ---------------------------------------------------------------------------


def test_pruning_by_age_deletes_only_the_older_records(store: AuditStore) -> None:
    store.write([record(n) for n in range(1, 6)])
    assert store.prune(older_than=T0 + datetime.timedelta(minutes=3), max_bytes=None) == 2
    assert ids(store) == ["exec-0005", "exec-0004", "exec-0003"]
    assert store.prune(older_than=None, max_bytes=None) == 0


def test_pruning_by_age_deletes_the_older_alerts_too(store: AuditStore) -> None:
    for n in range(1, 6):
        store.write_alert(alert(n))
    store.prune(older_than=T0 + datetime.timedelta(minutes=3), max_bytes=None)
    assert alert_ids(store) == ["alert-0003", "alert-0004", "alert-0005"]


def test_pruning_by_size_deletes_the_oldest_until_the_store_fits(store: AuditStore) -> None:
    for n in range(60):  # random text: compression cannot make it small
        store.write([record(n, code=secrets.token_hex(2048))])
    bound = 30 * 4096  # about half of the code written (the stores' overheads differ)
    removed = store.prune(older_than=None, max_bytes=bound)
    kept = ids(store)
    assert 0 < removed < 60 and len(kept) == 60 - removed
    assert kept == [f"exec-{n:04d}" for n in reversed(range(removed, 60))]  # the newest
    assert store.size_bytes() <= bound


# --- schema ------------------------------------------------------------------------------


def test_an_empty_database_is_migrated_to_the_current_schema(backend: Backend) -> None:
    for _ in range(2):  # opening a migrated store again changes nothing
        opened = open_store(backend.location)
        opened.close()
    assert backend.raw("SELECT value FROM audit_meta WHERE key = 'schema_version'") == [
        (str(SCHEMA_VERSION),)
    ]
    for table in TABLES:
        assert backend.raw(f"SELECT count(*) FROM {table}") == [(0,)]  # noqa: S608


def test_a_store_of_a_newer_schema_is_refused_and_left_alone(backend: Backend) -> None:
    opened = open_store(backend.location)
    opened.close()
    newer = SCHEMA_VERSION + 1
    backend.raw(f"UPDATE audit_meta SET value = '{newer}' WHERE key = 'schema_version'")  # noqa: S608
    with pytest.raises(ConfigError, match=f"schema version {newer}") as refused:
        open_store(backend.location)
    assert "upgrade codecage" in refused.value.hint
    assert backend.raw("SELECT value FROM audit_meta WHERE key = 'schema_version'") == [
        (str(newer),)
    ]


# --- PostgreSQL: the URL's password, a server that goes away -----------------------------------


PASSWORD = "pw-" + secrets.token_hex(8)


def test_the_password_is_in_no_location(postgres_server: PostgresServer, postgres_url: str) -> None:
    url = postgres_url.replace("postgres@", f"postgres:{PASSWORD}@")  # trust: any password
    opened = open_store(url)
    try:
        assert PASSWORD not in opened.location
        assert opened.location == postgres_url
    finally:
        opened.close()
    assert without_password(f"{postgres_url}?password={PASSWORD}&sslmode=disable") == (
        f"{postgres_url}?sslmode=disable"
    )


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://someone:{PASSWORD}@127.0.0.1:1/audit",  # nothing listens on port 1
        f"postgresql://someone@127.0.0.1:1/audit?password={PASSWORD}",
        f"postgresql://someone:{PASSWORD}@127.0.0.1:1/audit?no_such_option=1",
    ],
    # Named ids: the password is random, and xdist's workers must collect the same names.
    ids=["in-userinfo", "in-query", "with-unknown-option"],
)
def test_the_password_is_in_no_error(url: str) -> None:
    with pytest.raises((AuditError, ConfigError)) as failed:
        open_store(url)
    for text in (str(failed.value), failed.value.hint, repr(failed.value.__cause__)):
        assert PASSWORD not in text
    assert "127.0.0.1:1/audit" in str(failed.value)


@pytest.fixture
def postgres_store_of_one(postgres_url: str) -> Iterator[AuditStore]:
    """A store on the test server's database that holds `record(1)`; closed after the test."""
    opened = open_store(postgres_url)
    try:
        opened.write([record(1)])
        yield opened
    finally:
        opened.close()


def test_a_stopped_server_is_an_audit_error_and_the_store_works_again_when_it_is_back(
    postgres_server: PostgresServer, postgres_url: str, postgres_store_of_one: AuditStore
) -> None:
    opened = postgres_store_of_one
    postgres_server.stop()
    try:
        with pytest.raises(AuditError, match="cannot be reached") as down:
            opened.write([record(2)])
        assert not isinstance(down.value.__cause__, AuditError)
        with pytest.raises(AuditError):
            opened.get("exec-0001")
        with pytest.raises(AuditError, match="cannot be reached"):
            open_store(postgres_url)
    finally:
        postgres_server.start()
    opened.write([record(3)])
    assert ids(opened) == ["exec-0003", "exec-0001"]


def test_a_dropped_connection_is_opened_again_within_the_call(
    postgres_server: PostgresServer, postgres_url: str, postgres_store_of_one: AuditStore
) -> None:
    database = postgres_url.rsplit("/", 1)[1]
    killed = postgres_server.admin(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "  # noqa: S608
        f"WHERE datname = '{database}' AND application_name = 'codecage-audit'"
    )
    assert killed == [(True,)]
    postgres_store_of_one.write([record(2)])  # no error: the call reconnects once
    assert ids(postgres_store_of_one) == ["exec-0002", "exec-0001"]


def test_a_retried_batch_already_committed_is_not_refused(
    postgres_store_of_one: AuditStore,
) -> None:
    opened = postgres_store_of_one
    opened.write([record(1), record(2)])  # as after a commit whose answer was lost
    assert ids(opened) == ["exec-0002", "exec-0001"]
    assert opened.get("exec-0001") == record(1)


@pytest.mark.parametrize(
    ("sql", "translated"),
    [
        ("SELECT 1 WHERE a = ? AND b = ?", "SELECT 1 WHERE a = %s AND b = %s"),
        (
            "SELECT '?', \"?\" WHERE x LIKE '%a' AND y = ?",
            "SELECT '?', \"?\" WHERE x LIKE '%%a' AND y = %s",
        ),
        ("SELECT 'it''s ?' -- why?\n, ? /* ? */", "SELECT 'it''s ?' -- why?\n, %s /* ? */"),
    ],
)
def test_question_mark_placeholders_become_psycopgs(sql: str, translated: str) -> None:
    assert placeholders(sql) == translated


# --- end to end --------------------------------------------------------------------------


def test_a_sandbox_run_lands_in_postgresql(
    postgres_server: PostgresServer, postgres_url: str
) -> None:
    with Sandbox(pool=False, options=Options(audit=postgres_url)) as sandbox:
        result = sandbox.run("open('out.txt', 'w').write('abc')\nprint('mail bob@example.com')")
    assert result.status == "ok"
    database = postgres_url.rsplit("/", 1)[1]
    rows = postgres_server.admin(
        "SELECT execution_id, caller_kind, status FROM executions", database
    )
    assert rows == [(result.execution_id, "library", "ok")]
    opened = open_store(postgres_url)
    try:
        kept = opened.get(result.execution_id)
    finally:
        opened.close()
    assert kept is not None
    assert [(f.path, f.size) for f in kept.files] == [("out.txt", 3)]
    assert kept.code is not None and "bob@example.com" not in kept.code


def test_events_added_later_follow_the_records_own(store: AuditStore) -> None:
    written = record(1)
    store.write([written])
    later = RecordedEvent(kind="reply_trimmed", detail="cut to fit", data={"tokens": 2000})
    store.add_events(written.execution_id, [later])
    store.add_events("exec-none", [later])  # no such record: nothing
    got = store.get(written.execution_id)
    assert got is not None and got.events == [*written.events, later]
    assert store.get("exec-none") is None
    assert store.select("SELECT count(*) FROM events WHERE execution_id = ?", ("exec-none",)) == [
        (0,)
    ]
