"""Judging one run from what the host observed: how it ended, what the guest said, the result.

Pure: no I/O, no clock, no process. The engine hands in what it observed (`Observation`,
filled by `supervise`; the guest's control messages, parsed as they arrived by
`ControlStream`; usage and files it measured) and gets back the status and the
`ExecutionResult`. What the guest says never decides how the run ended; it only tells a
voluntary exit from a death by signal where the backend cannot (`ExitStatus`).
"""

from __future__ import annotations

import contextlib
import json
import signal
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from codecage.backends.base import ExitStatus
from codecage.errors import SandboxError
from codecage.guest import contract
from codecage.models import (
    DisplayOutput,
    ErrorInfo,
    Event,
    ExecutionResult,
    FileInfo,
    GuestDisplay,
    GuestEnd,
    GuestReady,
    GuestResult,
    Limits,
    Status,
    Usage,
)
from codecage.output import CappedBuffer, neutralise, neutralise_text
from codecage.policy.profiles import ImportPolicy


@dataclass(slots=True)
class GuestMessages:
    """What the guest said on the control socket, validated."""

    ready: bool = False
    report: GuestResult | None = None
    exit_code: int | None = None  # from the main process's "end": the run is over
    problems: list[str] = field(default_factory=list)  # what was malformed: the first few
    problem_count: int = 0  # every malformed line (only the first MAX_PROBLEMS are kept)
    displays: list[GuestDisplay] = field(default_factory=list)  # the main process's, in order
    displays_bytes: int = 0  # their lines' bytes together
    displays_refused: list[str] = field(default_factory=list)  # why: the first few
    displays_refused_count: int = 0  # every output left out


MAX_PROBLEMS = 8
"""Malformed guest lines whose reason is kept: the rest are only counted (the reason of a
15-byte line can be 500 bytes, and the guest sends up to the control cap of them)."""


_MIN_MESSAGE_BYTES = len(b'{"v":1,"kind":"ready","pid":0}')
"""No valid guest message is shorter (each has at least these three fields)."""


