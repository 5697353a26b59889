"""Hostile input on the MCP faces of `codecage serve` (issue 25): tool arguments and JSON-RPC
framing over stdio.

- Tool arguments of every tool, drawn by `_strategies.tool_calls` (wrong types, missing and
  extra fields, huge strings, deep nesting, NUL and surrogates, absurd limits): most examples
  through the SDK's in-memory client against the server object (the argument layer, the
  tools' own checks, real sandboxes for the calls that are valid), a bounded number through
  a real SDK client over stdio to one `codecage serve` process for the module.
  Property: a result, or an error that names an argument (in MCP terms: the tool's argument
  names) or says why the server refused; never a crash (the SDK's generic "Error executing
  tool X", logged with a traceback), never a traceback in the reply; the server still serves.
- JSON-RPC framing: raw lines to a `codecage serve` process (garbage, a huge line, invalid
  UTF-8, JSON that is not JSON-RPC, batches, ids of every type, a request split across
  writes). Property: each answer is a JSON-RPC response, the process stays up and answers a
  well-formed request afterwards, its memory stays bounded.
- Issue 17's findings on this face, each a case: terminal escapes and forged lines in file
  names (4, 16), a tool name of a megabyte and the log (5), uploads past the workspace (6),
  a request nested 200k deep (13).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp_types import CallToolResult, TextContent

from codecage import Sandbox
from codecage.mcp.server import build_server
from codecage.output import neutralise_line
from reliability import _strategies as hostile
from test_server import CODECAGE, INITIALIZE, server_env

# Examples per property (the whole module stays within ~30 s on a loaded 2-core machine).
# (times FUZZ_SCALE, see _strategies.scaled)
IN_PROCESS_EXAMPLES = hostile.scaled(200)
STDIO_CLIENT_EXAMPLES = hostile.scaled(30)
FRAMING_EXAMPLES = hostile.scaled(120)


def fuzz(examples: int) -> settings:
    """Hypothesis settings of a fuzz property: `examples` of them, no deadline (sandboxes and
    a loaded machine), no example database (nothing written into the checkout)."""
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )


# What the SDK answers when a tool raised something other than a ToolError: a crash.
_CRASH = re.compile(r"^Error executing tool [a-z_]+$")
# Refusals that are about the server's state, not one argument: they need not name one.
_STATE_REFUSALS = ("busy", "at most", "the most", "too many", "no session", "retry", "Unknown tool")


# --- the property ------------------------------------------------------------------------------


@dataclass
class Crashes(logging.Handler):
    """Records of the SDK's "raised an unexpected exception" (logged with the traceback)."""

    seen: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        logging.Handler.__init__(self, logging.ERROR)

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.seen.append(record.getMessage())

    __hash__ = logging.Handler.__hash__


def text_of(result: CallToolResult) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, TextContent))


def check_reply(tool: str, args: dict[str, Any], result: CallToolResult) -> None:
    """A result, or an error a model can act on: it names an argument or says what the
    server refused; never the SDK's crash line nor a traceback."""
    text = text_of(result)
    if not result.is_error:
        if tool == "execute_code":
            assert isinstance(result.structured_content, dict), text[:300]
            assert result.structured_content.get("status"), text[:300]
        return
    assert text, f"{tool}({_shown(args)}): an error with no text"
    assert not _CRASH.match(text), f"{tool}({_shown(args)}) crashed: {text!r}"
    assert "Traceback (most recent call last)" not in text, text[:500]
    names = set(hostile.TOOL_ARGUMENTS.get(tool, {})) | set(map(str, args))
    if text.startswith(f"Invalid arguments for {tool}"):
        # Each line starts with the argument's name as shown (neutralised), or "arguments"
        # for a name with nothing printable left.
        shown = {neutralise_line(n) or "arguments" for n in names}
        for line in text.splitlines()[1:]:
            assert line.startswith("…") or any(
                line.startswith(n) and line[len(n) : len(n) + 1] in (":", ".", "[") for n in shown
            ), f"{line!r} names no argument"
        return
    lowered = text.lower()
    named = any(n.lower().removesuffix("s") in lowered for n in names if n)
    assert named or any(s.lower() in lowered for s in _STATE_REFUSALS), (
        f"{tool}({_shown(args)}): the error names no argument: {text[:300]!r}"
    )


