"""`Sandbox.run_many` on a Ray cluster: the same items and the same results, run by one
long-lived actor per node, each holding a local Sandbox with its warm pool and fork server
(docs/scale-out.md). Needs the `ray` extra: `pip install 'codecage[ray]'`.

>>> from codecage import ray as cluster
>>> results = cluster.run_many(["1 + 1", {"code": "2 * 3", "id": "b"}], address="auto")
>>> [r.result.return_value for r in results]
[2, 6]

The decisions, in one place:
- The batch is checked on the driver before anything runs, as `Sandbox.run_many` checks
  it (`batch.prepare`): a bad item refuses the batch with a `ConfigError`.
- One actor per alive node (`NodeAffinitySchedulingStrategy`, no CPU reserved: the
  sandboxes' own cgroups bound what runs), kept for the driver process's lifetime and
  shared by its batches with the same options (another process, e.g. another reward
  worker of the same job, has actors of its own). The driver hands each actor at most `concurrency`
  items at a time (backpressure: the rest wait on the driver, never in the object store).
- Every item ends with exactly one `BatchResult`, at its index. When an actor's node goes
  away (or the actor dies or stops answering), the items the driver had not handed it are
  run elsewhere; the items it held, which may have started, are run again only when that
  is safe (its runs could not reach outside their sandbox: no tool bridge, no network;
  the batch lends no directory), otherwise each gets a `node_lost` error. An item whose
  node does not answer within its wall time and a margin gets `timed_out`, and that
  actor is replaced. No node left: the items not run get `node_lost`. Nothing waits for
  ever.
- Results are pickled whole by Ray; over Ray a result keeps no file bytes
  (`keep_files_mb` 0 unless the options set it): the files are listed, not carried.

Ray is imported here and nowhere else in codecage (the CLI imports this module only
for `--ray`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

try:
    import ray
    import ray.exceptions
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as exc:  # the extra is not installed: say how to get it
    raise ImportError(
        "codecage.ray needs Ray, which is not installed: pip install 'codecage[ray]'",
        name=exc.name,
    ) from exc

from codecage import batch, host
from codecage.errors import (
    CapacityError,
    CodecageError,
    ConfigError,
    HostError,
    RemoteRunError,
    SandboxError,
    SessionError,
)
from codecage.kept import KeptFiles
from codecage.models import FileInfo, Limits
from codecage.options import Options
from codecage.sandbox import Sandbox

log = logging.getLogger(__name__)

READY_TIMEOUT_S: Final = 180.0
"""How long a node's actor may take to start its Sandbox (self-test, pool) before the
node is left out of the batch."""
ANSWER_MARGIN_S: Final = 60.0
"""How much longer than an item's wall timeout its node may take to answer (start-up,
waiting for a pooled sandbox, carrying the result back) before the item is `timed_out`."""
TICK_S: Final = 1.0
"""How often the driver looks at deadlines and at nodes that joined while it waits."""
MAX_STARTS_PER_NODE: Final = 3
"""Actors one batch starts on one node at most (the first and two replacements)."""
REFILL_S: Final = 30.0
"""How often a server's placement looks for nodes with no actor of its own (nodes that
joined, or whose actor was replaced), besides right after it lost one."""


@dataclasses.dataclass(frozen=True, slots=True)
class NodeReport:
    """What a node's actor says of itself once its Sandbox is up."""

    node_id: str
    concurrency: int
    escapes: tuple[str, ...]
    """How its runs may reach outside their sandbox ("tools", "network"): an item such a
    run held is never run a second time."""


