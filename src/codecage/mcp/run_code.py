"""SandboxFusion's `POST /run_code` on `codecage serve --http`, so that an RL pipeline (verl's
sandbox_fusion reward, for one) can point at codecage by URL.

The request and response shapes mirror SandboxFusion's pydantic models (RunCodeRequest,
RunCodeResponse, CommandRunResult in its sandbox/server/sandbox_api.py and
sandbox/runners/types.py), bounded here. Only `language: "python"` runs; any other gets
SandboxFusion's own error shape (`status: "SandboxError"` and a `message`). A malformed
request gets FastAPI's 422 `{"detail": [...]}` as SandboxFusion's server would give it.

The program runs as a script (`__main__`, like SandboxFusion's `python file.py`) in the
server's host runtime (a worker thread, never the event loop) as execute_code's calls do:
the same queue (`max_concurrent` at once, `max_queued` waiting; past that: 503 with
Retry-After), and, for a named client of `[serve.clients.NAME]` (the token the gate
verified), the same bounds and the same counts: its largest memory and timeout (asked
above: refused; not asked: lowered to them), its runs per minute and at once (over them:
429 with Retry-After), and its name on the audit record (`http:NAME/run_code`). When the
host sends its runs to a Ray cluster (`serve --ray`), `executor_pod_name` names the node
that ran one, and a full cluster (`CapacityError`) is a 503 with Retry-After as well.
`stdin`: codecage runs a program with /dev/null on fd 0, so a given stdin is written to a
workspace file and a short launcher puts it on fd 0 (unlinked, so it is not listed among
the run's files) and runs the program, written as /workspace/main.py, with `runpy`: so
`input()`, `sys.stdin.read()` and a child process all read it.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import signal
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from codecage import host
from codecage.audit import Caller
from codecage.errors import CapacityError, CodecageError
from codecage.kept import KeptFiles, check_relpath
from codecage.mcp.callers import SCOPE_CLIENT_KEY
from codecage.mcp.clients import ClientRefused
from codecage.mcp.runner import BUSY_RETRY_S, Busy, Runner
from codecage.models import ExecutionResult, FileInfo, Limits
from codecage.models.result import MAX_CODE_BYTES

log = logging.getLogger(__name__)

PATH = "/run_code"
CALLER = "run_code"
"""The audit caller's version field for this face (execute_code's holds the MCP client)."""
MAX_STDIN_CHARS = 16 * 1024 * 1024
MAX_FILES = 100
MAX_FILE_BASE64_CHARS = 28 * 1024 * 1024  # ~20 MiB decoded, the uploads' bound in all
MAX_UPLOAD_BYTES = 20 * 1024 * 1024
MAX_FETCH_FILES = 100
MAX_BODY_BYTES = 32 * 1024 * 1024
PROGRAM_FILE = "main.py"
STDIN_FILE = ".codecage-stdin"
_WORKSPACE = "/workspace"
_LAUNCHER_NAME = "run_code_launcher.py"
# Puts the stdin file on fd 0 (so children read it too) and runs the program as a script.
_LAUNCHER = f"""\
import os, runpy
fd = os.open("{_WORKSPACE}/{STDIN_FILE}", os.O_RDONLY)
os.dup2(fd, 0)
os.close(fd)
os.unlink("{_WORKSPACE}/{STDIN_FILE}")
del fd
runpy.run_path("{_WORKSPACE}/{PROGRAM_FILE}", run_name="__main__")
"""
_PATH_HINT = "pass a path relative to the working directory, e.g. 'data/input.txt'"

CommandRunStatus = Literal["Finished", "Error", "TimeLimitExceeded"]
RunStatus = Literal["Success", "Failed", "SandboxError"]


class RunCodeRequest(BaseModel):
    """SandboxFusion's RunCodeRequest. Unknown fields are ignored, as SandboxFusion does: a
    client written for it may send fields of newer versions."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    code: str = Field(max_length=MAX_CODE_BYTES, description="the program (a Python script)")
    language: str = Field(max_length=64, description='only "python" runs here')
    compile_timeout: float = Field(
        10, ge=0, description="seconds; accepted and unused (Python is not compiled)"
    )
    run_timeout: float = Field(10, gt=0, description="seconds of wall time for the run")
    memory_limit_MB: int = Field(  # noqa: N815 - SandboxFusion's field name
        -1, description="MiB of memory; -1 (or any value <= 0): the server's default"
    )
    stdin: str | None = Field(
        None, max_length=MAX_STDIN_CHARS, description="text fed to the program's stdin"
    )
    files: dict[str, str | None] = Field(
        default_factory=dict,
        max_length=MAX_FILES,
        description="path relative to the working directory -> base64 content (None: skipped)",
    )
    fetch_files: list[str] = Field(
        default_factory=list,
        max_length=MAX_FETCH_FILES,
        description="paths of files the program wrote, returned base64 in `files`",
    )


