"""Alerts: a webhook or a command told when chosen things happen (`[alerts]`).

An `Alerter` is a `Host.observers` callback. After each run it looks at the finished run
for the triggers of `[alerts] on` (network_denied and import_blocked repeated by one
caller within a window, degraded_isolation, validation_high, status:<status>);
`client_blocked` is fed by whoever refuses a client's call (`Alerter.client_blocked`).
Deciding is cheap and happens on the run's thread. Sending happens on one worker thread
behind a bounded queue, so a hook that hangs or fails holds up no run: the queue fills,
and an alert that no longer fits is dropped and counted (the next one sent says how many).

Each trigger may send `max_per_hour` alerts; past that an alert is suppressed, recorded
and counted, and the next one sent says how many were suppressed. Every alert (sent,
failed and why, suppressed) goes to the audit store's alerts table when the host has an
audit trail, and to the log. An alert carries its kind, time, execution id, caller, a
detail taken from the run's events (scrubbed), and counts; never the code, never a
secret. Of a webhook only its host is recorded: its path may hold a token.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from codecage.audit.record import AlertRecord, Caller, Finished, utc_now
from codecage.audit.store import AuditStore
from codecage.audit.trail import AuditTrail, StoreFull
from codecage.errors import AuditError, ConfigError
from codecage.models import AlertSettings, Event, EventSource, ValidationReport
from codecage.models.settings import webhook_host

log = logging.getLogger(__name__)

QUEUE_MAX = 100
"""Alerts waiting to be sent; past this they are dropped (and counted)."""
CHECKS_MAX = QUEUE_MAX // 2
"""Runs waiting for the validation_high check: they never take the alerts' half."""
MAX_DETAIL = 500
REPEATED_TRIGGERS: dict[str, EventSource] = {"network_denied": "host", "import_blocked": "guest"}
"""The triggers counted by repetition, and the origin of the events each counts. A
network_denied alert comes only from what the host saw (its egress proxy): the guest's own
network_denied is a claim the code can forge. import_blocked exists only as a claim (the
import policy runs in the guest): its alert says so."""
"""Characters of an alert's detail."""
MAX_CALLERS = 10_000
"""Callers whose repeated events are counted at once (MCP clients name themselves)."""
HOUR_S = 3600.0
_HOOK_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ")
"""What a command hook gets of codecage's environment (its secrets stay here)."""
# Findings that say the code could not be analysed (syntax, limits) or imports outside a
# profile: each a refusal of its own, not a sign of an attack worth paging someone for.
_NOT_SECURITY = ("CC00",)


@dataclass(frozen=True, slots=True)
class Alert:
    """One alert as the triggers raised it, before it is sent."""

    kind: str  # the trigger: "network_denied", "status:memory_limit", ...
    caller: Caller
    detail: str  # scrubbed and cut to MAX_DETAIL
    execution_id: str | None = None
    counts: Mapping[str, int] = field(default_factory=dict)
    at: datetime.datetime = field(default_factory=utc_now)
    alert_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    origin: EventSource = "host"  # "guest": raised by the guest's claims (import_blocked)

    def payload(self, suppressed: int, dropped: int) -> bytes:
        """The JSON a hook receives."""
        return json.dumps(
            {
                "source": "codecage",
                "alert_id": self.alert_id,
                "kind": self.kind,
                "time": self.at.isoformat(timespec="milliseconds"),
                "host": socket.gethostname(),
                "execution_id": self.execution_id,
                "caller": {
                    "kind": self.caller.kind,
                    "name": self.caller.name,
                    "version": self.caller.version,
                },
                "detail": self.detail,
                "origin": self.origin,
                "counts": {**self.counts, "suppressed": suppressed, "dropped": dropped},
            },
            sort_keys=True,
        ).encode("utf-8")


class HookFailed(Exception):
    """A hook did not take an alert; the message is the reason recorded (no secret)."""


class Hook(Protocol):
    target: str  # what is recorded: a webhook's host, a command's name

    def send(self, body: bytes) -> None:
        """Deliver one alert.

        Raises:
            HookFailed: it was not delivered.
        """
        ...


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A webhook that redirects failed: the alert is not carried anywhere else."""

    def redirect_request(self, *_args: object, **_kwargs: object) -> None:
        return None


class Webhook:
    """POSTs each alert as JSON to the operator's URL (directly, or through the host's
    configured HTTP(S)_PROXY, as urllib does)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self.target = webhook_host(url)
        self.timeout_s = timeout_s
        self._opener = urllib.request.build_opener(_NoRedirect)

    def send(self, body: bytes) -> None:
        request = urllib.request.Request(  # noqa: S310 - https, or http to loopback: checked
            self.url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "User-Agent": "codecage-alerts"},
        )
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                response.read(64 * 1024)
        except urllib.error.HTTPError as exc:
            raise HookFailed(f"HTTP {exc.code}") from exc
        except urllib.error.URLError as exc:  # its text names no URL, only the reason
            raise HookFailed(str(exc.reason)[:200]) from exc
        except TimeoutError as exc:
            raise HookFailed(f"no answer within {self.timeout_s:g}s") from exc
        except OSError as exc:
            raise HookFailed(str(exc)[:200]) from exc


