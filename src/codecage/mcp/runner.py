"""The server's runner: one host runtime for every call, the queue in front of it, and one
run of `execute_code` (its limits, its import policy, its files read back).

Executions run in worker threads, at most `max_concurrent` at once; up to `max_queued` more
wait, and past that a call is refused with a clear "busy" error that says when to retry.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolResult, ContentBlock

from codecage.audit import Caller, tracing
from codecage.audit.metrics import ServerMetrics
from codecage.audit.record import RecordedEvent
from codecage.egress.rules import EgressPolicy
from codecage.errors import CapacityError, CodecageError, ConfigError
from codecage.host import Host, Request
from codecage.mcp import files as run_files
from codecage.mcp.arguments import current_call, refusal
from codecage.mcp.clients import ClientLimits
from codecage.models import ExecutionResult, FileInfo, Limits
from codecage.policy.profiles import ImportPolicy
from codecage.policy.scrub import merge_counts

MCP_CALLER = Caller("mcp")  # a call whose context names no client
_MAX_CACHED_PROFILES = 16
BUSY_RETRY_S = 1
"""The retry time a "busy" refusal names (the HTTP refusals' `Retry-After` is 1 s too)."""


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What a call may ask for at most (the server's configured maximums)."""

    max_timeout: float = 120.0
    max_memory_mb: int = 2048
    max_concurrent: int = 4
    max_queued: int = 32
    reply_max_tokens: int | None = None
    """Estimated tokens a reply may take (None: the config's [serve] reply_max_tokens)."""


class Busy(ToolError):
    """The server's queue is full: retry in `BUSY_RETRY_S` (a face over HTTP answers 503)."""


@dataclass(slots=True)
class Runner:
    """What every call of the server shares: the `Host` built once from the server's
    options (it runs every call, one warm pool for all), the import policies of the
    profiles called so far, and the queue."""

    host: Host
    limits: ServerLimits
    slots: anyio.Semaphore
    waiting: int = 0
    metrics: ServerMetrics | None = None  # serve --http's /metrics: the queue's waits
    client_limits: ClientLimits | None = None  # [serve.clients.NAME]'s bounds (HTTP)
    policies: dict[str, ImportPolicy | None] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note_trimmed(self, execution_id: str, built: CallToolResult) -> None:
        """Put the reply's `reply_trimmed` event on the run's audit record (the reply is
        made after the record: the trail adds it)."""
        trail = self.host.audit
        if trail is None:
            return
        events = (built.structured_content or {}).get("events") or []
        trimmed = [
            RecordedEvent(kind="reply_trimmed", detail=str(e.get("detail", "")), source="host")
            for e in events
            if isinstance(e, dict) and e.get("kind") == "reply_trimmed"
        ]
        trail.note(execution_id, trimmed)

    # --- named HTTP clients ([serve.clients.NAME], mcp/clients.py) --------------------------

    def named_client(self, caller: Caller) -> str | None:
        """The [serve.clients] name of an HTTP caller, or None (stdio, or no clients)."""
        return caller.name if caller.kind == "http" and caller.name else None

    def within_client(
        self, client: str | None, timeout: float | None, memory_mb: int | None
    ) -> tuple[float | None, int | None]:
        """A call's timeout and memory within its client's bounds: above them it is refused;
        unasked, the server's default is lowered to the bound.

        Raises:
            ToolError: the call asks for more than its client may.
        """
        if self.client_limits is None:
            return timeout, memory_mb
        default = self.host.limits
        try:
            return self.client_limits.within(
                client,
                timeout=timeout,
                memory_mb=memory_mb,
                defaults=(default.timeout, default.memory_mb),
            )
        except CodecageError as exc:
            raise ToolError(refusal(exc)) from exc

    def admit(self, client: str | None) -> None:
        """Count the call against its client's rate and concurrent runs (`release` after).

        Raises:
            ToolError: the client is over its rate or at its concurrent runs; says when to retry.
        """
        if self.client_limits is None:
            return
        try:
            self.client_limits.admit(client)
        except CodecageError as exc:
            raise ToolError(refusal(exc)) from exc

    def release(self, client: str | None) -> None:
        if self.client_limits is not None:
            self.client_limits.done(client)

    def __post_init__(self) -> None:
        if self.host.options.policy is not None:
            self.policies[self.host.options.policy.profile] = self.host.options.policy

    def policy_for(
        self, profile: str | None, allowed_imports: list[str] | None
    ) -> ImportPolicy | None:
        """The import policy of a call (None when the server runs without one).

        A single profile's policy is kept, and its sandboxes kept warm. Combinations
        ("basic,filesystem", in any order) and calls with extra imports get their own policy
        per call, kept by nobody: callers must not be able to make the pool keep a key, and
        memory, per spelling or import list. Their runs start cold.

        Raises:
            ToolError: an unknown profile, or one the operator did not enable.
        """
        if self.host.options.policy is None:
            return None
        name = profile or self.host.settings.profile
        try:
            if allowed_imports:
                return self.host.policy(name, allowed_imports)
            with self.lock:
                if name in self.policies:
                    return self.policies[name]
            policy = self.host.policy(name)
        except ConfigError as exc:
            raise ToolError(refusal(exc)) from exc
        if "," not in name:
            self.host.keep_warm(policy)
        with self.lock:
            if len(self.policies) < _MAX_CACHED_PROFILES:
                self.policies.setdefault(name, policy)
        return policy

    def network_for(
        self, policy: ImportPolicy | None, allow_hosts: list[str] | None
    ) -> tuple[EgressPolicy | None, ImportPolicy | None]:
        """A call's egress (the server's hosts and its `allow_hosts`, within the ceiling)
        and its import policy (with the network modules when it has egress).

        Raises:
            ToolError: an allow_hosts rule is malformed, outside the ceiling, or denied.
        """
        try:
            return self.host.network_for(policy, allow_hosts, "mcp")
        except ConfigError as exc:
            raise ToolError(refusal(exc)) from exc

    def call_limits(self, timeout: float | None, memory_mb: int | None) -> Limits:
        """The defaults with a call's timeout and memory, within the server's maximums.

        Raises:
            ToolError: above a maximum, or out of the limits' bounds.
        """
        limits = self.limits
        if timeout is not None and timeout > limits.max_timeout:
            raise ToolError(
                f"timeout={timeout:g} is above this server's maximum of {limits.max_timeout:g} s; "
                "ask for less, or split the work"
            )
        if memory_mb is not None and memory_mb > limits.max_memory_mb:
            raise ToolError(
                f"memory_limit_mb={memory_mb} is above this server's maximum of "
                f"{limits.max_memory_mb} MiB"
            )
        if timeout is None and memory_mb is None:
            return self.host.limits
        try:
            return self.host.limits.merged({"timeout": timeout, "memory_mb": memory_mb})
        except ValueError as exc:
            raise ToolError(f"invalid limits: {exc}") from exc

    def session_limits(self, session_id: str, client: str, timeout: float | None) -> Limits:
        """A run's limits in session `session_id`: the session's, with this call's timeout.

        Raises:
            ToolError: no such session for this client, or the timeout is over the maximum.
        """
        try:
            session = self.host.sessions.get(session_id, client)
        except CodecageError as exc:
            raise ToolError(refusal(exc)) from exc
        if timeout is None:
            return session.terms.limits
        self.call_limits(timeout, None)  # the same bound as any call's
        return session.terms.limits.merged({"timeout": timeout})

    async def queued(self, job: Any, cancel: threading.Event) -> Any:
        """Run `job` in a worker thread once a slot is free; refuse when too many wait. When
        the call is cancelled (its client went away), `cancel` is set: the job kills its
        sandbox. (The counter is only touched on the event loop's thread.)"""
        # Only a call that finds no free slot waits (with --max-queued 0, every call
        # was refused, an idle server's too).
        if self.slots.value == 0 and self.waiting >= self.limits.max_queued:
            raise Busy(  # says when, as the HTTP refusals' Retry-After does
                f"the server is busy: {self.waiting} executions are waiting already; "
                f"retry in {BUSY_RETRY_S} s"
            )
        self.waiting += 1
        waiting_since = time.monotonic()
        try:
            await self.slots.acquire()
        finally:
            self.waiting -= 1
            waited_s = time.monotonic() - waiting_since
            if (call := current_call.get()) is not None:
                call.queue_ms = waited_s * 1000
        if self.metrics is not None:
            self.metrics.queue_waited(waited_s)
        try:
            return await anyio.to_thread.run_sync(job, abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            cancel.set()
            raise
        finally:
            self.slots.release()

    def execute(
        self, request: Request, *, return_files: list[str]
    ) -> tuple[ExecutionResult, list[ContentBlock]]:
        """One run, as a request to the host runtime (`request` as the tool built it, for
        the face "mcp"). Uploads (its `files`) go into the run's fresh workspace (its tmpfs,
        bounded by workspace_mb, removed with it) before the code runs. Images and the
        asked-for files are read from the workspace after the run, before it is removed (a
        warm sandbox's workspace too).

        Raises:
            ToolError: what the caller must fix.
        """
        blocks: list[ContentBlock] = []
        redacted: list[dict[str, int]] = []
        scrubber = self.host.scrubber

        def read_back(workspace: Path, written: list[FileInfo]) -> None:
            found, counts = run_files.files_back(workspace, written, return_files, scrubber)
            blocks.extend(found)
            redacted.append(counts)

        request = dataclasses.replace(
            request, hooks=dataclasses.replace(request.hooks, on_files=read_back)
        )
        call = current_call.get()
        policy = request.policy
        profile = (
            policy.profile if policy is not None else "session" if request.session_id else None
        )
        try:
            with tracing.run_span(profile, call.queue_ms if call else None) as span:
                result = self.host.run(request)
                span.ended(result)
        except CapacityError as exc:  # every node of the cluster full: busy, as the queue is
            raise Busy(f"{exc}; retry in {exc.retry_after_s} s") from exc
        except CodecageError as exc:
            raise ToolError(refusal(exc)) from exc
        if not any(redacted):
            return result, blocks
        # model_copy keeps the private raw output (the CLI's --raw reads it)
        counted = merge_counts(result.redactions, *redacted)
        return result.model_copy(update={"redactions": counted}), blocks
