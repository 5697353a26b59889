"""The default audit store: one SQLite file in WAL mode.

WAL with `synchronous=NORMAL`: a committed transaction is in the WAL file before `write`
returns, so it survives the host process being killed (not a power cut before the next
checkpoint: `[audit] store` on PostgreSQL for that). `secure_delete` overwrites what is
deleted, and `erase` checkpoints and VACUUMs, so an erased client's text is gone from the
file's bytes, not only unlinked from its pages. The file is made 0600 in a 0700 directory:
it holds code and who ran it.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import secrets
import sqlite3
import stat
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from codecage.audit import rows, schema
from codecage.audit.record import AlertRecord, AuditRecord, RecordedEvent
from codecage.errors import AuditError

BUSY_TIMEOUT_MS = 500
"""How long a write waits for another process's transaction before it fails."""


class SqliteStore:
    """An `AuditStore` in one SQLite file; safe to share between threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.location = str(path)
        self._lock = threading.Lock()
        self._db = self._connect()
        try:
            self._migrate()
        except BaseException:
            self._db.close()  # a refused store leaves no open file behind
            raise

    def _connect(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            _make_private(self.path)
            db = sqlite3.connect(
                self.path, check_same_thread=False, isolation_level=None, timeout=0
            )
            for pragma in (
                "journal_mode = WAL",
                "synchronous = NORMAL",
                "foreign_keys = ON",
                "secure_delete = ON",
                f"busy_timeout = {BUSY_TIMEOUT_MS}",
            ):
                db.execute(f"PRAGMA {pragma}")
        except (OSError, sqlite3.Error) as exc:
            raise AuditError(
                f"the audit store {self.path} cannot be opened: {exc}",
                hint="point {audit} (or [audit] store, CODECAGE_AUDIT) at a writable place, "
                "or turn the trail off: {audit=off}",
            ) from exc
        return db

    def _migrate(self) -> None:
        with self._transaction() as db:
            db.execute(schema.MIGRATIONS[0][1][0])  # audit_meta, to read the version from
            found = _version(db)
            for statement in schema.migrations_after(found, str(self.path)):
                db.execute(statement)
            if found < schema.SCHEMA_VERSION:
                db.execute(
                    "INSERT OR REPLACE INTO audit_meta VALUES ('schema_version', ?)",
                    (str(schema.SCHEMA_VERSION),),
                )

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction under the lock; a failure rolls back and is an AuditError."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                raise AuditError(f"the audit store {self.path} cannot be written: {exc}") from exc

    def write(self, records: Sequence[AuditRecord], *, max_bytes: int | None = None) -> int:
        """Put `records` in, in one transaction; one already there is left as it is (a
        journal replayed twice adds nothing). With `max_bytes`, each record is put in under
        a savepoint and taken back out if the pages in use then pass it: the bound holds
        exactly, whatever a record's rows and indexes take. Returns how many were put in."""
        written = 0
        with self._transaction() as db:
            for record in records:
                if max_bytes is not None:
                    db.execute("SAVEPOINT record")
                self._insert(db, record)
                if max_bytes is not None:
                    if _used_bytes(db) > max_bytes:
                        db.execute("ROLLBACK TO record")
                        db.execute("RELEASE record")
                        break
                    db.execute("RELEASE record")
                written += 1
        return written

    def _insert(self, db: sqlite3.Connection, record: AuditRecord) -> None:
        if db.execute(rows.INSERT_EXECUTION_SQL, rows.execution_row(record)).rowcount == 0:
            return
        events, calls, files = rows.child_rows(record)
        if events:
            db.executemany(rows.INSERT_EVENT_SQL, events)
        if calls:
            db.executemany("INSERT INTO tool_calls VALUES (?, ?, ?, ?, ?, ?, ?)", calls)
        if files:
            db.executemany("INSERT INTO files VALUES (?, ?, ?, ?, ?)", files)

    def write_alert(self, alert: AlertRecord) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT INTO alerts VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                rows.alert_row(alert),
            )

    def add_events(self, execution_id: str, events: Sequence[RecordedEvent]) -> None:
        with self._transaction() as db:
            for event in events:
                db.execute(rows.ADD_EVENT_SQL, rows.added_event_params(execution_id, event))

    def select(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self._read(sql, params)

    def get(self, execution_id: str) -> AuditRecord | None:
        found = self._read(f"{rows.SELECT_EXECUTIONS_SQL} WHERE execution_id = ?", (execution_id,))
        return self._whole(found[0]) if found else None

    def query(self, query: rows.Query) -> list[AuditRecord]:
        where, params = rows.query_where(query)
        sql = f"{rows.SELECT_EXECUTIONS_SQL}{where} ORDER BY started_at DESC"
        if query.limit is not None:
            sql += f" LIMIT {int(query.limit)}"
        return [self._whole(row) for row in self._read(sql, params)]

    def _whole(self, row: Sequence[Any]) -> AuditRecord:
        rid = (row[0],)
        return rows.record_from_rows(
            row,
            self._read(rows.SELECT_EVENTS_SQL, rid),
            self._read(
                "SELECT server, tool, status, duration_ms, bytes FROM tool_calls "
                "WHERE execution_id = ? ORDER BY seq",
                rid,
            ),
            self._read(
                "SELECT path, size, sha256 FROM files WHERE execution_id = ? ORDER BY seq", rid
            ),
        )

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return self._db.execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                raise AuditError(f"the audit store {self.path} cannot be read: {exc}") from exc

    def erase(self, erasure: rows.Erasure) -> int:
        """Delete what `erasure` names (its alerts too), then compact the file."""
        statements = rows.erasure_statements(erasure)
        with self._transaction() as db:
            erased = [db.execute(sql, params).rowcount for sql, params in statements][-1]
        self.compact()
        return erased

    def prune(self, *, older_than: datetime.datetime | None, max_bytes: int | None) -> int:
        """Delete records started before `older_than`, then the oldest while the file is
        larger than `max_bytes`."""
        removed = 0
        if older_than is not None:
            with self._transaction() as db:
                removed += db.execute(
                    "DELETE FROM executions WHERE started_at < ?", (rows.timestamp(older_than),)
                ).rowcount
                # Alerts age out as records do (not counted: they are no executions).
                db.execute("DELETE FROM alerts WHERE at < ?", (rows.timestamp(older_than),))
        if max_bytes is not None and self.size_bytes() > max_bytes:
            self.compact()  # the WAL's copies of pages are no records: measure the file
        for _ in range(rows.PRUNE_ROUNDS if max_bytes is not None else 0):
            (count,) = self._read("SELECT count(*) FROM executions")[0]
            excess = rows.oldest_over(self.size_bytes(), count, max_bytes or 0)
            if excess == 0:
                break
            with self._transaction() as db:
                removed += db.execute(
                    "DELETE FROM executions WHERE execution_id IN (SELECT execution_id "
                    "FROM executions ORDER BY started_at LIMIT ?)",
                    (excess,),
                ).rowcount
            self.compact()
        return removed

    def size_bytes(self) -> int:
        return sum(
            p.stat().st_size
            for p in (self.path, self.path.with_name(self.path.name + "-wal"))
            if p.exists()
        )

    def used_bytes(self) -> int:
        """The database's pages in use (the WAL's latest state included), without the free
        ones: what the records take, whatever the file's and the WAL's sizes. Three
        numbers read from SQLite's header: cheap enough before every batch."""
        with self._lock:
            try:
                return _used_bytes(self._db)
            except sqlite3.Error as exc:
                raise AuditError(f"the audit store {self.path} cannot be read: {exc}") from exc

    def compact(self) -> None:
        """Give deleted pages back: checkpoint the WAL into the file, VACUUM, truncate the
        WAL (its frames still hold deleted rows)."""
        with self._lock:
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                self._db.execute("VACUUM")
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error as exc:
                raise AuditError(f"the audit store {self.path} cannot be compacted: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _make_private(path: Path) -> None:
    """Make the store's file, 0600, unless it is there; refuse a link in its place.

    Never by opening and closing `path` itself: SQLite's locks are POSIX locks, which a
    process loses on *every* descriptor of the file when it closes any one of them. A store
    opened beside another of this process (the same file) dropped that one's shared lock;
    another process closing its connection then took itself for the last user and deleted
    the WAL under it: a malformed store. So the file is made under a name of its own and
    closed, then linked into place (nothing else has it open before the link).

    Raises:
        OSError: it cannot be made, or a symlink (or no regular file) is in its place.
    """
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(found.st_mode):
            raise OSError(errno.ELOOP, "not a regular file (a link?)", str(path))
        return
    fresh = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}")
    os.close(os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    try:
        os.link(fresh, path)
    except FileExistsError:
        pass  # another process made it meanwhile: theirs is used
    finally:
        fresh.unlink(missing_ok=True)


def _used_bytes(db: sqlite3.Connection) -> int:
    """The pages in use (not on the free list) of `db`, in bytes, as its connection sees
    them: inside a transaction, with what it added so far."""
    (pages,) = db.execute("PRAGMA page_count").fetchone()
    (free,) = db.execute("PRAGMA freelist_count").fetchone()
    (size,) = db.execute("PRAGMA page_size").fetchone()
    return (int(pages) - int(free)) * int(size)


def _version(db: sqlite3.Connection) -> int:
    row = db.execute("SELECT value FROM audit_meta WHERE key = 'schema_version'").fetchone()
    return int(row[0]) if row else 0
