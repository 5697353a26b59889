"""The local server's side of `codecage run`'s hand-off (cli/handoff.py, which says why and
when): POST /cli/run on `codecage serve --http --uds` when it is the user's local server
(cli/local.py) started with no flag that changes a run.

A request is refused (one `{"decline": why}` line, and the client runs in-process) when
its fingerprint is not the server's own (another configuration, environment, user or
install), when the server could not give the run the in-process run's terms (upstream MCP
tools: a re-run in-process would call them again; [approval], which asks at the terminal;
[serve] data_dir, mounted by the server only), and when the run is refused before it
starts (an unknown profile, a limit out of bounds, a busy server): the in-process run
then says so in its own words.

Otherwise the run goes through the server's queue and its host (the warm pool) as the
CLI's face: `face="cli"` for its hints, the CLI's caller on the audit record. It is
printed by `run`'s own functions (run.py `show_run`: its live output, the person's view or
the --json object) into a `render.Screen` whose streams record each write, and each write
goes to the client as it happens, one JSON line: `{"o": "out"|"err", "t": text}` (or
`"b"`: base64 bytes, for --raw), then `{"exit": code}`. The screen is the client's as
rich would see it there (whether each stream is a TTY, the encoding, the size, the
variables rich reads), so the two outputs are the same by construction.
"""

from __future__ import annotations

import asyncio
import base64
import getpass
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TextIO, cast

from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from rich.console import Console

import codecage.cli.handoff as handoff
from codecage import host
from codecage.audit import Caller
from codecage.cli.render import LiveOutput, Screen, render_failure
from codecage.cli.run import exit_code, show_run
from codecage.errors import CodecageError
from codecage.host import Host
from codecage.mcp.runner import Busy, Runner
from codecage.models import ExecutionResult, Limits
from codecage.models.result import MAX_CODE_BYTES
from codecage.options import limits_over

log = logging.getLogger(__name__)

MAX_BODY_BYTES = MAX_CODE_BYTES * 2 + 64 * 1024  # the code, JSON-escaped at worst, and the rest
Emit = Callable[[dict[str, Any]], None]


class Terminal(BaseModel):
    """The client's screen as rich sees it (handoff.terminal)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    env: dict[str, str] = Field(max_length=len(handoff.RICH_ENV))
    tty: tuple[bool, bool] = Field(description="stdout, stderr")
    encoding: tuple[str, str] = Field(description="stdout, stderr")
    size: tuple[int, int] = Field(description="columns, lines")


class HandoffRequest(BaseModel):
    """One `codecage run` as the client sends it (handoff.request_body)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    protocol: int
    fingerprint: str = Field(max_length=128)
    code: str = Field(max_length=MAX_CODE_BYTES)
    filename: str = Field(min_length=1, max_length=255)
    profile: str | None = Field(None, max_length=1024)
    limits: dict[str, int | float] = Field(max_length=len(handoff.LIMIT_FLAGS))
    as_json: bool
    raw: bool
    strict: bool
    terminal: Terminal


class Declined(Exception):
    """Not run here: the client runs it in-process (the text says why)."""


class Handoff:
    """ASGI middleware: POST `handoff.PATH` is answered here, anything else goes to `app`.
    Put it behind the token gate (mcp/server.py `http_app`'s `wrap`)."""

    def __init__(self, app: Any, runner: Runner, fingerprint: str) -> None:
        self.app = app
        self.runner = runner
        self.fingerprint = fingerprint

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") != handoff.PATH:
            await self.app(scope, receive, send)
            return
        if scope.get("method") != "POST":
            await _plain(send, 405, b"POST only")
            return
        body = await _read_body(receive)
        try:
            request = HandoffRequest.model_validate_json(body or b"")
        except ValidationError:
            await _plain(send, 422, b"not a hand-off request")
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/x-ndjson"),
                    (b"cache-control", b"no-store"),
                ],
            }
        )
        lines: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        watch = asyncio.create_task(_cancel_on_disconnect(receive, cancel))

        def emit(message: dict[str, Any]) -> None:  # from any thread, in order
            loop.call_soon_threadsafe(lines.put_nowait, message)

        work = asyncio.create_task(self._answer(request, emit, cancel))
        # After the last line the work scheduled: both go through the loop's queue, in order.
        work.add_done_callback(lambda _: loop.call_soon(lines.put_nowait, None))
        try:
            while (line := await lines.get()) is not None:
                data = json.dumps(line).encode() + b"\n"
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            watch.cancel()
            if not work.done():
                cancel.set()
            await asyncio.gather(work, return_exceptions=True)

    async def _answer(self, request: HandoffRequest, emit: Emit, cancel: threading.Event) -> None:
        """Run `request`, its writes and exit code `emit`ted, or one decline."""
        written = threading.Event()

        def emitted(message: dict[str, Any]) -> None:
            written.set()
            emit(message)

        try:
            self._check(request)
            code = await self.runner.queued(
                lambda: self._run(request, _screen(request.terminal, emitted), written, cancel),
                cancel,
            )
        except (Declined, Busy) as why:
            log.info("handoff.declined", extra={"reason": str(why)})
            emit({"decline": str(why)})
            return
        except Exception:  # codecage's own failure: never one the client cannot recover from
            log.exception("handoff.failed")
            if not written.is_set():
                emit({"decline": "the local server failed (its log says why)"})
            return
        emit({"exit": code})

    def _check(self, request: HandoffRequest) -> None:
        """Raises: Declined: the run would not be the in-process run's here."""
        settings = self.runner.host.settings
        if request.protocol != handoff.PROTOCOL:
            raise Declined(f"protocol {request.protocol}, not {handoff.PROTOCOL}")
        if request.fingerprint != self.fingerprint:
            raise Declined("another configuration (config file, environment, user or install)")
        if settings.mcp_servers:
            raise Declined("upstream MCP tools are configured")
        if settings.approval.require is not None:
            raise Declined("[approval] asks at the terminal")
        if settings.serve.data_dir:
            raise Declined("the server mounts [serve] data_dir")
        unknown = set(request.limits) - set(Limits.model_fields)
        if unknown:
            raise Declined(f"unknown limit {sorted(unknown)[0]}")

    def _run(
        self,
        request: HandoffRequest,
        screen: Screen,
        written: threading.Event,
        cancel: threading.Event,
    ) -> int:
        """The run, printed on `screen` as `run` prints it (a worker thread); its exit code.

        Raises:
            Declined: refused before it ran (the in-process run says why in its words).
        """
        runtime = self.runner.host
        try:
            limits = limits_over(runtime.limits, request.limits)
            # The runner's: the profile kept warm, as execute_code's calls keep it.
            policy = self.runner.policy_for(request.profile, None)
            egress, policy = runtime.network_for(policy, None, "cli")
        except (CodecageError, ToolError) as exc:
            raise Declined(f"refused: {exc}") from exc
        live = LiveOutput(raw=request.raw, before_first=_nothing, screen=screen)
        try:
            result = _execute(runtime, request, limits, policy, egress, live, cancel)
        except CodecageError as exc:
            if not written.is_set():
                raise Declined(f"refused: {exc}") from exc
            return render_failure(exc, as_json=request.as_json, screen=screen)
        log.info("handoff.run", extra={"execution_id": result.execution_id})
        streamed = not request.as_json  # as `run` streams: live output unless --json
        show_run(result, as_json=request.as_json, raw=request.raw, streamed=streamed, screen=screen)
        return exit_code(result)


