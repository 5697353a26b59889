"""The audit trail in PostgreSQL: the same tables as SQLite, for a fleet's shared store.

One connection (psycopg 3, autocommit, each write its own transaction) behind a lock, so a
store is safe to share between threads; a batch is committed (and, with PostgreSQL's
default `synchronous_commit`, on the server's disk) before `write` returns. A connection
that dropped (a server restart, an idle timeout, a proxy) is opened again and the call
retried once; a server that cannot be reached is an `AuditError`, never a driver error.
Writes are idempotent (`ON CONFLICT DO NOTHING`): a retried batch whose first commit went
through before the connection dropped is not refused as a duplicate.

The URL's password is the one secret here: `location` (used in every message) is the URL
without it, and the driver's messages are searched for it before they are shown.
"""

from __future__ import annotations

import datetime
import logging
import re
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.types.numeric import FloatLoader

from codecage.audit import rows, schema
from codecage.audit.record import AlertRecord, AuditRecord, RecordedEvent
from codecage.errors import AuditError, ConfigError

log = logging.getLogger(__name__)

Connection = psycopg.Connection[tuple[Any, ...]]
T = TypeVar("T")

CONNECT_TIMEOUT_S = 5
"""How long opening a connection may take (unless the URL sets `connect_timeout`): a
host's start waits for it, and the trail's writer while it retries."""
TABLES = ("executions", "events", "tool_calls", "files", "alerts")
_MIGRATION_LOCK = (
    0x636F646563616765  # "codecage": hosts of a fleet that start at once migrate in turn
)
_SECRET_PARAMS = frozenset({"password", "sslpassword"})

_INSERT_EXECUTION = rows.INSERT_EXECUTION_SQL.replace("?", "%s")
_LIVE_BYTES = " + ".join(
    f"(SELECT coalesce(sum(pg_column_size(t.*)), 0)::bigint FROM {table} t)"  # noqa: S608
    for table in TABLES
)


def connect(url: str) -> PostgresStore:
    """The store at `url` (postgresql://user:password@host:port/database?...), migrated.

    Raises:
        ConfigError: the URL is not a valid connection string, or the database holds a
            newer schema than this codecage knows.
        AuditError: the server cannot be reached or refuses the connection.
    """
    return PostgresStore(url)