class ControlStream:
    """The guest's control messages, parsed once, line by line as they arrive.

    The bootstrap sends its result after the user's code has finished, then "end", so the
    *last* valid messages of the main process (the pid it announced as ready, before any
    user code ran) win: what the code wrote to the control socket earlier, and the reports
    of processes it forked (they return through the bootstrap too), are overridden or
    ignored. A warm sandbox said it was ready (`ready_pid`) before the request was sent.
    Past `cap_bytes` the rest is discarded (`truncated`); anything malformed is noted in
    `said.problems`, never trusted. "display" lines of the main process are kept in order
    within the contract's caps, enforced here again whatever the guest did: a line over
    `MAX_DISPLAY_BYTES` is refused unparsed, and past `MAX_DISPLAYS` outputs or
    `MAX_DISPLAYS_BYTES` together the rest are refused (`said.displays_refused`).
    """

    def __init__(self, cap_bytes: int, *, ready_pid: int | None) -> None:
        self.said = GuestMessages(ready=ready_pid is not None)
        self.truncated = False
        self._main_pid = ready_pid
        self._room = cap_bytes
        self._pending = bytearray()  # an unfinished line

    @property
    def ended(self) -> bool:
        """The main process said "end", and nothing unfinished follows it."""
        return self.said.ready and self.said.exit_code is not None and not self._pending

    def feed(self, chunk: bytes) -> None:
        """Parse the complete lines `chunk` finishes; keep the rest for the next one."""
        if len(chunk) > self._room:
            self.truncated = True
            chunk = chunk[: self._room]
        self._room -= len(chunk)
        start = len(self._pending)
        self._pending += chunk
        end = self._pending.rfind(b"\n", start)
        if end < 0:
            return
        lines = bytes(self._pending[:end])
        del self._pending[: end + 1]
        for line in lines.split(b"\n"):
            self._line(line)

    def finish(self) -> GuestMessages:
        """What was said, once no more comes: an unfinished last line is malformed."""
        if self._pending:
            self._line(bytes(self._pending))
            self._pending.clear()
        return self.said

    def _line(self, line: bytes) -> None:
        if not line:
            return
        if line[:1] != b"{" or len(line) < _MIN_MESSAGE_BYTES:
            # Refused before the (costlier) parser: a flood of short lines cost the host
            # ~3 µs each, 10 s of CPU for the control cap's worth of "{}".
            self._problem("not a JSON object" if line[:1] != b"{" else "too short")
            return
        said = self.said
        if line.startswith(b'{"v":1,"kind":"display"') and self._display_refused(len(line)):
            return
        try:
            message = json.loads(line)
            if not isinstance(message, dict):
                raise ValueError(f"not a JSON object: {type(message).__name__}")
            kind = message.get("kind")
            if kind == contract.KIND_DISPLAY:
                self._display(message, len(line))
            elif kind == contract.KIND_READY and not said.ready:
                self._main_pid = GuestReady.model_validate(message).pid
                said.ready = True
            elif kind == contract.KIND_RESULT:
                report = GuestResult.model_validate(message)
                if report.pid == self._main_pid:
                    said.report = report
            elif kind == contract.KIND_END:
                end = GuestEnd.model_validate(message)
                if end.pid == self._main_pid:
                    said.exit_code = end.exit_code
            else:
                raise ValueError("unexpected message")
        except RecursionError:
            self._problem("nested too deeply to parse")
        except (ValueError, ValidationError) as exc:
            self._problem(exc)

    def _problem(self, why: object) -> None:
        """Note one malformed line; its reason (made only here: costly for a validation
        error) is kept for the first few."""
        said = self.said
        said.problem_count += 1
        if len(said.problems) < MAX_PROBLEMS:
            said.problems.append(str(why))

    def _display_refused(self, size: int) -> bool:
        """Whether a display line of `size` bytes is over a cap (then noted, not parsed).
        A line spelled otherwise is checked in `_display`, after parsing: by then the
        cap on all the guest's bytes has bounded it."""
        said = self.said
        if size > contract.MAX_DISPLAY_BYTES:
            why = f"{size:,} bytes, over the {contract.MAX_DISPLAY_BYTES:,} an output may have"
        elif len(said.displays) >= contract.MAX_DISPLAYS:
            why = f"past the {contract.MAX_DISPLAYS} outputs a run may have"
        elif said.displays_bytes + size > contract.MAX_DISPLAYS_BYTES:
            why = f"past the {contract.MAX_DISPLAYS_BYTES:,} bytes a run's outputs may have"
        else:
            return False
        said.displays_refused_count += 1
        if len(said.displays_refused) < MAX_PROBLEMS:
            said.displays_refused.append(why)
        return True

    def _display(self, message: dict[str, Any], size: int) -> None:
        if self._display_refused(size):
            return
        display = GuestDisplay.model_validate(message)
        if display.pid == self._main_pid:  # a forked process's outputs are not the run's
            self.said.displays.append(display)
            self.said.displays_bytes += size


@dataclass(slots=True)
class Observation:
    """What the host saw of one run (filled by `engine.supervise.supervise`)."""

    stdout: CappedBuffer
    stderr: CappedBuffer
    control: ControlStream
    exit: ExitStatus | None = None  # None: it never exited while watched (see `reported`)
    timed_out: bool = False
    cpu_exceeded: bool = False
    wall_s: float = 0.0
    killed_by_host: bool = False
    reported: bool = False  # ended when the guest's final report came, before its exit
    cancelled: bool = False  # the caller gave up on the run (e.g. its client went away)
    interrupted: bool = False  # a session's run stopped by its guest at the timeout


