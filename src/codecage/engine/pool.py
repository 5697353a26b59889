"""Warm, single-use sandboxes: started ahead of time, each runs exactly one request.

Per key (what cannot change once a sandbox started: its `SandboxSpec`, i.e. the import
policy, the sizes of /workspace and /tmp, the modules to preload; and the pool's backend),
the pool keeps a few sandboxes whose guest has started the interpreter, imported the
profile's heavy modules and now waits for its request. A warm sandbox is isolated exactly
like a cold one: it was made by the same `engine.start`, with its own namespaces, seccomp
filter, cgroup, workspace tmpfs and /tmp. What a request may change late is applied when it
is taken (`engine.run_in`): cgroup limits by the host, rlimits by the guest before the
user's code, the wall timer from the moment the request is sent.

After its one run a sandbox is destroyed (in a background thread, off the caller's path);
the pool refills in the background. Nothing is reused: no process, no writable path. A
replacement starts `HOLD_OFF_S` after the last `take` (at once when a caller waits for a
sandbox), and a used one is destroyed `HOLD_OFF_S` after its release: starting one
(namespaces, an interpreter importing the profile's modules) or tearing one down competes
for the CPUs and the GIL with the call that took a sandbox, whose run and answer take a few
ms; on 2 cores the start made an MCP `execute_code` round trip ~2 ms slower at p50, the
teardown ~0.6 ms.

Threads: two starter threads start sandboxes (bwrap's --die-with-parent is tied to the
thread that started it, so they live as long as the pool); one manager thread watches the
starting ones until they are ready and the idle ones for a crash; one reaper thread
destroys used ones and tells the starters when a take left them work. Callers of `take`
only pop from a deque under a lock. What the pool keeps, which key starts next, how it
grows, shrinks and backs off is decided by its `PoolPlan` (`engine.pool_plan`, pure: no
threads, no clock); the threads here act on those decisions. A forked child leaves the
pool alone (`codecage.forks`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import selectors
import threading
import time

from codecage import engine, forks
from codecage.backends.base import Backend
from codecage.engine import SandboxSpec, StartedSandbox
from codecage.engine.forkserver import Templates
from codecage.engine.memory import rss_mb, sandbox_memory
from codecage.engine.pool_plan import HOLD_OFF_S, KeyPlan, PoolPlan
from codecage.errors import CodecageError
from codecage.models import Limits, PoolConfig, PoolKeyState, PoolState

log = logging.getLogger(__name__)

_TICK_S = 0.5
_STARTER_THREADS = 2
_REAPER_POLL_S = 0.02  # while runs come and go, the reaper looks for used sandboxes so often
_REAPER_LINGER_S = 2.0  # ... for so long after its last work; then it waits to be woken
_GRAVEYARD_MAX = 16  # used sandboxes waiting for the reaper; past it, the releaser destroys


_Key = KeyPlan[StartedSandbox]


class Pool:
    """Warm single-use sandboxes of one backend, kept per `SandboxSpec`.

    >>> pool = Pool(backend, PoolConfig(enabled=True), Limits())
    >>> pool.register(spec)                 # keep sandboxes of this spec warm
    >>> sandbox = pool.take(spec)           # a ready one, or None: start a cold one
    >>> ...engine.run_in(sandbox, request)...; pool.release(sandbox)
    >>> pool.close()                        # kills every pooled sandbox
    """

    def __init__(
        self,
        backend: Backend,
        config: PoolConfig,
        limits: Limits,
        templates: Templates | None = None,
    ) -> None:
        self.backend = backend
        self.templates = templates  # a fork server: sandboxes forked, not started anew
        self.config = config
        self._limits = limits  # idle sandboxes' cgroups; each request sets its own
        self._process = forks.ForkGuard()  # a forked child must not use (or close) this pool
        self._fork_noted = False
        self._cond = threading.Condition()
        # What the pool keeps and what it starts next; guarded by `_cond`.
        self._plan: PoolPlan[StartedSandbox] = PoolPlan(config)
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # Guards the wake pipe's closing: a starter still finishing a start after `close`
        # (runs in use keep them alive) must not write into a closed fd, whose number may
        # belong by then to another sandbox's control socket.
        self._wake_lock = threading.Lock()
        # Used sandboxes, each with the time it may be destroyed (see `_reap_loop`).
        self._graveyard: collections.deque[tuple[StartedSandbox, float]] = collections.deque()
        self._graveyard_cond = threading.Condition(threading.Lock())
        self._reaper_asleep = False  # waiting without a timeout: a burial must wake it
        self._replacements_due = False  # a take left the starters work; the reaper tells them
        self._reaper_told_to_stop = False
        self._reaper = threading.Thread(target=self._reap_loop, name="codecage-reaper", daemon=True)
        self._manager = threading.Thread(target=self._manage, name="codecage-pool", daemon=True)
        self._just_started: list[tuple[_Key, StartedSandbox]] = []
        self._waiting = 0  # callers of `take` waiting for a sandbox that is starting
        self._holding_off = 0  # starters waiting in `_hold_off`
        self._reaper_stopped = False
        self._starters = [
            threading.Thread(target=self._start_loop, name=f"codecage-starter-{i}", daemon=True)
            for i in range(min(config.max_starting, _STARTER_THREADS))
        ]
        self._reaper.start()
        self._manager.start()
        for starter in self._starters:
            starter.start()
        forks.close_at_exit(self)  # no pooled sandbox outlives the host

    # --- the callers' side ---------------------------------------------------------------

    def register(self, spec: SandboxSpec, profile: str | None = None) -> None:
        """Keep sandboxes of `spec` warm (sizes of `profile`, else the default sizes)."""
        if self._forked():
            return
        with self._cond:
            if self._plan.register(spec, profile):
                self._cond.notify_all()  # the starters have work

    def take(self, spec: SandboxSpec) -> StartedSandbox | None:
        """A ready sandbox of `spec`, now the caller's (run it, then `release` it); or None
        when none is ready within the configured wait, or `spec` is not registered: the
        caller starts a cold one (always in a process forked from the pool's)."""
        if self._forked():
            return None
        deadline = time.monotonic() + self.config.wait
        with self._cond:
            key = self._plan.keys.get(spec)
            waited = False
            while key is not None and not self._plan.closed:
                while (sandbox := self._plan.pop_idle(key)) is not None:
                    if sandbox.alive():
                        self._plan.took(key, time.monotonic(), waited=waited)
                        self._have_it_replaced()
                        return sandbox
                    self._plan.found_dead(key)
                    self._bury(sandbox)
                left = deadline - time.monotonic()
                if key.starting == 0 or left <= 0:
                    break
                self._waiting += 1
                if self._holding_off:  # a starter holding off must not make us wait
                    self._cond.notify_all()  # (not always: two waiting takers would wake
                    # each other in a loop, ~50 ms of CPU per run at concurrency 2)
                try:
                    self._cond.wait(left)  # one is starting: sooner ready than a cold start
                finally:
                    self._waiting -= 1
                waited = True
            if key is not None:
                self._plan.missed(key, time.monotonic())
                self._cond.notify_all()
        return None

    def started_cold(self, spec: SandboxSpec) -> None:
        """A sandbox of `spec` was started outside the pool, after a `take` found none: a
        back-off after failed starts ends, and the pool refills now rather than up to
        MAX_BACKOFF_S after whatever made its starts fail is over."""
        if self._forked():  # a forked child: the parent's lock may be held for good
            return
        with self._cond:
            key = self._plan.keys.get(spec)
            if key is not None and self._plan.started_elsewhere(key):
                log.info("pool.resumed", extra={"profile": key.profile})
                self._cond.notify_all()

    def _have_it_replaced(self) -> None:
        """Get a starter to replace a sandbox just taken; the lock is held. A starter would
        hold off `HOLD_OFF_S` anyway: while the reaper looks around every `_REAPER_POLL_S`
        it tells them at its next look, so a take wakes no thread (a wake-up costs the
        caller ~0.1 ms here, and the woken starters compete with its run for the GIL).
        `_reaper_asleep` is read without the reaper's lock: should it fall asleep just after,
        the release of this very sandbox wakes it, and the starters' own `_TICK_S` is the
        backstop."""
        if self._reaper_asleep:
            self._cond.notify_all()
        else:
            self._replacements_due = True

    def release(self, sandbox: StartedSandbox, *, ran: bool = True) -> None:
        """Hand back a sandbox `take` gave: it is destroyed. `ran=False`: it could not take
        the request (`LimitsNotApplicable`), so the run went cold and counts as a miss."""
        if self._forked():
            return  # the parent's to destroy
        with self._cond:
            self._plan.released(sandbox.spec, time.monotonic(), ran=ran)
            if self._plan.closed or not ran:  # a closing pool's starters wait for the last one;
                self._cond.notify_all()  # a miss gives them work. Else wake no one: the
                # threads would compete with the caller's answer for the GIL.
        self._bury(sandbox)

    def _bury(self, sandbox: StartedSandbox) -> None:
        """Have `sandbox` destroyed: by the reaper, or here once the reaper has stopped."""
        with self._cond:
            reaper_gone = self._reaper_stopped
            if not reaper_gone:
                self._to_graveyard(sandbox)
        if reaper_gone:
            sandbox.destroy()

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every key has its `min_idle` sandboxes ready; False on timeout."""
        if self._forked():
            return False
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._plan.all_ready():
                left = deadline - time.monotonic()
                if left <= 0 or self._plan.closed:
                    return False
                self._cond.wait(left)
        return True

    def state(self) -> PoolState:
        """Sizes, counters and the idle sandboxes' memory, per key."""
        if self._forked():
            return PoolState(enabled=False, config=self.config, keys=[], host_rss_mb=None)
        with self._cond:
            rows = [(k.state(), k.idle[0] if k.idle else None) for k in self._plan.keys.values()]
        # /proc is read outside the lock: runs must not wait for a report.
        keys = [_with_memory(row, sandbox) for row, sandbox in rows]
        return PoolState(
            enabled=True, config=self.config, keys=keys, host_rss_mb=rss_mb(os.getpid())
        )

    def close(self) -> None:
        """Stop refilling and kill every pooled sandbox; wait until they are gone. (In a
        forked child: nothing; the sandboxes and threads are the parent's.)"""
        if self._forked():
            return
        with self._cond:
            if not self._plan.close():
                return
            self._cond.notify_all()
        self._wake()
        if threading.current_thread() is not self._manager:
            self._manager.join()
        with self._cond:
            # Runs still going keep their sandboxes: the starters that started them stay
            # (their exit would kill them) until the last one is released, then go.
            starters_done = self._plan.in_use == 0
            for _, sandbox in self._just_started:  # started after the manager drained
                self._bury(sandbox)
            self._just_started = []
            self._reaper_stopped = True
        if starters_done:
            for starter in self._starters:
                if starter is not threading.current_thread():
                    starter.join()
        with self._graveyard_cond:
            self._reaper_told_to_stop = True
            self._graveyard_cond.notify()
        if threading.current_thread() is not self._reaper:
            self._reaper.join()
        self._close_wake_pipe()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _forked(self) -> bool:
        """Whether this process is a fork of the one that made the pool. Its idle sandboxes
        are the parent's: taking one would run a second request in a single-use sandbox
        (the parent takes it too) or steal the parent's; its threads did not survive the
        fork, and a lock one of them held stays held. So a child leaves the pool alone and
        its runs start cold; a Sandbox created after the fork has a pool of its own."""
        if self._process.owned_here():
            return False
        if not self._fork_noted:
            self._fork_noted = True
            log.warning("pool.forked", extra={"parent_pid": self._process.owner_pid})
        return True

    # --- the manager thread ----------------------------------------------------------------

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_write < 0:  # closed: nobody is listening any more
                return
            with contextlib.suppress(OSError):  # full pipe: a wake-up is pending anyway
                os.write(self._wake_write, b"x")

    def _close_wake_pipe(self) -> None:
        with self._wake_lock:
            for fd in (self._wake_read, self._wake_write):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._wake_read = self._wake_write = -1

    def _manage(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._wake_read, selectors.EVENT_READ, None)
            watched: dict[int, tuple[_Key, StartedSandbox, str]] = {}
            try:
                while not self._plan.closed:
                    self._watch_started(sel, watched)
                    for sel_key, _ in sel.select(_TICK_S):
                        if sel_key.data is None:
                            with contextlib.suppress(OSError):
                                os.read(self._wake_read, 4096)
                            continue
                        self._on_event(sel, watched, sel_key.fd)
                    self._expire_slow_starts(sel, watched)
                    with self._cond:
                        self._plan.shrink_calm_keys(time.monotonic())
            except Exception:
                log.exception("pool.manager_failed")
                with self._cond:
                    self._plan.close()
                    self._cond.notify_all()
            finally:
                self._drain(sel, watched)

    def _start_loop(self) -> None:
        """A starter thread: start sandboxes for the keys that need them, one at a time.

        Several run at once (a start spends most of its ~15 ms waiting on the kernel: the
        namespaces, the cgroup move), and each lives as long as the pool, because bwrap's
        --die-with-parent is tied to the thread that started it.
        """
        while True:
            with self._cond:
                key = self._plan.next_to_start(time.monotonic())
                while key is None and not self._plan.closed:
                    self._cond.wait(_TICK_S)
                    key = self._plan.next_to_start(time.monotonic())
                if key is None:  # closed
                    # bwrap's --die-with-parent follows this thread: a sandbox in use must
                    # not die because the pool closed under it.
                    while self._plan.in_use > 0:
                        self._cond.wait(_TICK_S)
                    return
                self._hold_off()
            try:
                sandbox = engine.start(
                    key.spec, self._limits, self.backend, pooled=True, templates=self.templates
                )
            except Exception as exc:  # a starter must survive anything, or the key starves
                if not isinstance(exc, CodecageError):
                    log.exception("pool.start_crashed")
                self._failed(key, str(exc) or type(exc).__name__)
                continue
            with self._cond:
                watch = self._plan.launched(key)
                if watch:
                    self._just_started.append((key, sandbox))
            if not watch:
                self._bury(sandbox)  # the pool closed meanwhile
            self._wake()

    def _watch_started(
        self, sel: selectors.BaseSelector, watched: dict[int, tuple[_Key, StartedSandbox, str]]
    ) -> None:
        with self._cond:
            started, self._just_started = self._just_started, []
        for key, sandbox in started:
            sel.register(sandbox.channel.host_control, selectors.EVENT_READ, "starting")
            watched[sandbox.channel.host_control.fileno()] = (key, sandbox, "starting")

    def _hold_off(self) -> None:
        """Wait (lock held) until the plan lets a start begin (`HOLD_OFF_S` after the last
        `take`); at once when a caller waits for a sandbox or the pool closes."""
        deadline = self._plan.start_not_before()
        self._holding_off += 1
        try:
            while self._waiting == 0 and not self._plan.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)
        finally:
            self._holding_off -= 1

    def _on_event(
        self,
        sel: selectors.BaseSelector,
        watched: dict[int, tuple[_Key, StartedSandbox, str]],
        fd: int,
    ) -> None:
        key, sandbox, phase = watched.pop(fd)
        sel.unregister(fd)
        if phase == "starting":
            self._on_started(sel, watched, key, sandbox)
            return
        # An idle sandbox's process ended: it crashed (or was taken, used and is gone).
        os.close(fd)
        with self._cond:
            if self._plan.idle_died(key, sandbox):
                log.warning("pool.idle_sandbox_died", extra={"profile": key.profile})
                self._bury(sandbox)
                self._cond.notify_all()

    def _on_started(
        self,
        sel: selectors.BaseSelector,
        watched: dict[int, tuple[_Key, StartedSandbox, str]],
        key: _Key,
        sandbox: StartedSandbox,
    ) -> None:
        try:
            engine.wait_ready(sandbox, timeout_s=1.0)
            pidfd = os.pidfd_open(sandbox.proc.pid)
        except (CodecageError, OSError) as exc:
            self._bury(sandbox)
            self._failed(key, str(exc))
            return
        with self._cond:
            if not self._plan.ready(key, sandbox):  # ready too late: nobody will take it
                os.close(pidfd)
                self._bury(sandbox)
                return
            sel.register(pidfd, selectors.EVENT_READ, "idle")
            watched[pidfd] = (key, sandbox, "idle")
            self._cond.notify_all()

    def _failed(self, key: _Key, error: str) -> None:
        """A sandbox did not start: note it (the plan backs off when it keeps happening)."""
        log.warning("pool.start_failed", extra={"profile": key.profile, "error": error})
        with self._cond:
            self._plan.start_failed(key, error, time.monotonic())
            self._cond.notify_all()

    def _expire_slow_starts(
        self, sel: selectors.BaseSelector, watched: dict[int, tuple[_Key, StartedSandbox, str]]
    ) -> None:
        now = time.monotonic()
        for fd, (key, sandbox, phase) in list(watched.items()):
            if phase == "starting" and self._plan.too_slow(sandbox.started_at, now):
                watched.pop(fd)
                sel.unregister(fd)
                self._bury(sandbox)
                self._failed(key, f"not ready within {self.config.ready_timeout:g} s")

    def _drain(
        self, sel: selectors.BaseSelector, watched: dict[int, tuple[_Key, StartedSandbox, str]]
    ) -> None:
        """On close: every sandbox not handed out is destroyed."""
        for fd, (_, sandbox, phase) in watched.items():
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(fd)
            if phase == "idle":
                os.close(fd)
            else:
                self._bury(sandbox)
        with self._cond:
            for sandbox in self._plan.drain():
                self._bury(sandbox)
            self._cond.notify_all()

    # --- the reaper thread -------------------------------------------------------------------

    def _to_graveyard(self, sandbox: StartedSandbox) -> None:
        """Leave `sandbox` to the reaper; or, when it already has `_GRAVEYARD_MAX` waiting
        (runs come faster than one thread tears sandboxes down: forked ones come at 100/s),
        destroy it here: the caller waits for it, and the sandboxes (their processes,
        mounts and fds) waiting for their end stay bounded."""
        with self._graveyard_cond:
            full = len(self._graveyard) >= _GRAVEYARD_MAX
            if not full:
                self._graveyard.append((sandbox, time.monotonic() + HOLD_OFF_S))
                if self._reaper_asleep:
                    self._graveyard_cond.notify()
        if full:
            try:
                sandbox.destroy()
            except Exception:
                log.exception("pool.destroy_failed")

    def _reap_loop(self) -> None:
        """Destroy used sandboxes, each `HOLD_OFF_S` after its release (at once when the
        pool closes): tearing one down (kill, wait, unmount, remove its cgroup and dirs)
        competes for the CPUs and the GIL with the answer of the run that just used it.
        On the way, pass the starters the replacements that takes left them."""
        last_work = time.monotonic()
        while (entry := self._next_in_graveyard(last_work)) is not None:
            if isinstance(entry, _ReplacementsDue):
                with self._cond:
                    self._replacements_due = False
                    self._cond.notify_all()
                continue
            sandbox, not_before = entry
            if not self._plan.closed:
                time.sleep(max(0.0, not_before - time.monotonic()))
            try:
                sandbox.destroy()
            except Exception:
                log.exception("pool.destroy_failed")
            last_work = time.monotonic()

    def _next_in_graveyard(
        self, last_work: float
    ) -> tuple[StartedSandbox, float] | _ReplacementsDue | None:
        """The next used sandbox, or `_REPLACEMENTS_DUE` when a take left the starters work;
        None once told to stop and all are destroyed.

        While runs come and go, the reaper looks every `_REAPER_POLL_S` by itself, so that
        releasing a sandbox wakes no thread: a wake-up then competed with the caller's
        answer for the GIL (~0.4 ms of an MCP round trip). `_REAPER_LINGER_S` after its
        last work it sleeps until a burial wakes it, so an idle pool costs nothing.
        """
        with self._graveyard_cond:
            while not self._graveyard:
                if self._reaper_told_to_stop:
                    return None
                if self._replacements_due:
                    return _REPLACEMENTS_DUE  # (told outside this lock: the order is _cond first)
                lingering = time.monotonic() - last_work < _REAPER_LINGER_S
                self._reaper_asleep = not lingering
                self._graveyard_cond.wait(_REAPER_POLL_S if lingering else None)
                self._reaper_asleep = False
            return self._graveyard.popleft()


class _ReplacementsDue:
    """What the reaper finds when a take left the starters work (see `_have_it_replaced`)."""


_REPLACEMENTS_DUE = _ReplacementsDue()


def _with_memory(row: PoolKeyState, sandbox: StartedSandbox | None) -> PoolKeyState:
    if sandbox is None:
        return row
    rss, pss = sandbox_memory(sandbox.proc.pid, sandbox.cgroup)
    return row.model_copy(update={"idle_rss_mb": rss, "idle_pss_mb": pss})
