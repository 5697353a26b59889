"""Records as rows, for every store: which records a `Query` or an `Erasure` means, the SQL
both stores run (`?` placeholders; PostgreSQL translates them), and an `AuditRecord` to its
rows and back. Below the stores (`audit.sqlite`, `audit.postgres`) and the interface that
chooses one (`audit.store`).
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from codecage.audit.record import (
    AlertRecord,
    AuditRecord,
    RecordedEvent,
    RecordedFile,
    RecordedToolCall,
)
from codecage.audit.schema import EXECUTION_COLUMNS, JSON_COLUMNS
from codecage.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Query:
    """Which records `query` returns, newest first."""

    status: str | None = None
    caller: str | None = None  # a caller's name
    since: datetime.datetime | None = None
    until: datetime.datetime | None = None
    event_kind: str | None = None  # records with at least one event of this kind
    limit: int | None = 100


@dataclass(frozen=True, slots=True)
class Erasure:
    """What `erase` deletes: one execution, every record of a caller (its alerts too), or
    all before a time; the fields given must all match."""

    execution_id: str | None = None
    caller: str | None = None
    before: datetime.datetime | None = None


def query_where(query: Query) -> tuple[str, list[Any]]:
    """The WHERE clause (or "") of `query` on `executions`, and its parameters."""
    clauses: list[str] = []
    params: list[Any] = []
    if query.status is not None:
        clauses.append("status = ?")
        params.append(query.status)
    if query.caller is not None:
        clauses.append("caller_name = ?")
        params.append(query.caller)
    if query.since is not None:
        clauses.append("started_at >= ?")
        params.append(timestamp(query.since))
    if query.until is not None:
        clauses.append("started_at < ?")
        params.append(timestamp(query.until))
    if query.event_kind is not None:
        clauses.append("execution_id IN (SELECT execution_id FROM events WHERE kind = ?)")
        params.append(query.event_kind)
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), params


def erasure_statements(erasure: Erasure) -> list[tuple[str, list[Any]]]:
    """The DELETEs of `erasure`, in order, the executions' last (its row count is the number
    erased; their events, tool calls and files go with them, ON DELETE CASCADE). Alerts go
    when they match the erasure's fields themselves (an alert's time is its `at`) or belong
    to an erased execution.

    Raises:
        ConfigError: the erasure names nothing.
    """
    matches = [
        (column, value)
        for column, value in (
            ("execution_id", erasure.execution_id),
            ("caller_name", erasure.caller),
        )
        if value is not None
    ]
    if not matches and erasure.before is None:
        raise ConfigError(
            "an erasure names nothing to erase",
            hint="name an execution id, a caller, a time before which to erase, or several",
        )
    before = [timestamp(erasure.before)] if erasure.before is not None else []
    fields = [f"{column} = ?" for column, _ in matches]
    values = [value for _, value in matches]
    executions = " AND ".join(fields + (["started_at < ?"] if before else []))
    alerts = " AND ".join(fields + (["at < ?"] if before else []))
    # Both clauses are built here from column names; only the values come from the caller.
    return [
        (
            f"DELETE FROM alerts WHERE ({alerts}) OR execution_id IN "  # noqa: S608
            f"(SELECT execution_id FROM executions WHERE {executions})",
            [*values, *before, *values, *before],
        ),
        (f"DELETE FROM executions WHERE {executions}", [*values, *before]),  # noqa: S608
    ]


PRUNE_ROUNDS = 5
"""Pruning by size deletes the estimated excess, then measures again, at most this often."""


def oldest_over(size_bytes: int, records: int, max_bytes: int) -> int:
    """How many of the oldest of `records` to delete to bring a store of `size_bytes` under
    `max_bytes`, by their mean size (0 when under it). An estimate: the store measures again
    after deleting them."""
    if size_bytes <= max_bytes or records == 0:
        return 0
    return min(records, math.ceil((size_bytes - max_bytes) * records / size_bytes))


# --- records as rows, and back: shared by the stores -------------------------------------------


def timestamp(moment: datetime.datetime) -> str:
    """The text form of a time in the tables: ISO 8601 in UTC, microseconds, sortable."""
    return moment.astimezone(datetime.UTC).isoformat(timespec="microseconds")


def execution_row(record: AuditRecord) -> tuple[Any, ...]:
    data = record.model_dump(mode="json")
    data["started_at"] = timestamp(record.started_at)
    data["finished_at"] = timestamp(record.finished_at)
    data["code_truncated"] = int(record.code_truncated)
    data["truncated"] = int(record.truncated)
    return tuple(
        json.dumps(data[c], sort_keys=True) if c in JSON_COLUMNS else data[c]
        for c in EXECUTION_COLUMNS
    )


def child_rows(
    record: AuditRecord,
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The record's events, tool calls and files as rows (execution_id, seq, ...)."""
    rid = record.execution_id
    events = [
        (rid, i, e.kind, e.detail, json.dumps(e.data, sort_keys=True) if e.data else None, e.source)
        for i, e in enumerate(record.events)
    ]
    calls = [
        (rid, i, c.server, c.tool, c.status, c.duration_ms, c.bytes)
        for i, c in enumerate(record.tool_calls)
    ]
    files = [(rid, i, f.path, f.size, f.sha256) for i, f in enumerate(record.files)]
    return events, calls, files


