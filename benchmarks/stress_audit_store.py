"""Stress the SQLite audit store the way a busy host does: several processes, each with
several threads opening and closing real audit trails on ONE store (max_mb small, so the
write-time bound and its savepoints run), a schema-1 file migrated to 2 by whichever opens
it first, a writer of the old (schema-1) code's SQL, erasures (VACUUM) and retention; then
`PRAGMA integrity_check`. Usage:

    python benchmarks/stress_audit_store.py [--seconds 120] [--procs 4] [--threads 3]
        [--close-wait 0.2]

`--close-wait` shortens `trail.CLOSE_WAIT_S` so that closes give up on a writer that is
still busy (what a loaded machine does with the default 10 s). Exits 1 if the store is not
intact. Real sandboxes make the results the records are built from (one per process).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import random
import secrets
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from codecage import ExecutionResult, Options, Sandbox
from codecage.audit import AuditTrail, Erasure, open_store
from codecage.audit import trail as trails
from codecage.audit.record import Caller, Finished
from codecage.audit.schema import _V1, _V1_ALERTS
from codecage.errors import AuditError
from codecage.models import AuditSettings


def make_schema_1(db: Path, records: int) -> None:
    """A store as the schema-1 code left it, with some records (files and events too)."""
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("BEGIN")
    for sql in _V1 + _V1_ALERTS:
        conn.execute(sql)
    conn.execute("INSERT INTO audit_meta VALUES ('schema_version', '1')")
    for _ in range(records):
        old_insert(conn)
    conn.execute("COMMIT")
    conn.close()


def old_insert(conn: sqlite3.Connection) -> None:
    """One record as the schema-1 code wrote it (no origin, no truncated/omitted)."""
    rid = uuid.uuid4().hex
    now = datetime.datetime.now(datetime.UTC).isoformat()
    conn.execute(
        "INSERT INTO executions (execution_id, started_at, finished_at, caller_kind, "
        "caller_name, caller_version, face, session_id, backend, profile, allowed_imports, "
        "limits, code_sha256, code_bytes, code, code_truncated, status, exit_code, signal, "
        "error_type, wall_ms, cpu_ms, peak_memory_mb, bytes_written, redactions) VALUES "
        "(?, ?, ?, 'library', 'old', '0', 'library', NULL, 'bwrap', NULL, '[]', '{}', 'x', "
        "10, ?, 0, 'ok', 0, NULL, NULL, 1, 1, 1.0, 0, '{}')",
        (rid, now, now, "# " + secrets.token_hex(2000)),
    )
    for seq in range(5):
        conn.execute(
            "INSERT INTO events (execution_id, seq, kind, detail, data) VALUES (?, ?, ?, ?, ?)",
            (rid, seq, "import_blocked", "x" * 50, None),
        )
        conn.execute(
            "INSERT INTO files VALUES (?, ?, ?, ?, ?)", (rid, seq, f"f{seq}.txt", 3, "ab" * 32)
        )


def finished(result: ExecutionResult, code_bytes: int) -> Finished:
    now = datetime.datetime.now(datetime.UTC)
    return Finished(
        result=result.model_copy(update={"execution_id": uuid.uuid4().hex}),
        code="# " + secrets.token_urlsafe(code_bytes),
        caller=Caller("library", name="stress"),
        face="library",
        profile=None,
        allowed_imports=(),
        started_at=now,
        finished_at=now,
    )


def trail_thread(db: Path, result: ExecutionResult, until: float, counts: dict[str, int]) -> None:
    rng = random.Random()
    while time.monotonic() < until:
        try:
            trail = AuditTrail.open(AuditSettings(store=str(db), max_mb=1), scrub=str)
        except (AuditError, Exception) as exc:  # a busy store at open: try again
            counts["open_failed"] = counts.get("open_failed", 0) + 1
            counts["last_open_error"] = str(exc)[:200]  # type: ignore[assignment]
            continue
        for _ in range(rng.randint(1, 8)):
            trail.record(finished(result, rng.choice((200, 4000, 30000))))
        trail.close()
        counts["trails"] = counts.get("trails", 0) + 1


def old_code_thread(db: Path, until: float, counts: dict[str, int]) -> None:
    """The schema-1 code's writes, on a connection opened as that code did."""
    while time.monotonic() < until:
        try:
            conn = sqlite3.connect(db, isolation_level=None, timeout=0.5)
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("BEGIN IMMEDIATE")
            old_insert(conn)
            conn.execute("COMMIT")
            conn.close()
            counts["old"] = counts.get("old", 0) + 1
        except sqlite3.Error:
            counts["old_failed"] = counts.get("old_failed", 0) + 1
        time.sleep(0.05)


def maintenance_thread(db: Path, until: float, counts: dict[str, int]) -> None:
    """`codecage audit erase` (delete, VACUUM) and retention, now and then."""
    while time.monotonic() < until:
        time.sleep(random.uniform(0.5, 2.0))
        try:
            store = open_store(db)
            try:
                if random.random() < 0.5:
                    store.erase(Erasure(caller="stress"))
                else:
                    old = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=1)
                    store.prune(older_than=old, max_bytes=None)
            finally:
                store.close()
            counts["maintenance"] = counts.get("maintenance", 0) + 1
        except Exception:
            counts["maintenance_failed"] = counts.get("maintenance_failed", 0) + 1


def worker(db: str, seconds: float, threads: int, close_wait: float, role: int) -> None:
    trails.CLOSE_WAIT_S = close_wait
    with Sandbox(pool=False, options=Options(audit=False)) as sandbox:
        result = sandbox.run("print('hi')")
    until = time.monotonic() + seconds
    counts: dict[str, int] = {}
    jobs = [
        threading.Thread(target=trail_thread, args=(Path(db), result, until, counts))
        for _ in range(threads)
    ]
    if role == 0:
        jobs.append(threading.Thread(target=old_code_thread, args=(Path(db), until, counts)))
    if role == 1:
        jobs.append(threading.Thread(target=maintenance_thread, args=(Path(db), until, counts)))
    for job in jobs:
        job.start()
    for job in jobs:
        job.join()
    print(f"worker {role}: {counts}", flush=True)


def integrity(db: Path) -> list[str]:
    conn = sqlite3.connect(db)
    try:
        return [row[0] for row in conn.execute("PRAGMA integrity_check").fetchall()]
    except sqlite3.DatabaseError as exc:
        return [f"{type(exc).__name__}: {exc}"]
    finally:
        conn.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=3)
    parser.add_argument("--close-wait", type=float, default=trails.CLOSE_WAIT_S)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    where = args.dir or Path(tempfile.mkdtemp(prefix="codecage-stress-"))
    db = where / "audit.db"
    make_schema_1(db, records=40)
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(
            target=worker, args=(str(db), args.seconds, args.threads, args.close_wait, role)
        )
        for role in range(args.procs)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    found = integrity(db)
    version = sqlite3.connect(db).execute("SELECT value FROM audit_meta").fetchall()
    print(f"store {db}: integrity_check {found[:5]}, schema {version}")
    return 0 if found == ["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
