"""Sessions: one long-lived sandbox whose runs share an interpreter, so that globals,
imports and the workspace persist from one run to the next.

A session's sandbox is made like a run's (its own namespaces, seccomp filter, cgroup and
workspace) and, when there is a pool, taken from it: a warm sandbox becomes a session at
its first request (the guest keeps its interpreter, `bootstrap._serve_session`). Limits
hold per run (wall time, CPU seconds, output) and per session (memory, processes, disk:
the cgroup and the workspace are the session's; the CPU of all its runs together, by the
guest's hard RLIMIT_CPU and the host's count). A run past its timeout is interrupted by
the guest (the session lives on) and killed with the sandbox only if it does not stop. A
run that ends the interpreter (memory limit, `os._exit`, that kill) ends the session, and
the next call is told why. Sessions share nothing with each other or with pooled runs.

`Sessions` is the registry one Host keeps: ids that cannot be guessed, an owner per
session (a client sees and uses only its own), per-client and total maxima, and a reaper
thread closing sessions idle past their TTL or older than their lifetime, and those whose
processes spent the CPU budget while no run was going (polled each second from the
session's cgroup: a background process a run left cannot outlast the budget).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from codecage import forks
from codecage.egress.rules import EgressPolicy
from codecage.engine import workspace as workspaces
from codecage.engine.run import RunRequest, SessionRun, StartedSandbox, run_in
from codecage.errors import ConfigError, SessionError
from codecage.models import Event, ExecutionResult, Limits, SessionSettings
from codecage.policy.profiles import ImportPolicy

log = logging.getLogger(__name__)

SESSION_ID_PREFIX = "ses_"
_REAP_EVERY_S = 1.0
_ENDED_KEPT = 256
_MIN_CPU_LEFT_S = 0.01  # less than this left of the session's CPU: it has used it up


@dataclass(frozen=True, slots=True)
class SessionTerms:
    """What a session is opened with and keeps: its limits (memory, processes, disk and
    the defaults of its runs), its TTLs and CPU budget, and whose it is."""

    limits: Limits
    owner: str = ""  # the client that opened it ("" for the library and the CLI)
    policy: ImportPolicy | None = None  # every run's, fixed at the first
    egress: EgressPolicy | None = None  # the hosts every run may reach; None: no network
    idle_ttl: float | None = None  # None: the settings'
    lifetime: float | None = None

    def with_defaults(self, settings: SessionSettings) -> SessionTerms:
        """These terms with the TTLs the caller left out taken from `settings`."""
        return dataclasses.replace(
            self,
            idle_ttl=self.idle_ttl if self.idle_ttl is not None else settings.idle_ttl,
            lifetime=self.lifetime if self.lifetime is not None else settings.lifetime,
        )

    @property
    def idle_ttl_s(self) -> float:
        assert self.idle_ttl is not None  # noqa: S101 - with_defaults filled it
        return self.idle_ttl

    @property
    def lifetime_s(self) -> float:
        assert self.lifetime is not None  # noqa: S101 - with_defaults filled it
        return self.lifetime


class Session:
    """One open session: run code in it with `run`, end it with `close`. Runs are one at
    a time (a second caller waits for the first, at most its own timeout)."""

    def __init__(
        self,
        session_id: str,
        sandbox: StartedSandbox,
        terms: SessionTerms,
        *,
        cpu_seconds: int,
        backend_name: str,
        dispose: Callable[[StartedSandbox], None],
    ) -> None:
        self.id = session_id
        self.terms = terms
        self.cpu_seconds = cpu_seconds  # the CPU budget of all its runs
        self.backend_name = backend_name
        self.created_at = time.monotonic()
        self.last_used = self.created_at
        self.runs = 0
        self.ended: str | None = None  # why, once it has
        self._sandbox = sandbox
        self._dispose = dispose
        self._lock = threading.Lock()
        self._disposed = False
        self._cpu_used_ms = 0

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def cpu_left_s(self) -> float:
        return max(0.0, self.cpu_seconds - self._cpu_used_ms / 1000)

    def expiry(self, now: float) -> str | None:
        """Why the session is over at `now`, or None while it may live on."""
        if now - self.created_at >= self.terms.lifetime_s:
            return f"it reached its lifetime of {self.terms.lifetime_s:g} s"
        if not self.busy and now - self.last_used >= self.terms.idle_ttl_s:
            return f"it was idle for {self.terms.idle_ttl_s:g} s (its idle TTL)"
        return None

    def idle_cpu_spent(self) -> str | None:
        """Why the session must end for the CPU it used while no run was going, or None.

        Processes a run leaves behind (a thread, a background child) keep running between
        runs; a run's own supervision holds the budget only while it runs. So the reaper
        asks this every second: the session's cgroup says what was used since its last run
        ended, added to what its runs used. (None while a run is going, and without a
        cgroup: nothing counts the processes then; the guest's hard RLIMIT_CPU holds each.)
        """
        if self.ended is not None or not self._lock.acquire(blocking=False):
            return None
        try:
            idle_ms = self._sandbox.cpu_since_baseline_ms()
        finally:
            if self.ended is not None:
                self._dispose_once()  # closed while this check held the sandbox
            self._lock.release()
        if idle_ms is None:
            return None
        left_ms = self.cpu_seconds * 1000 - self._cpu_used_ms - idle_ms
        if left_ms >= _MIN_CPU_LEFT_S * 1000:
            return None
        return (
            f"it used its CPU budget of {self.cpu_seconds} s: processes left running between "
            f"runs used {idle_ms / 1000:.1f} s of it while no run was going"
        )

    def run(self, request: RunRequest) -> ExecutionResult:
        """Run `request` in the session's interpreter.

        Raises:
            SessionError: the session has ended, or is busy past the run's timeout.
            ConfigError: the request was refused before anything ran.
            SandboxError: the sandbox broke down (the session ends).
        """
        if not self._lock.acquire(timeout=request.limits.timeout):
            raise SessionError(
                f"session {self.id} is still busy with another run",
                hint="wait for the other run to finish, or open another session",
            )
        try:
            self._check_usable()
            return self._run_locked(request)
        finally:
            self.last_used = time.monotonic()
            if self.ended is not None:
                self._dispose_once()  # ended during the run: destroyed now it is over
            self._lock.release()

    def _check_usable(self) -> None:
        if self.ended is not None:
            raise SessionError(f"session {self.id} has ended: {self.ended}")
        if self.cpu_left_s() < _MIN_CPU_LEFT_S:
            self._end(f"it used its CPU budget of {self.cpu_seconds} s")
            raise SessionError(f"session {self.id} has ended: {self.ended}")

    def _run_locked(self, request: RunRequest) -> ExecutionResult:
        number = self.runs + 1
        if request.filename == "main.py":  # runs are named apart, for their tracebacks
            request = dataclasses.replace(request, filename=f"run{number}.py")
        cpu_limit_ms = int(min(request.limits.cpu_seconds, self.cpu_left_s()) * 1000)
        try:
            result = run_in(
                self._sandbox,
                request,
                backend_name=self.backend_name,
                session=SessionRun(
                    cpu_limit_ms=max(cpu_limit_ms, 1),
                    session_cpu_seconds=self.cpu_seconds,
                ),
            )
        except ConfigError:
            raise  # refused before the guest got it (e.g. an upload): the session is as it was
        except Exception:
            self._end(f"its sandbox failed in run {number}")
            raise
        self.runs = number
        self._cpu_used_ms += result.usage.cpu_ms or 0
        if not self._sandbox.alive():
            self._end(f"run {self.runs} ended its interpreter (status {result.status})")
            result = _with_event(result, Event(kind="session_ended", detail=self._ended_detail()))
        return result.model_copy(update={"session_id": self.id})

    def read_file(self, path: str, *, max_bytes: int) -> bytes:
        """The content of the regular file `path` in the session's /workspace now (between
        runs: a run in progress is waited for), never through a link.

        Raises:
            SessionError: the session has ended.
            ConfigError: no such regular file, a link on the way, or over `max_bytes`.
        """
        with self._lock:
            try:
                if self.ended is not None:
                    raise SessionError(f"session {self.id} has ended: {self.ended}")
                return workspaces.read_file(self._sandbox.workspace.path, path, max_bytes=max_bytes)
            finally:
                if self.ended is not None:
                    self._dispose_once()  # closed while this read held the sandbox

    def _ended_detail(self) -> str:
        return f"session {self.id} has ended: {self.ended}; its state is gone"

    def close(self, why: str = "it was closed") -> None:
        """End the session and destroy its sandbox (a run in progress is killed)."""
        self._end(why)

    def _end(self, why: str) -> None:
        """Mark the session ended and destroy its sandbox; with a run in progress (on
        another thread, or this one), only kill its processes now: the run's thread,
        which still reads the sandbox's pipes and sockets, destroys it when it is over."""
        if self.ended is not None:
            return
        self.ended = why
        log.info("session.ended", extra={"session_id": self.id, "why": why})
        if not self._lock.acquire(blocking=False):
            self._sandbox.kill()
            return
        try:
            self._dispose_once()
        finally:
            self._lock.release()

    def _dispose_once(self) -> None:
        if not self._disposed:
            self._disposed = True
            self._dispose(self._sandbox)


