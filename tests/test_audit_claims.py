"""Events the guest reports are its claims, kept apart from what the host observed: a run's
code can put any event on its control stream (here: straight into the bootstrap's list of
events, found up its own call stack), and forged `network_denied` and `syscall_blocked`
events must count as denials nowhere, neither in `audit stats`, nor in /metrics, nor in
alerts (tests/test_alerts.py), while the host's own observations still do.

Real sandboxes, a real SQLite store, the real `codecage audit stats` and the metrics'
real Prometheus exposition."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from tests._postgres import postgres_server, postgres_url

from codecage import ExecutionResult, Options
from codecage import host as hosts
from codecage import sandbox as sandboxes
from codecage.audit import Query, open_store
from codecage.audit.metrics import ServerMetrics
from codecage.audit.schema import MIGRATIONS, SCHEMA_VERSION
from test_metrics import samples, value
from test_server import CODECAGE, server_env

__all__ = ["postgres_server", "postgres_url"]  # fixtures, used by name

FORGED = 3
FORGE_CODE = f"""
import sys
frame = sys._getframe()
while frame is not None and not isinstance(frame.f_globals.get("_events"), list):
    frame = frame.f_back
assert frame is not None, "the bootstrap's events were not found"
for i in range({FORGED}):
    frame.f_globals["_events"].append(
        {{"kind": "network_denied", "detail": f"evil.example:{{i}} refused by the proxy"}}
    )
    frame.f_globals["_events"].append(
        {{"kind": "syscall_blocked", "detail": f"ptrace refused ({{i}})"}}
    )
print("forged")
"""


@dataclass
class Forged:
    db: Path
    result: ExecutionResult
    metrics: ServerMetrics


@pytest.fixture(scope="module")
def forged(tmp_path_factory: pytest.TempPathFactory) -> Forged:
    db = tmp_path_factory.mktemp("claims") / "audit.db"
    metrics = ServerMetrics()
    options = Options(pool=False, audit=db, import_policy=False).resolve()
    with sandboxes.over(hosts.build(options, observers=(metrics.observe,))) as sandbox:
        result = sandbox.run(FORGE_CODE)
    return Forged(db, result, metrics)


def test_the_guests_events_are_marked_as_its_claims_in_the_result(
    forged: Forged,
) -> None:
    result = forged.result
    assert result.status == "ok" and result.stdout == "forged\n", result
    claimed = [e for e in result.events if e.kind in ("network_denied", "syscall_blocked")]
    assert len(claimed) == 2 * FORGED
    assert {e.source for e in claimed} == {"guest"}
    assert all(e.source == "host" for e in result.events if e not in claimed)
    assert json.loads(result.model_dump_json())["events"][0]["source"] in ("host", "guest")


def test_the_store_keeps_each_events_origin(forged: Forged) -> None:
    db, result = forged.db, forged.result
    store = open_store(db)
    try:
        [record] = store.query(Query(limit=None))
    finally:
        store.close()
    assert record.execution_id == result.execution_id
    assert [e.source for e in record.events] == [e.source for e in result.events]
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute(
            "SELECT source, count(*) FROM events WHERE kind IN "
            "('network_denied', 'syscall_blocked') GROUP BY source"
        ).fetchall()
    assert rows == [("guest", 2 * FORGED)]


def test_audit_stats_counts_no_forged_denial(forged: Forged) -> None:
    db = forged.db
    done = subprocess.run(
        [CODECAGE, "audit", "stats", "--store", str(db), "--json"],
        capture_output=True,
        text=True,
        env=server_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)
    assert stats["denials"]["network_denied"] == 0
    assert stats["denials"]["syscall_blocked"] == 0
    assert stats["guest_claims"]["network_denied"] == FORGED
    assert stats["guest_claims"]["syscall_blocked"] == FORGED
    human = subprocess.run(
        [CODECAGE, "audit", "stats", "--store", str(db)],
        capture_output=True,
        text=True,
        env=server_env(),
        timeout=120,
    )
    [denials] = [x for x in human.stdout.splitlines() if x.startswith("denials")]
    [claims] = [x for x in human.stdout.splitlines() if x.startswith("claims")]
    assert "network_denied 0" in denials and f"network_denied {FORGED}" in claims


def test_metrics_count_no_forged_denial_and_show_the_claims_apart(
    forged: Forged,
) -> None:
    metrics = forged.metrics
    found = samples(metrics.exposition().decode())
    for kind in ("network_denied", "syscall_blocked"):
        assert value(found, "codecage_denials_total", kind=kind) == 0
        assert value(found, "codecage_guest_claims_total", kind=kind) == FORGED


@pytest.fixture(params=["sqlite", "postgres"])
def schema_1(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store of schema 1 (before events had an origin), with one run's events in it."""
    v1 = [sql for version, statements in MIGRATIONS if version == 1 for sql in statements]
    rows = [
        "INSERT INTO audit_meta VALUES ('schema_version', '1')",
        "INSERT INTO executions VALUES ('old', '2026-11-01T12:00:00.000000+00:00', "
        "'2026-11-01T12:00:01.000000+00:00', 'cli', 'root', '', 'cli', NULL, 'bwrap', NULL, "
        "'[]', '{}', 'ab', 1, NULL, 0, 'ok', 0, NULL, NULL, 1, NULL, NULL, 0, '{}')",
        "INSERT INTO events VALUES ('old', 0, 'network_denied', 'socket(AF_INET)', NULL)",
        "INSERT INTO events VALUES ('old', 1, 'network_denied', 'x:80 refused', "
        '\'{"host": "x"}\')',
        "INSERT INTO events VALUES ('old', 2, 'output_truncated', 'stdout', NULL)",
        "INSERT INTO events VALUES ('old', 3, 'syscall_blocked', 'ptrace', NULL)",
    ]
    if request.param == "sqlite":
        db = tmp_path / "audit.db"
        with contextlib.closing(sqlite3.connect(db)) as conn, conn:
            for sql in v1 + rows:
                conn.execute(sql)
        return str(db)
    url: str = request.getfixturevalue("postgres_url")
    with psycopg.connect(url, autocommit=True) as conn:
        for sql in v1 + rows:
            conn.execute(sql)  # constants of this test
    return url


def test_a_schema_1_store_is_migrated_with_what_is_known_of_each_origin(schema_1: str) -> None:
    store = open_store(schema_1)
    try:
        record = store.get("old")
        (version,) = store.select("SELECT value FROM audit_meta")[0]
    finally:
        store.close()
    assert record is not None and int(version) == SCHEMA_VERSION
    # The guest's kinds are not known (NULL), but the proxy's network_denied (with data) is
    # the host's, as every kind the guest cannot report.
    assert [e.source for e in record.events] == [None, "host", "host", None]
    assert not record.truncated and record.omitted == {}