class NodeRunner:
    """The actor's class: a Sandbox on one node, running items on Ray's threads (one per
    item in flight; `max_concurrency` is the driver's bound plus room for `cancel`)."""

    def __init__(self, options: Options, concurrency: int) -> None:
        self._sandbox = Sandbox(options=options)
        self._concurrency = concurrency
        self._cancels: dict[int, threading.Event] = {}
        self._lock = threading.Lock()

    def ready(self) -> NodeReport:
        sandbox = self._sandbox
        escapes = []
        if sandbox.host.options.options.tools is not None:
            escapes.append("tools")
        if sandbox.host.network_for(sandbox.policy, None, sandbox.face)[0] is not None:
            escapes.append("network")
        return NodeReport(
            ray.get_runtime_context().get_node_id(), self._concurrency, tuple(escapes)
        )

    def run(self, index: int, program: batch.Program, limits: Limits) -> batch.BatchResult:
        cancel = threading.Event()
        with self._lock:
            self._cancels[index] = cancel
        try:
            # One item through the local batch: the same result, or the same error, as
            # `Sandbox.run_many` gives it (a batch of one: its index there is 0).
            item = batch.Item(0, program, limits)
            outcome = batch.run_items(self._sandbox, [item], concurrency=1, cancel=cancel)[0]
            return outcome.model_copy(update={"index": index})
        finally:
            with self._lock:
                self._cancels.pop(index, None)

    def execute(self, key: int, request: host.Request, keep_bytes: int) -> host.Placed | _Refused:
        """One run a server admitted (`ClusterRuns`): the sandbox step only (that server
        checks, scrubs and records it), the files it left kept up to `keep_bytes`. A
        refusal comes back as data, so that its class and hint survive the trip."""
        cancel = threading.Event()
        with self._lock:
            self._cancels[key] = cancel
        kept: list[KeptFiles] = []

        def read_back(workspace: Path, written: list[FileInfo]) -> None:
            if written and keep_bytes:
                kept.append(host.keep(workspace, written, keep_bytes))

        try:
            result = self._sandbox.host.execute(
                dataclasses.replace(request, hooks=host.Hooks(cancel=cancel, on_files=read_back))
            )
        except CodecageError as exc:
            return _Refused(type(exc).__name__, exc.message, exc.hint_template)
        finally:
            with self._lock:
                self._cancels.pop(key, None)
        return host.Placed(result, kept[0] if kept else None)

    def cancel(self, indices: list[int]) -> None:
        with self._lock:
            for index in indices:
                if index in self._cancels:
                    self._cancels[index].set()


@dataclasses.dataclass(frozen=True, slots=True)
class _Refused:
    """A CodecageError raised on a node, as data (an exception with a hint does not
    survive pickling whole)."""

    kind: str
    message: str
    hint: str

    def error(self) -> CodecageError:
        kinds: dict[str, type[CodecageError]] = {
            "ConfigError": ConfigError,
            "HostError": HostError,
            "SessionError": SessionError,
        }
        return kinds.get(self.kind, SandboxError)(self.message, hint=self.hint)


def run_many(
    programs: Iterable[batch.ProgramLike],
    *,
    address: str | None = None,
    concurrency: int | None = None,
    limits: Limits | Mapping[str, Any] | None = None,
    on_progress: batch.ProgressHandler | None = None,
    options: Options | None = None,
    max_queued: int = batch.DEFAULT_MAX_QUEUED,
) -> list[batch.BatchResult]:
    """Run every program once on a Ray cluster and return one `BatchResult` per program in
    input order, as `Sandbox.run_many` does on one host.

    Args:
        programs: code strings, `batch.Program`s or dicts with their keys.
        address: the cluster, as `ray.init` takes it ("auto", "ray://host:10001", ...);
            None: the one this process is connected to, else a new local one.
        concurrency: runs at once on each node, 1 to 256; None: each node's CPUs.
        limits: every program's default limits (a program's own override them).
        on_progress: called with (done, total, the BatchResult just finished), one call at
            a time, on the calling thread.
        options: the Sandbox of every node, as `Options` (its config is read here, on the
            driver, and sent to the nodes); no `tools`, `approve` or shared `pool`.
        max_queued: the most programs one batch may hold (default 100,000).

    Errors of items, by `BatchError.code`: "refused", "sandbox_error", "timed_out",
    "node_lost", "cancelled"; a program's own failure is its result.

    Raises:
        ConfigError: refused before anything ran (as `Sandbox.run_many`; or options that
            cannot go to other nodes).
        SandboxError: no node of the cluster could start a Sandbox (nothing ran).
    """
    node_options, defaults = node_options_of(options or Options(), limits)
    items = batch.prepare(programs, defaults, max_queued=max_queued)
    return run_items(
        items, node_options, address=address, concurrency=concurrency, on_progress=on_progress
    )