def guest_messages(seen: Observation) -> tuple[GuestMessages, list[Event]]:
    """The guest's messages, and an event when any was malformed (noted once).

    When the run ended at the guest's "end" (`seen.reported`), the exit code it announced
    is the run's: it stops instead of exiting (the bootstrap's `_end_run`).
    """
    said = seen.control.finish()
    problems = list(said.problems)
    count = said.problem_count
    if seen.control.truncated:
        problems.insert(0, "the guest's messages were over the size bound")
        count += 1
    events = []
    if problems:
        detail = f"ignored {count} malformed guest message(s); first: {problems[0]}"
        events.append(Event(kind="guest_report_invalid", detail=detail[:300]))
    if seen.reported and said.exit_code is not None:
        seen.exit = ExitStatus(code=said.exit_code)
    return said, events


def check_started(seen: Observation, said: GuestMessages) -> None:
    """Refuse to judge a run whose guest never got ready (unless a limit ended it first).

    Raises:
        SandboxError: the sandbox failed to start.
    """
    if said.ready or seen.timed_out or seen.cpu_exceeded or seen.cancelled:
        return
    how = seen.exit.describe() if seen.exit is not None else "no exit"
    raise SandboxError(
        "the sandbox failed to start: " + (neutralise(seen.stderr.data).strip()[:2000] or how),
        hint="run {doctor} to check this host's isolation layers",
    )


def _signal_name(number: int | None) -> str | None:
    if number is None:
        return None
    with contextlib.suppress(ValueError):
        return signal.Signals(number).name
    return None


def judge_status(
    seen: Observation, report: GuestResult | None, *, oom: bool, limits: Limits, usage: Usage
) -> tuple[Status, int | None, str | None]:
    """Status, exit code and signal name, from what the host observed.

    The guest's report only tells a voluntary exit (it reported, then exited) from a death
    by signal with the same exit code; it can never turn a limit into "ok".
    """
    end = seen.exit or ExitStatus(code=None)
    code = end.code
    # A signal the backend is sure of, or one it cannot tell from an exit code when the
    # guest did not report (a process that reports exits of its own accord).
    certain = code is None or report is None
    signal_name = _signal_name(end.signal) if certain else None
    exit_code = None if signal_name is not None or seen.killed_by_host else code
    if seen.timed_out:
        return "timeout", None, "SIGKILL"
    if seen.interrupted:
        return "timeout", None, "SIGALRM"
    if seen.cancelled:
        return "killed", None, "SIGKILL"
    cpu_used = usage.cpu_ms is not None and usage.cpu_ms >= limits.cpu_seconds * 1000
    if seen.cpu_exceeded or end.signal == signal.SIGXCPU or (cpu_used and code != 0):
        return "cpu_limit", None, signal_name or "SIGKILL"
    crashed = code != 0 or signal_name is not None
    if oom and crashed:
        return "memory_limit", exit_code, signal_name
    if signal_name is not None:
        return "killed", None, signal_name
    if code == 0:
        return "ok", 0, None
    return "error", exit_code, None


@dataclass(frozen=True, slots=True)
class Measured:
    """What the host measured of a run besides its observation (cgroup, workspace)."""

    usage: Usage
    oom: bool  # the cgroup counted an OOM kill during the run
    by_cgroup: bool  # a memory cgroup held the limit (else RLIMIT_AS)
    files: list[FileInfo]
    files_truncated: bool
    workspace_full: Event | None


