"""The fork server: sandboxes forked from a warm template instead of started anew.

A sandbox started anew pays bubblewrap, a new interpreter and the profile's imports (~20-40
ms of CPU). A template pays them once: a bwrap sandbox like any other whose guest, after its
imports, serves "fork" requests (guest/template.py). Each request makes a sandbox with
namespaces of its own (pid, mount, ipc, uts, net, and a user namespace), its own workspace
tmpfs (mounted here, handed over as a detached mount), /tmp and /proc, the run's cgroup
(init is moved into it before it makes anything), no capability and the same seccomp
filter as a bwrap sandbox. The host then runs it exactly as any started sandbox
(`engine.run_in`, `judge`): the same request, result, events, scrubbing and tool bridge.

What is forked: sandboxes of a fresh workspace and no network (`eligible`). A lent
workspace directory, a run allowed egress and other backends start anew, as before.
Templates are per `SandboxSpec`, started at the first sandbox of their spec, and replaced
when one dies (after `_MAX_FAILURES` failures in a row, that spec starts anew until a
back-off has passed: an outage of the backend does not turn the fork server off for good).

Recycled: every sandbox forked from one template shares its memory layout (ASLR) and its
hash seed, so a template is retired after `max_runs` forks or `max_age_s` seconds
(`[pool] template_max_runs`, `template_max_age`). Its replacement starts in the background
and the worn template keeps serving until the new one is ready (a run never waits for a
template while one is still serving); once retired it forks nothing more and is stopped
(on the starter thread) when the last sandbox forked from it is gone, since those die
with it.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import queue
import select
import signal
import socket
import struct
import subprocess
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import IO, Any, TypeVar

from codecage import forks
from codecage.backends.base import Backend, ExitStatus, SandboxProcess
from codecage.engine import launch, owner
from codecage.engine.launch import template_ids
from codecage.engine.memory import sandbox_memory
from codecage.engine.plan import SandboxSpec
from codecage.engine.run import StartedSandbox, start, wait_ready
from codecage.errors import SandboxError
from codecage.guest import template as guest_template
from codecage.isolation import cgroups, rlimits, rootfs, tmpfs
from codecage.isolation import identity as identities
from codecage.isolation.cgroups import CgroupHandle
from codecage.isolation.identity import Identity
from codecage.models import Limits
from codecage.models.settings import PoolConfig
from codecage.policy.profiles import preload_for

log = logging.getLogger(__name__)
_T = TypeVar("_T")

TEMPLATE_READY_TIMEOUT_S = 60.0
DEFAULT_TEMPLATE_MAX_RUNS: int = PoolConfig.model_fields["template_max_runs"].default
DEFAULT_TEMPLATE_MAX_AGE_S: float = PoolConfig.model_fields["template_max_age"].default
HELLO_TIMEOUT_S = 10.0  # a fork request answered by nothing (a template that is stuck)
_MAX_FAILURES = 3
_RETRY_AFTER_S = 0.25  # after _MAX_FAILURES, the next try waits this, doubling per failure
_MAX_RETRY_AFTER_S = 5.0  # ...up to this: a template start that fails costs ~20 ms of CPU
_TEMPLATE_PROCESSES = 64  # the template, and inits between their fork and their cgroup move
_INIT_EXIT_WAIT_S = 5.0

_OPEN_TREE_CLONE = 1
_OPEN_TREE_CLOEXEC = os.O_CLOEXEC
_AT_FDCWD = -100
_SYS_OPEN_TREE = 428  # the same number on every architecture (the generic table)
_libc = ctypes.CDLL(None, use_errno=True)


_LIVE: weakref.WeakSet[Templates] = weakref.WeakSet()


def stop_all() -> None:
    """Stop the templates of every `Templates` of this process (each starts new ones at
    its next sandbox): for a test's leak check, which counts a template as something a
    module's runs left."""
    for templates in list(_LIVE):
        templates.stop()


def supported(backend: Backend) -> str | None:
    """Why `backend` cannot fork sandboxes here, for a person; None when it can."""
    if not backend.forks_templates:
        return f"the {backend.name} backend starts every sandbox anew (no fork server)"
    if not tmpfs.can_mount_tmpfs():
        return "codecage cannot mount tmpfs workspaces here (it is not root)"
    if cgroups.why_unavailable() is not None:
        return "no per-run cgroup can be made here (each forked run needs its pids cgroup)"
    return None


