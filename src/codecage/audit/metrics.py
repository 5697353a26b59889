"""Prometheus metrics of one server: what its runs did, how long they and their queue took,
and what the warm pool holds (`codecage serve --http` serves them at /metrics).

One `ServerMetrics` per server, with a registry of its own (not prometheus_client's global
one: two servers in one process, or a test, must not count into each other). It is fed by
`observe`, which the server adds to `Host.observers`: after each run, on the run's thread, a
few counter increments (the events are walked once). The queue's depth and the runs in
flight are read from the MCP runner's limiter, and the pool's counts from `Pool.state()`,
when Prometheus scrapes; nothing is kept between scrapes for them.

Every label value comes from a fixed set (statuses, backends, denial kinds, the operator's
profiles and upstream servers) or is cut to a bounded set: the first `MAX_TOOL_LABELS`
server.tool pairs keep their names, the rest are counted under "other". A caller cannot
grow the number of series by what it sends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from codecage.audit.record import Finished
from codecage.backends.base import BACKENDS
from codecage.models import PoolState
from codecage.models.status import STATUSES
from codecage.models.wire import BridgeErrorKind, GuestEventKind
from codecage.policy.profiles import BUILTIN_PROFILES

OTHER = "other"
"""The label value of everything outside a label's fixed or bounded set."""
MAX_TOOL_LABELS = 100
"""Distinct server.tool pairs counted under their own names; later ones are "other"."""

DENIAL_KINDS = ("import_blocked", "syscall_blocked", "network_denied", "tool_not_allowed")
"""What `codecage_denials_total` counts: the refusal events of results the host observed,
and the tool calls the allow-list refused (`tool_call` events of status `not_allowed`)."""
CLAIM_KINDS: tuple[str, ...] = GuestEventKind.__args__  # type: ignore[attr-defined]
"""What `codecage_guest_claims_total` counts: events the guest reported (it can forge them)."""

TOOL_STATUSES = ("ok", *BridgeErrorKind.__args__)  # type: ignore[attr-defined]

RUN_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
"""From a warm pool's few milliseconds to the longest timeout a server allows by default."""
QUEUE_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60)


class BoundedLabels:
    """The first `cap` distinct values keep their own label; later ones are "other".
    Thread-safe: runs end on threads of their own."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        with self._lock:
            if value in self._seen:
                return value
            if len(self._seen) >= self._cap:
                return OTHER
            self._seen.add(value)
            return value


class ServerMetrics:
    """The metrics of one server, in `registry`.

    Args:
        pool: the warm pool's state at scrape time (`Pool.state`); None: no pool.
        profiles: the operator's own profile names (the built-in ones are always known);
            a run of any other profile, or of several, counts as "combined" or "other".
        servers: the upstream servers' names; a tool call to any other is "other".
        audit: the audit trail's state at scrape time (`AuditTrail`'s `full` and
            `dropped`); None: no trail.
    """

    def __init__(
        self,
        *,
        pool: Callable[[], PoolState] | None = None,
        profiles: Iterable[str] = (),
        servers: Iterable[str] = (),
        audit: Callable[[], AuditState] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self._profiles = frozenset(BUILTIN_PROFILES) | frozenset(profiles)
        self._servers = frozenset(servers)
        self._tool_names = BoundedLabels(MAX_TOOL_LABELS)
        r = self.registry
        self._runs = self._counter(
            "codecage_runs",
            "Runs finished, by status, backend and import profile.",
            ("status", "backend", "profile"),
        )
        self._wall = Histogram(
            "codecage_run_wall_seconds",
            "Wall time of a run in its sandbox (usage.wall_ms), by backend.",
            ["backend"],
            buckets=RUN_SECONDS_BUCKETS,
            registry=r,
        )
        self._queue_wait = Histogram(
            "codecage_queue_wait_seconds",
            "Time an execute_code call waited in the server's queue for a free slot.",
            buckets=QUEUE_SECONDS_BUCKETS,
            registry=r,
        )
        self._queue_depth = Gauge(
            "codecage_queue_depth", "execute_code calls waiting for a slot now.", registry=r
        )
        self._in_flight = Gauge(
            "codecage_runs_in_flight", "execute_code calls holding a slot now.", registry=r
        )
        self._denials = self._by_kind(
            "codecage_denials",
            "Refusals during runs the host observed (its proxy, broker, judge), by kind.",
            DENIAL_KINDS,
        )
        self._claims = self._by_kind(
            "codecage_guest_claims",
            "Events the guest reported, by kind: its claims, which the code can forge or "
            "suppress (an import refused by the in-sandbox policy is one).",
            CLAIM_KINDS,
        )
        self._tool_calls = self._counter(
            "codecage_tool_calls",
            "Upstream MCP tool calls made by runs' code, by server, tool and status.",
            ("server", "tool", "status"),
        )
        self._egress_out = self._counter(
            "codecage_egress_sent_bytes", "Bytes sent through the egress proxy to allowed hosts."
        )
        self.watch_host(pool, audit)

    def _counter(self, name: str, documentation: str, labels: tuple[str, ...] = ()) -> Counter:
        """A counter in this registry."""
        return Counter(name, documentation, labels, registry=self.registry)

    def _by_kind(self, name: str, documentation: str, kinds: Iterable[str]) -> Counter:
        """A counter by `kind`, each of `kinds` there from the start: a dashboard sees
        zeros, not missing series."""
        counter = self._counter(name, documentation, ("kind",))
        for kind in kinds:
            counter.labels(kind=kind)
        return counter

    # --- feeding ------------------------------------------------------------------------------

    def watch_host(
        self,
        pool: Callable[[], PoolState] | None,
        audit: Callable[[], AuditState] | None,
    ) -> None:
        """Read the pool's and the audit trail's state at each scrape (the host is built
        after its observers, these among them: it is watched once built)."""
        if pool is not None:
            self.registry.register(PoolCollector(pool, self.profile_label))
        if audit is not None:
            self.registry.register(AuditCollector(audit))

    def watch_queue(self, waiting: Callable[[], int], in_flight: Callable[[], int]) -> None:
        """Read the queue's depth and the runs in flight from the runner's limiter when
        scraped."""
        self._queue_depth.set_function(lambda: float(waiting()))
        self._in_flight.set_function(lambda: float(in_flight()))

    def queue_waited(self, seconds: float) -> None:
        """An execute_code call got its slot after `seconds` in the queue."""
        self._queue_wait.observe(seconds)

    def observe(self, finished: Finished) -> None:
        """Count one finished run (a `Host.observers` callback)."""
        result = finished.result
        backend = result.backend if result.backend in BACKENDS else OTHER
        status = result.status if result.status in STATUSES else OTHER
        profile = self.profile_label(finished.profile)
        self._runs.labels(status=status, backend=backend, profile=profile).inc()
        self._wall.labels(backend=backend).observe(result.usage.wall_ms / 1000)
        sent = 0
        for event in result.events:
            data = event.data or {}
            if event.source != "host":  # the guest's word: counted apart, never a denial
                if event.kind in CLAIM_KINDS:
                    self._claims.labels(kind=event.kind).inc()
            elif event.kind == "tool_call":
                self._tool_call(data)
            elif event.kind in DENIAL_KINDS:
                # Past its bound, the proxy folds connections into one event with a count.
                refused = data.get("refused") if "more" in data else 1
                self._denials.labels(kind=event.kind).inc(_count(refused))
            elif event.kind == "network_allowed":
                sent += _count(data.get("bytes_out"))
        if sent:
            self._egress_out.inc(sent)

    def _tool_call(self, data: Mapping[str, Any]) -> None:
        if not data:  # the summary of calls past the run's event bound: no names, no count
            return
        server, tool, status = (str(data.get(k, "")) for k in ("server", "tool", "status"))
        if status == "not_allowed":
            self._denials.labels(kind="tool_not_allowed").inc()
        if server not in self._servers:
            server, tool = OTHER, OTHER
        elif self._tool_names(f"{server}.{tool}") == OTHER:
            tool = OTHER
        status = status if status in TOOL_STATUSES else OTHER
        self._tool_calls.labels(server=server, tool=tool, status=status).inc()

    def profile_label(self, profile: str | None) -> str:
        """A profile's label: its name when it is one the operator or codecage defines,
        "none" without an import policy, "combined" for several, else "other"."""
        if profile is None or profile == "none":  # the pool's name for no import policy
            return "none"
        if profile in self._profiles:
            return profile
        return "combined" if "," in profile else OTHER

    # --- reading ------------------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric now (reads the pool's state)."""
        return generate_latest(self.registry)