class PostgresStore:
    """An `AuditStore` in a PostgreSQL database; safe to share between threads."""

    def __init__(self, url: str) -> None:
        self.location = without_password(url)
        self._params = _connection_params(url, self.location)
        self._secrets = [str(v) for k, v in self._params.items() if k in _SECRET_PARAMS and v]
        self._lock = threading.Lock()
        self._db: Connection | None = None
        self._closed = False
        try:
            self._migrate()
        except BaseException:
            self.close()
            raise

    # --- the connection ----------------------------------------------------------------

    def _open(self) -> Connection:
        if self._db is not None:
            self._db.close()
            self._db = None
        try:
            db: Connection = psycopg.connect(**self._params, autocommit=True)
        except psycopg.Error as exc:
            raise self._error("reached", exc) from exc
        # numeric (what sum() and avg() of integers give) as float, as SQLite gives it: the
        # views' rows are the same on both stores, and JSON can carry them.
        db.adapters.register_loader("numeric", FloatLoader)
        self._db = db
        return db

    def _call(self, what: str, work: Callable[[Connection], T]) -> T:
        """`work` on the connection, under the lock. A connection found dropped is opened
        again and `work` retried once; every failure is an AuditError."""
        with self._lock:
            if self._closed:  # not opened again behind its owner's back
                raise AuditError(f"the audit store {self.location} is closed")
            db = self._db if self._db is not None and not self._db.closed else self._open()
            try:
                return work(db)
            except psycopg.OperationalError as exc:
                if not db.broken:
                    raise self._error(what, exc) from exc
                log.warning(
                    "audit.reconnect", extra={"store": self.location, "error": self._clean(exc)}
                )
            except psycopg.Error as exc:
                raise self._error(what, exc) from exc
            db = self._open()
            try:
                return work(db)
            except psycopg.Error as exc:
                raise self._error(what, exc) from exc

    def _error(self, what: str, exc: BaseException) -> AuditError:
        return AuditError(
            f"the audit store {self.location} cannot be {what}: {self._clean(exc)}",
            hint="check that the PostgreSQL server of [audit] store (or CODECAGE_AUDIT, "
            "--audit) is up, reachable and accepts this user",
        )

    def _clean(self, exc: BaseException) -> str:
        """The driver's message, one line, without the password (it may quote the URL)."""
        text = " ".join(str(exc).split())
        for secret in self._secrets:
            for form in {secret, urllib.parse.quote(secret, safe="")}:
                text = text.replace(form, "***")
        return text

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._db is not None:
                self._db.close()
                self._db = None

    # --- the schema --------------------------------------------------------------------

    def _migrate(self) -> None:
        def work(db: Connection) -> None:
            with db.transaction():
                db.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
                db.execute(schema.MIGRATIONS[0][1][0])  # audit_meta, to read the version from
                row = db.execute(
                    "SELECT value FROM audit_meta WHERE key = 'schema_version'"
                ).fetchone()
                found = int(row[0]) if row else 0
                for statement in schema.migrations_after(found, self.location):
                    db.execute(statement)
                if found < schema.SCHEMA_VERSION:
                    db.execute(
                        "INSERT INTO audit_meta VALUES ('schema_version', %s) "
                        "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                        (str(schema.SCHEMA_VERSION),),
                    )

        self._call("migrated", work)

    # --- writing -----------------------------------------------------------------------

    def write(self, records: Sequence[AuditRecord], *, max_bytes: int | None = None) -> int:
        """Put `records` in, in one transaction (one on record already is skipped). With
        `max_bytes`: the rows' bytes are measured once (`size_bytes`, a scan of the tables)
        and each record counted by its size as JSON (more than its rows take: PostgreSQL
        compresses long text); those past the bound are left out. Returns how many were
        put in."""
        fit = len(records)
        if max_bytes is not None and records:
            used = self.size_bytes()
            fit = 0
            for record in records:
                used += len(record.model_dump_json().encode())
                if used > max_bytes:
                    break
                fit += 1
        kept = records[:fit]

        def work(db: Connection) -> None:
            with db.transaction(), db.cursor() as cur:
                for record in kept:
                    cur.execute(_INSERT_EXECUTION, rows.execution_row(record))
                    if cur.rowcount == 0:
                        continue  # on record already: this batch is a retry
                    events, calls, files = rows.child_rows(record)
                    cur.executemany(rows.INSERT_EVENT_SQL.replace("?", "%s"), events)
                    cur.executemany(
                        "INSERT INTO tool_calls VALUES (%s, %s, %s, %s, %s, %s, %s)", calls
                    )
                    cur.executemany("INSERT INTO files VALUES (%s, %s, %s, %s, %s)", files)

        if kept:
            self._call("written", work)
        return fit

    def write_alert(self, alert: AlertRecord) -> None:
        row = rows.alert_row(alert)
        self._call(
            "written",
            lambda db: db.execute(
                "INSERT INTO alerts VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (alert_id) DO NOTHING",
                row,
            ),
        )

    def add_events(self, execution_id: str, events: Sequence[RecordedEvent]) -> None:
        sql = rows.ADD_EVENT_SQL.replace("?", "%s")

        def add(db: Connection) -> None:
            with db.transaction(), db.cursor() as cur:
                for event in events:
                    cur.execute(sql, rows.added_event_params(execution_id, event))

        self._call("written", add)

    # --- reading -----------------------------------------------------------------------

    def select(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Rows of a read-only query written with `?` placeholders, in a READ ONLY
        transaction (a view cannot write, whatever its text)."""
        query = placeholders(sql)

        def work(db: Connection) -> list[tuple[Any, ...]]:
            with db.transaction():
                db.execute("SET TRANSACTION READ ONLY")
                return db.execute(query, list(params)).fetchall()

        return self._call("read", work)

    def get(self, execution_id: str) -> AuditRecord | None:
        def work(db: Connection) -> AuditRecord | None:
            with db.transaction():
                row = db.execute(
                    f"{rows.SELECT_EXECUTIONS_SQL} WHERE execution_id = %s", (execution_id,)
                ).fetchone()
                return _whole(db, row) if row is not None else None

        return self._call("read", work)

    def query(self, query: rows.Query) -> list[AuditRecord]:
        where, params = rows.query_where(query)
        sql = placeholders(f"{rows.SELECT_EXECUTIONS_SQL}{where} ORDER BY started_at DESC")
        if query.limit is not None:
            sql += f" LIMIT {int(query.limit)}"

        def work(db: Connection) -> list[AuditRecord]:
            with db.transaction():
                return [_whole(db, row) for row in db.execute(sql, params).fetchall()]

        return self._call("read", work)

    def size_bytes(self) -> int:
        """The bytes of the store's rows as PostgreSQL keeps them (`pg_column_size`, so
        after compression): what `prune`'s `max_bytes` bounds. The table files are larger
        (free space VACUUM made is kept for new rows, indexes), and do not shrink by prune."""
        row = self._call("read", lambda db: db.execute(f"SELECT {_LIVE_BYTES}").fetchone())
        return int(row[0]) if row is not None else 0

    def used_bytes(self) -> int:
        """The rows' bytes (`size_bytes`): a scan of the tables."""
        return self.size_bytes()

    # --- deleting ----------------------------------------------------------------------

    def erase(self, erasure: rows.Erasure) -> int:
        """Delete what `erasure` names (its alerts too), then rewrite the tables (VACUUM
        FULL), so the erased rows are gone from the table and index files, not only marked
        dead. The rewrite locks the tables while it lasts: writes wait for it."""
        statements = rows.erasure_statements(erasure)

        def work(db: Connection) -> list[int]:
            with db.transaction():
                return [
                    db.execute(placeholders(sql), params).rowcount for sql, params in statements
                ]

        counts = self._call("written", work)
        if any(counts):
            self.compact(full=True)
        return counts[-1]

    def prune(self, *, older_than: datetime.datetime | None, max_bytes: int | None) -> int:
        """Delete records started before `older_than`, then the oldest while the rows take
        more than `max_bytes` (`size_bytes`); a plain VACUUM after, so the space is reused
        (not given back to the file system: that would lock out writes)."""
        removed = 0
        if older_than is not None:
            removed += self._delete(
                "DELETE FROM executions WHERE started_at < %s", (rows.timestamp(older_than),)
            )
            # Alerts age out as records do (not counted: they are no executions).
            self._delete("DELETE FROM alerts WHERE at < %s", (rows.timestamp(older_than),))
        for _ in range(rows.PRUNE_ROUNDS if max_bytes is not None else 0):
            excess = self._excess(max_bytes or 0)
            if excess == 0:
                break
            removed += self._delete(
                "DELETE FROM executions WHERE execution_id IN (SELECT execution_id "
                "FROM executions ORDER BY started_at LIMIT %s)",
                (excess,),
            )
        if removed:
            self.compact(full=False)
        return removed

    def _excess(self, max_bytes: int) -> int:
        size = self.size_bytes()
        row = self._call(
            "read", lambda db: db.execute("SELECT count(*) FROM executions").fetchone()
        )
        return rows.oldest_over(size, int(row[0]) if row is not None else 0, max_bytes)

    def _delete(self, sql: str, params: Sequence[Any]) -> int:
        return self._call("written", lambda db: db.execute(sql, params).rowcount)

    def compact(self, *, full: bool) -> None:
        """VACUUM the tables: plain (dead rows' space reused, no lock against writes) or FULL
        (the tables and indexes rewritten into new files, the old ones removed)."""
        sql = f"VACUUM {'FULL ' if full else ''}{', '.join(TABLES)}"

        def work(db: Connection) -> None:
            db.execute(sql)  # autocommit: VACUUM cannot run in a transaction

        self._call("compacted", work)


