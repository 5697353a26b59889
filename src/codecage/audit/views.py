"""What the operator's commands show of a store: statistics, export rows, id lookup.

Everything here reads through the `AuditStore` interface (`query`, `get`, `select` with
portable `?` SQL), so it runs the same on SQLite and PostgreSQL; percentiles are computed
here, not by SQL functions one of the two lacks. What it reads is bounded: statistics cover
a window (`since`), exports walk the matching ids in order and read one record at a time.
"""

from __future__ import annotations

import csv
import datetime
import io
import json
from collections import Counter
from collections.abc import Iterable, Iterator

from pydantic import BaseModel, ConfigDict, Field

from codecage.audit.record import AuditRecord
from codecage.audit.schema import OUTCOME_COLUMNS, RUN_COLUMNS
from codecage.audit.store import AuditStore, Query, query_where
from codecage.errors import ConfigError

DENIAL_KINDS = ("import_blocked", "syscall_blocked", "network_denied")
"""Events that are a layer refusing something the code tried (what `stats` counts)."""
FAILED_STATUSES = frozenset({"error", "timeout", "cpu_limit", "memory_limit", "killed", "blocked"})
TOP = 10
MIN_PREFIX = 8


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Percentiles(_Model):
    runs: int
    p50_ms: float | None
    p95_ms: float | None


class ClientRow(_Model):
    client: str = Field(description="caller_name ('' when the caller gave none).")
    runs: int
    failures: int


class ToolRow(_Model):
    tool: str = Field(description="server.tool")
    calls: int
    errors: int


class Stats(_Model):
    """`codecage audit stats`."""

    since: datetime.datetime | None
    runs: int
    by_status: dict[str, int]
    by_profile: dict[str, int]
    by_backend: dict[str, int]
    wall: Percentiles
    wall_by_status: dict[str, Percentiles]
    denials: dict[str, int] = Field(
        description="Events of DENIAL_KINDS the host observed, by kind."
    )
    guest_claims: dict[str, int] = Field(
        default_factory=dict,
        description="Events of DENIAL_KINDS the guest reported, by kind: its claims, which "
        "the code can forge or suppress (records older than schema 2 whose origin is not "
        "known count here too).",
    )
    top_clients: list[ClientRow]
    tool_calls: list[ToolRow]


def stats(store: AuditStore, since: datetime.datetime | None) -> Stats:
    """Runs since `since` (None: all) by status, profile and backend, wall-time percentiles,
    denials by kind, the busiest clients and tools."""
    where, params = query_where(Query(since=since, limit=None))
    rows = store.select(
        f"SELECT status, profile, backend, caller_name, wall_ms FROM executions{where}",  # noqa: S608
        params,
    )
    walls: dict[str, list[float]] = {}
    clients: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    for status, _profile, _backend, caller, wall in rows:
        walls.setdefault(status, []).append(float(wall))
        clients[caller] += 1
        failures[caller] += status in FAILED_STATUSES
    return Stats(
        since=since,
        runs=len(rows),
        by_status=_counted(r[0] for r in rows),
        by_profile=_counted(r[1] or "none" for r in rows),
        by_backend=_counted(r[2] for r in rows),
        wall=_percentiles([w for ws in walls.values() for w in ws]),
        wall_by_status={status: _percentiles(ws) for status, ws in sorted(walls.items())},
        denials=_denials(store, where, params, claims=False),
        guest_claims=_denials(store, where, params, claims=True),
        top_clients=[
            ClientRow(client=name, runs=n, failures=failures[name])
            for name, n in clients.most_common(TOP)
        ],
        tool_calls=_tools(store, where, params),
    )


def _counted(values: Iterable[str]) -> dict[str, int]:
    return dict(Counter(values).most_common())


def _percentiles(values: list[float]) -> Percentiles:
    if not values:
        return Percentiles(runs=0, p50_ms=None, p95_ms=None)
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return Percentiles(runs=len(ordered), p50_ms=at(0.5), p95_ms=at(0.95))


def _denials(
    store: AuditStore, where: str, params: list[object], *, claims: bool
) -> dict[str, int]:
    """Denial events by kind: those the host observed, or (`claims`) the others."""
    marks = ", ".join("?" for _ in DENIAL_KINDS)
    origin = "(source IS NULL OR source != 'host')" if claims else "source = 'host'"
    found = dict(
        store.select(
            f"SELECT kind, count(*) FROM events WHERE kind IN ({marks}) AND {origin} AND "  # noqa: S608
            f"execution_id IN (SELECT execution_id FROM executions{where}) GROUP BY kind",
            [*DENIAL_KINDS, *params],
        )
    )
    return {kind: int(found.get(kind, 0)) for kind in DENIAL_KINDS}