def _with_event(result: ExecutionResult, event: Event) -> ExecutionResult:
    return result.model_copy(update={"events": [*result.events, event]})


class Sessions:
    """The open sessions of one Host, by id; closes the expired ones in a thread of its own.

    `opener` makes a session's ready sandbox (from the pool, or started and waited for).
    It runs on a thread of this registry's: a sandbox dies with the thread that started it
    (bwrap's --die-with-parent), and a session outlives the call that opened it.
    """

    def __init__(self, settings: SessionSettings) -> None:
        self.settings = settings
        self._by_id: dict[str, Session | _Reserved] = {}
        self._ended: dict[str, tuple[str, str]] = {}  # id -> (owner, why), the last few
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="codecage-session-start")
        self._reaper: threading.Thread | None = None
        self._process = forks.ForkGuard()  # a forked child's copy has no threads: see forks

    def open(
        self,
        terms: SessionTerms,
        opener: Callable[[], tuple[StartedSandbox, str, Callable[[StartedSandbox], None]]],
    ) -> Session:
        """A new session of `terms` (TTLs left out: the settings'); `opener` gives its
        ready sandbox, the backend's name and how to dispose of the sandbox at the end.

        Raises:
            SessionError: the client or the process has as many sessions as allowed.
            HostError, SandboxError: no sandbox could be made.
        """
        if not self._process.owned_here():
            raise SessionError(
                "sessions cannot be opened in a process forked from the one that made this "
                "Sandbox (its threads did not come along)",
                hint="make a Sandbox in this process, or open the session before forking",
            )
        with self._lock:
            self._check_room(terms.owner)
            placeholder = SESSION_ID_PREFIX + secrets.token_urlsafe(12)
            self._by_id[placeholder] = _Reserved(terms.owner)
        try:
            sandbox, backend_name, dispose = self._starter.submit(opener).result()
        except BaseException:
            with self._lock:
                self._by_id.pop(placeholder, None)
            raise
        session = Session(
            placeholder,
            sandbox,
            terms.with_defaults(self.settings),
            cpu_seconds=self.settings.cpu_seconds,
            backend_name=backend_name,
            dispose=dispose,
        )
        with self._lock:
            self._by_id[placeholder] = session
        if self._closed.is_set():  # close_all ran while the sandbox was being made
            self._forget(session, "the server closed it")
            raise SessionError("sessions are closed: the server is stopping", hint="")
        self._start_reaper()
        log.info("session.opened", extra={"session_id": session.id, "owner": terms.owner})
        return session

    def _check_room(self, owner: str) -> None:
        if self._closed.is_set():
            raise SessionError("sessions are closed: the server is stopping", hint="")
        # A session that ended (its interpreter died) but the reaper has not forgotten yet
        # holds no sandbox and is not listed: it takes no room (list_sessions would show
        # fewer than the refusal counted).
        live = [s for s in self._by_id.values() if not (isinstance(s, Session) and s.ended)]
        mine = sum(1 for s in live if s.terms.owner == owner)
        if mine >= self.settings.max_per_client:
            raise SessionError(
                f"this client has {mine} open sessions, the most it may have "
                f"(max_per_client={self.settings.max_per_client})",
                hint="close one you no longer need with {close_session}, or reuse one",
            )
        if len(live) >= self.settings.max_total:
            raise SessionError(
                f"this server holds {len(live)} sessions, the most it may "
                f"(max_total={self.settings.max_total})",
                hint="close a session you no longer need with {close_session}, or try again later",
            )

    def get(self, session_id: str, owner: str = "") -> Session:
        """The open session `session_id` of `owner`.

        Raises:
            SessionError: there is none (never was, another client's, or ended: then why;
                or this is a forked child, whose sessions are its parent's).
        """
        if not self._process.owned_here():
            raise SessionError(
                "this process was forked from the one that opened the sessions: they are "
                "its parent's",
                hint="open a session in this process",
            )
        with self._lock:
            session = self._by_id.get(session_id)
            owner_and_why = self._ended.get(session_id)
        why = None
        if isinstance(session, Session) and session.terms.owner == owner:
            if session.ended is None:
                return session
            why = session.ended
        elif owner_and_why is not None and owner_and_why[0] == owner:
            why = owner_and_why[1]
        if why is not None:
            raise SessionError(f"session {_shown(session_id)} has ended: {why}; its state is gone")
        raise SessionError(
            f"no session {_shown(session_id)} is open for this client",
            hint="open one with {open_session} and pass the id it returns",
        )

    def open_count(self) -> int:
        with self._lock:
            return sum(1 for s in self._by_id.values() if isinstance(s, Session))

    def owned_by(self, owner: str) -> list[Session]:
        with self._lock:
            return [
                s
                for s in self._by_id.values()
                if isinstance(s, Session) and s.terms.owner == owner and s.ended is None
            ]

    def close(self, session_id: str, owner: str = "", why: str = "it was closed") -> Session:
        """Close one session of `owner`.

        Raises:
            SessionError: there is no such open session.
        """
        session = self.get(session_id, owner)
        self._forget(session, why)
        return session

    def _forget(self, session: Session, why: str) -> None:
        session.close(why)
        with self._lock:
            self._by_id.pop(session.id, None)
            self._ended[session.id] = (session.terms.owner, session.ended or why)
            while len(self._ended) > _ENDED_KEPT:
                self._ended.pop(next(iter(self._ended)))

    def reap(self, now: float | None = None) -> list[str]:
        """Close the sessions whose TTL or lifetime has passed, those whose interpreter
        died, and those whose processes used up the CPU budget between runs (their
        processes are killed with the sandbox); the ids closed."""
        now = time.monotonic() if now is None else now
        with self._lock:
            sessions = [s for s in self._by_id.values() if isinstance(s, Session)]
        closed = []
        for session in sessions:
            why = session.ended or session.expiry(now) or session.idle_cpu_spent()
            if why is not None:
                self._forget(session, why)
                closed.append(session.id)
        return closed

    def _start_reaper(self) -> None:
        with self._lock:
            if self._reaper is not None:
                return
            self._reaper = threading.Thread(
                target=self._reap_loop, name="codecage-session-reaper", daemon=True
            )
            self._reaper.start()

    def _reap_loop(self) -> None:
        while not self._closed.wait(_REAP_EVERY_S):
            try:
                self.reap()
            except Exception:  # the reaper must outlive one session's failure
                log.exception("session.reap_failed")

    def close_all(self) -> None:
        """Close every session and stop the reaper (the Host is closing); in a forked
        child, nothing (the sessions are the parent's)."""
        if not self._process.owned_here():
            return
        self._closed.set()
        with self._lock:
            sessions = [s for s in self._by_id.values() if isinstance(s, Session)]
        for session in sessions:
            self._forget(session, "the server closed it")
        if self._reaper is not None:
            self._reaper.join()
        self._starter.shutdown(wait=True)


@dataclass(frozen=True, slots=True)
class _Reserved:
    """A place held in the registry while a session's sandbox is being made: it counts
    towards the maxima, so that many concurrent opens cannot pass them."""

    owner: str

    @property
    def terms(self) -> _Reserved:
        return self  # `.terms.owner`, as a Session has


def _shown(session_id: str) -> str:
    """A session id from a caller, safe to put in a message (bounded, printable)."""
    text = session_id[:64]
    return repr(text) if not text.isprintable() or " " in text else text
