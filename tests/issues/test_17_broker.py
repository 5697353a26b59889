"""Issue 17, the broker's items: what flows between the code and the upstream servers.

3: a failing tool's message and a crashed server's last words reach the code tokenized
(and without the server's credentials), as an answer does. 5: a tool name the code picks
reaches no library and no log unless the upstream listed it. 8: an HTTP upstream's answer
is bounded while it is read. 10: the code's `scrub` is no oracle on configured secrets.
12: a run's calls still running upstream are cancelled when the run ends. 14: allow-list
patterns match (server, tool) pairs, and wildcards only plain names.

The upstreams are real: a server on the MCP SDK (stdio), a lenient one that answers any
tool name (hand-written JSON-RPC over stdio, as a hostile server may be) and an HTTP one
that streams an answer far larger than any limit.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tests._upstreams import attempt_code

import codecage
from codecage import Options, Sandbox
from codecage.bridge import upstreams
from codecage.bridge.broker import Broker
from codecage.bridge.channel import CallFailed
from codecage.errors import ConfigError

EMAIL = "ana.lima@example.com"
CREDENTIAL = "493817"  # six digits: the shortest credential the scrubber accepts

SDK_SERVER = """
import asyncio, os, sys
from pathlib import Path
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

marks = Path(sys.argv[1])
server = MCPServer("py")

@server.tool()
def lookup() -> str:
    return "customer ana.lima@example.com"

@server.tool()
def find(email: str) -> str:
    raise ToolError(f"no customer {email}")

@server.tool()
def crash_with(word: str) -> str:
    os.write(2, f"fatal: {word} (token {os.environ['PY_TOKEN']})\\n".encode())
    os._exit(3)

@server.tool()
async def slow(tag: str) -> str:
    (marks / f"{tag}.started").touch()
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        (marks / f"{tag}.cancelled").touch()
        raise
    return "late"

server.run()
"""

# What the raw servers share: the requests a stdio server reads (notifications, which want
# no answer, left out), and the answer to the rest of MCP: the handshake, their tools (by
# name, any arguments) and {} for anything else.
RAW_SERVER_BASICS = """
import json, sys

def requests():
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("id") is not None:
            yield msg

def handshake(msg, name, tools):
    if msg.get("method") == "initialize":
        return {"protocolVersion": msg["params"]["protocolVersion"],
                "capabilities": {"tools": {}}, "serverInfo": {"name": name, "version": "1"}}
    if msg.get("method") == "tools/list":
        return {"tools": [{"name": tool, "inputSchema": {"type": "object"}} for tool in tools]}
    return {}
"""

# Answers every tools/call, listed name or not, as a success (as a hostile or sloppy
# server may): the SDK then warns "Tool <name> not listed by server" with the name.
LENIENT_SERVER = (
    RAW_SERVER_BASICS
    + """
calls = sys.argv[1]
for msg in requests():
    method, mid = msg.get("method"), msg["id"]
    if method == "tools/call":
        with open(calls, "a") as f:
            f.write(json.dumps(msg["params"]["name"]) + "\\n")
        result = {"content": [{"type": "text", "text": "ok"}]}
    else:
        result = handshake(msg, "lenient", ["echo", "read_notes"])
    print(json.dumps({"jsonrpc": "2.0", "id": mid, "result": result}), flush=True)
"""
)

# Streamable HTTP without sessions: tools/call is answered with a JSON body of
# `sys.argv[2]` MiB, streamed (the server never holds it).
HUGE_HTTP_SERVER = (
    RAW_SERVER_BASICS
    + """
