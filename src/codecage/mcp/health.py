"""What `codecage serve --http` tells operators beside /mcp: `/healthz` (the process serves),
`/readyz` (it can run code warm now) and `/metrics` (Prometheus, `audit.metrics`).

`Endpoints` answers GET (and HEAD) of its paths and hands every other request to the app it
wraps. `http_app` puts one in front of the bearer-token gate for the health endpoints (and
for /metrics with `--metrics-public`), and one behind it for /metrics otherwise: so /metrics
takes exactly the tokens /mcp takes. The health answers hold no detail an unauthenticated
caller should not have: no layer names, no error texts, no counts beyond the pool's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from codecage.audit.metrics import AuditState, ServerMetrics
from codecage.config import Settings
from codecage.host import Host
from codecage.models import PoolState

if TYPE_CHECKING:
    from codecage.bridge.broker import Broker

PROMETHEUS_TEXT = b"text/plain; version=0.0.4; charset=utf-8"
JSON = b"application/json"


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    content_type: bytes
    body: bytes


Route = Callable[[], Awaitable[Answer]]


@dataclass(frozen=True, slots=True)
class Readiness:
    """Whether the server is ready to run code, and if not, why (for people, not parsing)."""

    ready: bool
    reason: str = ""
    degraded: str = ""  # ready, but something the operator must see (a full audit store)

    def answer(self) -> Answer:
        body: dict[str, object] = {"ready": True}
        if not self.ready:
            body = {"ready": False, "reason": self.reason}
        elif self.degraded:
            body["degraded"] = self.degraded
        return Answer(200 if self.ready else 503, JSON, json.dumps(body).encode())


def readiness(missing: tuple[str, ...] | None, pool: PoolState | None) -> Readiness:
    """Ready when the self-test passed (`missing`: the layers it found missing; None: the
    self-test is off) and every key of the warm pool has its `min_idle` sandboxes ready (no
    pool: nothing to wait for).

    `min_idle`, not the pool's moving `target`: the target grows past it under load, and a
    server that turned unready whenever it got busy would be taken out of a load balancer
    exactly when needed.
    """
    if missing:
        return Readiness(False, "the isolation self-test did not pass (run `codecage doctor`)")
    if pool is None or not pool.enabled:
        return Readiness(True)
    short = [k for k in pool.keys if k.idle < k.min_idle]
    if short:
        counts = ", ".join(f"{k.profile} {k.idle} of {k.min_idle}" for k in short)
        return Readiness(False, f"the warm pool is starting: ready {counts}")
    return Readiness(True)


def host_readiness(host: Host) -> Readiness:
    """`readiness` of this host now: not ready either while an audit trail the operator
    required cannot be written (its runs are refused). Its first call may run the self-test
    (once per process): call it off the event loop."""
    audit = host.audit
    if audit is not None and audit.settings.required and audit.failure is not None:
        full = audit.full
        why = full.reason if full is not None else "its store cannot be written"
        return Readiness(False, f"the required audit trail refuses runs: {why}")
    missing = host.selftest_missing()
    found = readiness(missing, host.pool.state() if host.pool is not None else None)
    full = audit.full if audit is not None else None
    if found.ready and full is not None and audit is not None:
        # Runs go on unrecorded: ready (a balancer keeps sending), and saying so.
        dropped = f"{audit.dropped} record(s) dropped"
        return dataclasses.replace(found, degraded=f"{full.reason}; {dropped}")
    return found


def server_metrics(settings: Settings, tools: Broker | None) -> ServerMetrics:
    """The metrics of a server: its operator's profiles and upstream servers as the known
    label values. Pass its `observe` to `host.build`, then `watch` the host built."""
    return ServerMetrics(
        profiles=settings.custom_profiles,
        servers=tools.servers if tools is not None else (),
    )


def watch(metrics: ServerMetrics, runtime: Host) -> None:
    """Have `metrics` read `runtime`'s pool and audit trail at each scrape."""
    pool, trail = runtime.pool, runtime.audit
    metrics.watch_host(
        pool.state if pool is not None else None,
        (lambda: AuditState(trail.full is not None, trail.dropped)) if trail is not None else None,
    )


def routes(host: Host, metrics: ServerMetrics | None) -> dict[str, Route]:
    """/healthz, /readyz and (given `metrics`) /metrics of `host`."""

    async def healthz() -> Answer:
        return Answer(200, JSON, b'{"status": "ok"}')

    async def readyz() -> Answer:
        found = await anyio.to_thread.run_sync(host_readiness, host)
        return found.answer()

    found: dict[str, Route] = {"/healthz": healthz, "/readyz": readyz}
    if metrics is not None:

        async def scrape() -> Answer:
            # In a thread: the pool's state reads /proc for its idle sandboxes' memory.
            text = await anyio.to_thread.run_sync(metrics.exposition)
            return Answer(200, PROMETHEUS_TEXT, text)

        found["/metrics"] = scrape
    return found


class Endpoints:
    """ASGI middleware: GET or HEAD of one of `routes` is answered here (any other method:
    405); everything else goes to `app`."""

    def __init__(self, app: Any, routes: Mapping[str, Route]) -> None:
        self.app = app
        self.routes = dict(routes)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        route = self.routes.get(scope.get("path", "")) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "GET")
        if method in ("GET", "HEAD"):
            answer = await route()
        else:
            answer = Answer(405, JSON, b'{"error": "only GET and HEAD are served here"}')
        headers = [
            (b"content-type", answer.content_type),
            (b"content-length", str(len(answer.body)).encode()),
            (b"cache-control", b"no-store"),
        ]
        if answer.status == 405:
            headers.append((b"allow", b"GET, HEAD"))
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        body = b"" if method == "HEAD" else answer.body
        await send({"type": "http.response.body", "body": body})