class CommandRunResult(BaseModel):
    """SandboxFusion's CommandRunResult: how the one command went."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    status: CommandRunStatus
    execution_time: float | None = Field(None, description="wall seconds")
    return_code: int | None = Field(None, description="exit code; -N when killed by signal N")
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    """SandboxFusion's RunCodeResponse."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    status: RunStatus
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request as codecage runs it: the code, its file name, and the workspace's files."""

    code: str
    filename: str
    files: dict[str, bytes]


class Refused(Exception):
    """A request codecage will not run; its text is the response's `message`."""


def prepare(request: RunCodeRequest) -> Prepared:
    """What to run for `request`: the program itself, or (with `stdin`) the launcher.

    Raises:
        Refused: another language, a bad file name, bad base64, or too many bytes.
    """
    if request.language != "python":
        raise Refused(
            f'language "{request.language}" is not supported: codecage runs only '
            '"python" (send language "python", or use SandboxFusion for other languages)'
        )
    files = decode_files(request.files)
    if request.stdin is None:
        return Prepared(request.code, PROGRAM_FILE, files)
    for reserved in (PROGRAM_FILE, STDIN_FILE):
        if reserved in files:
            raise Refused(
                f"files: '{reserved}' is where the program (or its stdin) is written when "
                "`stdin` is given; upload it under another name"
            )
    files[PROGRAM_FILE] = request.code.encode("utf-8", "surrogatepass")
    files[STDIN_FILE] = request.stdin.encode("utf-8", "surrogatepass")
    return Prepared(_LAUNCHER, _LAUNCHER_NAME, files)


def decode_files(files: Mapping[str, str | None]) -> dict[str, bytes]:
    """`files` as bytes, by checked relative path; None values skipped (SandboxFusion's
    own rule).

    Raises:
        Refused: a path outside the working directory, bad base64, or over the bounds.
    """
    decoded: dict[str, bytes] = {}
    for name, value in files.items():
        if value is None:
            continue
        _check_path("files", name)
        if len(value) > MAX_FILE_BASE64_CHARS:
            raise Refused(f"files: '{name}' is larger than {MAX_UPLOAD_BYTES} bytes")
        try:
            decoded[name] = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise Refused(f"files: the content of '{name}' is not valid base64") from exc
    total = sum(len(data) for data in decoded.values())
    if total > MAX_UPLOAD_BYTES:
        raise Refused(f"files: {total} bytes together; at most {MAX_UPLOAD_BYTES} are accepted")
    return decoded


def _check_path(field: str, name: str) -> None:
    """Absolute paths (SandboxFusion's /tmp/...) have no place here: the program's only
    writable directory is its working directory, /workspace."""
    try:
        check_relpath(name, hint=_PATH_HINT)
    except CodecageError as exc:
        raise Refused(f"{field}: {exc} ({exc.hint})") from exc


def respond(request: RunCodeRequest, result: ExecutionResult) -> RunCodeResponse:
    """SandboxFusion's response for codecage's `result`: a timeout (or CPU limit) is
    `TimeLimitExceeded`; any other run is `Finished` with its return code (-N for a
    signal), `Failed` unless it is 0."""
    timed_out = result.status in ("timeout", "cpu_limit")
    return_code = None if timed_out else _return_code(result)
    run = CommandRunResult(
        status="TimeLimitExceeded" if timed_out else "Finished",
        execution_time=result.usage.wall_ms / 1000,
        return_code=return_code,
        stdout=result.stdout,
        stderr=result.stderr + _error_text(result),
    )
    success = not timed_out and return_code == 0
    return RunCodeResponse(
        status="Success" if success else "Failed",
        run_result=run,
        executor_pod_name=result.node,  # the Ray node that ran it (serve --ray); else null
        files=fetched(request.fetch_files, result),
    )