def _tools(store: AuditStore, where: str, params: list[object]) -> list[ToolRow]:
    rows = store.select(
        "SELECT server, tool, status, count(*) FROM tool_calls WHERE execution_id IN "  # noqa: S608
        f"(SELECT execution_id FROM executions{where}) GROUP BY server, tool, status",
        params,
    )
    calls: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for server, tool, status, n in rows:
        name = f"{server}.{tool}"
        calls[name] += int(n)
        errors[name] += int(n) if status != "ok" else 0
    return [ToolRow(tool=t, calls=n, errors=errors[t]) for t, n in calls.most_common(TOP)]


# --- finding and walking records -----------------------------------------------------------


def resolve_id(store: AuditStore, wanted: str) -> str:
    """The execution id `wanted` names: itself, or the one id it is a prefix of.

    Raises:
        ConfigError: it is shorter than MIN_PREFIX, names none, or names several.
    """
    if len(wanted) < MIN_PREFIX:
        raise ConfigError(
            f"{wanted!r} is too short to name an execution",
            hint=f"give the whole id or its first {MIN_PREFIX} characters or more",
        )
    escaped = wanted.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    found = [
        row[0]
        for row in store.select(
            "SELECT execution_id FROM executions WHERE execution_id LIKE ? ESCAPE '\\' "
            "ORDER BY execution_id LIMIT 2",
            [escaped + "%"],
        )
    ]
    if len(found) == 1:
        return str(found[0])
    if not found:
        raise ConfigError(
            f"no execution {wanted!r} in the audit store",
            hint="`codecage audit list` shows the recent ones",
        )
    raise ConfigError(f"{wanted!r} names more than one execution", hint="give more of the id")


def matching(store: AuditStore, query: Query) -> Iterator[AuditRecord]:
    """The records `query` matches, oldest first, read one at a time (its limit: the
    newest that many)."""
    where, params = query_where(query)
    sql = f"SELECT execution_id FROM executions{where} ORDER BY started_at DESC, execution_id"  # noqa: S608
    if query.limit is not None:
        sql += f" LIMIT {int(query.limit)}"
    for (execution_id,) in reversed(store.select(sql, params)):
        record = store.get(execution_id)
        if record is not None:  # erased meanwhile
            yield record


CSV_COLUMNS = (
    *RUN_COLUMNS,
    *OUTCOME_COLUMNS,
    "code_sha256",
    "code_bytes",
    "events",
    "event_kinds",
    "tool_calls",
    "files",
    "redactions",
)


def csv_header() -> str:
    return _csv_line(list(CSV_COLUMNS))


def csv_row(record: AuditRecord) -> str:
    """One record as a CSV line: its columns, events as a count and their kinds, tool calls
    and files as counts, redactions as JSON. Cells a spreadsheet would run as a formula
    (starting with = + - @) are quoted with a leading apostrophe."""
    data = record.model_dump(mode="json")
    cells: list[object] = []
    for column in CSV_COLUMNS:
        if column == "events":
            cells.append(len(record.events))
        elif column == "event_kinds":
            cells.append(" ".join(sorted({e.kind for e in record.events})))
        elif column in ("tool_calls", "files"):
            cells.append(len(data[column]))
        elif column == "redactions":
            cells.append(json.dumps(record.redactions, sort_keys=True))
        else:
            cells.append(data[column])
    return _csv_line(cells)


def _csv_line(cells: list[object]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([_defused(c) for c in cells])
    return out.getvalue()


def _defused(cell: object) -> object:
    if isinstance(cell, str) and cell[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + cell
    return "" if cell is None else cell


def jsonl_row(record: AuditRecord) -> str:
    return record.model_dump_json() + "\n"


def parse_when(text: str, *, now: datetime.datetime | None = None) -> datetime.datetime:
    """An ISO date or date-time (UTC unless it says), or an age back from now: 30m, 12h,
    7d, 2w.

    Raises:
        ConfigError: neither.
    """
    now = now or datetime.datetime.now(datetime.UTC)
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    spelled = text.strip().lower()
    if spelled[:-1].isdigit() and spelled[-1:] in units:
        return now - datetime.timedelta(seconds=int(spelled[:-1]) * units[spelled[-1]])
    try:
        moment = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(
            f"{text!r} is not a time",
            hint="give an ISO date or time (2026-11-01, 2026-11-01T12:00) or an age: 30m, 12h, 7d",
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=datetime.UTC)
