"""The library's sessions: `Sandbox(...).session()` gives a `Session`, whose runs share one
interpreter (globals, imports, the workspace) inside one isolated sandbox.

    with Sandbox().session(ttl=600) as s:
        s.run("x = 42")
        s.run("x + 1").return_value   # 43

A thin facade over `codecage.engine.session` through the Host, like `Sandbox` over runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from codecage import host
from codecage.errors import ConfigError, Face
from codecage.models import ExecutionResult, Limits
from codecage.options import describe_validation, limits_hint
from codecage.policy import approval as approvals
from codecage.policy.profiles import ImportPolicy

if TYPE_CHECKING:  # the Host opens it; this face only calls its methods
    from codecage.engine import session as sessions_engine


class Session:
    """An open session; use it as a context manager, or `close()` it.

    Its memory, processes and disk limits are fixed when it is opened; each run sets its
    own timeout, CPU seconds and output cap (`limits={"timeout": 30}`), and all its runs
    together have the session's CPU budget (the config's `[sessions] cpu_seconds`). A run
    that ends the interpreter (the memory limit, `os._exit`, a timeout: the sandbox is
    killed) ends the session: its result carries a `session_ended` event, and the next
    `run` raises SessionError saying why.
    """

    def __init__(
        self,
        runtime: host.Host,
        opened: sessions_engine.Session,
        *,
        allowed_tools: tuple[str, ...] | None,
        face: Face,
        approver: approvals.Approver | None,
    ) -> None:
        self._host = runtime
        self._session = opened
        self._allowed_tools = allowed_tools
        self._face: Face = face
        self._approver = approver

    @property
    def id(self) -> str:
        return self._session.id

    @property
    def limits(self) -> Limits:
        """The session's limits (its runs' defaults)."""
        return self._session.terms.limits

    @property
    def ended(self) -> str | None:
        """Why the session ended, or None while it is open."""
        return self._session.ended

    @property
    def runs(self) -> int:
        return self._session.runs

    def run(
        self,
        code: str,
        *,
        limits: dict[str, Any] | None = None,
        files: Mapping[str, bytes | str] | None = None,
        cancel: threading.Event | None = None,
        on_output: Callable[[str, str], None] | None = None,
    ) -> ExecutionResult:
        """Run `code` in the session: what earlier runs defined is there.

        Args:
            code: Python source; the last expression's value is the return value.
            limits: this run's timeout, cpu_seconds and max_output_bytes (the rest is the
                session's).
            files: written into the session's /workspace before the code runs.
            cancel: set it to kill the run (which ends the session).
            on_output: called with ("stdout" | "stderr", text) as the run prints, as for
                `Sandbox.run`.

        Raises:
            SessionError: the session has ended (the message says why).
            ConfigError: the request was refused before anything ran.
            SandboxError: the sandbox broke down.
        """
        request = host.Request(
            host.Program(code, files=host.input_files(files)),
            limits=self._run_limits(limits),
            policy=self._session.terms.policy,
            allowed_tools=self._allowed_tools,
            session_id=self.id,
            asker=host.Asker(face=self._face, approve=self._approver),
            hooks=host.Hooks(cancel=cancel, on_output=on_output),
        )
        return self._host.run(request)

    async def arun(
        self,
        code: str,
        *,
        limits: dict[str, Any] | None = None,
        files: Mapping[str, bytes | str] | None = None,
    ) -> ExecutionResult:
        """`run()` for asyncio callers, in a worker thread; cancelling the task kills the
        run (and so ends the session).

        Raises:
            SessionError: the session has ended (the message says why).
            ConfigError: the request was refused before anything ran.
            SandboxError: the sandbox broke down.
        """
        import asyncio  # here: a plain `run` (the CLI's) need not pay its import (~15 ms)

        cancel = threading.Event()
        try:
            return await asyncio.to_thread(
                self.run, code, limits=limits, files=files, cancel=cancel
            )
        except asyncio.CancelledError:
            cancel.set()
            raise

    def read_file(self, path: str, *, max_bytes: int = 64 * 1024 * 1024) -> bytes:
        """The content of a file in the session's /workspace as it is now, by its path
        relative to /workspace (as `result.files` lists it); regular files only, never
        through a link. (A session run's result keeps no copies: the files stay here.)

        Raises:
            SessionError: the session has ended.
            ConfigError: no such regular file, a link on the way, or over `max_bytes`.
        """
        return self._session.read_file(path, max_bytes=max_bytes)

    def close(self) -> None:
        """End the session and destroy its sandbox; closing twice does nothing."""
        if self._session.ended is None:
            self._host.sessions.close(self.id, self._session.terms.owner)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc: object) -> None:
        import asyncio  # as in `arun`

        await asyncio.to_thread(self.close)

    def _run_limits(self, overrides: dict[str, Any] | None) -> Limits:
        """The session's limits with this run's own overrides.

        Raises:
            ConfigError: an override is out of its bounds or not a run's to set.
        """
        chosen = {name: value for name, value in (overrides or {}).items() if value is not None}
        if not chosen:
            return self.limits
        try:
            return self.limits.merged(chosen)
        except ValidationError as exc:
            raise ConfigError(describe_validation(exc), hint=limits_hint(exc)) from exc


def open_session(
    runtime: host.Host,
    *,
    policy: ImportPolicy | None,
    allowed_tools: tuple[str, ...] | None,
    face: Face,
    approver: approvals.Approver | None,
    ttl: float | None,
    lifetime: float | None,
    limits: Limits,
    allow_hosts: Iterable[str] | None = None,
) -> Session:
    """Open a session on `runtime` for a face whose runs have `policy`, `allowed_tools` and
    `approver` (see `Sandbox.session`).

    Raises:
        SessionError: as many sessions are open as allowed.
        ConfigError: a host asked for is outside what the operator permits.
        HostError, SandboxError: no sandbox could be made.
    """
    egress, run_policy = runtime.network_for(policy, allow_hosts, face)
    opened = runtime.open_session(
        host.SessionRequest(
            limits=limits,
            policy=run_policy,
            idle_ttl=ttl,
            lifetime=lifetime,
            face=face,
            egress=egress,
        )
    )
    return Session(runtime, opened, allowed_tools=allowed_tools, face=face, approver=approver)