def node_options_of(
    options: Options, limits: Limits | Mapping[str, Any] | None = None
) -> tuple[Options, Limits]:
    """The options each node's Sandbox is made from (the driver's settings, a pool, no file
    bytes kept unless asked) and the batch's default limits.

    Raises:
        ConfigError: options that cannot go to another node, or invalid ones.
    """
    for name in ("tools", "approve"):
        if getattr(options, name) is not None:
            raise ConfigError(
                f"options.{name} cannot be sent to the nodes of a Ray cluster",
                hint=f"run the batch without {name}, or with Sandbox.run_many on one host",
            )
    if options.pool not in (None, True, False):
        raise ConfigError(
            "options.pool is a Pool of this process; each node keeps its own",
            hint="pass pool=True (or leave it unset)",
        )
    if limits is not None:
        options = dataclasses.replace(options, limits=limits)
    resolved = options.resolve()  # here: a bad config or limit is refused before any node
    keep = options.keep_files_mb if "keep_files_mb" in options.given() else 0
    shipped = dataclasses.replace(options, config=resolved.settings, pool=True, keep_files_mb=keep)
    return shipped, resolved.limits


def run_items(
    items: list[batch.Item],
    options: Options,
    *,
    address: str | None = None,
    concurrency: int | None = None,
    on_progress: batch.ProgressHandler | None = None,
) -> list[batch.BatchResult]:
    """`run_many` of items `batch.prepare` checked already, on nodes made from `options`
    (`node_options_of`): the CLI's `run-batch --ray`.

    Raises:
        ConfigError: a bad concurrency (nothing ran).
        SandboxError: no node could start a Sandbox (nothing ran).
    """
    if concurrency is not None:
        batch.check_concurrency(concurrency)
    connect(address)
    return _Dispatch(items, _Fleet(options, concurrency), on_progress).run()


def connect(address: str | None) -> None:
    """Join the cluster at `address` unless this process is in one already.

    Raises:
        ConfigError: there is no cluster at `address`.
    """
    if ray.is_initialized():
        return
    _check_reachable(address)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # never phone home by default
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(
            f"cannot join the Ray cluster at {address!r}: {exc}",
            hint="pass the address `ray start --head` printed (e.g. 10.0.0.1:6379, or "
            "auto on a node of the cluster)",
        ) from exc


CONNECT_TIMEOUT_S: Final = 5.0
"""How long a HOST:PORT address may take to accept a connection before it is refused
(Ray itself keeps trying to reach a missing head for minutes)."""