def _execute(
    runtime: Host,
    request: HandoffRequest,
    limits: Limits,
    policy: Any,
    egress: Any,
    live: LiveOutput,
    cancel: threading.Event,
) -> ExecutionResult:
    """One run as the CLI's face asks it (sandbox.py `Sandbox.run`): its output `live`
    unless --json, as `run` streams it."""
    return runtime.run(
        host.Request(
            host.Program(request.code, request.filename),
            limits=limits,
            policy=policy,
            egress=egress,
            allowed_tools=runtime.options.allowed_tools,
            strict=request.strict,
            asker=host.Asker(face="cli", caller=Caller("cli", name=_login_name())),
            hooks=host.Hooks(cancel=cancel, on_output=None if request.as_json else live),
        )
    )


def _nothing() -> None:
    """No spinner to stop: the client shows none."""


def _login_name() -> str:
    """The CLI's caller name (sandbox.py `_login_name`): the server runs as the client's
    user (the fingerprint holds it)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


class _Recorded:
    """A stream of the client's: each write is sent there as a JSON line. What render.py
    and rich use of a text stream: write, flush, isatty, encoding, buffer."""

    def __init__(self, name: str, tty: bool, encoding: str, emit: Emit) -> None:
        self._name, self._tty, self._emit = name, tty, emit
        self.encoding = encoding
        self.buffer = _RecordedBytes(name, emit)

    def isatty(self) -> bool:
        return self._tty

    def write(self, text: str) -> int:
        if text:
            self._emit({"o": self._name, "t": text})
        return len(text)

    def flush(self) -> None:
        return None


class _RecordedBytes:
    """A stream's bytes (--raw), sent as base64."""

    def __init__(self, name: str, emit: Emit) -> None:
        self._name, self._emit = name, emit

    def write(self, data: bytes) -> int:
        if data:
            self._emit({"o": self._name, "b": base64.b64encode(data).decode("ascii")})
        return len(data)

    def flush(self) -> None:
        return None


def _screen(terminal: Terminal, emit: Emit) -> Screen:
    """A screen like the client's: its streams recorded, its console as rich would make
    it there (render.stderr: `Console(stderr=True, highlight=False, soft_wrap=True)`)."""
    out = _Recorded("out", terminal.tty[0], terminal.encoding[0], emit)
    err = _Recorded("err", terminal.tty[1], terminal.encoding[1], emit)
    console = Console(
        file=cast(TextIO, err),
        highlight=False,
        soft_wrap=True,
        width=terminal.size[0],
        height=terminal.size[1],
        force_jupyter=False,
        legacy_windows=False,
        _environ={k: v for k, v in terminal.env.items() if k in handoff.RICH_ENV},
    )
    return Screen(cast(TextIO, out), cast(TextIO, err), console)


async def _cancel_on_disconnect(receive: Any, cancel: threading.Event) -> None:
    """Set `cancel` when the client goes away (Ctrl-C): the run is killed."""
    while (await receive())["type"] != "http.disconnect":
        continue
    cancel.set()


async def _read_body(receive: Any) -> bytes | None:
    """The whole body, or None over `MAX_BODY_BYTES` (the gate has bounded it already)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _plain(send: Any, status: int, text: bytes) -> None:
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(text)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": text})
