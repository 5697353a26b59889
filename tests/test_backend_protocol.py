"""What a backend can do is part of the `Backend` protocol (backends/base.py): each backend
states every trait, nothing outside backends/ reads one with `getattr` or tests a backend's
name, and a sandboxed upstream server starts through the protocol's `start` like a run,
with no bubblewrap syntax of its own (bridge/sandboxed.py)."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from codecage.backends import base
from codecage.backends.base import BACKENDS, Backend, LaunchSpec, OnCreated, SandboxProcess
from codecage.bridge import sandboxed, upstreams
from codecage.bridge.broker import Broker
from codecage.isolation import identity as identities

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "codecage"
PROBE = ROOT / "tests" / "fixtures" / "probe_server.py"

TRAITS = sorted(name for name in Backend.__annotations__ if name != "name")


def _backend_class(name: str) -> type:
    module_name, class_name = BACKENDS[name].split(":")
    found: type = getattr(importlib.import_module(module_name), class_name)
    return found


def _assigned_in_init(cls: type) -> set[str]:
    """The attributes `__init__` sets on self (a trait that depends on the host, such as
    Landlock's ABI, is stated there)."""
    tree = ast.parse(inspect.getsource(cls))
    return {
        target.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
    }


def test_the_protocol_declares_what_a_backend_can_do() -> None:
    assert {"forks_templates", "lends_directories", "serves_stdio", "host_overhead"} <= set(TRAITS)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_states_every_trait(name: str) -> None:
    """No default stands in for a trait a backend forgot: each is in its class body, or set
    by its `__init__`."""
    cls = _backend_class(name)
    stated = set(vars(cls)) | _assigned_in_init(cls)
    missing = [trait for trait in TRAITS if trait not in stated]
    assert not missing, f"{cls.__name__} does not state {missing}"


def _reads_by_getattr_or_name(path: Path) -> list[str]:
    """`getattr(<...backend...>, ...)` and `<...backend...>.name == "..."` in one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and node.args
            and "backend" in ast.unparse(node.args[0]).lower()
        ):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(
                isinstance(s, ast.Attribute)
                and s.attr == "name"
                and "backend" in ast.unparse(s.value).lower()
                for s in sides
            )
            literal = any(isinstance(s, ast.Constant) and isinstance(s.value, str) for s in sides)
            if named and literal:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_outside_backends_reads_a_trait_by_getattr_or_tests_a_name() -> None:
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if "backends" not in path.relative_to(PACKAGE).parts
        for hit in _reads_by_getattr_or_name(path)
    ]
    assert not found, "\n".join(found)


class RecordingBackend:
    """The real stdio backend, recording what it is asked to start: the sandboxed server
    still runs in a real bubblewrap sandbox; this only shows which interface started it."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.specs: list[LaunchSpec] = []

    def __getattr__(self, name: str) -> Any:  # the traits, version and probe: the inner's
        return getattr(self.inner, name)

    def start(self, spec: LaunchSpec, on_created: OnCreated | None = None) -> SandboxProcess:
        self.specs.append(spec)
        return self.inner.start(spec, on_created)


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A state directory the sandbox's host id can use (pytest's tmp_path is root's 0700)."""
    path = Path(tempfile.mkdtemp(prefix="codecage-test-state-"))
    path.chmod(0o755)
    who = identities.plan().identity
    os.chown(path, who.uid, who.gid)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_a_sandboxed_server_starts_through_the_backend_protocol(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recording = RecordingBackend(base.stdio_backend())
    monkeypatch.setattr(sandboxed, "stdio_backend", lambda: recording)
    entry = {
        "command": str(Path(sys.executable).parent / "python"),
        "args": [str(PROBE)],
        "sandbox": True,
        "state_dir": str(state_dir),
    }
    servers = upstreams.parse({"mcpServers": {"caged": entry}}, source="test", environ={})
    with Broker(servers) as broker:
        answer = broker.call("caged", "environment", {}).result(timeout=120)
    assert answer.structured is not None and "/state" in str(answer.structured)
    assert len(recording.specs) == 1
    spec = recording.specs[0]
    assert spec.stdio and spec.control_fd is None and spec.bridge_fd is None
    # The command inside, as the bridge planned it: no launcher syntax of any backend's.
    assert spec.guest_argv[0] == "/usr/bin/prlimit", spec.guest_argv


def test_the_stdio_backend_is_one_that_serves_stdio() -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("needs bubblewrap")
    assert base.stdio_backend().serves_stdio
