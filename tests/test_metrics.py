"""Metrics, health and traces of `codecage serve --http` (audit/metrics.py, audit/tracing.py,
mcp/health.py).

The end-to-end tests start the real server, make real MCP calls over streamable HTTP (a run
that succeeds, one that raises, one refused an import), then read /metrics with the
Prometheus client's own parser and expect the counts exactly. The counting of what those
calls cannot produce here (upstream tool calls, egress bytes, label bounds) is tested by
feeding `ServerMetrics.observe` real results with those events added. Traces go to the
SDK's in-memory exporter, and, end to end, to the console exporter on the server's stderr.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client.parser import text_string_to_metric_families
from tests._anyio import anyio_backend  # noqa: F401 - a fixture
from tests._finished import finished_run

from codecage import Sandbox
from codecage.audit import Finished, tracing
from codecage.audit.metrics import MAX_TOOL_LABELS, ServerMetrics
from codecage.mcp import health
from codecage.mcp.server import build_server
from codecage.models import Event, ExecutionResult, PoolConfig, PoolKeyState, PoolState
from test_server import TOKEN, HttpServer, serving_http, structured, text_of

pytestmark = pytest.mark.anyio

AUTH = {"Authorization": f"Bearer {TOKEN}"}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


# --- helpers ---------------------------------------------------------------------------------


def get(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {}, method=method)  # noqa: S310
    try:
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - loopback
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as err:
        with err:
            return int(err.code), err.read().decode()


def base_url(server: HttpServer) -> str:
    return server.url.removesuffix("/mcp")


def samples(text: str) -> Samples:
    """Every sample of a Prometheus exposition, parsed by prometheus_client's own parser."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found: Samples, name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def total(found: Samples, name: str, **labels: str) -> float:
    """The sum of `name` over every series whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in found.items() if n == name and wanted <= ls)


def scrape(server: HttpServer, headers: dict[str, str] | None = None) -> Samples:
    status, text = get(base_url(server) + "/metrics", AUTH if headers is None else headers)
    assert status == 200, text
    return samples(text)


def wait_ready(server: HttpServer) -> dict[str, Any]:
    """/readyz until it says ready (the warm pool starting), within a bound."""
    deadline = time.monotonic() + 90
    while True:
        status, body = get(base_url(server) + "/readyz")
        if status == 200 or time.monotonic() > deadline:
            assert status == 200, body
            return dict(json.loads(body))
        assert status == 503, body
        time.sleep(0.1)


async def calls(server: HttpServer, *arguments: dict[str, Any]) -> list[CallToolResult]:
    async with (
        httpx2.AsyncClient(headers=AUTH, timeout=httpx2.Timeout(30, read=90)) as http,
        Client(streamable_http_client(server.url, http_client=http)) as client,
    ):
        return [await client.call_tool("execute_code", a) for a in arguments]


# --- the real server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    workdir = tmp_path_factory.mktemp("serve-metrics")
    with serving_http(workdir, "--token", TOKEN) as server:
        yield server


async def test_metrics_count_the_runs_of_real_calls_exactly(http_server: HttpServer) -> None:
    wait_ready(http_server)
    before = scrape(http_server)
    assert total(before, "codecage_runs_total") == 0
    ok, failed, refused = await calls(
        http_server,
        {"code": "6 * 7"},
        {"code": "1 / 0"},
        {"code": "import socket", "profile": "basic"},
    )
    assert structured(ok)["status"] == "ok"
    assert structured(failed)["status"] == "error"
    assert structured(refused)["status"] == "error"
    assert "import_blocked" in {e["kind"] for e in structured(refused)["events"]}
    backend = structured(ok)["backend"]

    found = scrape(http_server)
    runs = "codecage_runs_total"
    assert value(found, runs, status="ok", backend=backend, profile="standard") == 1
    assert value(found, runs, status="error", backend=backend, profile="standard") == 1
    assert value(found, runs, status="error", backend=backend, profile="basic") == 1
    assert total(found, runs) == 3
    # The import policy runs in the guest: its refusal is the guest's claim, counted apart.
    assert value(found, "codecage_guest_claims_total", kind="import_blocked") == 1
    for kind in ("import_blocked", "syscall_blocked", "network_denied", "tool_not_allowed"):
        assert ("codecage_denials_total", frozenset({("kind", kind)})) in found  # zero, shown
        assert value(found, "codecage_denials_total", kind=kind) == 0
    assert value(found, "codecage_run_wall_seconds_count", backend=backend) == 3
    assert value(found, "codecage_queue_wait_seconds_count") == 3
    assert value(found, "codecage_queue_depth") == 0
    assert value(found, "codecage_runs_in_flight") == 0
    assert total(found, "codecage_tool_calls_total") == 0
    assert value(found, "codecage_egress_sent_bytes_total") == 0


async def test_pool_metrics_agree_with_the_pools_own_report(http_server: HttpServer) -> None:
    async with (
        httpx2.AsyncClient(headers=AUTH, timeout=httpx2.Timeout(30, read=90)) as http,
        Client(streamable_http_client(http_server.url, http_client=http)) as client,
    ):
        await client.call_tool("execute_code", {"code": "1"})
        info = structured(await client.call_tool("get_sandbox_info", {"detail": True}))
    found = scrape(http_server)
    keys = info["detail"]["pool"]["keys"]
    assert keys, info["detail"]["pool"]
    for profile in {k["profile"] for k in keys}:
        mine = [k for k in keys if k["profile"] == profile]
        for field in ("hits", "misses"):  # they change only with runs: none runs now
            reported = sum(k[field] for k in mine)
            assert value(found, f"codecage_pool_{field}_total", profile=profile) == reported
        assert ("codecage_pool_idle", frozenset({("profile", profile)})) in found
        assert ("codecage_pool_target", frozenset({("profile", profile)})) in found
    assert total(found, "codecage_pool_hits_total") >= 1  # the warm pool served a call


def test_metrics_need_the_token_and_health_does_not(http_server: HttpServer) -> None:
    url = base_url(http_server)
    assert get(url + "/metrics")[0] == 401
    assert get(url + "/metrics", {"Authorization": "Bearer wrong"})[0] == 401
    status, body = get(url + "/healthz")
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    assert wait_ready(http_server) == {"ready": True}
    assert get(url + "/healthz", method="POST")[0] == 405
    assert get(url + "/readyz", method="HEAD")[0] == 200
    assert get(url + "/mcp")[0] == 401  # the rest stays behind the token


async def test_metrics_public_serves_metrics_without_the_token_and_traces_to_stderr(
    tmp_path: Path,
) -> None:
    otel = {"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    with serving_http(tmp_path, "--token", TOKEN, "--metrics-public", "--no-pool", **otel) as s:
        assert wait_ready(s) == {"ready": True}  # no pool: ready once the self-test passed
        (result,) = await calls(s, {"code": "6 * 7"})
        execution_id = structured(result)["execution_id"]
        found = scrape(s, headers={})
        assert total(found, "codecage_runs_total", status="ok") == 1
        assert total(found, "codecage_pool_idle") == 0  # no pool, no pool series
        assert get(s.url)[0] == 401  # /mcp still needs it
        deadline = time.monotonic() + 30
        while execution_id not in s.stderr_path.read_text(encoding="utf-8", errors="replace"):
            assert time.monotonic() < deadline, "no span of the call on the server's stderr"
            await anyio.sleep(0.05)
    log = s.stderr_path.read_text(encoding="utf-8", errors="replace")
    assert '"name": "execute_code"' in log
    assert '"codecage.status": "ok"' in log


# --- readiness, decided ------------------------------------------------------------------------


def pool_of(*keys: tuple[str, int, int]) -> PoolState:
    """A pool report with keys of (profile, idle, min_idle)."""
    return PoolState(
        enabled=True,
        config=PoolConfig(enabled=True),
        keys=[
            PoolKeyState(
                profile=profile,
                preload=[],
                workspace_mb=64,
                tmp_mb=64,
                idle=idle,
                starting=0,
                target=min_idle,
                min_idle=min_idle,
                max_idle=4,
                hits=0,
                misses=0,
                started=idle,
                crashed=0,
                failed_starts=0,
                last_error="secret detail",
                idle_rss_mb=None,
                idle_pss_mb=None,
            )
            for profile, idle, min_idle in keys
        ],
        host_rss_mb=None,
    )


def test_readiness_waits_for_the_self_test_and_each_pool_key() -> None:
    assert health.readiness((), pool_of(("standard", 1, 1), ("basic", 2, 1))).ready
    assert health.readiness(None, None).ready  # self-test off, no pool
    failed = health.readiness(("seccomp",), pool_of(("standard", 1, 1)))
    assert not failed.ready
    assert "seccomp" not in failed.reason  # unauthenticated: no layer names
    starting = health.readiness((), pool_of(("standard", 1, 1), ("basic", 0, 2)))
    assert (starting.ready, starting.answer().status) == (False, 503)
    assert "basic 0 of 2" in starting.reason
    assert "secret detail" not in starting.answer().body.decode()
    # The target grows under load; readiness asks for min_idle only.
    busy = pool_of(("standard", 1, 1))
    busy = busy.model_copy(update={"keys": [busy.keys[0].model_copy(update={"target": 3})]})
    assert health.readiness((), busy).ready


def test_a_real_host_is_ready_once_its_pool_is_warm() -> None:
    sandbox = Sandbox(pool=True)
    try:
        assert sandbox.warm(90)
        assert health.host_readiness(sandbox.host) == health.Readiness(True)
    finally:
        sandbox.close()


# --- counting what the calls above cannot produce -----------------------------------------------


def finished(result: ExecutionResult, profile: str | None = "standard") -> Finished:
    return finished_run(result, profile=profile)


@pytest.fixture(scope="module")
def a_result() -> ExecutionResult:
    with Sandbox(pool=False) as sandbox:
        return sandbox.run("1")


def tool_call(server: str, tool: str, status: str = "ok") -> Event:
    data = {"server": server, "tool": tool, "status": status, "duration_ms": 1.0}
    return Event(kind="tool_call", detail=f"{server}.{tool}", data=data)


def test_tool_calls_egress_bytes_and_denials_are_counted_from_a_results_events(
    a_result: ExecutionResult,
) -> None:
    metrics = ServerMetrics(servers=["files"])
    sent = {"host": "a.example", "port": 443, "bytes_out": 1200, "bytes_in": 5}
    events = [
        tool_call("files", "read"),
        tool_call("files", "read", "timeout"),
        tool_call("files", "delete", "not_allowed"),
        tool_call("nowhere", "x", "unknown_server"),
        Event(kind="tool_call", detail="3 more tool calls (not listed one by one)"),
        Event(kind="network_allowed", detail="GET", data=sent),
        Event(kind="network_allowed", detail="GET", data={**sent, "bytes_out": 300}),
        Event(kind="network_denied", detail="b refused", data={"host": "b", "bytes_out": 0}),
        Event(kind="network_denied", detail="more", data={"more": 9, "refused": 4}),
    ]
    metrics.observe(finished(a_result.model_copy(update={"events": events}), "basic,filesystem"))
    found = samples(metrics.exposition().decode())
    calls_ = "codecage_tool_calls_total"
    assert value(found, calls_, server="files", tool="read", status="ok") == 1
    assert value(found, calls_, server="files", tool="read", status="timeout") == 1
    assert value(found, calls_, server="files", tool="delete", status="not_allowed") == 1
    assert value(found, calls_, server="other", tool="other", status="unknown_server") == 1
    assert total(found, calls_) == 4
    assert value(found, "codecage_denials_total", kind="tool_not_allowed") == 1
    assert value(found, "codecage_denials_total", kind="network_denied") == 5
    assert value(found, "codecage_egress_sent_bytes_total") == 1500
    assert total(found, "codecage_runs_total", profile="combined") == 1


def test_label_values_stay_bounded_whatever_the_code_calls(a_result: ExecutionResult) -> None:
    metrics = ServerMetrics(servers=["files"], profiles=["mine"])
    events = [tool_call("files", f"tool{i}", f"status{i}") for i in range(MAX_TOOL_LABELS + 50)]
    metrics.observe(finished(a_result.model_copy(update={"events": events})))
    for profile in ("mine", "made-up", None):
        metrics.observe(finished(a_result, profile))
    found = samples(metrics.exposition().decode())
    tools = {dict(ls)["tool"] for (n, ls) in found if n == "codecage_tool_calls_total"}
    statuses = {dict(ls)["status"] for (n, ls) in found if n == "codecage_tool_calls_total"}
    assert len(tools) == MAX_TOOL_LABELS + 1
    assert "other" in tools
    assert statuses == {"other"}
    assert (
        value(found, "codecage_tool_calls_total", server="files", tool="other", status="other")
        == 50
    )
    profiles = {dict(ls)["profile"] for (n, ls) in found if n == "codecage_runs_total"}
    assert profiles == {"standard", "mine", "other", "none"}


# --- traces ---------------------------------------------------------------------------------------


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    try:
        yield exporter
    finally:
        tracing.use(None)
        provider.shutdown()


async def test_each_execute_code_call_is_a_span_with_the_runs_attributes(
    spans: InMemorySpanExporter,
) -> None:
    server = build_server(Sandbox(pool=False).host)
    async with Client(server, read_timeout_seconds=60) as client:
        ran = structured(await client.call_tool("execute_code", {"code": "6 * 7"}))
        blocked = structured(
            await client.call_tool("execute_code", {"code": "import socket", "profile": "basic"})
        )
        refused = await client.call_tool("execute_code", {"code": "1", "backend": "nope"})
    assert refused.is_error, text_of(refused)
    first, second, third = spans.get_finished_spans()
    assert first.name == "execute_code"
    attributes = dict(first.attributes or {})
    queue_ms = attributes.pop("codecage.queue_ms")
    assert isinstance(queue_ms, float)
    assert queue_ms >= 0
    assert attributes == {
        "codecage.profile": "standard",
        "codecage.execution_id": ran["execution_id"],
        "codecage.status": "ok",
        "codecage.backend": ran["backend"],
        "codecage.wall_ms": ran["usage"]["wall_ms"],
    }
    assert second.attributes is not None
    assert second.attributes["codecage.profile"] == "basic"
    assert second.attributes["codecage.status"] == "error"
    assert second.attributes["codecage.execution_id"] == blocked["execution_id"]
    assert third.status.status_code == StatusCode.ERROR  # refused inside the run: no result
    assert "codecage.execution_id" not in (third.attributes or {})


def test_traces_are_on_only_when_the_environment_configures_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    try:
        assert not tracing.configure({})
        assert not tracing.enabled()
        assert tracing.run_span("standard") is tracing.NO_SPAN  # off: nothing made per run
        assert not tracing.configure({"OTEL_TRACES_EXPORTER": "none"})
        assert not tracing.configure(
            {"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}
        )
        assert not tracing.configure({"OTEL_TRACES_EXPORTER": "no_such_exporter"})
        assert "server.otel_exporter_unavailable" in caplog.text
        assert tracing.configure({"OTEL_TRACES_EXPORTER": "console"})
        assert tracing.enabled()
        assert tracing.run_span("standard") is not tracing.NO_SPAN
    finally:
        tracing.use(None)
