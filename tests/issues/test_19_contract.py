"""Issue 19: one contract between host and guest (codecage/guest/contract.py).

The wire version, the message kinds and ops, the guest's paths and fds and the caps are
written once, in a stdlib-only module both sides import; these tests pin that the host's
models and modules and the guest (on the host, and inside a real sandbox) agree with it.
"""

from __future__ import annotations

import ast
import json
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import BaseModel, TypeAdapter
from tests._source import relative_imports, top_level_imports

import codecage.runtime as host_runtime
from codecage import Sandbox
from codecage.bridge import channel
from codecage.engine import run as engine_run
from codecage.guest import bootstrap, contract
from codecage.guest import runtime as guest_runtime
from codecage.guest.runtime import bridge as guest_bridge
from codecage.isolation import rootfs
from codecage.models import (
    BridgeAnswer,
    BridgeClosed,
    BridgeFailure,
    BridgeRequest,
    CallToolRequest,
    GuestEnd,
    GuestEvent,
    GuestReady,
    GuestRequest,
    GuestResult,
    ScrubRequest,
)

SRC = Path(contract.__file__).parents[2]  # src/


def _literal(model: type[BaseModel], field: str) -> Any:
    (value,) = get_args(model.model_fields[field].annotation)
    return value


def _max_length(model: type[BaseModel], field: str) -> int:
    found = [m.max_length for m in model.model_fields[field].metadata if hasattr(m, "max_length")]
    assert len(found) == 1, found
    return int(found[0])