def eligible(spec: SandboxSpec) -> bool:
    """Whether sandboxes of `spec` are forked: no network (the relay needs a loopback of
    its own, made by bwrap)."""
    return spec.egress is None


class Templates:
    """One template per spec, started at the first sandbox of that spec; `fork` makes a
    sandbox from it. Thread-safe; closed with the host (and never used by a forked child
    of this process)."""

    def __init__(
        self,
        backend: Backend,
        limits: Limits,
        *,
        max_runs: int = DEFAULT_TEMPLATE_MAX_RUNS,
        max_age_s: float = DEFAULT_TEMPLATE_MAX_AGE_S,
        prefork: bool = False,
    ) -> None:
        self.backend = backend
        self._limits = limits
        self._max_runs = max_runs
        self._max_age_s = max_age_s
        self._lock = threading.Lock()
        self._templates: dict[SandboxSpec, _Template] = {}
        self._replacements: dict[SandboxSpec, Future[_Template]] = {}
        self._replace_after: dict[SandboxSpec, float] = {}  # monotonic: after a failed start
        self._retired: list[_Template] = []  # forking nothing; stopped once drained
        self._failures: dict[SandboxSpec, int] = {}
        self._paused_until: dict[SandboxSpec, float] = {}  # monotonic; see _record_failure
        self._process = forks.ForkGuard()
        self._closed = False
        # bwrap's --die-with-parent is tied to the thread that started it: templates are
        # started by a thread of their own, which lives as long as this object (a caller's
        # thread, e.g. a ThreadPoolExecutor's, may end and take the template with it).
        self._starter: _StarterThread | None = None  # made with the first template
        # Prefork (`[pool] prefork`): one sandbox per spec forked ahead, after a run of that
        # spec, by the keeper thread, which also destroys the used ones off the caller's path.
        self.prefork = prefork
        self._spares: dict[SandboxSpec, StartedSandbox] = {}
        self._refilling: set[SandboxSpec] = set()  # a spare of it is due on the keeper
        self._keeper: _Keeper | None = None  # made at the first release
        self._generation = 0  # bumped by `stop` and `_retire`: a spare forked before is not kept
        self.forked = 0  # sandboxes made, for `info` and the benchmarks
        self.spares_taken = 0  # runs that found their sandbox forked ahead
        forks.close_at_exit(self)
        _LIVE.add(self)

    def fork(self, spec: SandboxSpec, limits: Limits) -> StartedSandbox | None:
        """A sandbox of `spec` forked from its template, its cgroup set to `limits`; None
        when `spec` is not forked (the caller starts one anew).

        Raises:
            SandboxError: the template could not fork it (the template is replaced).
        """
        if not eligible(spec) or not self._process.owned_here():
            return None
        spare = self._take_spare(spec, limits)
        if spare is not None:
            return spare
        # A cold run's spec names no modules to preload; its template preloads the
        # profile's all the same (the point of a template), and serves both.
        served = (
            spec if spec.preload else dataclasses.replace(spec, preload=preload_for(spec.policy))
        )
        for _ in range(2):  # a template retired between the two steps: its replacement
            template = self._template_for(served)
            if template is None:
                return None
            try:
                sandbox = template.fork(spec, limits, on_drained=self._drained)
            except _Retired:
                continue
            except SandboxError:
                self._failed(template)
                raise
            self.forked += 1
            return sandbox
        return None

    def _take_spare(self, spec: SandboxSpec, limits: Limits) -> StartedSandbox | None:
        """The sandbox of `spec` forked ahead, its cgroup set to `limits`; None when there
        is none alive, or its cgroup cannot take them (it is then destroyed)."""
        with self._lock:
            spare = self._spares.pop(spec, None)
        if spare is None:
            return None
        if spare.alive() and _limits_applied(spare, limits):
            with self._lock:
                self.spares_taken += 1
            return spare
        self.release(spare)
        return None

    def release(self, sandbox: StartedSandbox) -> bool:
        """Take back a used sandbox forked here: the keeper thread destroys it `HOLD_OFF_S`
        later (its teardown does not delay the answer of the run that used it) and then,
        with prefork, forks the next sandbox of its spec. False when it was not forked
        here (started anew: the caller destroys it)."""
        if sandbox.plan is not None or not self._process.owned_here():
            return False
        spec = sandbox.spec
        with self._lock:
            keeper = None
            if not self._closed:
                if self._keeper is None:
                    self._keeper = _Keeper()
                keeper = self._keeper
            refill = keeper is not None and self.prefork and eligible(spec)
            refill = refill and spec not in self._spares and spec not in self._refilling
            if refill:
                self._refilling.add(spec)
        if keeper is None or not keeper.destroy(sandbox):
            sandbox.destroy()
        if refill and (keeper is None or not keeper.refill(lambda: self._prepare_spare(spec))):
            with self._lock:
                self._refilling.discard(spec)
        return True

    def _prepare_spare(self, spec: SandboxSpec) -> None:
        """Fork a sandbox of `spec` now and keep it for the next run of that spec (on the
        keeper thread); nothing when one is kept already or the templates stopped."""
        try:
            self._fork_spare(spec)
        finally:
            with self._lock:
                self._refilling.discard(spec)

    def _fork_spare(self, spec: SandboxSpec) -> None:
        with self._lock:
            if self._closed or spec in self._spares:
                return
            generation = self._generation
        served = (
            spec if spec.preload else dataclasses.replace(spec, preload=preload_for(spec.policy))
        )
        template = self._template_for(served)
        if template is None:
            return
        try:
            sandbox = template.fork(spec, self._limits, on_drained=self._drained)
        except _Retired:
            return
        except SandboxError as exc:
            self._failed(template)
            log.info("forkserver.prefork_failed", extra={"error": str(exc)})
            return
        try:
            wait_ready(sandbox, HELLO_TIMEOUT_S)  # its baseline: a run counts its own use
        except BaseException:
            sandbox.destroy()
            raise
        self.forked += 1
        with self._lock:
            kept = not self._closed and self._generation == generation
            kept = kept and spec not in self._spares
            if kept:
                self._spares[spec] = sandbox
        if not kept:
            sandbox.destroy()

    def spares(self) -> int:
        """How many sandboxes are forked ahead now (for `info`)."""
        with self._lock:
            return len(self._spares)

    def _template_for(self, spec: SandboxSpec) -> _Template | None:
        with self._lock:
            if self._closed or time.monotonic() < self._paused_until.get(spec, 0.0):
                return None
            template = self._templates.get(spec)
            if template is not None and template.sandbox.alive():
                if template.worn(self._max_runs, self._max_age_s):
                    return self._recycled(spec, template)
                return template
            if template is not None:
                self._templates.pop(spec).close()
            ready = self._replacements.get(spec)
            if ready is not None and ready.done() and ready.exception() is None:
                # A replacement of a template that died meanwhile: it serves now.
                del self._replacements[spec]
                self._templates[spec] = template = ready.result()
                return template
            if self._starter is None:
                self._starter = _StarterThread()
            try:
                template = self._starter.call(
                    lambda: _Template.start(spec, self._limits, self.backend)
                )
            except SandboxError as exc:
                self._record_failure(spec)
                log.warning("forkserver.template_failed", extra={"error": str(exc)})
                return None
            self._failures[spec] = 0
            self._paused_until.pop(spec, None)
            self._templates[spec] = template
            return template

    def _recycled(self, spec: SandboxSpec, worn: _Template) -> _Template:
        """`worn`'s replacement if it is ready (`worn` is then retired), else `worn` while
        its replacement starts in the background; the lock is held."""
        pending = self._replacements.get(spec)
        if pending is None:
            if time.monotonic() >= self._replace_after.get(spec, 0.0):
                if self._starter is None:
                    self._starter = _StarterThread()
                self._replacements[spec] = self._starter.submit(
                    lambda: _Template.start(spec, self._limits, self.backend)
                )
            return worn
        if not pending.done():
            return worn
        del self._replacements[spec]
        try:
            fresh = pending.result()
        except SandboxError as exc:
            log.warning("forkserver.replacement_failed", extra={"error": str(exc)})
            self._replace_after[spec] = time.monotonic() + _MAX_RETRY_AFTER_S
            return worn
        if self._closed:
            self._retire(fresh)
            return worn
        self._templates[spec] = fresh
        self._retire(worn)
        log.info("forkserver.template_recycled", extra={"runs": worn.runs})
        return fresh

    def _retire(self, template: _Template) -> None:
        """Fork nothing more from `template`; stop it once no sandbox of it is left (now,
        if none is); the lock is held."""
        with template.lock:
            template.retired = True
            drained = template.live == 0
        # A sandbox forked ahead (prefork) would keep a retired template alive until a run
        # took it, and that run would still share the old seed: every spare goes (destroyed
        # off the caller's path), one being forked now is not kept (the generation), and
        # the next run's refill forks from the replacement.
        self._generation += 1
        stale, self._spares = list(self._spares.values()), {}
        for spare in stale:
            self._stop_later_sandbox(spare)
        if drained:
            self._stop_later(template)
        else:
            self._retired.append(template)

    def _drained(self, template: _Template) -> None:
        """The last sandbox forked from the retired `template` is gone: stop it."""
        with self._lock:
            if template in self._retired:
                self._retired.remove(template)
                self._stop_later(template)

    def _stop_later_sandbox(self, sandbox: StartedSandbox) -> None:
        """Destroy `sandbox` on the starter thread, off the caller's path; the lock is held."""
        if self._starter is None:
            self._starter = _StarterThread()
        self._starter.submit(sandbox.destroy)

    def _stop_later(self, template: _Template) -> None:
        """Stop `template` on the starter thread, off the caller's path; the lock is held."""
        if self._starter is None:
            self._starter = _StarterThread()
        self._starter.submit(template.close)

    def _failed(self, template: _Template) -> None:
        spec = template.sandbox.spec
        with self._lock:
            if self._templates.get(spec) is template:
                self._templates.pop(spec).close()
                self._record_failure(spec)

    def _record_failure(self, spec: SandboxSpec) -> None:
        """Count a failure of `spec`'s template; the lock is held. From `_MAX_FAILURES` in a
        row, `spec` starts anew for a back-off that doubles with each failure after."""
        failures = self._failures[spec] = self._failures.get(spec, 0) + 1
        if failures >= _MAX_FAILURES:
            wait = min(_MAX_RETRY_AFTER_S, _RETRY_AFTER_S * 2 ** (failures - _MAX_FAILURES))
            self._paused_until[spec] = time.monotonic() + wait

    def memory(self) -> dict[str, tuple[float | None, float | None]]:
        """RSS and PSS (MB) of each template's processes (bwrap's and the template's), by
        profile."""
        with self._lock:
            return {
                (spec.policy.profile if spec.policy else "none"): sandbox_memory(
                    t.sandbox.proc.pid, t.sandbox.cgroup
                )
                for spec, t in self._templates.items()
            }

    def stop(self) -> None:
        """Stop every template now (the sandboxes forked from them die with them); the
        next sandbox of a spec starts a new one."""
        if not self._process.owned_here():
            return
        with self._lock:
            keeper, self._keeper = self._keeper, None
            self._generation += 1
        if keeper is not None:  # the used sandboxes it holds destroyed now; no refill
            keeper.close()
        with self._lock:
            spares, self._spares = list(self._spares.values()), {}
            self._refilling.clear()  # the keeper dropped them
        for spare in spares:
            spare.destroy()
        with self._lock:
            templates, self._templates = list(self._templates.values()), {}
            templates += self._retired
            self._retired = []
            pending, self._replacements = list(self._replacements.values()), {}
            starter, self._starter = self._starter, None
        if starter is not None:  # its queued starts and stops done first; then it may end
            starter.close()
        for future in pending:
            with contextlib.suppress(BaseException):
                templates.append(future.result(timeout=0))
        for template in templates:
            template.close()

    def close(self) -> None:
        """Stop every template, and fork nothing more."""
        with self._lock:
            self._closed = True
        self.stop()