def _shown(args: dict[str, Any]) -> str:
    return repr(args)[:300]


# --- in process: the SDK's in-memory client against the server object --------------------------


@dataclass
class PortalClient:
    """An async MCP client driven from the (sync) hypothesis tests through a portal."""

    portal: BlockingPortal
    client: Client

    def call(self, tool: str, args: dict[str, Any]) -> CallToolResult:
        result: CallToolResult = self.portal.call(self.client.call_tool, tool, args)
        return result


@dataclass
class InProcess(PortalClient):
    crashes: Crashes


@pytest.fixture(scope="module")
def in_process() -> Iterator[InProcess]:
    crashes = Crashes()
    sdk_log = logging.getLogger("mcp")
    sdk_log.addHandler(crashes)
    sandbox = Sandbox(pool=False)
    try:
        with start_blocking_portal("asyncio") as portal:
            server = build_server(sandbox.host)
            client_cm = Client(server, read_timeout_seconds=60)
            with portal.wrap_async_context_manager(client_cm) as client:
                yield InProcess(portal, client, crashes)
                _close_sessions(portal, client)
    finally:
        sdk_log.removeHandler(crashes)
        sandbox.close()


def _close_sessions(portal: BlockingPortal, client: Client) -> None:
    listed = portal.call(client.call_tool, "list_sessions", {})
    for entry in (listed.structured_content or {}).get("sessions", []):
        portal.call(client.call_tool, "close_session", {"session_id": entry["session_id"]})


def _client_can_send(args: dict[str, Any]) -> bool:
    """The SDK's client serializes with pydantic, which refuses a lone surrogate in a key
    and values nested deeper than its limit (~250)."""
    keys, depth = _keys_and_depth(args)
    try:
        json.dumps(keys, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return depth < 200


def _keys_and_depth(value: Any) -> tuple[list[str], int]:
    keys: list[str] = []
    deepest = 0
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            keys.extend(map(str, item))
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return keys, deepest


@given(call=hostile.tool_calls())
@fuzz(IN_PROCESS_EXAMPLES)
def test_hostile_tool_arguments_get_a_result_or_an_error_naming_the_argument(
    in_process: InProcess, call: tuple[str, dict[str, Any]]
) -> None:
    tool, args = call
    if not _client_can_send(args):
        return  # a client-side refusal: nothing reaches the server
    before = len(in_process.crashes.seen)
    result = in_process.call(tool, args)
    assert in_process.crashes.seen[before:] == [], f"{tool}({_shown(args)}) crashed"
    check_reply(tool, args, result)


def test_after_the_hostile_arguments_the_server_still_serves(in_process: InProcess) -> None:
    result = in_process.call("execute_code", {"code": "6 * 7"})
    assert not result.is_error and (result.structured_content or {}).get("status") == "ok"
    assert in_process.crashes.seen == []


@pytest.mark.parametrize(
    "path",
    ["\ud800", "a/\udfff.txt", "\ud83d"],
    ids=["lone-high", "lone-low-in-dir", "half-pair"],
)
def test_a_return_file_that_is_not_text_is_refused_not_a_crash(
    in_process: InProcess, path: str
) -> None:
    """Found here: a lone surrogate in return_files reached os.stat and crashed the tool
    (UnicodeEncodeError: the generic "Error executing tool execute_code", traceback logged)."""
    before = len(in_process.crashes.seen)
    result = in_process.call("execute_code", {"code": "1", "return_files": [path]})
    assert in_process.crashes.seen[before:] == []
    assert not result.is_error, text_of(result)
    assert "not valid text" in text_of(result)


def test_an_argument_name_with_line_breaks_cannot_forge_lines_of_the_error(
    in_process: InProcess,
) -> None:
    """Found here: an unknown argument's name was shown with its line breaks, so a caller
    could forge lines of the refusal (`code: required, but not given`)."""
    forged = "x\ncode: required, but not given\nstatus: ok"
    result = in_process.call("get_sandbox_info", {forged: 1})
    lines = text_of(result).splitlines()
    assert result.is_error and len(lines) == 2, lines
    assert lines[1].startswith("x\\ncode: required, but not given\\nstatus: ok: not an argument")


def test_uploads_past_the_workspace_are_refused_before_any_run(in_process: InProcess) -> None:
    """Issue 17 (6): uploads land in the run's bounded workspace; too much is refused."""
    big = "a" * (21 * 1024 * 1024)
    result = in_process.call("execute_code", {"code": "1", "files": {"big.txt": big}})
    assert result.is_error and "at most" in text_of(result)
    check_reply("execute_code", {"files": None}, result)


# --- a real SDK client over stdio ----------------------------------------------------------------


@dataclass
class StdioServer(PortalClient):
    log: Path


@pytest.fixture(scope="module")
def stdio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StdioServer]:
    """One `codecage serve` (with its warm pool) for the module, spawned by the SDK client."""
    workdir = tmp_path_factory.mktemp("fuzz-stdio")
    env = {k: v for k, v in os.environ.items() if k == "PYTHONPATH"}
    params = StdioServerParameters(command=CODECAGE, args=["serve"], cwd=str(workdir), env=env)
    log = workdir / "stderr.log"
    with log.open("w", encoding="utf-8") as errlog, start_blocking_portal("asyncio") as portal:
        client_cm = Client(stdio_client(params, errlog=errlog), read_timeout_seconds=60)
        with portal.wrap_async_context_manager(client_cm) as client:
            server = StdioServer(portal, client, log)
            yield server
            _close_sessions(portal, client)