def _check_reachable(address: str | None) -> None:
    """Refuse a HOST:PORT (or ray://HOST:PORT) address where nothing accepts a connection,
    at once: `ray.init` would retry for minutes before it gave up.

    Raises:
        ConfigError: nothing listens there.
    """
    if address is None or address == "auto" or address.startswith("local"):
        return
    where = address.removeprefix("ray://")
    host_part, _, port_part = where.rpartition(":")
    if not host_part or not port_part.isdigit():
        return  # not HOST:PORT: Ray judges it
    try:
        socket.create_connection((host_part.strip("[]"), int(port_part)), CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ConfigError(
            f"cannot join the Ray cluster at {address!r}: nothing accepts a connection "
            f"there ({exc.strerror or exc})",
            hint="pass the address `ray start --head` printed (e.g. 10.0.0.1:6379, or "
            "auto on a node of the cluster), and check that the head is running",
        ) from exc


def shutdown() -> None:
    """Stop this process's codecage actors (their Sandboxes and pools); the next batch
    starts new ones. Ray stops them anyway when the driver exits."""
    for handle in list(_ACTORS.values()):
        ray.kill(handle, no_restart=True)
    _ACTORS.clear()


_ACTORS: dict[str, Any] = {}
"""This driver's actors by name, kept across batches (the long-lived part)."""


@dataclasses.dataclass(slots=True)
class _Worker:
    """One node's actor as the driver sees it."""

    name: str
    node_id: str
    handle: Any
    report: NodeReport
    held: dict[Any, int] = dataclasses.field(default_factory=dict)  # ref -> item index


class _Fleet:
    """The actors of the batch: one per alive node, started (or found) and replaced.
    `workers` changes under `guard` (a server's placement fills it on a thread of its
    own while its runs read it)."""

    def __init__(self, options: Options, concurrency: int | None) -> None:
        self._options = options
        self._concurrency = concurrency
        self._key = hashlib.sha256(pickle.dumps((options, concurrency))).hexdigest()[:12]
        self._starts: collections.Counter[str] = collections.Counter()
        self.workers: dict[str, _Worker] = {}  # by node id
        self.first_error: str | None = None
        self.guard = threading.RLock()

    def fill(self) -> None:
        """An actor on each alive node that has none, within MAX_STARTS_PER_NODE (a
        node offering Ray no CPU, as a KubeRay head usually is, runs no sandbox)."""
        while wanted := {
            node["NodeID"]: node
            for node in _nodes()
            if node.get("Alive")
            and node.get("Resources", {}).get("CPU", 0) > 0
            and node["NodeID"] not in self.workers
            and self._starts[node["NodeID"]] < MAX_STARTS_PER_NODE
        }:
            self._start_all(wanted)

    def _start_all(self, wanted: Mapping[str, Mapping[str, Any]]) -> None:
        starting = {node_id: self._start(node_id, node) for node_id, node in wanted.items()}
        for node_id, (name, handle) in starting.items():
            self._starts[node_id] += 1
            try:
                report = ray.get(handle.ready.remote(), timeout=READY_TIMEOUT_S)
            except ray.exceptions.RayError as exc:
                self.first_error = self.first_error or _reason(exc)
                log.warning("ray.node_failed", extra={"node": node_id, "error": _reason(exc)})
                self._drop(name, handle)
                continue
            with self.guard:
                self.workers[node_id] = _Worker(name, node_id, handle, report)

    def _start(self, node_id: str, node: Mapping[str, Any]) -> tuple[str, Any]:
        # Named after this driver process (a pipeline's reward workers are drivers of one
        # job each with actors of their own), the node and the options.
        driver = ray.get_runtime_context().get_worker_id()[:12]
        name = f"codecage-{driver}-{node_id[:16]}-{self._key}"
        if name in _ACTORS:
            return name, _ACTORS[name]
        cpus = max(1, int(node.get("Resources", {}).get("CPU", 1)))
        concurrency = self._concurrency or min(cpus, batch.MAX_CONCURRENCY)
        actor = ray.remote(NodeRunner).options(
            name=name,
            num_cpus=0,
            max_restarts=0,
            max_concurrency=concurrency + 2,  # `ready` and `cancel` never wait behind runs
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        handle = actor.remote(self._options, concurrency)
        _ACTORS[name] = handle
        return name, handle

    def lose(self, worker: _Worker) -> None:
        """Forget `worker` and make sure it runs nothing more of ours."""
        with self.guard:
            if self.workers.get(worker.node_id) is worker:
                del self.workers[worker.node_id]
        self._drop(worker.name, worker.handle)

    def _drop(self, name: str, handle: Any) -> None:
        _ACTORS.pop(name, None)
        try:
            ray.kill(handle, no_restart=True)
        except Exception as exc:  # gone already with its node: nothing left to stop
            log.debug("ray.kill_failed", extra={"error": type(exc).__name__})


class _Dispatch:
    """The items of one batch: waiting on the driver, held by a worker, or finished."""

    def __init__(
        self,
        items: list[batch.Item],
        fleet: _Fleet,
        on_progress: batch.ProgressHandler | None,
    ) -> None:
        self._items = items
        self._fleet = fleet
        self._waiting: collections.deque[int] = collections.deque(range(len(items)))
        self._deadlines: dict[Any, float] = {}  # ref -> monotonic deadline
        self._results: list[batch.BatchResult | None] = [None] * len(items)
        self._on_progress = on_progress
        self._done = 0

    def run(self) -> list[batch.BatchResult]:
        if not self._items:
            return []
        self._fleet.fill()
        if not self._fleet.workers:
            raise SandboxError(
                "no node of the Ray cluster could start a sandbox; nothing was run: "
                f"{self._fleet.first_error or 'no alive node of the cluster offers Ray a CPU'}",
                hint="run `codecage doctor` on a node: each needs codecage, bwrap and root "
                "or user namespaces (docs/scale-out.md)",
            )
        try:
            while self._done < len(self._items):
                self._step()
        except BaseException:  # Ctrl-C or a bug: stop what runs, leave nothing behind
            self._cancel_all()
            raise
        return [r for r in self._results if r is not None]

    def _step(self) -> None:
        self._hand_out()
        held = [ref for worker in self._fleet.workers.values() for ref in worker.held]
        if not held:
            if self._waiting:  # no worker left: a node may have joined; else give up
                self._fleet.fill()
                if not self._fleet.workers:
                    self._lose_waiting()
            return
        ready, rest = ray.wait(held, num_returns=1, timeout=TICK_S)
        if ready and rest:  # and whatever else is done by now, without waiting for it
            ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        for ref in ready:
            self._collect(ref)
        self._check_deadlines()

    def _hand_out(self) -> None:
        for worker in list(self._fleet.workers.values()):
            while self._waiting and len(worker.held) < worker.report.concurrency:
                index = self._waiting.popleft()
                item = self._items[index]
                ref = worker.handle.run.remote(index, item.program, item.limits)
                worker.held[ref] = index
                self._deadlines[ref] = time.monotonic() + item.limits.timeout + ANSWER_MARGIN_S

    def _collect(self, ref: Any) -> None:
        worker = self._holder(ref)
        if worker is None:  # its worker was lost meanwhile and the item dealt with
            return
        try:
            outcome: batch.BatchResult = ray.get(ref)
        except ray.exceptions.RayActorError as exc:  # the actor or its node is gone
            self._lose(worker, _reason(exc))
            return
        except ray.exceptions.RayTaskError as exc:
            # The actor's own code failed for this item (a bug, not the program's fault).
            index = worker.held.pop(ref)
            self._deadlines.pop(ref, None)
            self._finish(self._error(index, "sandbox_error", _reason(exc)))
            return
        except ray.exceptions.RayError as exc:  # its node is gone (object or owner lost)
            self._lose(worker, _reason(exc))
            return
        index = worker.held.pop(ref)
        self._deadlines.pop(ref, None)
        if outcome.index != index:  # the driver's own record decides, never the answer
            outcome = outcome.model_copy(update={"index": index})
        self._finish(outcome)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for worker in list(self._fleet.workers.values()):
            late = [ref for ref in worker.held if self._deadlines[ref] < now]
            if not late:
                continue
            for ref in late:
                index = worker.held.pop(ref)
                self._deadlines.pop(ref)
                waited = self._items[index].limits.timeout + ANSWER_MARGIN_S
                self._finish(
                    self._error(
                        index,
                        "timed_out",
                        f"its node ({worker.node_id[:12]}) did not answer within {waited:.0f} s "
                        "(the wall timeout and a margin); that node's actor was replaced",
                    )
                )
            self._lose(worker, "it stopped answering")

    def _lose(self, worker: _Worker, why: str) -> None:
        """`worker` is gone: what it held runs again if that is safe, else `node_lost`."""
        self._fleet.lose(worker)
        held = sorted(worker.held.items(), key=lambda pair: pair[1])
        log.warning(
            "ray.node_lost", extra={"node": worker.node_id, "held": len(held), "error": why}
        )
        for ref, index in reversed(held):  # back to the front of the queue, in order
            self._deadlines.pop(ref, None)
            if worker.report.escapes:
                self._finish(
                    self._error(
                        index,
                        "node_lost",
                        f"its node ({worker.node_id[:12]}) was lost while it may have been "
                        f"running ({why}); it was not run again because its runs could "
                        f"reach outside the sandbox ({', '.join(worker.report.escapes)})",
                    )
                )
            else:
                log.info("ray.item_rerun", extra={"index": index, "node": worker.node_id})
                self._waiting.appendleft(index)
        worker.held.clear()

    def _lose_waiting(self) -> None:
        while self._waiting:
            index = self._waiting.popleft()
            self._finish(
                self._error(index, "node_lost", "no node of the cluster was left to run it")
            )

    def _holder(self, ref: Any) -> _Worker | None:
        for worker in self._fleet.workers.values():
            if ref in worker.held:
                return worker
        return None

    def _error(self, index: int, code: batch.ErrorCode, message: str) -> batch.BatchResult:
        hints = {
            "node_lost": "run the item again (in a new batch); a node was removed or died",
            "timed_out": "run the item again; if it recurs, check the node's load and "
            "`codecage doctor` on it",
            "sandbox_error": "run the item again; if it recurs, report it with the message",
        }
        error = batch.BatchError(
            type="NodeLost" if code == "node_lost" else "SandboxError",
            message=message,
            hint=hints.get(code),
            code=code,
        )
        item = self._items[index]
        return batch.BatchResult(index=index, id=item.program.id, result=None, error=error)

    def _finish(self, outcome: batch.BatchResult) -> None:
        if self._results[outcome.index] is not None:  # never two outcomes for one item
            log.error("ray.duplicate_dropped", extra={"index": outcome.index})
            return
        self._results[outcome.index] = outcome
        self._done += 1
        if self._on_progress is None:
            return
        try:
            self._on_progress(self._done, len(self._items), outcome)
        except Exception as exc:  # the caller's code: it stops hearing, the batch goes on
            log.warning("ray.on_progress_failed", extra={"error": type(exc).__name__})
            self._on_progress = None

    def _cancel_all(self) -> None:
        for worker in list(self._fleet.workers.values()):
            if worker.held:
                try:
                    worker.handle.cancel.remote(list(worker.held.values()))
                except Exception as exc:  # its node is gone: nothing runs there
                    log.debug("ray.cancel_failed", extra={"error": type(exc).__name__})


class ClusterRuns:
    """`codecage serve --ray`'s placement (`host.Placement`): each run a server admitted is
    sent to one of this process's actors (one per node, as `run_many`'s: a Sandbox with
    its warm pool and fork server), at most `concurrency` in flight on each.

    - Admission stays explicit: a run that finds every actor full is refused at once
      (`CapacityError`: the server answers 503 with Retry-After), never queued here.
    - Runs go round-robin to the least loaded actors; the result names its node.
    - A run whose node is lost before it answered (removed, died, its actor killed) runs
      again on another node when that is safe (no network: it could not reach outside its
      sandbox; admitted already, it waits for room there within its wall time and
      ANSWER_MARGIN_S), else it fails with `RemoteRunError("node_lost")`. A node that does not
      answer within the run's wall time and ANSWER_MARGIN_S fails it `timed_out`, and its
      actor is replaced. No node left: `node_lost` at once. Nothing waits for ever.
    - A thread looks for nodes without an actor every REFILL_S seconds and right after a
      loss (nodes that joined, nodes whose actor was replaced).
    """

    def __init__(self, options: Options, *, address: str | None, concurrency: int | None) -> None:
        """Join the cluster and start an actor on each node now, so that a bad address or
        a cluster where no node can run a sandbox is refused before the server listens.

        Args:
            options: each node's Sandbox (`node_options_of`; no tools, no approver).
            address: as `ray.init` takes it.
            concurrency: runs at once on each node, 1 to 256; None: each node's CPUs.

        Raises:
            ConfigError: no cluster at `address`, or a bad concurrency.
            SandboxError: no node of the cluster could start a Sandbox.
        """
        if concurrency is not None:
            batch.check_concurrency(concurrency)
        connect(address)
        self._fleet = _Fleet(options, concurrency)
        self._keys = itertools.count()
        self._turn = 0
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._fleet.fill()
        if not self._fleet.workers:
            raise SandboxError(
                "no node of the Ray cluster could start a sandbox: "
                f"{self._fleet.first_error or 'no alive node of the cluster offers Ray a CPU'}",
                hint="run `codecage doctor` on a node: each needs codecage, bwrap and root "
                "or user namespaces (docs/scale-out.md)",
            )
        self._refiller = threading.Thread(target=self._refill, name="codecage-ray", daemon=True)
        self._refiller.start()

    @property
    def capacity(self) -> int:
        """Runs the cluster's actors may hold at once now, all nodes together."""
        with self._fleet.guard:
            return sum(w.report.concurrency for w in self._fleet.workers.values())

    @property
    def nodes(self) -> list[str]:
        """The ids of the nodes with an actor of this placement now."""
        with self._fleet.guard:
            return sorted(self._fleet.workers)

    def run(self, request: host.Request, keep_bytes: int) -> host.Placed:
        """`host.Placement.run` (see the class).

        Raises:
            CapacityError: every actor holds as many runs as it may.
            RemoteRunError: node_lost, timed_out or sandbox_error.
            CodecageError: the node refused the run, as this host would have.
        """
        # What goes to the node: no callables of this process (hooks, the approver).
        shipped = dataclasses.replace(
            request, hooks=host.Hooks(), asker=dataclasses.replace(request.asker, approve=None)
        )
        lost: list[str] = []
        while True:
            worker, key = (
                self._take_again(lost, shipped.limits.timeout) if lost else self._take(lost)
            )
            try:
                answer = self._answer(worker, key, shipped, keep_bytes, request.hooks.cancel)
            except _NodeLost as exc:
                lost.append(worker.node_id)
                if request.egress is not None:
                    raise RemoteRunError(
                        "node_lost",
                        f"its node ({worker.node_id[:12]}) was lost while the run may have "
                        f"been running ({exc}); it was not run again because it could reach "
                        "the network",
                        hint="send it again if its side effects allow; a node of the Ray "
                        "cluster was removed or died",
                    ) from None
                log.info("ray.item_rerun", extra={"key": key, "node": worker.node_id})
                continue
            finally:
                with self._fleet.guard:
                    worker.held.pop(key, None)
            if isinstance(answer, _Refused):
                raise answer.error()
            result = answer.result.model_copy(update={"node": worker.node_id})
            return host.Placed(result, answer.kept)

    def _take(self, lost: list[str]) -> tuple[_Worker, int]:
        """The actor the next run goes to, with its place held (`lost`: nodes this run was
        lost on already: never again).

        Raises:
            RemoteRunError: no node is left (node_lost).
            CapacityError: every actor is full.
        """
        with self._fleet.guard:
            workers = [w for w in self._fleet.workers.values() if w.node_id not in lost]
            if not workers:
                self._wake.set()
                raise RemoteRunError(
                    "node_lost",
                    "no node of the Ray cluster is left to run it"
                    + (" (the node it was running on was lost)" if lost else ""),
                    hint="send it again once the cluster has nodes; `ray status` lists them",
                )
            room = [w for w in workers if len(w.held) < w.report.concurrency]
            if not room:
                total = sum(w.report.concurrency for w in workers)
                raise CapacityError(
                    f"every node of the Ray cluster is running as many runs as it may "
                    f"({total} in all)",
                    hint=f"send it again after Retry-After; to have the server queue runs "
                    f"instead, serve with --max-concurrent {total} or less, or add nodes",
                )
            self._turn += 1
            start = self._turn % len(room)
            worker = min(room[start:] + room[:start], key=lambda w: len(w.held))
            key = next(self._keys)
            worker.held[key] = key
            return worker, key

    def _take_again(self, lost: list[str], timeout_s: float) -> tuple[_Worker, int]:
        """`_take` for a run whose node was lost: it was admitted already, so it waits for
        room (within its wall time and ANSWER_MARGIN_S) rather than be refused as busy.

        Raises:
            RemoteRunError: no node left, or none had room in time (node_lost).
        """
        waited = timeout_s + ANSWER_MARGIN_S
        deadline = time.monotonic() + waited
        while True:
            try:
                return self._take(lost)
            except CapacityError:
                if time.monotonic() > deadline:
                    raise RemoteRunError(
                        "node_lost",
                        "its node was lost while it ran, and no other node had room to run "
                        f"it again within {waited:.0f} s",
                        hint="send it again; a node of the Ray cluster was removed or died",
                    ) from None
                time.sleep(TICK_S / 4)

    def _answer(
        self,
        worker: _Worker,
        key: int,
        shipped: host.Request,
        keep_bytes: int,
        cancel: threading.Event | None,
    ) -> host.Placed | _Refused:
        """The node's answer, waited for within the run's wall time and a margin.

        Raises:
            _NodeLost: the actor or its node went away before it answered.
            RemoteRunError: timed_out, or sandbox_error (the actor's own code failed).
        """
        ref = worker.handle.execute.remote(key, shipped, keep_bytes)
        waited = shipped.limits.timeout + ANSWER_MARGIN_S
        deadline = time.monotonic() + waited
        stopping = False
        while not ray.wait([ref], timeout=TICK_S)[0]:
            if cancel is not None and cancel.is_set() and not stopping:
                stopping = True  # its caller went away: the node kills its sandbox
                worker.handle.cancel.remote([key])
            if time.monotonic() > deadline:
                self._lose(worker, "it stopped answering")
                raise RemoteRunError(
                    "timed_out",
                    f"its node ({worker.node_id[:12]}) did not answer within {waited:.0f} s "
                    "(the run's wall timeout and a margin); that node's actor was replaced",
                    hint="send it again; if it recurs, check the node's load and "
                    "`codecage doctor` on it",
                )
        try:
            answer: host.Placed | _Refused = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            self._lose(worker, _reason(exc))
            raise _NodeLost(_reason(exc)) from None
        except ray.exceptions.RayTaskError as exc:
            raise RemoteRunError(
                "sandbox_error",
                f"its node ({worker.node_id[:12]}) failed to run it: {_reason(exc)}",
                hint="send it again; if it recurs, report it with the message",
            ) from None
        except ray.exceptions.RayError as exc:  # its node is gone (object or owner lost)
            self._lose(worker, _reason(exc))
            raise _NodeLost(_reason(exc)) from None
        return answer

    def _lose(self, worker: _Worker, why: str) -> None:
        log.warning("ray.node_lost", extra={"node": worker.node_id, "error": why})
        self._fleet.lose(worker)
        self._wake.set()  # a new actor there if the node is still alive; others meanwhile

    def _refill(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(REFILL_S)
            self._wake.clear()
            if self._closed.is_set():
                return
            try:
                self._fleet.fill()
            except Exception as exc:  # the cluster is unreachable now: try again later
                log.warning("ray.refill_failed", extra={"error": type(exc).__name__})

    def close(self) -> None:
        """Stop the refilling thread and this placement's actors."""
        self._closed.set()
        self._wake.set()
        with self._fleet.guard:
            workers = list(self._fleet.workers.values())
        for worker in workers:
            self._fleet.lose(worker)


class _NodeLost(Exception):
    """A run's actor or node went away before it answered (why: the text)."""


def _nodes() -> list[dict[str, Any]]:
    """The cluster's nodes as Ray lists them (dead ones too: "Alive" says)."""
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]  # Ray's own
    return nodes


def _reason(exc: BaseException) -> str:
    """The first line of a Ray error, which is what happened (the rest is its trace)."""
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