class _StarterThread:
    """One long-lived thread that runs the calls given to `call` (template starts), one at
    a time, and hands back their result or exception."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._serve, name="codecage-templates", daemon=True)
        self._thread.start()

    def call(self, function: Callable[[], _T]) -> _T:
        return self.submit(function).result()

    def submit(self, function: Callable[[], _T]) -> Future[_T]:
        """Run `function` after the calls given so far; its result comes in the future."""
        done: Future[_T] = Future()
        self._calls.put((function, done))
        return done

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            function, done = item
            try:
                done.set_result(function())
            except BaseException as exc:
                done.set_exception(exc)

    def close(self) -> None:
        """End the thread once the calls given so far are done; wait for it (a template
        start it is running takes up to TEMPLATE_READY_TIMEOUT_S)."""
        self._calls.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=TEMPLATE_READY_TIMEOUT_S + 5)


HOLD_OFF_S = 0.005
"""How long after a run the next sandbox is forked and the used one destroyed: both compete
for the CPUs (and the GIL) with that run's answer to its caller, which is a few hundred us
of the host's work from there. (A fork then takes ~20 ms, most of it the kernel's cgroup v1
attach, with the GIL released.)"""
_KEEPER_MAX_HELD = 16


class _Keeper:
    """One thread that destroys used forked sandboxes, each `HOLD_OFF_S` after its run,
    and then forks the spares that prefork asks for. It holds at most `_KEEPER_MAX_HELD`
    used ones (past that, the releaser destroys its own: runs faster than one thread
    tears sandboxes down keep what waits bounded); `close` destroys those it holds at
    once and drops the refills: nothing is forked after it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._used: collections.deque[tuple[float, StartedSandbox]] = collections.deque()
        self._refills: collections.deque[tuple[float, Callable[[], None]]] = collections.deque()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="codecage-keeper", daemon=True)
        self._thread.start()

    def destroy(self, sandbox: StartedSandbox) -> bool:
        """Destroy `sandbox` `HOLD_OFF_S` from now; False when closed or full (the caller
        destroys it)."""
        with self._cond:
            if self._closed or len(self._used) >= _KEEPER_MAX_HELD:
                return False
            self._used.append((time.monotonic() + HOLD_OFF_S, sandbox))
            self._cond.notify()
        return True

    def refill(self, prepare: Callable[[], None]) -> bool:
        """Call `prepare` `HOLD_OFF_S` from now, once the used sandboxes due by then are
        destroyed; False once closed."""
        with self._cond:
            if self._closed:
                return False
            self._refills.append((time.monotonic() + HOLD_OFF_S, prepare))
            self._cond.notify()
        return True

    def _next(self) -> StartedSandbox | Callable[[], None] | None:
        """The next due work, destroys first; None once closed and every used one is gone."""
        with self._cond:
            while True:
                now = time.monotonic()
                if self._used and (self._closed or self._used[0][0] <= now):
                    return self._used.popleft()[1]
                if self._closed:
                    return None
                if self._refills and self._refills[0][0] <= now:
                    return self._refills.popleft()[1]
                due = [queue[0][0] for queue in (self._used, self._refills) if queue]
                self._cond.wait(min(due) - now if due else None)

    def _serve(self) -> None:
        while (item := self._next()) is not None:
            try:
                if isinstance(item, StartedSandbox):
                    item.destroy()
                else:
                    item()
            except Exception:
                log.exception("forkserver.keeper_failed")

    def close(self) -> None:
        """Destroy the used sandboxes held, drop the refills; wait for the thread."""
        with self._cond:
            self._closed = True
            self._refills.clear()
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()