def alert_row(alert: AlertRecord) -> tuple[Any, ...]:
    """The alert as a row of `alerts`, in the table's column order."""
    return (
        alert.alert_id,
        timestamp(alert.at),
        alert.kind,
        alert.execution_id,
        alert.caller_name,
        alert.detail,
        alert.target,
        alert.outcome,
    )


# The column lists are this module's constants (never input): S608 does not apply.
_EXECUTION_COLUMNS = ", ".join(EXECUTION_COLUMNS)
INSERT_EXECUTION_SQL = (
    f"INSERT INTO executions ({_EXECUTION_COLUMNS}) "  # noqa: S608
    f"VALUES ({', '.join('?' for _ in EXECUTION_COLUMNS)}) "
    # Only an execution already on record is skipped: SQLite's OR IGNORE would also drop,
    # silently, a row that breaks NOT NULL.
    "ON CONFLICT (execution_id) DO NOTHING"
)
"""An `execution_row`, unless its execution is on record already."""
SELECT_EXECUTIONS_SQL = f"SELECT {_EXECUTION_COLUMNS} FROM executions"  # noqa: S608
"""The columns `record_from_rows` reads, in `EXECUTION_COLUMNS` order."""
INSERT_EVENT_SQL = (
    "INSERT INTO events (execution_id, seq, kind, detail, data, source) VALUES (?, ?, ?, ?, ?, ?)"
)
SELECT_EVENTS_SQL = (
    "SELECT kind, detail, data, source FROM events WHERE execution_id = ? ORDER BY seq"
)
ADD_EVENT_SQL = (
    "INSERT INTO events (execution_id, seq, kind, detail, data, source) "
    "SELECT x.execution_id, "
    "(SELECT COALESCE(MAX(seq), -1) + 1 FROM events WHERE execution_id = ?), ?, ?, ?, ? "
    "FROM executions x WHERE x.execution_id = ?"
)
"""One event after a record's others (portable: `?` placeholders, each store translates)."""


def added_event_params(execution_id: str, event: RecordedEvent) -> tuple[Any, ...]:
    data = json.dumps(event.data, sort_keys=True) if event.data else None
    return (execution_id, event.kind, event.detail, data, event.source, execution_id)


def record_from_rows(
    execution: Sequence[Any],
    events: Iterable[Sequence[Any]],
    calls: Iterable[Sequence[Any]],
    files: Iterable[Sequence[Any]],
) -> AuditRecord:
    """The inverse of `execution_row` and `child_rows` (children without their two keys)."""
    data: dict[str, Any] = dict(zip(EXECUTION_COLUMNS, execution, strict=True))
    for column in JSON_COLUMNS:
        data[column] = json.loads(data[column])
    data["code_truncated"] = bool(data["code_truncated"])
    data["truncated"] = bool(data["truncated"])
    data["events"] = [
        RecordedEvent(kind=k, detail=d, data=json.loads(x) if x else None, source=s)
        for k, d, x, s in events
    ]
    data["tool_calls"] = [
        RecordedToolCall(server=s, tool=t, status=st, duration_ms=ms, bytes=b)
        for s, t, st, ms, b in calls
    ]
    data["files"] = [RecordedFile(path=p, size=n, sha256=h) for p, n, h in files]
    return AuditRecord.model_validate(data)