class Command:
    """Runs the operator's argv per alert (no shell), the alert as JSON on stdin, in its
    own process group, killed with the group when it takes longer than the timeout."""

    def __init__(self, argv: list[str], timeout_s: float) -> None:
        program = argv[0] if "/" in argv[0] else shutil.which(argv[0])
        if program is None or not os.access(program, os.X_OK):
            raise ConfigError(
                f"[alerts] command: {argv[0]!r} is not an executable program",
                hint="give the absolute path of the program to run for each alert",
            )
        self.argv = [program, *argv[1:]]
        self.target = Path(program).name
        self.timeout_s = timeout_s

    def send(self, body: bytes) -> None:
        env = {k: os.environ[k] for k in _HOOK_ENV if k in os.environ}
        try:
            proc = subprocess.Popen(  # the operator's own argv, no shell
                self.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,  # serve's stdout may be the MCP protocol
                stderr=subprocess.DEVNULL,
                cwd="/",
                env=env,
                process_group=0,
            )
        except OSError as exc:
            raise HookFailed(f"cannot start: {exc.strerror}") from exc
        with proc:
            try:
                proc.communicate(body, timeout=self.timeout_s)
            except subprocess.TimeoutExpired as exc:
                _kill_group(proc)
                raise HookFailed(f"killed after {self.timeout_s:g}s") from exc
        if proc.returncode != 0:
            raise HookFailed(f"exit status {proc.returncode}")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def hooks_of(settings: AlertSettings) -> list[Hook]:
    """The hooks `settings` name.

    Raises:
        ConfigError: the command is not an executable program.
    """
    hooks: list[Hook] = []
    if settings.webhook_url:
        hooks.append(Webhook(settings.webhook_url, settings.timeout))
    if settings.command:
        hooks.append(Command(settings.command, settings.timeout))
    return hooks


class _Budget:
    """`max_per_hour` alerts per trigger; what is over it is counted as suppressed."""

    def __init__(self, per_hour: int) -> None:
        self.per_hour = per_hour
        self._sent: dict[str, collections.deque[float]] = {}
        self._suppressed: collections.Counter[str] = collections.Counter()

    def take(self, kind: str, now: float) -> int | None:
        """None: over the budget (counted); else how many were suppressed since the last
        one of `kind` that was sent."""
        sent = self._sent.setdefault(kind, collections.deque())
        while sent and now - sent[0] >= HOUR_S:
            sent.popleft()
        if len(sent) >= self.per_hour:
            self._suppressed[kind] += 1
            return None
        sent.append(now)
        return self._suppressed.pop(kind, 0)


class _Repeats:
    """Events of one kind from one caller within a window: `count` of them make an alert,
    and the count starts again."""

    def __init__(self, count: int, window_s: float) -> None:
        self.count = count
        self.window_s = window_s
        self._seen: dict[tuple[str, str], collections.deque[float]] = {}

    def add(self, kind: str, who: str, n: int, now: float) -> int | None:
        """The events in the window when this brings them to `count`; else None."""
        seen = self._seen.pop((kind, who), collections.deque())
        while seen and now - seen[0] >= self.window_s:
            seen.popleft()
        seen.extend([now] * min(n, self.count))
        if len(seen) >= self.count:
            return len(seen)  # the caller's count starts again
        self._seen[(kind, who)] = seen  # re-inserted last: the oldest callers go first
        while len(self._seen) > MAX_CALLERS:
            del self._seen[next(iter(self._seen))]
        return None


@dataclass(frozen=True, slots=True)
class _Send:
    alert: Alert
    suppressed: int | None  # None: over the rate, only recorded


@dataclass(frozen=True, slots=True)
class _Check:
    finished: Finished  # validated on the worker for validation_high