@given(call=hostile.tool_calls())
@fuzz(STDIO_CLIENT_EXAMPLES)
def test_hostile_arguments_over_stdio_get_a_result_or_a_named_error(
    stdio: StdioServer, call: tuple[str, dict[str, Any]]
) -> None:
    tool, args = call
    if not hostile.wire_safe(args):
        return  # the client cannot send it (the framing tests send such bytes raw)
    check_reply(tool, args, stdio.call(tool, args))


def test_over_stdio_no_crash_was_logged_and_the_server_serves(stdio: StdioServer) -> None:
    result = stdio.call("execute_code", {"code": "6 * 7"})
    assert (result.structured_content or {}).get("status") == "ok", text_of(result)
    log = stdio.log.read_text(encoding="utf-8", errors="replace")
    assert "Traceback" not in log and "unexpected exception" not in log, log[-3000:]


def test_file_names_with_escapes_and_line_breaks_cannot_forge_the_reply(stdio: StdioServer) -> None:
    """Issue 17 (4, 16): guest- and caller-chosen file names are neutralised in the reply."""
    names = ["x\x1b]52;c;aGk=\x07.txt", "a\nstatus: ok", "b\u202ecod.txt", "c\x1b[2J"]
    code = "for n in NAMES:\n    open(n[::-1], 'w').write('x')"
    code = code.replace("NAMES", repr(names))
    result = stdio.call("execute_code", {"code": code, "files": {n: "x" for n in names}})
    text = text_of(result)
    assert (result.structured_content or {}).get("status") == "ok", text
    assert "\x1b" not in text and "\u202e" not in text
    assert "status: ok" not in [line.strip() for line in text.splitlines()]


def test_a_megabyte_tool_name_is_refused_without_flooding_the_log(stdio: StdioServer) -> None:
    """Issue 17 (5): a name the caller picks never reaches a log unbounded."""
    size_before = stdio.log.stat().st_size
    result = stdio.call("x" * (1024 * 1024), {"a": "b"})
    assert result.is_error and "Unknown tool" in text_of(result)
    assert stdio.log.stat().st_size - size_before < 64 * 1024


# --- JSON-RPC framing: raw bytes on a stdio server's stdin ---------------------------------------