import json, sys, zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MIB = int(sys.argv[2])

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(405); self.send_header("Content-Length", "0"); self.end_headers()

    do_DELETE = do_GET

    def do_POST(self):
        msg = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mid, method = msg.get("id"), msg.get("method")
        if mid is None:
            self.send_response(202); self.send_header("Content-Length", "0"); self.end_headers()
            return
        if method == "tools/call" and msg["params"]["name"] == "bomb":
            head = json.dumps({"jsonrpc": "2.0", "id": mid}).encode()[:-1]
            packer = zlib.compressobj(wbits=31)  # gzip
            body = packer.compress(head + b', "result": {"content": [{"type": "text", "text": "')
            for _ in range(MIB):
                body += packer.compress(b"x" * (1 << 20))
            body += packer.compress(b'"}]}}') + packer.flush()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if method == "tools/call":
            head = json.dumps({"jsonrpc": "2.0", "id": mid}).encode()[:-1]
            head += b', "result": {"content": [{"type": "text", "text": "'
            tail = b'"}]}}'
            chunk = b"x" * (1 << 20)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(head) + MIB * len(chunk) + len(tail)))
            self.end_headers()
            self.wfile.write(head)
            try:
                for _ in range(MIB):
                    self.wfile.write(chunk)
                self.wfile.write(tail)
            except OSError:
                pass  # the client stopped reading: what this server is for
            return
        result = handshake(msg, "huge", ["huge", "bomb"])
        body = json.dumps({"jsonrpc": "2.0", "id": mid, "result": result}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
with open(sys.argv[1], "w") as f:
    f.write(str(httpd.server_address[1]))
httpd.serve_forever()
"""
)

# Over stdio: tools/call is answered with one line of `sys.argv[1]` MiB.
HUGE_STDIO_SERVER = (
    RAW_SERVER_BASICS
    + """
MIB = int(sys.argv[1])
out = sys.stdout.buffer
for msg in requests():
    method, mid = msg.get("method"), msg["id"]
    if method == "tools/call":
        head = json.dumps({"jsonrpc": "2.0", "id": mid}).encode()[:-1]
        out.write(head + b', "result": {"content": [{"type": "text", "text": "')
        for _ in range(MIB):
            out.write(b"x" * (1 << 20))
        out.write(b'"}]}}\\n')
        out.flush()
        continue
    result = handshake(msg, "huge", ["huge"])
    out.write(json.dumps({"jsonrpc": "2.0", "id": mid, "result": result}).encode() + b"\\n")
    out.flush()
"""
)

ATTEMPT = (
    attempt_code("py")
    + """def text(value):
    return value["result"] if isinstance(value, dict) else value
"""
)


def wait_for(check: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def parse(config: dict[str, Any]) -> dict[str, upstreams.Upstream]:
    return upstreams.parse({"mcpServers": config}, source="test", environ={})


@pytest.fixture(scope="module")
def marks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("marks")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory, marks: Path) -> Iterator[Broker]:
    scripts = tmp_path_factory.mktemp("servers")
    (scripts / "py.py").write_text(SDK_SERVER, encoding="utf-8")
    (scripts / "lenient.py").write_text(LENIENT_SERVER, encoding="utf-8")
    env = {"PY_TOKEN": CREDENTIAL, "PATH": os.environ.get("PATH", "")}
    config = {
        "py": {"command": sys.executable, "args": [str(scripts / "py.py"), str(marks)], "env": env},
        "lenient": {
            "command": sys.executable,
            "args": [str(scripts / "lenient.py"), str(marks / "lenient-calls.txt")],
        },
    }
    with Broker(parse(config)) as shared:
        yield shared


def lenient_calls(marks: Path) -> list[str]:
    path = marks / "lenient-calls.txt"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def outcome(future: Any) -> tuple[str, str]:
    try:
        answer = future.result(timeout=30)
    except CallFailed as exc:
        return exc.kind, exc.message
    return "ok", answer.text


# --- 3: the error path is tokenized as the answer path is -------------------------------


def test_a_tools_error_and_a_crashed_servers_last_words_reach_the_code_tokenized(
    broker: Broker,
) -> None:
    code = """
who = text(attempt("lookup")[1]).split()[-1]
[who, attempt("find", email=who), attempt("crash_with", word=who)]
"""
    with Sandbox(tools=broker, pool=False, options=Options(tokenize=True, scrub=False)) as sandbox:
        result = sandbox.run(ATTEMPT + code, limits={"timeout": 60})
    assert result.status == "ok", (result.error, result.stderr)
    who, found, crashed = result.return_value
    assert who == "[EMAIL_1]"
    # The server got the real address (detokenized) and said it back in its error.
    assert found[0] == "tool_error" and found[1].endswith("no customer [EMAIL_1]"), found
    assert crashed[0] == "upstream_error"
    assert "last words: " in crashed[1] and "fatal: [EMAIL_1] (token [SECRET])" in crashed[1]
    assert EMAIL not in json.dumps(result.return_value)
    # The server's credential, in its last words, is not the code's to see either.
    assert CREDENTIAL not in crashed[1] and "[SECRET]" in crashed[1]


def test_without_tokenizing_a_crashed_servers_credential_still_does_not_reach_the_code(
    broker: Broker,
) -> None:
    tools = broker.for_run(tokenize=False)
    try:
        kind, message = outcome(tools.call_tool("py", "crash_with", {"word": "plain"}))
    finally:
        tools.close()
    assert kind == "upstream_error"
    assert "fatal: plain (token [SECRET])" in message
    assert CREDENTIAL not in message


# --- 5: names are checked before any library (or log) sees them -------------------------


def test_a_name_the_upstream_did_not_list_is_refused_before_the_sdk_or_a_log_sees_it(
    broker: Broker, marks: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    tools = broker.for_run()
    try:
        assert outcome(tools.call_tool("lenient", "echo", {})) == ("ok", "ok")
        long_name = "forged\n" + "x" * 4_000_000
        kinds = [
            outcome(tools.call_tool("lenient", name, {}))[0]
            for name in ("not_listed", "echo\nWARNING forged line", long_name)
        ]
    finally:
        tools.close()
    assert kinds == ["not_allowed", "not_allowed", "bad_request"]
    assert lenient_calls(marks) == ["echo"]  # nothing unlisted reached the upstream
    logged = "".join(record.getMessage() + str(record.__dict__) for record in caplog.records)
    assert "not_listed" not in logged and "forged" not in logged
    assert len(logged) < 100_000


def test_the_refusal_names_the_tool_bounded_and_on_one_line(broker: Broker) -> None:
    tools = broker.for_run()
    try:
        kind, message = outcome(tools.call_tool("lenient", "a\x1b]52;c;x\x07\nb" * 20, {}))
    finally:
        tools.close()
    assert kind == "not_allowed"
    assert "\n" not in message and "\x1b" not in message and "\x07" not in message
    assert "it lists 2: echo, read_notes" in message


# --- 8: an HTTP upstream's answer is bounded while it is read ---------------------------

HOST_PROBE = """
import json, sys
from codecage.bridge import upstreams
from codecage.bridge.broker import Broker
from codecage.bridge.channel import CallFailed
config = {"mcpServers": {"huge": json.loads(sys.argv[1])}}
with Broker(upstreams.parse(config, source="probe", environ={})) as broker:
    tools = broker.for_run()
    try:
        answer = tools.call_tool("huge", sys.argv[2], {}).result(timeout=180)
        outcome = ["ok", len(answer.text)]
    except CallFailed as exc:
        outcome = [exc.kind, exc.message]
    tools.close()
# VmHWM, not ru_maxrss: that one keeps the peak of the process this one was exec'd from
# (its vfork parent's, the test run's, 360 MiB late in the suite).
with open("/proc/self/status") as status:
    hwm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
print(json.dumps([outcome, hwm_kib // 1024]))
"""


def probe_outcome(probe: subprocess.CompletedProcess[str]) -> tuple[list[str], int]:
    assert probe.returncode == 0, probe.stderr[-3000:]
    outcome, peak_mib = json.loads(probe.stdout.strip().splitlines()[-1])
    return outcome, peak_mib


@pytest.mark.parametrize(("tool", "refusal"), [("huge", "over 65 MiB"), ("bomb", "compressed")])
def test_a_huge_http_answer_is_cut_while_it_is_read(
    tmp_path: Path, tool: str, refusal: str
) -> None:
    """The host (a fresh process, so that its peak RSS is this call's) reads at most
    `_MAX_MESSAGE_BYTES` of a 400 MiB answer. Before: the whole body, then its copies
    (~1.3 GB peak)."""
    (tmp_path / "server.py").write_text(HUGE_HTTP_SERVER, encoding="utf-8")
    port_file = tmp_path / "port"
    server = subprocess.Popen([sys.executable, str(tmp_path / "server.py"), str(port_file), "400"])
    try:
        assert wait_for(lambda: port_file.exists() and port_file.read_text() != "")
        url = f"http://127.0.0.1:{port_file.read_text()}/mcp"
        probe = subprocess.run(
            [sys.executable, "-c", HOST_PROBE, json.dumps({"url": url, "timeout": 120}), tool],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(Path(codecage.__file__).parents[1])},
        )
    finally:
        server.kill()
        server.wait(timeout=10)
    (kind, message), peak_mib = probe_outcome(probe)
    assert kind == "upstream_error", message
    assert refusal in message
    assert peak_mib < 300, f"the host peaked at {peak_mib} MiB"


# --- 10: the code's scrub is no oracle on configured secrets -----------------------------

ORACLE = """
from codecage.runtime import scrub
guesses = [f"{n:06d}" for n in range(490000, 500000)]
seen = scrub(" ".join(guesses) + " mail ana.lima@example.com").split()
[[i for i, word in enumerate(seen[: len(guesses)]) if word != guesses[i]], seen[-1]]
"""


def test_the_codes_scrub_does_not_confirm_a_guessed_upstream_credential(broker: Broker) -> None:
    with Sandbox(tools=broker, pool=False, options=Options(scrub=True)) as sandbox:
        assert CREDENTIAL in sandbox.host.scrubber.config.secrets  # type: ignore[union-attr]
        result = sandbox.run(ORACLE, limits={"timeout": 60})
    assert result.status == "ok", (result.error, result.stderr)
    assert result.return_value == [[], "[EMAIL]"]  # detectors work; no guess confirmed


def test_the_codes_scrub_without_servers_does_not_confirm_a_configured_secret() -> None:
    from codecage.models import ScrubSettings

    settings = ScrubSettings(secrets=[CREDENTIAL])
    with Sandbox(pool=False, options=Options(scrub=settings)) as sandbox:
        result = sandbox.run(f"print({CREDENTIAL!r})\n" + ORACLE, limits={"timeout": 60})
    assert result.status == "ok", (result.error, result.stderr)
    assert result.return_value == [[], "[EMAIL]"]
    assert CREDENTIAL not in result.stdout  # still scrubbed from what the run returns


# --- 12: a run's unfinished calls are cancelled when it ends -----------------------------


def test_closing_a_run_cancels_its_calls_upstream(broker: Broker, marks: Path) -> None:
    tools = broker.for_run()
    future = tools.call_tool("py", "slow", {"tag": "direct"})
    assert wait_for((marks / "direct.started").exists)
    tools.close()
    assert wait_for((marks / "direct.cancelled").exists), "the upstream call still runs"
    assert outcome(future)[0] == "upstream_error"


def test_a_run_that_ends_with_calls_in_flight_leaves_none_running(
    broker: Broker, marks: Path
) -> None:
    code = """
import asyncio
from codecage.runtime import call_tool
tasks = [asyncio.ensure_future(call_tool("py", "slow", {"tag": f"run{i}"})) for i in range(3)]
await asyncio.sleep(0)
"""
    # The run ends while its calls are in flight: 10 s gives them time to reach the upstream
    # on a loaded machine (2 s did not, in CI), and the slow tool never answers before that.
    with Sandbox(tools=broker, pool=False, options=Options(scrub=False)) as sandbox:
        sandbox.run(code + "\nawait asyncio.wait(tasks, timeout=10)", limits={"timeout": 30})
    assert wait_for(lambda: all((marks / f"run{i}.started").exists() for i in range(3)))
    assert wait_for(lambda: all((marks / f"run{i}.cancelled").exists() for i in range(3)))


# --- 14: allow-list patterns match (server, tool) pairs ----------------------------------


def test_a_pattern_matches_a_server_and_a_tool_separately() -> None:
    from codecage.bridge.tooling import ToolPattern

    evil = ToolPattern.parse("evil.*")
    assert evil.matches("evil", "echo")
    assert not evil.matches("evil.echo", "anything")
    assert ToolPattern.parse("fs.read.*") == ToolPattern("fs", "read.*")
    for bad in ("memory", "*", ".x", "x."):
        with pytest.raises(ConfigError):
            ToolPattern.parse(bad)


def test_a_wildcard_matches_only_plain_names() -> None:
    from codecage.bridge.tooling import ToolPattern

    read = ToolPattern.parse("notes.read_*")
    assert read.matches("notes", "read_file")
    assert not read.matches("notes", "read_/../admin_delete")
    assert not read.matches("notes", "read_x\nadmin")
    exact = ToolPattern.parse("notes.read_/odd")
    assert exact.matches("notes", "read_/odd")


def test_a_server_name_with_a_dot_is_refused() -> None:
    with pytest.raises(ConfigError, match="dot"):
        parse({"evil.echo": {"command": "true"}})


def test_a_run_allow_list_of_pairs_and_a_pattern_without_a_dot(broker: Broker, marks: Path) -> None:
    tools = broker.for_run(allowed_tools=["lenient.read_*"])
    try:
        assert outcome(tools.call_tool("lenient", "read_notes", {}))[0] == "ok"
        assert outcome(tools.call_tool("lenient", "echo", {}))[0] == "not_allowed"
    finally:
        tools.close()
    with pytest.raises(ConfigError, match="does not name a server"):
        broker.for_run(allowed_tools=["lenient"])
    with pytest.raises(ConfigError):
        Sandbox(tools=broker, allowed_tools=["*"], pool=False)


def test_a_servers_own_allow_list_wildcard_matches_only_plain_names(tmp_path: Path) -> None:
    (tmp_path / "lenient.py").write_text(LENIENT_SERVER, encoding="utf-8")
    calls = tmp_path / "calls.txt"
    config = {
        "lenient": {
            "command": sys.executable,
            "args": [str(tmp_path / "lenient.py"), str(calls)],
            "allow_tools": ["read_*"],
        }
    }
    with Broker(parse(config)) as own:
        tools = own.for_run()
        try:
            refused = outcome(tools.call_tool("lenient", "read_/../echo", {}))
        finally:
            tools.close()
    assert refused[0] == "not_allowed"
    assert not calls.exists()


def test_a_huge_stdio_line_is_cut_while_it_is_read(tmp_path: Path) -> None:
    """The SDK's stdio client gathers a line whole (copying it at each chunk); the
    broker's stops at `_MAX_MESSAGE_BYTES`, ends the session, and says why."""
    (tmp_path / "server.py").write_text(HUGE_STDIO_SERVER, encoding="utf-8")
    server = {"command": sys.executable, "args": [str(tmp_path / "server.py"), "200"]}
    probe = subprocess.run(
        [sys.executable, "-c", HOST_PROBE, json.dumps({**server, "timeout": 60}), "huge"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(codecage.__file__).parents[1])},
    )
    (kind, message), peak_mib = probe_outcome(probe)
    assert kind == "upstream_error", message
    assert "over 65 MiB" in message
    assert peak_mib < 300, f"the host peaked at {peak_mib} MiB"