def _count(value: object) -> int:
    """A count from an event's data: a non-negative int, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


@dataclass(frozen=True, slots=True)
class AuditState:
    """What /metrics says of the audit trail: whether its store is full, and the records a
    full store dropped (a trail not required)."""

    full: bool
    dropped: int


class AuditCollector(Collector):
    """The audit trail's store, read at each scrape."""

    def __init__(self, state: Callable[[], AuditState]) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        now = self._state()
        yield GaugeMetricFamily(
            "codecage_audit_store_full",
            "1 while the audit store is at its [audit] max_mb and refuses new records.",
            value=int(now.full),
        )
        yield CounterMetricFamily(
            "codecage_audit_records_dropped",
            "Records a full audit store refused and the trail (not required) dropped.",
            value=now.dropped,
        )


_POOL_FAMILIES: tuple[tuple[str, type[GaugeMetricFamily | CounterMetricFamily], str], ...] = (
    ("idle", GaugeMetricFamily, "Warm sandboxes ready now."),
    ("starting", GaugeMetricFamily, "Warm sandboxes starting now."),
    ("target", GaugeMetricFamily, "Warm sandboxes the pool keeps ready now (min_idle..max_idle)."),
    ("hits", CounterMetricFamily, "Runs that got a warm sandbox."),
    (
        "misses",
        CounterMetricFamily,
        "Runs of a kept profile that found no warm sandbox and started cold.",
    ),
)
"""The pool's metrics by profile: (the `PoolKeyState` field, its kind, its help); each is
codecage_pool_<field>."""


class PoolCollector(Collector):
    """The warm pool's sandboxes and counters, read from `Pool.state()` at each scrape and
    summed per profile (a profile has a second key when its runs may have egress)."""

    def __init__(self, state: Callable[[], PoolState], label: Callable[[str], str]) -> None:
        self._state = state
        self._label = label

    def collect(self) -> Iterator[Metric]:
        families = {
            name: family(f"codecage_pool_{name}", documentation, labels=["profile"])
            for name, family, documentation in _POOL_FAMILIES
        }
        sums: dict[tuple[str, str], int] = {}
        for key in self._state().keys:
            profile = self._label(key.profile)
            for name in families:
                sums[name, profile] = sums.get((name, profile), 0) + getattr(key, name)
        for (name, profile), value in sorted(sums.items()):
            families[name].add_metric([profile], value)
        yield from families.values()
