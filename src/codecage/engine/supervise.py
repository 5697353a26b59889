"""Watching one running sandbox from the host: output caps, the control channel, and the
wall-clock and CPU limits. Everything here is what the host *observes*; nothing the guest
says decides how the run ended.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable

from codecage.backends.base import SandboxProcess
from codecage.engine.judge import ControlStream, Observation
from codecage.isolation import cgroups
from codecage.isolation.cgroups import CgroupHandle
from codecage.output import CappedBuffer

log = logging.getLogger(__name__)

_READ_CHUNK = 1 << 16
_CPU_POLL_S = 0.05
_DRAIN_AFTER_EXIT_S = 2.0


def supervise(
    proc: SandboxProcess,
    control: socket.socket,
    request: bytes,
    *,
    kill: Callable[[], None],
    messages: ControlStream,
    started: float,
    wall_timeout_s: float,
    cpu_limit_ms: int,
    cpu_baseline_ms: int = 0,
    output_cap_bytes: int,
    cgroup: CgroupHandle | None,
    cancel: threading.Event | None = None,
    keep_open: bool = False,
    on_output: Callable[[str, bytes], None] | None = None,
) -> Observation:
    """Send `request`, then read until the sandbox is gone or a limit ends it.

    `keep_open`: a session's run, whose guest says "end" and waits for the next request
    with the socket open: the "end" alone ends the run.

    `cpu_baseline_ms` is the cgroup's CPU time before the request (a warm sandbox's start).

    What comes on `control` is fed to `messages` as it arrives (parsed there, once). Once it
    holds the guest's last message ("end"), and the guest shut its end of the control
    socket, the run is over without waiting for the sandbox to exit: the caller answers the
    guest, which stops itself then (the bootstrap's `_end_run`), and destroys the sandbox
    later. The guest flushed its
    output before, so what is in the pipes then is all of it.

    `kill` kills the whole sandbox (`StartedSandbox.kill`): on the wall-clock or CPU limit,
    or once `cancel` is set (checked at least every 50 ms).

    `on_output` is given each chunk read from the program's output ("stdout" or "stderr",
    the bytes) as it arrives, beside the capped buffers; it must not block (see
    `engine.stream.OutputStream.feed`).
    """
    seen = Observation(
        # Head and tail, half each: the end of the output is where results and errors are.
        stdout=CappedBuffer(output_cap_bytes, tail_bytes=output_cap_bytes // 2),
        stderr=CappedBuffer(output_cap_bytes, tail_bytes=output_cap_bytes // 2),
        control=messages,
    )
    deadline = started + wall_timeout_s
    pending = memoryview(request)
    control.setblocking(False)
    streams = {
        proc.stdout.fileno(): _sink(seen.stdout, "stdout", on_output),
        proc.stderr.fileno(): _sink(seen.stderr, "stderr", on_output),
    }
    for fd in streams:
        os.set_blocking(fd, False)
    pidfd = _exit_fd(proc.pid)
    with selectors.DefaultSelector() as sel, contextlib.closing(_Fd(pidfd)):
        for fd in streams:
            sel.register(fd, selectors.EVENT_READ)
        sel.register(control, selectors.EVENT_READ | selectors.EVENT_WRITE)
        sel.register(pidfd, selectors.EVENT_READ)
        exited_at: float | None = None
        next_cpu_check = time.monotonic() + _CPU_POLL_S
        while True:
            now = time.monotonic()
            if exited_at is None and now >= deadline and not seen.killed_by_host:
                seen.timed_out = True
                _kill(kill, seen)
            if cancel is not None and cancel.is_set() and not seen.killed_by_host:
                seen.cancelled = True
                _kill(kill, seen)
            if (
                exited_at is None
                and cgroup is not None
                and now >= next_cpu_check
                and not seen.killed_by_host
            ):
                next_cpu_check = now + _CPU_POLL_S
                used = cgroups.cpu_usage_ms(cgroup)
                if used is not None and used - cpu_baseline_ms >= cpu_limit_ms:
                    seen.cpu_exceeded = True
                    _kill(kill, seen)
            open_streams = len(sel.get_map()) - (1 if exited_at is None else 0)
            if exited_at is not None and (
                open_streams == 0 or now - exited_at > _DRAIN_AFTER_EXIT_S
            ):
                break
            timeout = _next_wakeup(now, deadline, next_cpu_check, cgroup, exited_at)
            if (seen.killed_by_host and exited_at is None) or cancel is not None:
                # Killed: only waiting for the exit to be reported; or watching `cancel`.
                timeout = min(timeout, 0.05)
            for key, mask in sel.select(timeout):
                fd = key.fd
                if fd == pidfd:
                    sel.unregister(pidfd)
                    exited_at = time.monotonic()
                    seen.exit = proc.wait()
                elif key.fileobj is control:
                    if mask & selectors.EVENT_WRITE and pending:
                        pending = _send_some(control, pending)
                    if not pending:
                        sel.modify(control, selectors.EVENT_READ)
                    if mask & selectors.EVENT_READ and not _read_into(
                        control.fileno(), messages.feed
                    ):
                        sel.unregister(control)
                        seen.reported = (
                            exited_at is None and not seen.killed_by_host and messages.ended
                        )
                    elif keep_open and messages.ended:
                        seen.reported = exited_at is None and not seen.killed_by_host
                elif not _read_into(fd, streams[fd]):
                    sel.unregister(fd)
            if seen.reported:
                break
    seen.wall_s = time.monotonic() - started
    if seen.reported:
        for fd, sink in streams.items():
            _read_into(fd, sink)  # what the guest wrote before its report
        return seen
    if seen.exit is None:  # drained past the grace period: make sure it is gone
        _kill(kill, seen)
        seen.exit = proc.wait()
    return seen


def _sink(
    buffer: CappedBuffer, name: str, on_output: Callable[[str, bytes], None] | None
) -> Callable[[bytes], None]:
    """Where a stream's chunks go: its capped buffer, and `on_output` when there is one."""
    if on_output is None:
        return buffer.append

    def both(chunk: bytes) -> None:
        buffer.append(chunk)
        on_output(name, chunk)

    return both


def _exit_fd(pid: int) -> int:
    """A descriptor readable once `pid` has exited: its pidfd; or, when it is already gone
    and reaped (a warm sandbox forked from a template that died meanwhile), one readable at
    once, so that the loop reads its exit status (`proc.wait`) as for any other end."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return os.eventfd(1)


class _Fd:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _next_wakeup(
    now: float,
    deadline: float,
    next_cpu_check: float,
    cgroup: CgroupHandle | None,
    exited_at: float | None,
) -> float:
    if exited_at is not None:
        return max(0.0, exited_at + _DRAIN_AFTER_EXIT_S - now)
    wake = deadline
    if cgroup is not None:
        wake = min(wake, next_cpu_check)
    return max(0.0, wake - now)


def _send_some(control: socket.socket, pending: memoryview) -> memoryview:
    try:
        sent = control.send(pending)
    except BlockingIOError:
        return pending
    except OSError:
        return pending[len(pending) :]  # the guest is gone; the exit tells the rest
    return pending[sent:]


def _read_into(fd: int, sink: Callable[[bytes], None]) -> bool:
    """Read what is there into `sink` (which discards past its cap). False at EOF."""
    while True:
        try:
            chunk = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not chunk:
            return False
        sink(chunk)


def _kill(kill: Callable[[], None], seen: Observation) -> None:
    seen.killed_by_host = True
    kill()