def _return_code(result: ExecutionResult) -> int:
    if result.exit_code is not None:
        return result.exit_code
    if result.signal is not None and result.signal in signal.Signals.__members__:
        return -signal.Signals[result.signal].value
    return 0 if result.status == "ok" else 1


def _error_text(result: ExecutionResult) -> str:
    """What `python file.py` prints on stderr for the error codecage reports apart: the
    traceback, without the launcher's and runpy's frames."""
    error = result.error
    if error is None:
        return ""
    text = error.traceback or f"{error.type}: {error.message}\n"
    header = "Traceback (most recent call last):\n"
    program = f'  File "{_WORKSPACE}/{PROGRAM_FILE}"'
    if text.startswith(header) and program in text:
        text = header + text[text.index(program) :]
    return text


def fetched(paths: list[str], result: ExecutionResult) -> dict[str, str]:
    """The asked-for files the run left, base64; a missing one is left out (SandboxFusion's
    rule), as is one with a bad path."""
    found: dict[str, str] = {}
    for path in paths:
        try:
            found[path] = base64.b64encode(result.read_file(path)).decode("ascii")
        except CodecageError:
            continue
    return found


def limits_for(runner: Runner, request: RunCodeRequest, client: str | None) -> Limits:
    """The server's default limits with the request's run_timeout and memory_limit_MB,
    within the server's maximums and the named `client`'s bounds ([serve.clients.NAME], as
    for execute_code): asked above them, refused; not asked (`run_timeout` left out, or
    `memory_limit_MB` <= 0), lowered to the client's bound.

    Raises:
        Refused: above the server's maximum or the client's, or out of the limits' bounds.
    """
    most = runner.limits
    if request.run_timeout > most.max_timeout:
        raise Refused(
            f"run_timeout={request.run_timeout:g} is above this server's maximum of "
            f"{most.max_timeout:g} s; send a smaller run_timeout"
        )
    memory_mb = request.memory_limit_MB if request.memory_limit_MB > 0 else None
    if memory_mb is not None and memory_mb > most.max_memory_mb:
        raise Refused(
            f"memory_limit_MB={memory_mb} is above this server's maximum of "
            f"{most.max_memory_mb} MiB; send a smaller memory_limit_MB (or -1 for the default)"
        )
    asked = request.run_timeout if "run_timeout" in request.model_fields_set else None
    timeout: float | None = asked
    if runner.client_limits is not None:
        try:
            timeout, memory_mb = runner.client_limits.within(
                client,
                timeout=asked,
                memory_mb=memory_mb,
                defaults=(request.run_timeout, runner.host.limits.memory_mb),
                names=("memory_limit_MB", "run_timeout"),
            )
        except CodecageError as exc:
            raise Refused(f"{exc} ({exc.hint})") from exc
    try:
        return runner.host.limits.merged(
            {"timeout": request.run_timeout if timeout is None else timeout, "memory_mb": memory_mb}
        )
    except ValueError as exc:
        raise Refused(
            f"run_timeout or memory_limit_MB out of bounds: {exc}; "
            "`codecage info` on the server lists the bounds"
        ) from exc


def execute(
    runner: Runner,
    prepared: Prepared,
    *,
    limits: Limits,
    fetch_files: list[str],
    caller: Caller,
    cancel: threading.Event,
) -> ExecutionResult:
    """One run of the server's host runtime, as `caller` (in a worker thread). The asked-for
    files are kept while the workspace exists, within the server's `keep_files_mb`.

    Raises:
        CodecageError: refused before it ran, or the sandbox failed.
    """
    runtime = runner.host
    egress, policy = runtime.network_for(runtime.options.policy, None, runtime.options.face)
    wanted = set(fetch_files)
    kept: list[KeptFiles] = []

    def read_back(workspace: Path, written: list[FileInfo]) -> None:
        chosen = [f for f in written if f.path in wanted]
        if chosen and runtime.options.keep_files_mb:
            kept.append(host.keep(workspace, chosen, runtime.options.keep_files_mb * 2**20))

    result = runtime.run(
        host.Request(
            host.Program(prepared.code, prepared.filename, files=prepared.files or None),
            limits=limits,
            policy=policy,
            egress=egress,
            allowed_tools=runtime.options.allowed_tools,
            asker=host.Asker(
                face=runtime.options.face, caller=caller, approve=runtime.options.approver
            ),
            hooks=host.Hooks(cancel=cancel, on_files=read_back),
        )
    )
    return result.with_kept_files(kept[0]) if kept else result


