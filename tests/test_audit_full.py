"""`[audit] max_mb` holds at write time, on a real SQLite store and a real PostgreSQL server
(tests/_postgres.py): a full store refuses new records and keeps the ones it has, says so
(a log warning, `full`, the `audit_full` alert, /readyz, /metrics), and follows `required`: runs are
refused while it is full, or go on with their records dropped and counted. Real sandboxes
make the runs."""

from __future__ import annotations

import datetime
import json
import logging
import secrets
from pathlib import Path

import pytest
from tests._finished import finished_run
from tests._postgres import postgres_server, postgres_url

from codecage import ExecutionResult, Options, Sandbox
from codecage.audit import AuditTrail, Erasure, Query, open_store
from codecage.audit.record import Caller, Finished, record_of
from codecage.errors import AuditError
from codecage.mcp.health import host_readiness, server_metrics, watch
from codecage.models import AlertSettings, AuditSettings
from test_alerts import WAIT_S, writer
from test_metrics import samples, value

__all__ = ["postgres_server", "postgres_url"]  # fixtures, used by name

MIB = 1024 * 1024
CODE_BYTES = 48 * 1024  # kept whole ([audit] max_code_bytes is 64 KiB): ~20 fill a MiB


def big_code() -> str:
    """CODE_BYTES of code that no store compresses much (a comment of random text)."""
    return "# " + secrets.token_urlsafe(CODE_BYTES * 3 // 4) + "\n"


@pytest.fixture(scope="module")
def a_result() -> ExecutionResult:
    with Sandbox(pool=False) as sandbox:
        return sandbox.run("print('hi')")


def finished(result: ExecutionResult) -> Finished:
    """A run of `result` with its own id and code no store compresses much."""
    return finished_run(result, big_code(), caller=Caller("library", name="tester"), fresh_id=True)


@pytest.fixture(params=["sqlite", "postgres"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "audit.db")
    url: str = request.getfixturevalue("postgres_url")
    return url


def count(location: str) -> int:
    store = open_store(location)
    try:
        return len(store.query(Query(limit=None)))
    finally:
        store.close()


def test_max_mb_holds_at_write_time_and_a_full_store_keeps_what_it_has(
    location: str, a_result: ExecutionResult, caplog: pytest.LogCaptureFixture
) -> None:
    runs = 60  # ~3 MiB of records for a 1 MiB store
    settings = AuditSettings(store=location, max_mb=1)
    trail = AuditTrail.open(settings, scrub=str)
    told = []
    trail.on_full.append(told.append)
    first = finished(a_result)
    try:
        with caplog.at_level(logging.WARNING, logger="codecage.audit.trail"):
            for n in range(runs):
                trail.record(first if n == 0 else finished(a_result))
                assert trail.flush(WAIT_S)
                assert trail.store.used_bytes() <= MIB  # after every write, not hourly
        full = trail.full
        assert full is not None and full.max_bytes == MIB
        assert len(told) == 1  # said once, when it became full
        assert "audit.store_full" in caplog.text
        kept = count(location)
        assert 0 < kept < runs
        assert trail.dropped == runs - kept  # not required: dropped, and counted
        assert trail.failure is None
        # What it had is kept: the first record, not the newest, is on record.
        assert trail.store.get(first.result.execution_id) is not None
    finally:
        trail.close()


def test_a_required_trail_refuses_runs_while_full_and_serves_again_once_there_is_room(
    tmp_path: Path,
) -> None:
    db = tmp_path / "audit.db"
    config = tmp_path / "config.toml"
    config.write_text("[audit]\nmax_mb = 1\nrequired = true\n")
    with Sandbox(config=config, pool=False, options=Options(audit=db)) as sandbox:
        trail = sandbox.host.audit
        assert trail is not None
        with pytest.raises(AuditError) as refused:
            for _ in range(80):  # fills it: each record keeps its ~48 KiB of code
                sandbox.run(big_code() + "print(1)")
        assert "full" in str(refused.value) and "erase" in (refused.value.hint or "")
        assert trail.full is not None
        answer = host_readiness(sandbox.host).answer()
        assert answer.status == 503
        assert "full" in json.loads(answer.body)["reason"]
        with pytest.raises(AuditError):  # still full: refused again, at once
            sandbox.run("print(2)")
        assert trail.store.used_bytes() <= MIB
        # Room again (the operator erased): runs are served, and the waiting record written.
        trail.store.erase(Erasure(before=datetime.datetime.now(datetime.UTC)))
        result = sandbox.run("print(3)")
        assert result.status == "ok"
        assert trail.full is None and trail.failure is None
        assert host_readiness(sandbox.host).answer().status == 200
        assert trail.flush(WAIT_S)
        assert trail.store.get(result.execution_id) is not None


def test_a_full_store_that_is_not_required_alerts_and_says_so_on_readyz(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    config = tmp_path / "config.toml"
    config.write_text("[audit]\nmax_mb = 1\n")
    script, out = writer(tmp_path)
    alerts = AlertSettings(command=[str(script)], on=["audit_full"])
    with Sandbox(config=config, pool=False, options=Options(audit=db, alerts=alerts)) as sandbox:
        trail = sandbox.host.audit
        assert trail is not None and sandbox.host.alerter is not None
        results = []
        for _ in range(40):
            results.append(sandbox.run(big_code() + "1"))
            assert trail.flush(WAIT_S)
        assert all(r.status == "ok" for r in results)  # runs go on
        assert trail.full is not None and trail.dropped > 0
        answer = host_readiness(sandbox.host).answer()
        body = json.loads(answer.body)
        assert answer.status == 200 and body["ready"] is True
        assert (
            "full" in body["degraded"]
            and f"{trail.dropped} record(s) dropped" in (body["degraded"])
        )
        metrics = server_metrics(sandbox.host.settings, sandbox.host.tools)
        watch(metrics, sandbox.host)
        found = samples(metrics.exposition().decode())
        assert value(found, "codecage_audit_store_full") == 1
        assert value(found, "codecage_audit_records_dropped_total") == trail.dropped
        assert sandbox.host.alerter.flush(WAIT_S)
    [line] = out.read_text().splitlines()  # once, when it became full
    alert = json.loads(line)
    assert alert["kind"] == "audit_full" and "full" in alert["detail"]


def test_a_store_full_at_open_refuses_the_first_run_of_a_required_trail(
    tmp_path: Path, a_result: ExecutionResult
) -> None:
    db = tmp_path / "audit.db"
    store = open_store(db)
    try:
        while store.used_bytes() < MIB:
            made = record_of(finished(a_result), keep_code=True, max_code_bytes=MIB, scrub=str)
            store.write([made])
    finally:
        store.close()
    config = tmp_path / "config.toml"
    config.write_text("[audit]\nmax_mb = 1\nrequired = true\n")
    with (
        Sandbox(config=config, pool=False, options=Options(audit=db)) as sandbox,
        pytest.raises(AuditError, match="full"),
    ):
        sandbox.run("print(1)")