def _guest_python(code: str) -> str:
    """The stdout of `code` in an interpreter like the guest's (-I -S) with `sys` imported
    and the guest package on the path (as `guest`: its directory's name on the host)."""
    script = f"import sys; sys.path.insert(0, sys.argv[1])\n{code}"
    return subprocess.run(
        [sys.executable, "-I", "-S", "-c", script, str(SRC / "codecage")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout


# --- the contract module ----------------------------------------------------------------


def test_the_contract_imports_only_the_standard_library() -> None:
    path = Path(contract.__file__)
    assert not relative_imports(path)
    imported = top_level_imports(path)
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


def test_the_contract_loads_in_a_bare_interpreter_without_the_host() -> None:
    """As in the sandbox: -I -S, only the guest package on the path, nothing else imported
    (the guest loads it on every cold start)."""
    out = _guest_python(
        "before = set(sys.modules)\n"
        "import guest.contract as c\n"
        "print(c.WIRE_VERSION, sorted(set(sys.modules) - before))"
    ).split(maxsplit=1)
    assert int(out[0]) == contract.WIRE_VERSION
    loaded = {name.split(".")[0] for name in ast.literal_eval(out[1])} - {"guest"}
    assert loaded <= set(sys.stdlib_module_names), loaded


def test_the_wire_version_is_written_once_in_the_sources() -> None:
    defined = [
        f"{path.relative_to(SRC)}:{number}"
        for path in sorted(SRC.rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.match(r"\s*WIRE_VERSION\s*(:[^=]*)?=\s*\d", line)
    ]
    assert defined == ["codecage/guest/contract.py:22"]


def test_the_stop_line_is_the_kind_stop_at_the_wire_version() -> None:
    assert json.loads(contract.STOP_LINE) == {"v": contract.WIRE_VERSION, "kind": "stop"}
    assert contract.STOP_LINE.endswith(b"\n") and b" " not in contract.STOP_LINE


# --- the host agrees --------------------------------------------------------------------


def test_the_control_models_spell_the_contract() -> None:
    for model in (GuestRequest, GuestReady, GuestResult, GuestEnd):
        assert _literal(model, "v") == contract.WIRE_VERSION, model
    assert _literal(GuestReady, "kind") == contract.KIND_READY
    assert _literal(GuestRequest, "kind") == contract.KIND_RUN
    assert _literal(GuestResult, "kind") == contract.KIND_RESULT
    assert _literal(GuestEnd, "kind") == contract.KIND_END
    assert _max_length(GuestEvent, "detail") == contract.MAX_EVENT_DETAIL
    assert _max_length(GuestResult, "events") == contract.MAX_EVENTS


def test_the_bridge_models_spell_the_contract() -> None:
    for model in (CallToolRequest, ScrubRequest, BridgeAnswer, BridgeFailure, BridgeClosed):
        assert _literal(model, "v") == contract.WIRE_VERSION, model
    assert _literal(CallToolRequest, "op") == contract.OP_CALL_TOOL
    assert _literal(ScrubRequest, "op") == contract.OP_SCRUB
    assert _max_length(BridgeClosed, "closed") == contract.BRIDGE_MAX_CLOSED_REASON


def test_the_host_modules_use_the_contracts_names() -> None:
    assert engine_run.STOP_LINE is contract.STOP_LINE
    assert channel.MAX_REQUEST_BYTES == contract.BRIDGE_MAX_REQUEST_BYTES
    assert rootfs.GUEST_PACKAGE_ROOT == contract.GUEST_PACKAGE_ROOT
    assert rootfs.GUEST_BOOTSTRAP_PYC == contract.GUEST_BOOTSTRAP_PYC
    assert rootfs.WORKSPACE == contract.WORKSPACE_DIR
    assert rootfs.GUEST_PREFIX == contract.GUEST_PREFIX


def test_the_guest_modules_use_the_contract_too() -> None:
    assert bootstrap.contract is contract
    assert guest_runtime.BRIDGE_FD == contract.BRIDGE_FD == host_runtime.BRIDGE_FD
    assert guest_runtime.SERVERS_DIR == contract.SERVERS_DIR


def test_the_host_runtime_takes_its_names_from_the_guest_package() -> None:
    source = Path(host_runtime.__file__).read_text(encoding="utf-8")
    assert '"call_tool"' not in source  # no hand-copied list
    assert host_runtime.__all__ == guest_runtime.__all__


# --- the bridge's messages, both ends ---------------------------------------------------


def test_what_the_guest_sends_is_a_request_model_and_it_reads_the_answer_models() -> None:
    guest_end, host_end = socket.socketpair()
    guest_bridge._use_channel(guest_end)
    parsed: list[Any] = []

    def serve() -> None:
        with host_end.makefile("rb") as lines:
            for line in lines:
                request = TypeAdapter(BridgeRequest).validate_json(line)
                parsed.append(request)
                if isinstance(request, ScrubRequest):
                    answer = BridgeAnswer(id=request.id, result="[EMAIL]").to_dict()
                else:
                    answer = BridgeFailure.model_validate(
                        {"id": request.id, "error": {"kind": "not_allowed", "message": "no"}}
                    ).model_dump()
                host_end.sendall(json.dumps(answer).encode() + b"\n")
                if len(parsed) == 2:
                    closed = BridgeClosed(closed="the run is over").model_dump()
                    host_end.sendall(json.dumps(closed).encode() + b"\n")
                    return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        assert host_runtime.scrub("mail a@b.c") == "[EMAIL]"
        with pytest.raises(host_runtime.ToolCallError) as refused:
            host_runtime.call_tool_sync("memory", "read_graph", {"q": [1]})
        assert refused.value.kind == "not_allowed"
        thread.join(timeout=10)
        with pytest.raises(host_runtime.ToolCallError) as closed:
            host_runtime.scrub("again")
        assert closed.value.kind == "channel_closed"
        assert closed.value.message == "the run is over"
    finally:
        guest_bridge._reset()
        host_end.close()
    assert isinstance(parsed[0], ScrubRequest) and parsed[0].text == "mail a@b.c"
    call = parsed[1]
    assert isinstance(call, CallToolRequest)
    assert (call.server, call.tool, call.arguments) == ("memory", "read_graph", {"q": [1]})


# --- inside a real sandbox --------------------------------------------------------------


@pytest.fixture(scope="module")
def basic() -> Any:
    with Sandbox(profile="basic", pool=False) as box:
        yield box


def test_the_guest_in_a_sandbox_has_the_same_contract() -> None:
    with Sandbox(profile="standard", pool=False) as box:
        r = box.run(
            "from codecage import contract\n"
            "import codecage.runtime as rt\n"
            "import codecage.runtime.bridge as bridge\n"
            "[contract.WIRE_VERSION, contract.STOP_LINE.decode(), rt.BRIDGE_FD,"
            " rt.SERVERS_DIR, contract.__file__, bridge.__name__]"
        )
    assert r.status == "ok", (r.error, r.stderr)
    assert r.return_value == [
        contract.WIRE_VERSION,
        contract.STOP_LINE.decode(),
        contract.BRIDGE_FD,
        contract.SERVERS_DIR,
        f"{contract.GUEST_PACKAGE_DIR}/contract.py",
        "codecage.runtime.bridge",
    ]


def test_a_long_event_detail_is_cut_to_the_contracts_cap_not_lost(basic: Sandbox) -> None:
    """The guest bounds its events' details as the host's model does: one long refused
    import no longer voids the whole report (error, events) as invalid."""
    name = "m" * 700
    r = basic.run(f"import {name}")
    assert r.error is not None and r.error.type == "ModuleNotFoundError", r.events
    kinds = [e.kind for e in r.events]
    assert "import_blocked" in kinds and "guest_report_invalid" not in kinds, kinds
    blocked = next(e for e in r.events if e.kind == "import_blocked")
    assert blocked.detail.startswith(name[:100])


def test_the_runtime_package_loads_only_the_modules_of_the_names_used() -> None:
    """Split into modules, `codecage.runtime` costs no more to import than it did whole:
    a generated tool module's `from codecage.runtime import call_tool` loads the bridge
    client only (the guest's interpreter: -I -S, the guest package alone on the path)."""
    out = _guest_python(
        "from guest.runtime import call_tool, ToolCallError\n"
        "print(sorted(m for m in sys.modules if m.startswith('guest') or m == 'logging'))"
    )
    assert ast.literal_eval(out) == [
        "guest",
        "guest.contract",
        "guest.runtime",
        "guest.runtime.bridge",
    ]
