"""codecage.runtime (the package src/codecage/guest/runtime/) on the host, part by part.

The bridge talks to a fake host on the other end of a real `socket.socketpair()`, served by
a thread that answers per docs/tool-bridge.md (in any order, with every error kind, with
EOF or garbage). The real host (channel.py and the broker) and the sandbox are exercised
by test_runtime_in_sandbox.py; here each part's edge cases are reachable directly. The
tool tree is written by the real generator (codegen.generate/write_tree).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mcp_types import Tool

import codecage.runtime as host_runtime
from codecage.bridge import codegen
from codecage.guest import runtime
from codecage.guest.runtime import (
    ToolCallError,
    ToolRef,
    Workspace,
    WorkspacePathError,
    call_tool,
    call_tool_sync,
    list_servers,
    run_async,
    scrub,
    search_tools,
)
from codecage.guest.runtime import bridge as guest_bridge
from codecage.models.wire import BridgeErrorKind

GUEST_DIR = Path(runtime.__file__).parent.parent  # the guest package

# --- a fake host on a real socket ------------------------------------------------------

Answer = dict[str, Any] | bytes
Responder = Callable[[dict[str, Any]], list[Answer]]


class FakeHost:
    """The host's end of the bridge: reads request lines, answers what `respond` returns."""

    def __init__(self, sock: socket.socket, respond: Responder) -> None:
        self.sock = sock
        self.respond = respond
        self.requests: list[dict[str, Any]] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with self.sock.makefile("rb") as lines:
            try:
                for line in lines:
                    request = json.loads(line)
                    self.requests.append(request)
                    for answer in self.respond(request):
                        self.send(answer)
            except OSError:
                pass  # the guest ended the channel

    def send(self, answer: Answer) -> None:
        data = answer if isinstance(answer, bytes) else json.dumps(answer).encode() + b"\n"
        with contextlib.suppress(OSError):  # the guest closed its end (on a bad answer)
            self.sock.sendall(data)

    def hang_up(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.hang_up()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()
        self.sock.close()


def ok(request: dict[str, Any], structured: Any = None, text: str = "") -> dict[str, Any]:
    result: Any = {"structured": structured, "text": text, "is_error": False}
    if request["op"] == "scrub":
        result = text
    return {"v": 1, "id": request["id"], "ok": True, "result": result}


def failed(request: dict[str, Any], kind: str, message: str) -> dict[str, Any]:
    return {"v": 1, "id": request["id"], "ok": False, "error": {"kind": kind, "message": message}}


def echo(request: dict[str, Any]) -> list[Answer]:
    return [ok(request, structured={"echo": request.get("arguments")})]


@pytest.fixture
def host() -> Iterator[Callable[[Responder], FakeHost]]:
    """Start a fake host; the runtime's bridge talks to it instead of fd 4."""
    hosts: list[FakeHost] = []

    def start(respond: Responder) -> FakeHost:
        guest_end, host_end = socket.socketpair()
        guest_bridge._use_channel(guest_end)
        hosts.append(FakeHost(host_end, respond))
        return hosts[-1]

    yield start
    guest_bridge._reset()
    for h in hosts:
        h.close()


# --- calls -----------------------------------------------------------------------------


def test_a_sync_call_sends_one_request_line_and_returns_the_structured_content(
    host: Callable[[Responder], FakeHost],
) -> None:
    fake = host(echo)
    assert call_tool_sync("memory", "search_nodes", {"query": "ana"}) == {"echo": {"query": "ana"}}
    assert call_tool_sync("memory", "read_graph") == {"echo": {}}
    first, second = fake.requests
    assert first == {
        "v": 1,
        "id": first["id"],
        "op": "call_tool",
        "server": "memory",
        "tool": "search_nodes",
        "arguments": {"query": "ana"},
    }
    assert type(first["id"]) is int and second["id"] != first["id"]


def test_the_text_is_returned_when_the_tool_sends_no_structured_content(
    host: Callable[[Responder], FakeHost],
) -> None:
    host(lambda r: [ok(r, structured=None, text="line 1\nline 2")])
    assert call_tool_sync("fs", "read_file", {"path": "a"}) == "line 1\nline 2"
    assert asyncio.run(call_tool("fs", "read_file", {"path": "a"})) == "line 1\nline 2"


@pytest.mark.parametrize("kind", get_args(BridgeErrorKind))  # every kind the host may send
def test_every_error_kind_raises_a_tool_call_error_naming_the_tool(
    host: Callable[[Responder], FakeHost], kind: str
) -> None:
    host(lambda r: [failed(r, kind, f"it went {kind}")])
    with pytest.raises(ToolCallError) as sync_error:
        call_tool_sync("memory", "read_graph")
    with pytest.raises(ToolCallError) as async_error:
        asyncio.run(call_tool("memory", "read_graph"))
    for exc in (sync_error.value, async_error.value):
        assert (exc.kind, exc.message, exc.server, exc.tool) == (
            kind,
            f"it went {kind}",
            "memory",
            "read_graph",
        )
        assert str(exc) == f"memory.read_graph failed ({kind}): it went {kind}"


def test_a_tool_call_error_survives_pickling() -> None:
    data = pickle.dumps(ToolCallError("timeout", "slow", "memory", "read_graph"))
    exc = pickle.loads(data)  # noqa: S301 - our own bytes
    assert (exc.kind, exc.message, exc.server, exc.tool) == (
        "timeout",
        "slow",
        "memory",
        "read_graph",
    )
    assert str(exc) == "memory.read_graph failed (timeout): slow"


def test_twenty_concurrent_calls_answered_in_reverse_order_each_get_their_own_answer(
    host: Callable[[Responder], FakeHost],
) -> None:
    waiting: list[dict[str, Any]] = []

    def answer_all_at_once_backwards(request: dict[str, Any]) -> list[Answer]:
        waiting.append(request)
        if len(waiting) < 20:
            return []
        return [ok(r, structured={"i": r["arguments"]["i"]}) for r in reversed(waiting)]

    fake = host(answer_all_at_once_backwards)

    async def main() -> list[Any]:
        return await asyncio.gather(*(call_tool("s", "t", {"i": i}) for i in range(20)))

    assert asyncio.run(main()) == [{"i": i} for i in range(20)]
    assert len({r["id"] for r in fake.requests}) == 20


def test_sync_calls_from_many_threads_share_the_bridge(
    host: Callable[[Responder], FakeHost],
) -> None:
    host(echo)
    results: dict[int, Any] = {}

    def call(i: int) -> None:
        results[i] = call_tool_sync("s", "t", {"i": i})

    threads = [threading.Thread(target=call, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert results == {i: {"echo": {"i": i}} for i in range(16)}


def test_eof_mid_call_fails_it_and_every_later_call_with_channel_closed(
    host: Callable[[Responder], FakeHost],
) -> None:
    def hang_up(request: dict[str, Any]) -> list[Answer]:
        fake.hang_up()
        return []

    fake = host(hang_up)
    with pytest.raises(ToolCallError) as first:
        call_tool_sync("memory", "read_graph")
    assert first.value.kind == "channel_closed"
    assert (first.value.server, first.value.tool) == ("memory", "read_graph")
    assert "closed" in first.value.message
    with pytest.raises(ToolCallError) as later:
        asyncio.run(call_tool("memory", "search_nodes", {"query": "x"}))
    assert later.value.kind == "channel_closed"
    with pytest.raises(ToolCallError) as scrubbed:
        scrub("mail bob@example.com")
    assert scrubbed.value.kind == "channel_closed"
    assert len(fake.requests) == 1  # nothing more was sent


@pytest.mark.parametrize(
    ("line", "said"),
    [
        (b"this is not json\n", "not JSON"),
        (b'{"hello": "world"}\n', "not a bridge answer"),
        (b"[1, 2, 3]\n", "not a bridge answer"),
        (b'{"v": 1, "id": "1", "ok": true, "result": null}\n', "not a bridge answer"),
    ],
)
def test_a_line_that_is_not_an_answer_closes_the_channel(
    host: Callable[[Responder], FakeHost], line: bytes, said: str
) -> None:
    fake = host(lambda r: [line])
    with pytest.raises(ToolCallError) as exc:
        call_tool_sync("memory", "read_graph")
    assert exc.value.kind == "channel_closed"
    assert said in exc.value.message
    with pytest.raises(ToolCallError, match="channel_closed"):
        call_tool_sync("memory", "read_graph")
    assert len(fake.requests) == 1


def test_an_answer_of_the_wrong_shape_closes_the_channel(
    host: Callable[[Responder], FakeHost],
) -> None:
    host(lambda r: [{"v": 1, "id": r["id"], "ok": True, "result": ["not", "a", "result"]}])
    with pytest.raises(ToolCallError) as exc:
        call_tool_sync("memory", "read_graph")
    assert exc.value.kind == "channel_closed" and "unexpected shape" in exc.value.message
    with pytest.raises(ToolCallError, match="channel_closed"):
        call_tool_sync("memory", "read_graph")


def test_an_answer_line_over_64_mib_closes_the_channel(
    host: Callable[[Responder], FakeHost],
) -> None:
    host(lambda r: [b"x" * (64 * 1024 * 1024 + 1)])
    with pytest.raises(ToolCallError) as exc:
        call_tool_sync("big", "dump")
    assert exc.value.kind == "channel_closed" and "64 MiB" in exc.value.message


def test_a_large_answer_under_the_bound_arrives_whole(
    host: Callable[[Responder], FakeHost],
) -> None:
    text = "0123456789abcdef" * (512 * 1024)  # 8 MiB, in many reads
    host(lambda r: [ok(r, text=text), ok({"id": r["id"] + 1000, "op": "x"})])
    assert call_tool_sync("big", "dump") == text


def test_an_answer_for_a_cancelled_call_is_dropped_and_the_bridge_goes_on(
    host: Callable[[Responder], FakeHost],
) -> None:
    held: list[dict[str, Any]] = []

    def respond(request: dict[str, Any]) -> list[Answer]:
        if request["arguments"].get("hold"):
            held.append(request)
            return []
        late = [ok(r, structured="late") for r in held]
        return [*late, ok(request, structured="fresh")]

    host(respond)

    async def main() -> Any:
        task = asyncio.ensure_future(call_tool("s", "t", {"hold": True}))
        await asyncio.sleep(0)  # the task runs up to its await: the request is sent
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await call_tool("s", "t", {})

    assert asyncio.run(main()) == "fresh"
    assert held  # the cancelled call did reach the host, and its answer came late
    assert call_tool_sync("s", "t", {}) == "fresh"


@pytest.mark.parametrize(
    "arguments",
    [
        [("a", 1)],
        "a=1",
        {"a": {1, 2}},
        {"a": object()},
        {"a": float("nan")},
        {1: "one"},
    ],
)
def test_arguments_that_are_not_a_json_mapping_are_refused_before_sending(
    host: Callable[[Responder], FakeHost], arguments: Any
) -> None:
    fake = host(echo)
    with pytest.raises(TypeError, match=r"arguments of memory\.create_entities"):
        call_tool_sync("memory", "create_entities", arguments)
    with pytest.raises(TypeError):
        asyncio.run(call_tool("memory", "create_entities", arguments))
    assert call_tool_sync("memory", "read_graph") == {"echo": {}}
    assert [r["tool"] for r in fake.requests] == ["read_graph"]


def test_server_and_tool_must_be_names(host: Callable[[Responder], FakeHost]) -> None:
    fake = host(echo)
    with pytest.raises(TypeError, match="server"):
        call_tool_sync("", "read_graph")
    with pytest.raises(TypeError, match="tool"):
        call_tool_sync("memory", None)  # type: ignore[arg-type]
    assert fake.requests == []


def test_a_request_over_4_mib_fails_with_limit_and_the_channel_stays_open(
    host: Callable[[Responder], FakeHost],
) -> None:
    fake = host(echo)
    with pytest.raises(ToolCallError) as exc:
        call_tool_sync("fs", "write_file", {"content": "x" * (4 * 1024 * 1024)})
    assert exc.value.kind == "limit" and "4 MiB" in exc.value.message
    assert call_tool_sync("fs", "list") == {"echo": {}}
    assert len(fake.requests) == 1


def test_non_ascii_arguments_and_answers_round_trip(host: Callable[[Responder], FakeHost]) -> None:
    host(echo)
    value = {"name": "Zoë ✓ 日本", "emoji": "🙂", "lone": "\ud800"}
    assert call_tool_sync("s", "t", value) == {"echo": value}


def test_scrub_asks_the_host(host: Callable[[Responder], FakeHost]) -> None:
    fake = host(lambda r: [ok(r, text=r["text"].replace("bob@example.com", "[EMAIL]"))])
    assert scrub("mail bob@example.com now") == "mail [EMAIL] now"
    assert scrub("") == ""
    (request,) = fake.requests
    assert request == {
        "v": 1,
        "id": request["id"],
        "op": "scrub",
        "text": "mail bob@example.com now",
    }
    with pytest.raises(TypeError):
        scrub(b"bytes")  # type: ignore[arg-type]


def test_a_forked_child_cannot_use_the_parents_bridge(
    host: Callable[[Responder], FakeHost],
) -> None:
    fake = host(echo)
    assert call_tool_sync("s", "before") == {"echo": {}}
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # the child: report the outcome and leave without any cleanup
        signal.alarm(20)  # should the call wait for an answer that cannot come
        try:
            call_tool_sync("s", "in_child")
            outcome = "called"
        except ToolCallError as exc:
            outcome = f"{exc.kind}: {exc.message}"
        except BaseException as exc:
            outcome = repr(exc)
        os.write(write_end, outcome.encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        outcome = f.read().decode()
    os.waitpid(pid, 0)
    assert outcome.startswith("channel_closed: ") and "forked child" in outcome
    assert call_tool_sync("s", "after") == {"echo": {}}  # the parent's bridge is intact
    assert [r["tool"] for r in fake.requests] == ["before", "after"]


_NO_BRIDGE = """
import json, os, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import guest.runtime as runtime  # the guest package, by its directory's name on the host
from guest.runtime import bridge
out = []
def attempt():
    try:
        runtime.call_tool_sync("memory", "read_graph")
    except runtime.ToolCallError as exc:
        out.append([exc.kind, str(exc)])
attempt()  # fd 4 is not open
path = os.path.join(sys.argv[2], "file")
fd = os.open(path, os.O_RDWR | os.O_CREAT)
os.dup2(fd, 4)
bridge._reset()
attempt()  # fd 4 is a regular file: left alone
os.write(4, b"still mine")
out.append(open(path).read())
print(json.dumps(out))
"""


def test_without_a_bridge_on_fd_4_calls_fail_with_channel_closed(tmp_path: Path) -> None:
    """In a fresh interpreter: the test process's own fd 4 may be anything."""
    run = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _NO_BRIDGE, str(GUEST_DIR), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    closed, on_file, content = json.loads(run.stdout)
    for kind, message in (closed, on_file):
        assert kind == "channel_closed"
        assert "--mcp-config" in message and "memory.read_graph failed" in message
    assert content == "still mine"


# --- finding tools ---------------------------------------------------------------------

_ENTITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "entityType": {"type": "string"},
        "observations": {
            "type": "array",
            "items": {"type": "string"},
            "description": "Observation contents associated with the entity",
        },
    },
    "required": ["name", "entityType", "observations"],
}


def tool(
    name: str, description: str, required: tuple[str, ...] = (), **properties: dict[str, Any]
) -> Tool:
    """A tool whose arguments are `properties`, those named in `required` required."""
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    return Tool(name=name, description=description, inputSchema=schema)


TOOLS = {
    "memory": [
        tool(
            "create_entities",
            "Create multiple new entities in the knowledge graph",
            required=("entities",),
            entities={"type": "array", "items": _ENTITY},
        ),
        tool(
            "create_relations",
            "Create multiple new relations between entities in the knowledge graph",
            relations={"type": "array"},
        ),
        tool("read_graph", "Read the entire knowledge graph"),
        tool(
            "search_nodes",
            "Search for nodes in the knowledge graph based on a query",
            query={"type": "string"},
        ),
    ],
    "file-system": [
        tool(
            "list_directory",
            "Get a detailed listing of all files and directories in a path",
            path={"type": "string"},
        ),
        tool(
            "search_files",
            "Recursively search for files matching a pattern, from a directory",
            pattern={"type": "string"},
        ),
        tool(
            "getFileInfo",
            "Metadata of a file: size, times, permissions.\n\nKept in memory.",
            path={"type": "string"},
        ),
        tool(
            "write_file",
            "Create a new file or overwrite an existing one",
            path={"type": "string"},
            content={"type": "string", "description": "The zebra-striped payload"},
        ),
    ],
}


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real `servers/` tree, as `codecage gen` writes it."""
    servers = tmp_path_factory.mktemp("tree") / "servers"
    codegen.write_tree(codegen.generate(TOOLS), servers)
    return servers


def modules(refs: list[ToolRef]) -> list[str]:
    return [r.module for r in refs]


def test_create_entity_finds_create_entities_first(tree: Path) -> None:
    found = search_tools("create entity", root=tree)
    assert found[0].module == "servers.memory.create_entities"
    assert found[0] == ToolRef(
        "memory",
        "create_entities",
        "servers.memory.create_entities",
        "Create multiple new entities in the knowledge graph",
    )
    assert modules(found)[1] == "servers.memory.create_relations"


def test_the_tool_name_weighs_more_than_the_server_then_the_summary(tree: Path) -> None:
    # "directory": list_directory by name; search_files only in its summary.
    assert modules(search_tools("directory", root=tree)) == [
        "servers.file_system.list_directory",
        "servers.file_system.search_files",
    ]
    # "memory": the memory server's tools by server name; getFileInfo's description.
    by_server = modules(search_tools("memory", root=tree))
    assert by_server[:4] == [f"servers.memory.{t}" for t in sorted(t.name for t in TOOLS["memory"])]
    assert by_server[4:] == ["servers.file_system.get_file_info"]
    # "search": the names of search_files and search_nodes (a tie, by module name).
    assert modules(search_tools("search", root=tree))[:2] == [
        "servers.file_system.search_files",
        "servers.memory.search_nodes",
    ]


def test_plurals_and_verb_forms_match_their_stems(tree: Path) -> None:
    assert modules(search_tools("searching", root=tree))[:2] == [
        "servers.file_system.search_files",
        "servers.memory.search_nodes",
    ]
    assert modules(search_tools("directories", root=tree))[0] == (
        "servers.file_system.list_directory"
    )
    assert modules(search_tools("entity", root=tree))[0] == "servers.memory.create_entities"


def test_a_word_of_a_parameter_description_is_found(tree: Path) -> None:
    assert modules(search_tools("zebra", root=tree)) == ["servers.file_system.write_file"]
    assert search_tools("observations", root=tree)[0].tool == "create_entities"


def test_no_match_gives_nothing_and_stop_words_do_not_match_everything(tree: Path) -> None:
    assert search_tools("quantum teleport", root=tree) == []
    assert modules(search_tools("the graph of a", root=tree)) == modules(
        search_tools("graph", root=tree)
    )


def test_camel_case_names_and_original_names_are_kept(tree: Path) -> None:
    (ref,) = search_tools("file info", root=tree, limit=1)
    assert (ref.server, ref.tool, ref.module) == (
        "file-system",
        "getFileInfo",
        "servers.file_system.get_file_info",
    )


def test_an_empty_query_lists_every_tool_by_name_up_to_the_limit(tree: Path) -> None:
    everything = search_tools("", root=tree, limit=None)
    assert modules(everything) == sorted(modules(everything))
    assert len(everything) == 8
    assert modules(search_tools("", root=tree, limit=3)) == modules(everything)[:3]
    assert len(search_tools("", root=tree)) == 8  # the default limit is 10


def test_detail_levels(tree: Path) -> None:
    (name,) = search_tools("read graph", "name", limit=1, root=tree)
    (basic,) = search_tools("read graph", "basic", limit=1, root=tree)
    (full,) = search_tools("read graph", "full", limit=1, root=tree)
    assert name == ToolRef("memory", "read_graph", "servers.memory.read_graph", "", None)
    assert basic == ToolRef(
        "memory", "read_graph", "servers.memory.read_graph", "Read the entire knowledge graph"
    )
    assert full.summary == basic.summary
    assert full.description is not None
    assert full.description.startswith("Read the entire knowledge graph\n")
    assert "Parameters:" in full.description and "Returns:" in full.description
    assert str(basic) == "servers.memory.read_graph: Read the entire knowledge graph"
    assert str(name) == "servers.memory.read_graph"


def test_bad_detail_or_limit_is_refused(tree: Path) -> None:
    with pytest.raises(ValueError, match="detail"):
        search_tools("x", "everything", root=tree)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="limit"):
        search_tools("x", limit=0, root=tree)
    with pytest.raises(TypeError):
        search_tools(None, root=tree)  # type: ignore[arg-type]


def test_searching_imports_nothing_and_skips_huge_and_broken_files(tmp_path: Path) -> None:
    servers = tmp_path / "servers"
    codegen.write_tree(codegen.generate({"memory": TOOLS["memory"]}), servers)
    huge = '"""Teleport a quantum graph."""\n' + "# padding\n" * (110 * 1024)
    (servers / "memory" / "huge_tool.py").write_text(huge, encoding="utf-8")
    (servers / "memory" / "broken.py").write_text('"""Teleport quantum."""\ndef (', "utf-8")
    (servers / "memory" / "small.py").write_text('"""Teleport quantum."""\n', "utf-8")
    assert modules(search_tools("teleport", root=servers)) == ["servers.memory.small"]
    assert not [m for m in sys.modules if m == "servers" or m.startswith("servers.")]


def test_list_servers_names_the_server_packages(tree: Path, tmp_path: Path) -> None:
    assert list_servers(tree) == ["file_system", "memory"]
    assert list_servers(tmp_path / "nothing") == []
    assert search_tools("graph", root=tmp_path / "nothing") == []


def test_load_imports_the_tool_module(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tree.parent))
    try:
        (ref,) = search_tools("create entities", limit=1, root=tree)
        module = ref.load()
        assert module.__name__ == "servers.memory.create_entities"
        assert (module.SERVER, module.TOOL) == ("memory", "create_entities")
        assert callable(module.call) and callable(module.call_sync)
    finally:
        for name in [m for m in sys.modules if m == "servers" or m.startswith("servers.")]:
            del sys.modules[name]


def test_a_tool_ref_is_immutable_hashable_and_picklable() -> None:
    ref = ToolRef("memory", "read_graph", "servers.memory.read_graph", "Read it", "Read it\n")
    with pytest.raises(AttributeError):
        ref.tool = "other"
    assert ref == ToolRef(
        "memory", "read_graph", "servers.memory.read_graph", "Read it", "Read it\n"
    )
    assert len({ref, pickle.loads(pickle.dumps(ref))}) == 1  # noqa: S301 - our own bytes
    assert "tool='read_graph'" in repr(ref)
    match ref:
        case ToolRef(server, tool):
            assert (server, tool) == ("memory", "read_graph")


# --- the workspace ---------------------------------------------------------------------


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    root = tmp_path / "workspace"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("host secret", encoding="utf-8")
    return Workspace(root)


def test_files_round_trip_and_list_sorted_relative_paths(ws: Workspace) -> None:
    assert ws.write_text("notes.txt", "hi") == ws.path / "notes.txt"
    ws.write_bytes("data/raw/blob.bin", b"\x00\x01")  # parents are made
    ws.write_json("out/report.json", {"n": 3, "name": "Zoë"})
    assert ws.read_text("notes.txt") == "hi"
    assert ws.read_bytes("data/raw/blob.bin") == b"\x00\x01"
    assert ws.read_json("out/report.json") == {"n": 3, "name": "Zoë"}
    assert (ws.path / "out/report.json").read_text(encoding="utf-8") == (
        '{\n  "n": 3,\n  "name": "Zoë"\n}\n'
    )
    assert ws.list() == ["data/raw/blob.bin", "notes.txt", "out/report.json"]
    assert ws.list("*.json") == ["out/report.json"]
    assert ws.list("raw/*") == ["data/raw/blob.bin"]
    assert ws.list("**/*.txt") == ["notes.txt"]
    assert ws.exists("out") and ws.exists("notes.txt") and not ws.exists("nope.txt")
    assert ws.resolve("out/report.json") == ws.path.resolve() / "out/report.json"
    assert ws.read_text(ws.path / "notes.txt") == "hi"  # absolute, but inside: fine
    ws.delete("notes.txt")
    assert not ws.exists("notes.txt")
    with pytest.raises(FileNotFoundError):
        ws.delete("notes.txt")
    ws.delete("notes.txt", missing_ok=True)


@pytest.mark.parametrize(
    ("path", "rule"),
    [
        ("..", "'..' may not climb"),
        ("../outside/secret.txt", "'..' may not climb"),
        ("a/../../outside/secret.txt", "'..' may not climb"),
        ("/etc/passwd", "absolute path must be inside"),
        ("link_out/secret.txt", "symbolic link"),
        ("secret_link.txt", "symbolic link"),
    ],
)
def test_paths_that_lead_outside_the_workspace_are_refused(
    ws: Workspace, path: str, rule: str
) -> None:
    (ws.path / "link_out").symlink_to(ws.path.parent / "outside")
    (ws.path / "secret_link.txt").symlink_to(ws.path.parent / "outside" / "secret.txt")
    attempts: list[Callable[[], object]] = [
        lambda: ws.read_text(path),
        lambda: ws.read_bytes(path),
        lambda: ws.read_json(path),
        lambda: ws.write_text(path, "pwned"),
        lambda: ws.write_bytes(path, b"pwned"),
        lambda: ws.write_json(path, "pwned"),
        lambda: ws.exists(path),
        lambda: ws.resolve(path),
    ]
    for attempt in attempts:
        with pytest.raises(WorkspacePathError) as exc:
            attempt()
        assert repr(path) in str(exc.value) and rule in str(exc.value)
        assert "outside the workspace" in str(exc.value)
    assert (ws.path.parent / "outside" / "secret.txt").read_text(encoding="utf-8") == "host secret"
    assert sorted(p.name for p in (ws.path.parent / "outside").iterdir()) == ["secret.txt"]


def test_delete_removes_links_not_their_targets_and_never_the_root(ws: Workspace) -> None:
    outside = ws.path.parent / "outside" / "secret.txt"
    (ws.path / "secret_link.txt").symlink_to(outside)
    ws.write_text("kept.txt", "kept")
    (ws.path / "inner_link.txt").symlink_to(ws.path / "kept.txt")
    ws.delete("secret_link.txt")
    ws.delete("inner_link.txt")
    assert outside.exists() and ws.read_text("kept.txt") == "kept"
    assert sorted(p.name for p in ws.path.iterdir()) == ["kept.txt"]
    for path in ("", ".", "sub/..", str(ws.path)):
        with pytest.raises(WorkspacePathError, match="the workspace itself"):
            ws.delete(path)
    with pytest.raises(WorkspacePathError, match="outside the workspace"):
        ws.delete("../outside/secret.txt")
    (ws.path / "dir_link").symlink_to(ws.path.parent / "outside")
    with pytest.raises(WorkspacePathError, match="symbolic link"):
        ws.delete("dir_link/secret.txt")
    assert outside.exists()


def test_list_skips_links_and_refuses_patterns_that_leave(ws: Workspace) -> None:
    ws.write_text("a.txt", "a")
    (ws.path / "link_out").symlink_to(ws.path.parent / "outside")
    (ws.path / "file_link.txt").symlink_to(ws.path / "a.txt")
    assert ws.list() == ["a.txt"]
    for pattern in ("../*", "/etc/*", "x/../../*"):
        with pytest.raises(WorkspacePathError):
            ws.list(pattern)


def test_a_link_that_stays_inside_is_followed(ws: Workspace) -> None:
    ws.write_text("real/data.csv", "a,b\n")
    (ws.path / "alias").symlink_to(ws.path / "real")
    assert ws.read_text("alias/data.csv") == "a,b\n"
    ws.write_text("alias/more.csv", "c\n")
    assert ws.list("*.csv") == ["real/data.csv", "real/more.csv"]


_PARTS = st.sampled_from(["a", "b", "..", ".", "", "c.txt", "link"])


@settings(max_examples=300, deadline=None)
@given(st.lists(_PARTS, max_size=6), st.booleans())
def test_every_path_either_resolves_inside_or_is_refused(parts: list[str], absolute: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp, "ws")
        (root / "a" / "b").mkdir(parents=True)
        Path(tmp, "out").mkdir()
        (root / "a" / "link").symlink_to(Path(tmp, "out"))
        space = Workspace(root)
        text = "/".join(parts)
        if absolute:
            text = str(root / text)
        inside = root.resolve()
        expected_inside = (inside / text).resolve().is_relative_to(inside)
        try:
            got = space.resolve(text)
        except WorkspacePathError:
            assert not expected_inside
        else:
            assert expected_inside and got.is_relative_to(inside)


# --- run_async and the logger ----------------------------------------------------------


async def _twice(x: int) -> tuple[int, str]:
    await asyncio.sleep(0)
    return 2 * x, threading.current_thread().name


async def _boom() -> None:
    await asyncio.sleep(0)
    raise KeyError("boom")


def test_run_async_without_a_running_loop() -> None:
    assert run_async(_twice(21)) == (42, threading.current_thread().name)
    with pytest.raises(KeyError, match="boom"):
        run_async(_boom())


def test_run_async_inside_a_running_loop_uses_a_thread_of_its_own() -> None:
    async def main() -> tuple[int, str]:
        with pytest.raises(KeyError, match="boom"):
            run_async(_boom())
        return run_async(_twice(21))

    value, thread = asyncio.run(main())
    assert value == 42 and thread != threading.current_thread().name


def test_run_async_takes_only_coroutines() -> None:
    with pytest.raises(TypeError, match="coroutine"):
        run_async(lambda: 1)  # type: ignore[arg-type]


def test_the_logger_writes_one_json_object_per_line_to_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logger = runtime.logger
    assert logger is host_runtime.logger is logging.getLogger("agent")
    assert logger.level == logging.INFO and not logger.propagate
    logger.debug("not shown")
    logger.info("done", extra={"rows": 3, "path": Path("/workspace/a")})
    logger.warning("careful: %s", "x", extra={"level": "spoofed"})
    try:
        raise ValueError("bad row")
    except ValueError:
        logger.exception("failed")
    out, err = capsys.readouterr()
    assert out == ""
    lines = [json.loads(line) for line in err.splitlines()]
    assert lines[0] == {"level": "info", "msg": "done", "rows": 3, "path": "/workspace/a"}
    assert lines[1] == {"level": "warning", "msg": "careful: x"}
    assert lines[2]["level"] == "error" and lines[2]["msg"] == "failed"
    assert "ValueError: bad row" in lines[2]["exception"]
    assert len(lines) == 3


def test_the_host_module_re_exports_the_guest_runtime() -> None:
    assert host_runtime.__all__ == runtime.__all__ == sorted(runtime.__all__)
    for name in runtime.__all__:
        assert getattr(host_runtime, name) is getattr(runtime, name), name