def _whole(db: Connection, row: Sequence[Any]) -> AuditRecord:
    rid = (row[0],)
    return rows.record_from_rows(
        row,
        db.execute(rows.SELECT_EVENTS_SQL.replace("?", "%s"), rid).fetchall(),
        db.execute(
            "SELECT server, tool, status, duration_ms, bytes FROM tool_calls "
            "WHERE execution_id = %s ORDER BY seq",
            rid,
        ).fetchall(),
        db.execute(
            "SELECT path, size, sha256 FROM files WHERE execution_id = %s ORDER BY seq", rid
        ).fetchall(),
    )


# A quoted string or name, or a comment: a `?` in one is text, not a placeholder.
_QUOTED = re.compile(r"""('(?:[^']|'')*'|"(?:[^"]|"")*"|--[^\n]*|/\*.*?\*/)|\?""", re.DOTALL)


def placeholders(sql: str) -> str:
    """`sql` written with `?` placeholders (SQLite's) in psycopg's: `%s`, and every literal
    `%` doubled (psycopg reads `%` anywhere in the text, quoted or not)."""
    return _QUOTED.sub(lambda m: m.group(1) or "%s", sql.replace("%", "%%"))


def without_password(url: str) -> str:
    """`url` without its password (in the user part or as a `password=` parameter), for
    messages and logs."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        user, _, hosts = netloc.rpartition("@")
        netloc = f"{user.partition(':')[0]}@{hosts}"
    query = urllib.parse.urlencode(
        [
            (k, v)
            for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
            if k not in _SECRET_PARAMS
        ]
    )
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))


def _connection_params(url: str, location: str) -> dict[str, Any]:
    try:
        params: dict[str, Any] = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        # libpq's message may quote the URL (and its password): only the location is shown.
        raise ConfigError(
            f"the audit store {location} is not a valid PostgreSQL URL",
            hint="write [audit] store as postgresql://USER:PASSWORD@HOST:PORT/DATABASE",
        ) from None
    params.setdefault("connect_timeout", CONNECT_TIMEOUT_S)
    params.setdefault("application_name", "codecage-audit")
    return params