def _limits_applied(sandbox: StartedSandbox, limits: Limits) -> bool:
    """Set a sandbox forked ahead to a run's `limits` (its cgroup was made with the host's
    defaults); False when its cgroup cannot take them (e.g. a memory limit below what it
    uses already)."""
    if limits == sandbox.cgroup_limits or sandbox.cgroup is None:
        return True
    try:
        cgroups.set_limits(sandbox.cgroup, limits, previous=sandbox.cgroup_limits)
    except OSError as exc:
        log.info("forkserver.spare_refused_limits", extra={"error": str(exc)})
        return False
    sandbox.cgroup_limits = limits
    return True


class _Retired(SandboxError):
    """The template asked to fork was retired meanwhile: its replacement serves."""


@dataclass(slots=True)
class _Template:
    sandbox: StartedSandbox
    lock: threading.Lock = field(default_factory=threading.Lock)
    started_at: float = field(default_factory=time.monotonic)
    runs: int = 0  # sandboxes forked from it
    live: int = 0  # of which not yet destroyed (they die with it)
    retired: bool = False  # replaced: forks nothing more, stopped once `live` is 0

    # The range its user namespace maps (host base + k is 1000 + k inside): each run it
    # forks drops to its own id; None: its runs share its one id.
    ids: identities.IdRange | None = None

    def worn(self, max_runs: int, max_age_s: float) -> bool:
        """Whether it served its share: `max_runs` forks or `max_age_s` seconds."""
        return self.runs >= max_runs or time.monotonic() - self.started_at >= max_age_s

    def _ended(self, on_drained: Callable[[_Template], None]) -> None:
        """One sandbox forked from it is gone (its cleanup ran)."""
        with self.lock:
            self.live -= 1
            drained = self.retired and self.live == 0
        if drained:
            on_drained(self)

    @classmethod
    def start(cls, spec: SandboxSpec, limits: Limits, backend: Backend) -> _Template:
        """Start a template of `spec` and wait until it serves.

        Raises:
            SandboxError: it failed to start.
        """
        own = limits.model_copy(update={"max_processes": _TEMPLATE_PROCESSES})
        sandbox = start(spec, own, backend, pooled=True, as_template=True)
        try:
            wait_ready(sandbox, TEMPLATE_READY_TIMEOUT_S)
        except BaseException:
            sandbox.destroy()
            raise
        return cls(sandbox, ids=template_ids(spec))

    def fork(
        self,
        spec: SandboxSpec,
        limits: Limits,
        on_drained: Callable[[_Template], None] = lambda _: None,
    ) -> StartedSandbox:
        """Make one sandbox of `spec` (see the module docstring); `on_drained` is called
        when the last sandbox of a retired template is gone.

        Raises:
            SandboxError: the template did not answer, or it was retired meanwhile.
        """
        execution_id = uuid.uuid4().hex
        with self.lock:
            if self.retired:  # replaced between `_template_for` and here
                raise _Retired("the fork server's template was retired")
            self.runs += 1
            self.live += 1
        cleanup = contextlib.ExitStack()
        # First on the stack, so last to run: the sandbox is gone when it is counted out.
        cleanup.callback(self._ended, on_drained)
        try:
            # Its own host id (returned last, as `run.start` does), which the maker drops
            # to in the template's user namespace, where it is `inside`; the same id as
            # the template when the template maps no range.
            identity = cleanup.enter_context(identities.lease(spec.identity)).identity
            inside = None
            if self.ids is not None:
                inside = rootfs.SANDBOX_UID + identity.uid - self.ids.base
            run_dir = launch.make_run_dir(cleanup)
            ws = launch.prepare_workspace(None, spec.workspace_mb, run_dir, cleanup, owner=identity)
            cgroup = cgroups.create(
                f"{owner.key()}-{execution_id}",
                limits,
                extra_pids=rlimits.SANDBOX_INIT_PROCESSES,  # init, as bwrap's
            )
            if cgroup is not None:
                cleanup.callback(cgroups.destroy, cgroup)
            channel = launch.Channels.open(cleanup)
            proc = self._request(channel, ws.bind_source, spec.tmp_mb, inside)
            cleanup.callback(proc.close)
            channel.close_guest_ends()
            try:
                proc.admit(cgroup, None if inside is None else identity)
            except SandboxError as exc:
                # A maker or init that failed said why on the template's stderr.
                raise SandboxError(f"{exc}; {_said(self.sandbox.proc.stderr)}") from exc
        except BaseException:
            cleanup.close()
            raise
        return StartedSandbox(
            execution_id=execution_id,
            spec=spec,
            proc=proc,
            channel=channel,
            cgroup=cgroup,
            workspace=ws,
            cgroup_limits=limits,
            started_at=time.monotonic(),
            cleanup=cleanup,
            identity=identity,
            # With an id of its own, RLIMIT_NPROC counts its processes alone (the kernel
            # counts per user namespace and id): the guest sets it, as in any sandbox.
            shares_user_namespace=inside is None,
        )

    def _request(
        self,
        channel: launch.Channels,
        workspace: os.PathLike[str] | str,
        tmp_mb: int,
        inside: int | None,
    ) -> ForkedProcess:
        """Send the template one fork request with the new sandbox's fds (and, with
        `inside`, the id in the template's user namespace the run drops to)."""
        out_read, out_write = os.pipe2(os.O_CLOEXEC)
        err_read, err_write = os.pipe2(os.O_CLOEXEC)
        exit_host, exit_guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        exit_host.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        proc = ForkedProcess(exit_host, os.fdopen(out_read, "rb"), os.fdopen(err_read, "rb"))
        tree = -1
        try:
            tree = _detached_mount(workspace)
            fields: dict[str, int | str] = {
                "v": 1,
                "kind": guest_template.KIND_FORK,
                "tmp_bytes": tmp_mb * cgroups.MiB,
            }
            if inside is not None:
                fields["uid"] = inside
            message = json.dumps(fields).encode()
            fds = [
                channel.guest_control.fileno(),
                channel.guest_bridge.fileno(),
                out_write,
                err_write,
                exit_guest.fileno(),
                tree,
            ]
            with self.lock:
                socket.send_fds(self.sandbox.channel.host_control, [message], fds)
        except OSError as exc:
            proc.close()
            raise SandboxError(f"the fork server's template is gone: {exc}") from exc
        finally:
            for fd in (out_write, err_write, tree):
                if fd >= 0:
                    os.close(fd)
            exit_guest.close()
        return proc

    def close(self) -> None:
        self.sandbox.destroy()


