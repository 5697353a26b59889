"""What every audit store does, and choosing one from `[audit] store`.

A store keeps `AuditRecord`s in the tables of `audit.schema`: `write` commits a batch in one
transaction (so a record the caller saw written is on disk), `get` and `query` read them
back whole, `erase` and `prune` delete (and compact). What they share (which records a
`Query` or an `Erasure` means, records as rows, the SQL) is `audit.rows`. SQLite
(`audit.sqlite`) is the default; a `postgresql://` URL picks `audit.postgres`.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from codecage.audit import sqlite
from codecage.audit.record import (
    AlertRecord,
    AuditRecord,
    RecordedEvent,
)
from codecage.audit.rows import Erasure, Query
from codecage.errors import ConfigError

DEFAULT_NAME = "audit.db"


class AuditStore(Protocol):
    location: str  # a path or a URL without its password, for messages

    def write(self, records: Sequence[AuditRecord], *, max_bytes: int | None = None) -> int:
        """Put `records` in, in order, in one transaction; with `max_bytes`, only those that
        keep `used_bytes` within it (the first that would not, and the rest, are left
        out). Returns how many were put in (one on record already counts)."""
        ...

    def write_alert(self, alert: AlertRecord) -> None: ...
    def add_events(self, execution_id: str, events: Sequence[RecordedEvent]) -> None:
        """Append events to a record already written (what the face learnt after the run,
        e.g. a trimmed MCP reply); nothing when there is no such record."""
        ...

    def select(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Rows of a read-only query written with `?` placeholders (portable SQL: the
        views of `audit.views` run on every store)."""
        ...

    def get(self, execution_id: str) -> AuditRecord | None: ...
    def query(self, query: Query) -> list[AuditRecord]: ...
    def erase(self, erasure: Erasure) -> int: ...
    def prune(self, *, older_than: datetime.datetime | None, max_bytes: int | None) -> int: ...
    def size_bytes(self) -> int:
        """What `prune`'s `max_bytes` bounds (SQLite: the file and its WAL; PostgreSQL: the
        rows' bytes)."""
        ...

    def used_bytes(self) -> int:
        """What the records take now, as `[audit] max_mb` bounds it at write time (SQLite:
        the database's pages in use, the free ones and the WAL's copies not counted;
        PostgreSQL: the rows' bytes, as `size_bytes`)."""
        ...

    def close(self) -> None: ...


def default_location(environ: Mapping[str, str] | None = None) -> Path:
    """audit.db in codecage's state directory: /var/lib/codecage for root, else
    $XDG_STATE_HOME/codecage (~/.local/state/codecage)."""
    env = os.environ if environ is None else environ
    if os.geteuid() == 0:
        return Path("/var/lib/codecage") / DEFAULT_NAME
    state = env.get("XDG_STATE_HOME", "")
    base = Path(state) if Path(state).is_absolute() else Path.home() / ".local" / "state"
    return base / "codecage" / DEFAULT_NAME


def open_store(location: str | Path | None) -> AuditStore:
    """The store at `location`: a postgresql:// URL, else a SQLite file (None: the default).

    Raises:
        ConfigError: it cannot be opened or is of a newer schema than this codecage.
    """
    text = str(location) if location is not None else ""
    if text.startswith(("postgresql://", "postgres://")):
        try:
            from codecage.audit import postgres  # the driver is an optional dependency
        except ImportError as exc:
            raise ConfigError(
                f"a PostgreSQL audit store needs its driver: {exc}",
                hint="pip install 'codecage[postgres]' (psycopg), or use a SQLite file",
            ) from exc
        return postgres.connect(text)
    path = Path(text).expanduser() if text else default_location()
    if not path.is_absolute():
        raise ConfigError(
            f"the audit store {text!r} is a relative path",
            hint="give an absolute path to a SQLite file, or a postgresql:// URL",
        )
    return sqlite.SqliteStore(path)
