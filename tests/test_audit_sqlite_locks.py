"""Opening a second SQLite store on the same file in one process leaves the first one's
locks alone.

SQLite's locks are POSIX advisory locks, which belong to the process and the file: closing
*any* descriptor of the file drops all of them (https://sqlite.org/howtocorrupt.html,
section 2.2). `SqliteStore` made the file with `os.open` + `os.close` before SQLite opened
it, so each store opened in a process that had one open already (a test run, a server with
an alerter, the web view) dropped the shared lock its other connections believed they
held. Another process closing its connection then found itself the last user, checkpointed
and deleted the WAL under them: their next commits went to a deleted file, and the store
ended "database disk image is malformed", its header naming more pages than the file had.
Real SQLite, real stores, a real second process."""

from __future__ import annotations

import datetime
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

from codecage import Options, Sandbox
from codecage.audit import AuditTrail, Query, open_store
from codecage.audit.record import AuditRecord
from codecage.audit.sqlite import SqliteStore
from codecage.models import AuditSettings
from test_audit_close import finished

_CLOSE_ELSEWHERE = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
db.execute("SELECT count(*) FROM executions").fetchall()
db.close()  # the last connection of the host would checkpoint and delete the WAL here
"""


_WRITE_ELSEWHERE = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
for i in range(200):  # pages enough to need a few in the WAL
    db.execute(
        "INSERT INTO alerts VALUES (?, 'at', 'k', NULL, 'c', ?, 't', 'o')", (f"a{i}", "d" * 500)
    )
db.close()
"""


def a_record(template: AuditRecord) -> AuditRecord:
    now = datetime.datetime.now(datetime.UTC)
    update = {"execution_id": uuid.uuid4().hex, "started_at": now, "finished_at": now}
    return template.model_copy(update=update)


def template_record(tmp_path: Path) -> AuditRecord:
    """A whole record as the trail writes one, read back from a store it was put in."""
    with Sandbox(pool=False, options=Options(audit=False)) as sandbox:
        result = sandbox.run("print('hi')")
    seed = tmp_path / "seed.db"
    trail = AuditTrail.open(AuditSettings(store=str(seed)), scrub=str)
    trail.record(finished(result))
    trail.close()
    store = open_store(seed)
    try:
        return store.query(Query(limit=1))[0]
    finally:
        store.close()


def test_a_second_store_in_the_process_keeps_the_first_ones_lock(tmp_path: Path) -> None:
    template = template_record(tmp_path)
    db = tmp_path / "audit.db"
    first = SqliteStore(db)
    try:
        first.write([a_record(template)])
        second = SqliteStore(db)  # made the file again: os.open + os.close, locks dropped
        try:
            subprocess.run([sys.executable, "-c", _CLOSE_ELSEWHERE, str(db)], check=True)
            # Still in use here: no other process may take the WAL away.
            assert db.with_name("audit.db-wal").exists()
            records = [a_record(template) for _ in range(20)]
            first.write(records[:10])
            subprocess.run([sys.executable, "-c", _WRITE_ELSEWHERE, str(db)], check=True)
            second.write(records[10:])
        finally:
            second.close()
    finally:
        first.close()
    check = sqlite3.connect(db)
    try:  # "database disk image is malformed" here, before
        assert check.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        counts = check.execute(
            "SELECT (SELECT count(*) FROM executions), (SELECT count(*) FROM alerts)"
        ).fetchone()
    finally:
        check.close()
    assert counts == (21, 200)