class Alerter:
    """Raises, rate-limits, sends and records alerts (see the module docstring).

    Args:
        settings: the `[alerts]` table.
        hooks: where alerts go (None: `hooks_of(settings)`).
        store: the audit store alerts are recorded in; None: logged only.
        scrub: applied to every detail (they come from events, which come from the code).
        validate: static validation of a run's code, for validation_high on runs that
            were not validated before they ran; None: only their validation_finding events.
        clock: monotonic seconds, for the rate limit and the repeat windows.

    Raises:
        ConfigError: the command is not an executable program.
    """

    def __init__(
        self,
        settings: AlertSettings,
        *,
        hooks: list[Hook] | None = None,
        store: AuditStore | None = None,
        scrub: Callable[[str], str] = lambda text: text,
        validate: Callable[[str], ValidationReport] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.hooks = hooks_of(settings) if hooks is None else hooks
        self.store = store
        self._scrub = scrub
        self._validate = validate
        self._clock = clock
        self._on = frozenset(settings.on)
        self._lock = threading.Lock()  # the budget, the repeats and the counts below
        self._budget = _Budget(settings.max_per_hour)
        self._repeats = _Repeats(settings.repeat_count, settings.repeat_window)
        self._dropped = 0
        self._checks_waiting = 0
        self._queue: queue.Queue[_Send | _Check | None] = queue.Queue(QUEUE_MAX)
        self._idle = threading.Condition()
        self._pending = 0  # queued or being handled
        self._worker = threading.Thread(target=self._work, name="codecage-alerts", daemon=True)
        self._worker.start()

    # --- raising (on the caller's thread) ------------------------------------------------

    def __call__(self, finished: Finished) -> None:
        """A `Host.observers` callback: the alerts of one finished run."""
        result = finished.result
        for kind, source in REPEATED_TRIGGERS.items():
            events = [e for e in result.events if e.kind == kind and e.source == source]
            if kind in self._on and events:
                self._repeated(kind, events, finished)
        if "degraded_isolation" in self._on:
            lost = [
                e.detail
                for e in result.events
                if e.kind == "degraded_isolation" and e.source == "host"
            ]
            if lost:
                self._raise("degraded_isolation", finished, "; ".join(lost))
        if "validation_high" in self._on:
            self._validation_high(finished)
        status = f"status:{result.status}"
        if status in self._on:
            error = f": {result.error.type}" if result.error is not None else ""
            self._raise(status, finished, f"the run ended {result.status}{error}")

    def audit_full(self, full: StoreFull) -> None:
        """The audit store became full (an `AuditTrail.on_full` callback): alert when
        audit_full is on. Never raises."""
        if "audit_full" not in self._on:
            return
        try:
            self._offer(Alert("audit_full", Caller("library", name="codecage"), full.reason))
        except Exception:
            log.exception("alert.audit_full_failed")

    def client_blocked(self, client: str | Caller, reason: str) -> None:
        """A client's call was refused (over its rate, its concurrent runs, its largest
        limits): alert when client_blocked is on. Never raises, never waits."""
        if "client_blocked" not in self._on:
            return
        try:
            caller = client if isinstance(client, Caller) else Caller("http", name=client)
            self._offer(Alert("client_blocked", caller, self._detail(reason)))
        except Exception:  # the refusal it reports must go out whatever happens here
            log.exception("alert.client_blocked_failed")

    def _repeated(self, kind: str, events: list[Event], finished: Finished) -> None:
        caller = finished.caller
        with self._lock:
            total = self._repeats.add(kind, caller.label, len(events), self._clock())
        if total is None:
            return
        window = self.settings.repeat_window
        claimed = " reported by the guest (its claim)" if events[-1].source != "host" else ""
        detail = (
            f"{total} {kind} events{claimed} from {caller.label} within {window:g}s; "
            f"the last: {events[-1].detail}"
        )
        counts = {"events": total, "window_s": int(window)}
        self._raise(kind, finished, detail, counts, origin=events[-1].source)

    def _validation_high(self, finished: Finished) -> None:
        findings = [e for e in finished.result.events if e.kind == "validation_finding"]
        high = [e.detail for e in findings if _is_high_security(e.detail)]
        if high:
            self._raise("validation_high", finished, "; ".join(high))
            return
        if findings or self._validate is None:
            return  # validated before it ran, and nothing high
        with self._lock:
            if self._checks_waiting >= CHECKS_MAX:
                log.warning("alert.check_skipped", extra=_ids(finished))
                return
            self._checks_waiting += 1
        self._enqueue(_Check(finished))

    def _raise(
        self,
        kind: str,
        finished: Finished,
        detail: str,
        counts: Mapping[str, int] | None = None,
        origin: EventSource = "host",
    ) -> None:
        alert = Alert(
            kind,
            finished.caller,
            self._detail(detail),
            execution_id=finished.result.execution_id,
            counts=dict(counts or {}),
            origin=origin,
        )
        self._offer(alert)

    def _detail(self, text: str) -> str:
        # Cut before scrubbing too (bounded work on the run's thread), with room to spare:
        # a value cut in two at the first cut is past the second.
        return self._scrub(text[: 4 * MAX_DETAIL])[:MAX_DETAIL]

    def _offer(self, alert: Alert) -> None:
        """Rate-limit `alert`, then hand it to the worker."""
        with self._lock:
            suppressed = self._budget.take(alert.kind, self._clock())
        self._enqueue(_Send(alert, suppressed))

    def _enqueue(self, job: _Send | _Check) -> None:
        with self._idle:
            self._pending += 1
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self._done()
            with self._lock:
                if isinstance(job, _Check):
                    self._checks_waiting -= 1
                else:
                    self._dropped += 1
            log.warning("alert.dropped", extra={"reason": "the alert queue is full"})

    # --- sending (on the worker) ---------------------------------------------------------

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                if isinstance(job, _Check):
                    self._check(job.finished)
                else:
                    self._deliver(job)
            except Exception:  # the worker must outlive any one alert
                log.exception("alert.worker_failed")
            finally:
                self._done()

    def _check(self, finished: Finished) -> None:
        with self._lock:
            self._checks_waiting -= 1
        if self._validate is None:  # only queued with one
            return
        report = self._validate(finished.code)
        high = [
            f"{f.rule_id} high line {f.line}: {f.message}"
            for f in report.findings
            if f.severity == "high" and f.kind == "security"
        ]
        if high:
            self._raise("validation_high", finished, "; ".join(high))

    def _deliver(self, job: _Send) -> None:
        alert = job.alert
        targets = ", ".join(h.target for h in self.hooks)
        if job.suppressed is None:
            self._record(alert, "suppressed", targets)
            return
        with self._lock:
            dropped, self._dropped = self._dropped, 0
        body = alert.payload(job.suppressed, dropped)
        failures = []
        for hook in self.hooks:
            try:
                hook.send(body)
            except HookFailed as exc:
                failures.append(f"{hook.target}: {exc}" if len(self.hooks) > 1 else str(exc))
        self._record(alert, f"failed: {'; '.join(failures)}" if failures else "sent", targets)

    def _record(self, alert: Alert, outcome: str, target: str) -> None:
        """One record per alert (whatever the number of hooks): `target` names them all."""
        extra = {
            "alert_id": alert.alert_id,
            "kind": alert.kind,
            "execution_id": alert.execution_id,
            "caller": alert.caller.label,
            "target": target,
            "outcome": outcome,
        }
        log.log(logging.INFO if outcome == "sent" else logging.WARNING, "alert", extra=extra)
        if self.store is None:
            return
        record = AlertRecord(
            alert_id=alert.alert_id,
            at=alert.at,
            kind=alert.kind,
            execution_id=alert.execution_id,
            caller_name=alert.caller.name,
            detail=alert.detail,
            target=target,
            outcome=outcome,
        )
        try:
            self.store.write_alert(record)
        except AuditError as exc:
            log.error("alert.record_failed", extra={**extra, "error": str(exc)})

    def _done(self) -> None:
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    # --- the end ---------------------------------------------------------------------------

    def flush(self, timeout: float) -> bool:
        """Wait until every alert raised so far is sent and recorded; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Send what is waiting (for at most `timeout` seconds; None: one hook timeout
        per hook), then stop the worker. A hook still stuck is left to its daemon thread:
        closing never hangs."""
        wait = timeout if timeout is not None else self.settings.timeout * len(self.hooks)
        drained = self.flush(wait)
        if not drained:
            log.warning("alert.unsent_at_close", extra={"waiting": self._pending})
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            return
        if drained:
            self._worker.join(wait)


def _is_high_security(detail: str) -> bool:
    """A validation_finding event's detail is "RULE SEVERITY line N: message"."""
    words = detail.split(maxsplit=2)
    return len(words) >= 2 and words[1] == "high" and not words[0].startswith(_NOT_SECURITY)


def _ids(finished: Finished) -> dict[str, str]:
    return {"execution_id": finished.result.execution_id, "caller": finished.caller.label}


def start(
    settings: AlertSettings,
    trail: AuditTrail | None,
    scrub: Callable[[str], str],
    validate: Callable[[str], ValidationReport],
) -> Alerter:
    """An `Alerter` for a host's runs (the host factory passes it among its observers):
    recording in `trail` (if there is one) and scrubbing with `scrub`. Close it before the
    audit trail.

    Raises:
        ConfigError: the command is not an executable program.
    """
    alerter = Alerter(
        settings,
        store=trail.store if trail is not None else None,
        scrub=scrub,
        validate=validate,
    )
    if trail is not None:
        trail.on_full.append(alerter.audit_full)
        if trail.full is not None:  # full already when it opened
            alerter.audit_full(trail.full)
    log.info(
        "alerts.start",
        extra={"targets": [h.target for h in alerter.hooks], "on": sorted(settings.on)},
    )
    return alerter