def _detached_mount(path: os.PathLike[str] | str) -> int:
    """A detached copy of the mount at `path` (open_tree), to be attached in the sandbox.

    Raises:
        OSError: the kernel refused (no open_tree before Linux 5.2; no privilege).
    """
    fd = int(
        _libc.syscall(
            _SYS_OPEN_TREE,
            _AT_FDCWD,
            os.fsencode(path),
            _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC,
        )
    )
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"open_tree {path}: {os.strerror(code)}")
    return fd


class ForkedProcess(SandboxProcess):
    """A forked sandbox as the host holds it: its init (host pid from the hello's
    credentials, held by a pidfd), its output pipes, and its exit as init reports it over
    the exit socket (the template, not the host, is init's parent)."""

    def __init__(self, exit_sock: socket.socket, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.stdout = stdout
        self.stderr = stderr
        self._exit_sock = exit_sock
        self._status: ExitStatus | None = None
        self._buffer = b""
        self._init_pid = 0
        self._init_pidfd: int | None = None
        self._init_lock = threading.Lock()

    def admit(self, cgroup: CgroupHandle | None, identity: Identity | None = None) -> None:
        """Follow the sandbox's making: move the maker into `cgroup` before it makes
        anything (init and the guest inherit it), then hold init by a pidfd. With
        `identity`, the maker and init must be that host id (the run's own).

        Raises:
            SandboxError: no answer in time (the template could not fork it), or a process
                of it is not who a sandbox must be.
        """
        maker = self._hello(b"h", identity)
        if cgroup is not None:
            cgroups.attach(cgroup, maker)
        self._exit_sock.sendall(b"g")
        self._init_pid = self._hello(b"i", identity)
        with contextlib.suppress(OSError):
            self._init_pidfd = os.pidfd_open(self._init_pid)

    def _hello(self, expected: bytes, identity: Identity | None = None) -> int:
        """The host pid of the process that sent `expected` (from its credentials), which
        must be `identity` when one is given."""
        if not _readable(self._exit_sock, HELLO_TIMEOUT_S):
            raise SandboxError(
                f"the fork server did not fork the sandbox within {HELLO_TIMEOUT_S:g} s"
            )
        data, ancillary, _, _ = self._exit_sock.recvmsg(1, socket.CMSG_SPACE(12))
        pid = _sender_pid(ancillary, identity)  # and never host root (see _sender_pid)
        if data != expected or pid is None:
            raise SandboxError(f"the fork server could not fork the sandbox (got {data!r})")
        return pid

    @property
    def pid(self) -> int:
        """The host pid of the sandbox's init."""
        return self._init_pid

    def poll(self) -> ExitStatus | None:
        if self._status is None and _readable(self._exit_sock, 0):
            self._read_status()
        return self._status

    def alive(self) -> bool:
        return self.poll() is None

    def wait(self, timeout: float | None = None) -> ExitStatus:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._status is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not _readable(self._exit_sock, left):
                raise subprocess.TimeoutExpired("sandbox", timeout or 0)
            self._read_status()
        return self._status

    def _read_status(self) -> None:
        """Read what init said: "x CODE SIGNAL" once the guest ended; nothing (the socket
        closed) when init itself was killed."""
        try:
            chunk = self._exit_sock.recv(64)
        except OSError:
            chunk = b""
        self._buffer += chunk
        if b"\n" in self._buffer:
            self._status = _parse_status(self._buffer[: self._buffer.index(b"\n")])
        elif not chunk or len(self._buffer) > 64:
            self._status = ExitStatus(code=None, signal=signal.SIGKILL)

    def kill(self) -> None:
        """SIGKILL init: the kernel then kills every process of its pid namespace. Returns
        once init has exited (at most a few seconds)."""
        with self._init_lock:
            pidfd = self._init_pidfd
            if pidfd is None:
                return
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            with contextlib.suppress(OSError):
                poller.poll(_INIT_EXIT_WAIT_S * 1000)

    def close(self) -> None:
        """Kill it, close its pipes and sockets; idempotent."""
        self.kill()
        if self._status is None:
            self._status = ExitStatus(code=None, signal=signal.SIGKILL)
        self.stdout.close()
        self.stderr.close()
        self._exit_sock.close()
        with self._init_lock:
            if self._init_pidfd is not None:
                os.close(self._init_pidfd)
                self._init_pidfd = None


def _readable(sock: socket.socket, timeout_s: float | None) -> bool:
    """poll, not select: a busy host's fds pass FD_SETSIZE (1024)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else timeout_s * 1000))


def _sender_pid(
    ancillary: list[tuple[int, int, bytes]], identity: Identity | None = None
) -> int | None:
    """The host pid in the kernel's credentials of a message.

    Raises:
        SandboxError: the sender runs as host root (uid or gid 0), or not as `identity`
            (the run's own id) when one is given. The template was checked when it started
            (`identity.ensure_not_root`); its user namespace maps no host root, so the ids
            the kernel reports are the check here.
    """
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= 12:
            pid, uid, gid = struct.unpack("iII", data[:12])
            if uid == 0 or gid == 0:
                raise SandboxError(
                    f"refused: a forked sandbox runs as host root (uid {uid}, gid {gid})"
                )
            if identity is not None and (uid, gid) != (identity.uid, identity.gid):
                raise SandboxError(
                    f"refused: a forked sandbox runs as host uid {uid}, gid {gid}, not its "
                    f"own uid {identity.uid}, gid {identity.gid}"
                )
            return pid if pid > 0 else None
    return None


def _parse_status(line: bytes) -> ExitStatus:
    """ "x CODE SIGNAL" (one of the two empty) -> ExitStatus; anything else: killed."""
    parts = line.decode("ascii", "replace").split(" ")
    if len(parts) == 3 and parts[0] == "x":
        if parts[1].isdigit():
            return ExitStatus(code=int(parts[1]))
        if parts[2].isdigit():
            return ExitStatus(code=None, signal=int(parts[2]))
    return ExitStatus(code=None, signal=signal.SIGKILL)


def _said(stderr: IO[bytes]) -> str:
    """What the template's stderr holds now (where a maker or init that failed says why),
    without waiting."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        os.set_blocking(stderr.fileno(), False)
        data = stderr.read1(2000) if hasattr(stderr, "read1") else stderr.read(2000)
        return (data or b"").decode("utf-8", "replace").strip()[-1000:] or "no message"
    return "no message"