class RawStdio:
    """`codecage serve --no-pool` on pipes: lines written raw, answers read by a thread."""

    def __init__(self, workdir: Path) -> None:
        self.log = workdir / "stderr.log"
        with self.log.open("wb") as stderr:
            self.proc = subprocess.Popen(
                [CODECAGE, "serve", "--no-pool"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                cwd=workdir,
                env=server_env(),
                start_new_session=True,
            )
        self.answers: queue.Queue[bytes] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self._next_id = 1000

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.answers.put(line)

    def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def drain(self) -> list[bytes]:
        lines = []
        with contextlib.suppress(queue.Empty):
            while True:
                lines.append(self.answers.get_nowait())
        return lines

    def ping(self, within: float = 30.0) -> list[bytes]:
        """A well-formed request; its answer must come. Returns the lines before it."""
        self._next_id += 1
        wanted = self._next_id
        self.send(json.dumps({"jsonrpc": "2.0", "id": wanted, "method": "ping"}).encode() + b"\n")
        before: list[bytes] = []
        deadline = time.monotonic() + within
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.answers.get(timeout=left)
            except queue.Empty:
                break
            if json.loads(line).get("id") == wanted:
                return before
            before.append(line)
        raise AssertionError(f"no answer to a ping within {within} s (alive: {self.alive})")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]

    def close(self) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RawStdio]:
    server = RawStdio(tmp_path_factory.mktemp("fuzz-raw"))
    try:
        server.send(json.dumps(INITIALIZE).encode() + b"\n")
        first = server.answers.get(timeout=60)
        assert json.loads(first)["id"] == 1, first[:300]
        server.send(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n')
        yield server
    finally:
        server.close()


def assert_responses(lines: list[bytes]) -> None:
    """Whatever the server wrote is a JSON-RPC response (or a notification), one per line."""
    for line in lines:
        message = json.loads(line)
        assert message.get("jsonrpc") == "2.0", line[:300]
        assert ("id" in message and ("result" in message or "error" in message)) or (
            "method" in message
        ), line[:300]


@given(lines=st.lists(hostile.stdio_lines(), min_size=1, max_size=4))
@fuzz(FRAMING_EXAMPLES)
def test_garbage_lines_get_errors_or_are_ignored_and_the_server_answers_after(
    raw: RawStdio, lines: list[bytes]
) -> None:
    for line in lines:
        raw.send(line)
    assert_responses(raw.ping())
    assert raw.alive


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(
            b'{"jsonrpc":"2.0","id":5,"method":"ping","params":' + b"[" * 200_000, id="deep"
        ),
        pytest.param(b"\xff" * (16 * 1024 * 1024), id="16MiB-invalid-utf8"),
        pytest.param(b'{"a":"' + b"x" * (24 * 1024 * 1024) + b'"}', id="24MiB-json"),
    ],
)
def test_a_huge_or_deep_line_leaves_the_server_answering_with_bounded_memory(
    raw: RawStdio, data: bytes
) -> None:
    """Issue 17 (13) on the MCP face: a request nested 200k deep; and lines of megabytes.
    The server holds at most one line (`stdio.MAX_LINE_BYTES`); what it keeps afterwards
    is bounded: well under the line's own size once it is gone."""
    raw.ping()
    before = raw.rss_mib()
    raw.send(data + b"\n")
    assert_responses(raw.ping(within=60))
    grew = raw.rss_mib() - before
    assert grew < len(data) / (1024 * 1024) * 3 + 64, f"RSS grew by {grew:.0f} MiB"


def test_a_request_split_across_writes_is_answered_once(raw: RawStdio) -> None:
    raw.ping()
    request = json.dumps({"jsonrpc": "2.0", "id": "split", "method": "tools/list"}).encode()
    for i in range(0, len(request), 7):
        raw.send(request[i : i + 7])
        time.sleep(0.002)
    raw.send(b"\n")
    lines = raw.ping()
    answers = [json.loads(line) for line in lines]
    assert [a.get("id") for a in answers] == ["split"], lines
    assert "tools" in answers[0]["result"]


def test_the_raw_server_logged_no_traceback(raw: RawStdio) -> None:
    raw.ping()
    log = raw.log.read_text(encoding="utf-8", errors="replace")
    assert "Traceback" not in log, log[-3000:]
