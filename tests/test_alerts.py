"""Alerts as an operator gets them: real runs raise them, a real HTTP server on loopback
and a real command receive them, the rate limit holds them back and says how many, a hook
that hangs or fails holds up no run, and every alert is in the audit SQLite file."""

from __future__ import annotations

import contextlib
import http.server
import json
import sqlite3
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from codecage import ConfigError, Options, Sandbox
from codecage import host as hosts
from codecage import sandbox as sandboxes
from codecage.audit.alerts import QUEUE_MAX, Alerter
from codecage.audit.record import Finished
from codecage.models import AlertSettings
from test_audit_claims import FORGE_CODE
from test_server import call_over_stdio

WAIT_S = 60.0  # a bound on waiting for the worker, never a measure of it
SOCKET_CODE = """
import socket
try:
    socket.socket(socket.AF_PACKET)
except OSError as exc:
    print(exc)
"""
METADATA_CODE = """
import urllib.error, urllib.request
try:
    urllib.request.urlopen("http://metadata.test/latest/meta-data/", timeout=10)
except urllib.error.HTTPError as exc:
    print("HTTP", exc.code)
"""


class Receiver:
    """A webhook on loopback: keeps each POSTed body; answers `status`; while `hold` is
    clear, a request waits for it (a hook that hangs)."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.bodies: list[dict[str, object]] = []
        self.arrived = threading.Event()  # a request came in (it may be held)
        self.hold = threading.Event()
        self.hold.set()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.arrived.set()
                receiver.hold.wait(WAIT_S)
                receiver.bodies.append(json.loads(body))
                self.send_response(receiver.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/T0123/s3cr3t-path"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver()
    yield found
    found.close()


def hook_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "hook.py"
    script.write_text(f"#!{sys.executable}\nimport sys, time\n{body}\n")
    script.chmod(0o700)
    return script


def writer(tmp_path: Path) -> tuple[Path, Path]:
    """A command hook that appends its stdin (one alert) as a line to a file."""
    out = tmp_path / "alerts.jsonl"
    script = hook_script(
        tmp_path, f"open({str(out)!r}, 'ab').write(sys.stdin.buffer.read() + b'\\n')"
    )
    return script, out


def alert_rows(db: Path) -> list[tuple[str, str | None, str, str, str, str]]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute(
            "SELECT kind, execution_id, caller_name, detail, target, outcome FROM alerts "
            "ORDER BY at"
        ).fetchall()


def test_repeated_network_denials_alert_a_webhook_with_the_run_but_not_its_code(
    tmp_path: Path, receiver: Receiver
) -> None:
    """Denials the host observed (its egress proxy refused a name that resolves to the
    metadata address) alert; the guest's own `network_denied` (its socket() audit hook, or
    a forged one) is a claim and never does."""
    db = tmp_path / "audit.db"
    config = tmp_path / "config.toml"
    config.write_text('[network.resolve]\n"metadata.test" = ["169.254.169.254"]\n')
    settings = AlertSettings(webhook_url=receiver.url, on=["network_denied"], repeat_count=2)
    with Sandbox(
        config=config,
        pool=False,
        allow_hosts=["metadata.test:80"],
        options=Options(import_policy=False, audit=db, alerts=settings),
    ) as sandbox:
        assert sandbox.host.alerter is not None
        claims = [sandbox.run(SOCKET_CODE), sandbox.run(FORGE_CODE)]
        assert sandbox.host.alerter.flush(WAIT_S)
        first = sandbox.run(METADATA_CODE)
        assert sandbox.host.alerter.flush(WAIT_S)
        assert receiver.bodies == []  # one denial: not yet repeated; claims: never counted
        second = sandbox.run(METADATA_CODE)
        assert sandbox.host.alerter.flush(WAIT_S)
    for claim in claims:
        assert claim.status == "ok", claim
        assert {e.source for e in claim.events if e.kind == "network_denied"} == {"guest"}
    assert first.status == second.status == "ok"
    assert first.stdout.startswith("HTTP 403"), first.stdout
    [alert] = receiver.bodies
    assert alert["kind"] == "network_denied"
    assert alert["execution_id"] == second.execution_id
    assert alert["caller"] == {"kind": "library", "name": sandbox.caller.name, "version": ""}
    assert alert["counts"] == {"events": 2, "window_s": 600, "suppressed": 0, "dropped": 0}
    assert alert["origin"] == "host"
    assert "metadata.test:80 refused" in str(alert["detail"])
    assert "urlopen" not in json.dumps(alert)  # never the code
    [row] = alert_rows(db)
    assert row[0:3] == ("network_denied", second.execution_id, sandbox.caller.name)
    assert row[4:] == ("127.0.0.1", "sent")  # the webhook's host only, not its path


def test_a_command_gets_the_alert_as_json_on_its_stdin(tmp_path: Path) -> None:
    script, out = writer(tmp_path)
    settings = AlertSettings(command=[str(script)], on=["import_blocked"], repeat_count=1)
    with Sandbox(pool=False, profile="basic", options=Options(alerts=settings)) as sandbox:
        result = sandbox.run("import socket")
        assert sandbox.host.alerter is not None and sandbox.host.alerter.flush(WAIT_S)
    assert result.status == "error"
    [line] = out.read_text().splitlines()
    alert = json.loads(line)
    assert alert["kind"] == "import_blocked" and alert["execution_id"] == result.execution_id
    assert "socket" in alert["detail"]
    # The import policy runs in the guest: its refusals are claims, and the alert says so.
    assert alert["origin"] == "guest" and "claim" in alert["detail"]


def test_degraded_isolation_and_a_status_alert(tmp_path: Path) -> None:
    script, out = writer(tmp_path)
    settings = AlertSettings(command=[str(script)], on=["degraded_isolation", "status:error"])
    with Sandbox(
        pool=False, backend="landlock", options=Options(allow_degraded=True, alerts=settings)
    ) as sandbox:
        result = sandbox.run("1 / 0")
        assert sandbox.host.alerter is not None and sandbox.host.alerter.flush(WAIT_S)
    alerts = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(a["kind"] for a in alerts) == ["degraded_isolation", "status:error"]
    by_kind = {a["kind"]: a for a in alerts}
    assert "layer not in force" in by_kind["degraded_isolation"]["detail"]
    assert by_kind["status:error"]["detail"] == "the run ended error: ZeroDivisionError"
    assert {a["execution_id"] for a in alerts} == {result.execution_id}


def test_a_high_validation_finding_alerts_whether_or_not_the_run_was_validated(
    tmp_path: Path, receiver: Receiver
) -> None:
    code = "subclasses = ().__class__.__base__.__subclasses__()\nlen(subclasses)"
    settings = AlertSettings(webhook_url=receiver.url, on=["validation_high"])
    with Sandbox(pool=False, options=Options(alerts=settings)) as sandbox:
        blocked = sandbox.run(code, strict=True)  # validated before: its events say so
        ran = sandbox.run(code)  # not validated: the alerter checks it off the run path
        harmless = sandbox.run("print(sum(range(10)))")
        assert sandbox.host.alerter is not None and sandbox.host.alerter.flush(WAIT_S)
    assert blocked.status == "blocked" and ran.status == harmless.status == "ok"
    by_run = {str(b["execution_id"]): b for b in receiver.bodies}
    assert set(by_run) == {blocked.execution_id, ran.execution_id}
    assert all("CC104 high" in str(b["detail"]) for b in receiver.bodies)


def test_over_the_rate_alerts_are_suppressed_recorded_and_counted_in_the_next(
    tmp_path: Path, receiver: Receiver
) -> None:
    db = tmp_path / "audit.db"
    now = [1000.0]
    settings = AlertSettings(webhook_url=receiver.url, on=["status:error"], max_per_hour=1)
    alerters: list[Alerter] = []

    def observe(finished: Finished) -> None:
        alerters[0](finished)  # made with the trail the host opened

    options = Options(pool=False, audit=db).resolve()
    with sandboxes.over(hosts.build(options, observers=(observe,))) as sandbox:
        assert sandbox.host.audit is not None
        alerter = Alerter(settings, store=sandbox.host.audit.store, clock=lambda: now[0])
        alerters.append(alerter)
        runs = [sandbox.run("1 / 0") for _ in range(3)]
        assert alerter.flush(WAIT_S)
        assert len(receiver.bodies) == 1
        now[0] += 3600  # an hour later: the budget is back
        last = sandbox.run("1 / 0")
        assert alerter.flush(WAIT_S)
        alerter.close()
    outcomes = [(r[1], r[5]) for r in alert_rows(db)]
    ids = [r.execution_id for r in runs]
    assert outcomes == [
        (ids[0], "sent"),
        (ids[1], "suppressed"),
        (ids[2], "suppressed"),
        (last.execution_id, "sent"),
    ]
    counts = [b["counts"] for b in receiver.bodies]
    assert counts == [{"suppressed": 0, "dropped": 0}, {"suppressed": 2, "dropped": 0}]


def test_a_hanging_webhook_holds_up_no_run(tmp_path: Path, receiver: Receiver) -> None:
    db = tmp_path / "audit.db"
    receiver.hold.clear()
    settings = AlertSettings(webhook_url=receiver.url, on=["status:error"], timeout=WAIT_S)
    with Sandbox(pool=False, options=Options(audit=db, alerts=settings)) as sandbox:
        assert sandbox.host.alerter is not None
        try:
            first = sandbox.run("1 / 0")
            assert receiver.arrived.wait(WAIT_S)  # its alert is at the hook, which hangs
            second = sandbox.run("1 / 0")
            # Both runs returned while the hook still held the first alert: had sending
            # been on the run's path, the first would have come back only once the hook
            # gave up, with its failure on record.
            assert not receiver.hold.is_set() and alert_rows(db) == []
        finally:
            receiver.hold.set()
        assert sandbox.host.alerter.flush(WAIT_S)
    assert first.status == second.status == "error"
    assert [(r[1], r[5]) for r in alert_rows(db)] == [
        (first.execution_id, "sent"),
        (second.execution_id, "sent"),
    ]


def test_failing_hooks_are_recorded_as_failed_and_the_run_is_as_it_was(
    tmp_path: Path,
) -> None:
    db = tmp_path / "audit.db"
    failing = Receiver(status=500)
    stuck = hook_script(tmp_path, "time.sleep(600)")
    settings = AlertSettings(
        webhook_url=failing.url, command=[str(stuck)], on=["status:error"], timeout=1
    )
    try:
        with Sandbox(pool=False, options=Options(audit=db, alerts=settings)) as sandbox:
            result = sandbox.run("print('still here')\n1 / 0")
            assert sandbox.host.alerter is not None and sandbox.host.alerter.flush(WAIT_S)
    finally:
        failing.close()
    assert result.status == "error" and result.stdout == "still here\n"
    [row] = alert_rows(db)
    assert row[4] == "127.0.0.1, hook.py"
    assert row[5] == "failed: 127.0.0.1: HTTP 500; hook.py: killed after 1s"


def test_a_full_queue_drops_alerts_and_the_next_one_sent_counts_them(
    receiver: Receiver,
) -> None:
    receiver.hold.clear()
    settings = AlertSettings(
        webhook_url=receiver.url, on=["client_blocked"], max_per_hour=3600, timeout=WAIT_S
    )
    alerter = Alerter(settings)
    try:
        alerter.client_blocked("alice", "over its rate")
        assert receiver.arrived.wait(WAIT_S)  # the worker is stuck on the first
        raised = 1 + QUEUE_MAX + 20
        for _ in range(raised - 1):
            alerter.client_blocked("alice", "over its rate")  # never waits
    finally:
        receiver.hold.set()
    assert alerter.flush(WAIT_S)
    alerter.close()
    dropped = sum(int(b["counts"]["dropped"]) for b in receiver.bodies)  # type: ignore[index]
    assert len(receiver.bodies) == QUEUE_MAX + 1 and dropped == raised - len(receiver.bodies)


def test_a_blocked_client_alerts_with_a_scrubbed_reason(tmp_path: Path, receiver: Receiver) -> None:
    db = tmp_path / "audit.db"
    settings = AlertSettings(webhook_url=receiver.url)  # client_blocked is on by default
    with Sandbox(pool=False, options=Options(audit=db, alerts=settings)) as sandbox:
        alerter = sandbox.host.alerter
        assert alerter is not None and alerter in sandbox.host.observers
        alerter.client_blocked("alice", "over 10 runs a minute; contact alice@example.com")
        assert alerter.flush(WAIT_S)
    [alert] = receiver.bodies
    assert alert["kind"] == "client_blocked"
    assert alert["caller"] == {"kind": "http", "name": "alice", "version": ""}
    assert "[EMAIL]" in str(alert["detail"]) and "alice@example.com" not in json.dumps(alert)
    [row] = alert_rows(db)
    assert row[0] == "client_blocked" and row[2] == "alice" and "alice@example.com" not in row[3]


def test_serve_sends_the_alerts_of_its_calls(tmp_path: Path) -> None:
    script, out = writer(tmp_path)
    db = tmp_path / "audit.db"
    config = tmp_path / "config.toml"
    config.write_text(f'[alerts]\ncommand = ["{script}"]\non = ["status:error"]\n')
    config.chmod(0o600)
    answers = call_over_stdio(
        tmp_path,
        "--no-pool",
        "--audit",
        str(db),
        "--config",
        str(config),
        code="1 / 0",
        timeout=WAIT_S,
    )
    execution_id = answers[-1]["result"]["structuredContent"]["execution_id"]
    [alert] = [json.loads(line) for line in out.read_text().splitlines()]
    assert alert["kind"] == "status:error" and alert["execution_id"] == execution_id
    assert alert["caller"] == {"kind": "mcp", "name": "test", "version": "0"}
    assert [(r[1], r[4], r[5]) for r in alert_rows(db)] == [(execution_id, "hook.py", "sent")]


def test_alerts_without_a_hook_or_with_a_plain_http_webhook_are_refused(
    tmp_path: Path, clean_env: dict[str, str]
) -> None:
    with pytest.raises(ConfigError, match="no webhook_url or command"):
        Sandbox(pool=False, options=Options(alerts=True))
    with pytest.raises(ConfigError, match="not an executable program"):
        Sandbox(
            pool=False, options=Options(alerts=AlertSettings(command=[str(tmp_path / "missing")]))
        )
    config = tmp_path / "config.toml"
    config.write_text('[alerts]\nwebhook_url = "http://hooks.example.com/x"\n')
    config.chmod(0o600)
    with pytest.raises(ConfigError, match="loopback only"):
        Sandbox(pool=False, config=config, options=Options(alerts=True))