@dataclass(frozen=True, slots=True)
class Answer:
    """An HTTP answer: its status, its JSON body and any extra headers."""

    status: int
    body: Any
    headers: tuple[tuple[bytes, bytes], ...] = ()


async def answer(runner: Runner, request: RunCodeRequest, caller: Caller) -> Answer:
    """Run `request` for `caller` as execute_code runs a call: the client's limits, its
    admission (rate, concurrent runs: 429 with Retry-After), the server's queue (503 with
    Retry-After when full), and the audit record in its name. A refusal of the request or
    codecage's own failure is SandboxFusion's `SandboxError` response."""
    named = runner.named_client(caller)
    try:
        limits = limits_for(runner, request, named)
        prepared = prepare(request)
    except Refused as exc:
        return Answer(200, _dump(RunCodeResponse(status="SandboxError", message=str(exc))))
    if runner.client_limits is not None:
        try:
            runner.client_limits.admit(named)
        except ClientRefused as exc:
            retry = (b"retry-after", str(exc.retry_after_s).encode())
            return Answer(429, {"detail": f"{exc}; {exc.hint}"}, (retry,))
    cancel = threading.Event()
    try:
        result = await runner.queued(
            lambda: execute(
                runner,
                prepared,
                limits=limits,
                fetch_files=request.fetch_files,
                caller=caller,
                cancel=cancel,
            ),
            cancel,
        )
    except Busy as exc:
        return Answer(503, {"detail": str(exc)}, ((b"retry-after", str(BUSY_RETRY_S).encode()),))
    except CapacityError as exc:  # every node of the cluster full (serve --ray)
        retry = (b"retry-after", str(exc.retry_after_s).encode())
        return Answer(503, {"detail": f"{exc}; {exc.hint}"}, (retry,))
    except CodecageError as exc:
        failed = RunCodeResponse(status="SandboxError", message=f"{exc} ({exc.hint})")
        return Answer(200, _dump(failed))
    finally:
        runner.release(named)
    return Answer(200, _dump(respond(request, result)))


def _dump(response: RunCodeResponse) -> Any:
    return response.model_dump(mode="json")


class RunCode:
    """ASGI middleware: POST /run_code is answered here (other methods: 405), everything else
    goes to `app`. Put it behind the token gate: it runs code, and the gate names the client
    (`callers.SCOPE_CLIENT_KEY`) whose limits and audit caller the run gets."""

    def __init__(self, app: Any, runner: Runner) -> None:
        self.app = app
        self.runner = runner

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") != PATH:
            await self.app(scope, receive, send)
            return
        if scope.get("method") != "POST":
            await _send(send, 405, {"detail": "Method Not Allowed"}, [(b"allow", b"POST")])
            return
        body = await _read_body(receive)
        if body is None:
            await _send(send, 413, {"detail": f"the body is over {MAX_BODY_BYTES} bytes"})
            return
        try:
            request = RunCodeRequest.model_validate_json(body)
        except ValidationError as exc:
            await _send(send, 422, {"detail": _detail(exc)})
            return
        client = scope.get(SCOPE_CLIENT_KEY)
        # Who, as execute_code names an HTTP caller: the token's client; the face beside it.
        caller = Caller("http", name=client if isinstance(client, str) else "", version=CALLER)
        answered = await answer(self.runner, request, caller)
        await _send(send, answered.status, answered.body, list(answered.headers))


async def _read_body(receive: Any) -> bytes | None:
    """The whole body (the gate in front has read and bounded it already), or None over
    `MAX_BODY_BYTES`."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _detail(exc: ValidationError) -> list[dict[str, Any]]:
    """FastAPI's 422 detail (what SandboxFusion answers a malformed request with)."""
    return [
        {"type": e["type"], "loc": ["body", *e["loc"]], "msg": e["msg"]}
        for e in exc.errors(include_url=False, include_input=False)
    ]


async def _send(
    send: Any, status: int, body: Any, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    data = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        (b"cache-control", b"no-store"),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
