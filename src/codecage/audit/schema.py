"""The audit trail's tables, the same for SQLite and PostgreSQL, and their versions.

Portable SQL only: times are ISO 8601 UTC text (`2026-11-26T21:18:31.123456+00:00`, which
sorts as time does), JSON is text, booleans are integers. Byte counts are BIGINT and floats
DOUBLE PRECISION: PostgreSQL's INTEGER and REAL have 4 bytes (no 2 GiB file; 5.3 MB read
back as 5.300000190734863), and SQLite reads both names as its INTEGER and REAL. A store
applies the migrations above the version it finds (`audit_meta.schema_version`) at open,
in one transaction each; a store newer than this code is refused, never written.
"""

from __future__ import annotations

from typing import Final

from codecage.errors import ConfigError

SCHEMA_VERSION: Final = 2

_V1: Final = (
    """CREATE TABLE IF NOT EXISTS audit_meta (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS executions (
        execution_id TEXT PRIMARY KEY,
        started_at TEXT NOT NULL,
        finished_at TEXT NOT NULL,
        caller_kind TEXT NOT NULL,
        caller_name TEXT NOT NULL,
        caller_version TEXT NOT NULL,
        face TEXT NOT NULL,
        session_id TEXT,
        backend TEXT NOT NULL,
        profile TEXT,
        allowed_imports TEXT NOT NULL,
        limits TEXT NOT NULL,
        code_sha256 TEXT NOT NULL,
        code_bytes BIGINT NOT NULL,
        code TEXT,
        code_truncated INTEGER NOT NULL,
        status TEXT NOT NULL,
        exit_code INTEGER,
        signal TEXT,
        error_type TEXT,
        wall_ms INTEGER NOT NULL,
        cpu_ms INTEGER,
        peak_memory_mb DOUBLE PRECISION,
        bytes_written BIGINT NOT NULL,
        redactions TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS executions_started ON executions (started_at)",
    "CREATE INDEX IF NOT EXISTS executions_caller ON executions (caller_name)",
    "CREATE INDEX IF NOT EXISTS executions_status ON executions (status)",
    """CREATE TABLE IF NOT EXISTS events (
        execution_id TEXT NOT NULL REFERENCES executions (execution_id) ON DELETE CASCADE,
        seq INTEGER NOT NULL,
        kind TEXT NOT NULL,
        detail TEXT NOT NULL,
        data TEXT,
        PRIMARY KEY (execution_id, seq)
    )""",
    "CREATE INDEX IF NOT EXISTS events_kind ON events (kind)",
    """CREATE TABLE IF NOT EXISTS tool_calls (
        execution_id TEXT NOT NULL REFERENCES executions (execution_id) ON DELETE CASCADE,
        seq INTEGER NOT NULL,
        server TEXT NOT NULL,
        tool TEXT NOT NULL,
        status TEXT NOT NULL,
        duration_ms INTEGER,
        bytes BIGINT,
        PRIMARY KEY (execution_id, seq)
    )""",
    """CREATE TABLE IF NOT EXISTS files (
        execution_id TEXT NOT NULL REFERENCES executions (execution_id) ON DELETE CASCADE,
        seq INTEGER NOT NULL,
        path TEXT NOT NULL,
        size BIGINT NOT NULL,
        sha256 TEXT,
        PRIMARY KEY (execution_id, seq)
    )""",
)

_V1_ALERTS: Final = (
    """CREATE TABLE IF NOT EXISTS alerts (
        alert_id TEXT PRIMARY KEY,
        at TEXT NOT NULL,
        kind TEXT NOT NULL,
        execution_id TEXT,
        caller_name TEXT NOT NULL,
        detail TEXT NOT NULL,
        target TEXT NOT NULL,
        outcome TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS alerts_at ON alerts (at)",
)

GUEST_KINDS: Final = (
    "syscall_blocked",
    "network_denied",
    "return_value_truncated",
    "import_blocked",
    "display_truncated",
)
"""The event kinds a guest may report (`models.wire.GuestEventKind`), as of version 2."""

_V2: Final = (
    # Who says an event happened: 'host' (observed) or 'guest' (the guest's claim). Rows of
    # version 1 are marked 'host' where only the host makes that kind (and the proxy's
    # network_denied, which alone has data); the rest stay NULL: not known.
    "ALTER TABLE events ADD COLUMN source TEXT",
    "UPDATE events SET source = 'host' WHERE kind NOT IN ("  # noqa: S608 - constants only
    + ", ".join(f"'{kind}'" for kind in GUEST_KINDS)
    + ") OR (kind = 'network_denied' AND data IS NOT NULL)",
    "CREATE INDEX IF NOT EXISTS events_source_kind ON events (source, kind)",
    # What bounding a record left out (record.MAX_*): counts by what, and a flag.
    "ALTER TABLE executions ADD COLUMN truncated INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE executions ADD COLUMN omitted TEXT NOT NULL DEFAULT '{}'",
)

MIGRATIONS: Final[tuple[tuple[int, tuple[str, ...]], ...]] = (
    (1, _V1 + _V1_ALERTS),
    (2, _V2),
)
"""(version, statements) in order: each brings a store from the version before to it."""


def migrations_after(found: int, location: str) -> list[str]:
    """The statements that bring a store of schema version `found` (0: empty) to
    `SCHEMA_VERSION`, in order.

    Raises:
        ConfigError: the store is newer than this codecage (it is never written then).
    """
    if found > SCHEMA_VERSION:
        raise ConfigError(
            f"the audit store {location} has schema version {found}; this codecage knows up "
            f"to {SCHEMA_VERSION}",
            hint="upgrade codecage, or point [audit] store at another store",
        )
    return [sql for version, statements in MIGRATIONS if version > found for sql in statements]


RUN_COLUMNS: Final = (
    "execution_id",
    "started_at",
    "finished_at",
    "caller_kind",
    "caller_name",
    "caller_version",
    "face",
    "session_id",
    "backend",
    "profile",
)
"""Which run, whose, where: the first columns of `executions` and of the CSV export."""
OUTCOME_COLUMNS: Final = (
    "status",
    "exit_code",
    "signal",
    "error_type",
    "wall_ms",
    "cpu_ms",
    "peak_memory_mb",
    "bytes_written",
)
"""How it ended and what it used, in `executions` and in the CSV export."""
EXECUTION_COLUMNS: Final = (
    *RUN_COLUMNS,
    "allowed_imports",
    "limits",
    "code_sha256",
    "code_bytes",
    "code",
    "code_truncated",
    *OUTCOME_COLUMNS,
    "redactions",
    "truncated",
    "omitted",
)
JSON_COLUMNS: Final = frozenset({"allowed_imports", "limits", "redactions", "omitted"})
EVENT_COLUMNS: Final = ("execution_id", "seq", "kind", "detail", "data", "source")