def build_result(
    *,
    execution_id: str,
    backend: str,
    limits: Limits,
    policy: ImportPolicy | None,
    degraded: tuple[str, ...],
    seen: Observation,
    said: GuestMessages,
    events: list[Event],
    measured: Measured,
    egress: bool = False,
) -> ExecutionResult:
    """The run's result: status judged, the guest's text neutralised (once, here), events
    in a fixed order (host's, policy's, guest's, limits', degradation). `egress`: the run
    was allowed hosts (the network profile's "no host" event is then not made)."""
    report = said.report
    usage = measured.usage
    status, exit_code, signal_name = judge_status(
        seen, report, oom=measured.oom, limits=limits, usage=usage
    )
    error = _error_of(report)
    if status == "memory_limit" and error is None:
        error = ErrorInfo(
            type="MemoryError",
            message=f"the sandbox was killed for using more than {limits.memory_mb} MiB",
            traceback="",
        )
    all_events = [*events, *_policy_events(policy, egress), *_guest_events(report)]
    all_events += _refused_displays_events(said)
    all_events += _limit_events(seen, measured.files_truncated, limits)
    if seen.cancelled:
        all_events.append(Event(kind="cancelled", detail="the caller cancelled the run"))
    if measured.workspace_full is not None:
        all_events.append(measured.workspace_full)
    all_events += [
        Event(kind="degraded_isolation", detail=f"layer not in force: {layer}")
        for layer in degraded
    ]
    if (
        not measured.by_cgroup
        and status == "error"
        and error is not None
        and error.type == "MemoryError"
    ):
        # Without a memory cgroup the limit is RLIMIT_AS, which the host cannot observe:
        # hitting it surfaces as MemoryError. (With a cgroup, only an OOM kill counts.)
        status = "memory_limit"
    return ExecutionResult(
        execution_id=execution_id,
        status=status,
        exit_code=exit_code,
        signal=signal_name,
        stdout=neutralise(seen.stdout.data),
        stderr=neutralise(seen.stderr.data),
        stdout_truncated=seen.stdout.truncated,
        stderr_truncated=seen.stderr.truncated,
        return_value=_return_value_of(report, status),
        error=error,
        files=measured.files,
        usage=usage,
        limits=limits,
        events=all_events,
        backend=backend,
        displays=_displays_of(said),
    ).with_raw_output(seen.stdout.data, seen.stderr.data)


def _displays_of(said: GuestMessages) -> list[DisplayOutput]:
    """The main process's outputs, in the order it sent them, numbered from 0. Kept
    whatever the status: they were made before the run ended, like its output."""
    return [
        DisplayOutput(index=index, source=display.source, data=display.data)
        for index, display in enumerate(said.displays)
    ]


def _refused_displays_events(said: GuestMessages) -> list[Event]:
    refused = said.displays_refused
    if not refused:
        return []
    return [
        Event(
            kind="display_truncated",
            detail=f"the host left out {said.displays_refused_count} display output(s): "
            f"{refused[0]}",
            data={"left_out": said.displays_refused_count},
        )
    ]


def _error_of(report: GuestResult | None) -> ErrorInfo | None:
    if report is None or report.error is None:
        return None
    e = report.error
    return ErrorInfo(
        type=neutralise_text(e.type)[:200],
        message=neutralise_text(e.message)[:10_000],
        traceback=neutralise_text(e.traceback)[:50_000],
    )


def _return_value_of(report: GuestResult | None, status: Status) -> Any:
    if report is None or status != "ok":
        return None
    # Data, kept as the code returned it: JSON escapes control characters, and the CLI's
    # human mode neutralises what it prints.
    return report.return_value


def _policy_events(policy: ImportPolicy | None, egress: bool) -> list[Event]:
    if egress or policy is None or "network" not in policy.profile.split(","):
        return []
    return [
        Event(
            kind="network_denied",
            detail="the network profile allows network modules, but this run was allowed "
            "no host: it has no network and connections will be refused (allow hosts with "
            "--allow-host, allow_hosts=[...], or the config's [network] allow)",
        )
    ]


def _guest_events(report: GuestResult | None) -> list[Event]:
    """The guest's events, marked as its claims: the code writes its control stream and can
    say anything there (a forged `network_denied` must not count as one the host saw)."""
    if report is None:
        return []
    return [
        Event(kind=e.kind, detail=neutralise_text(e.detail), source="guest") for e in report.events
    ]


def _limit_events(seen: Observation, files_truncated: bool, limits: Limits) -> list[Event]:
    events: list[Event] = []
    for name, buf in (("stdout", seen.stdout), ("stderr", seen.stderr)):
        if buf.truncated:
            events.append(
                Event(
                    kind="output_truncated",
                    detail=f"{name}: kept {limits.max_output_bytes} of {buf.total_bytes} bytes "
                    "(head and tail, the middle cut)",
                )
            )
    if files_truncated:
        events.append(
            Event(kind="files_truncated", detail="too many or too large files to list them all")
        )
    return events
