"""Issue 19: a backend is a real boundary. The engine starts sandboxes through the `Backend`
protocol only (no backend named in engine/), bwrap's conventions live in backends/bwrap.py,
the guest's control stream is parsed once, and the self-test is a function of the backend."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import codecage.engine
from codecage import Sandbox
from codecage.backends import bwrap
from codecage.backends.base import ExitStatus, HostOverhead, LaunchSpec, OnCreated, SandboxProcess
from codecage.engine import RunRequest, execute, judge, selftest
from codecage.models import LayerStatus, Limits

ENGINE = Path(codecage.engine.__file__).parent


def _named_in_code(path: Path) -> set[str]:
    """Every identifier, imported module and string of `path` that is not a docstring."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            names.add(node.value)
    return names


@pytest.mark.parametrize("path", sorted(ENGINE.glob("*.py")), ids=lambda p: p.name)
def test_the_engine_names_no_backend(path: Path) -> None:
    named = [n for n in _named_in_code(path) if "bwrap" in n.lower()]
    assert named == [], f"{path.name} speaks a backend's language: {named}"


@pytest.mark.parametrize(
    ("returncode", "status"),
    [
        (0, ExitStatus(code=0)),
        (1, ExitStatus(code=1)),
        (128, ExitStatus(code=128)),
        (137, ExitStatus(code=137, signal=9)),
        (-9, ExitStatus(code=None, signal=9)),
    ],
)
def test_bwraps_exit_convention_is_read_by_bwrap(returncode: int, status: ExitStatus) -> None:
    assert bwrap.exit_status(returncode) == status


class RecordingBackend:
    """A second backend, as an engine sees it: bwrap underneath, under another name."""

    name = "recording"
    # What it can do, stated as every backend states it (backends.base.Backend): a plain
    # one, each sandbox started anew.
    forks_templates = False
    lends_directories = False
    serves_stdio = False
    runs_bubblewrap = False
    root_launcher = False
    guest_is_sentry_root = False
    shares_host_user_namespace = False
    filters_unix_addressing = False
    host_overhead = HostOverhead()
    lost_layers: tuple[str, ...] = ()
    selftest_gaps: frozenset[str] = frozenset()

    def __init__(self) -> None:
        self.inner = bwrap.BwrapBackend()
        self.created: list[int] = []

    def version(self) -> str | None:
        return "1.0"

    def probe(self) -> list[LayerStatus]:
        return []

    def start(self, spec: LaunchSpec, on_created: OnCreated | None = None) -> SandboxProcess:
        def created(pid: int) -> None:
            self.created.append(pid)
            if on_created is not None:
                on_created(pid)

        return self.inner.start(spec, created)


def test_the_engine_runs_code_through_any_backend() -> None:
    backend = RecordingBackend()
    request = RunRequest(code="print(6 * 7)", filename="main.py", limits=Limits())
    result = execute(request, backend)
    assert (result.status, result.stdout, result.backend) == ("ok", "42\n", "recording")
    assert len(backend.created) == 1 and backend.created[0] > 1


def test_the_control_stream_is_parsed_once_per_run(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[bytes] = []
    real = judge.ControlStream._line

    def counting(self: judge.ControlStream, line: bytes) -> None:
        parsed.append(line)
        real(self, line)

    monkeypatch.setattr(judge.ControlStream, "_line", counting)
    result = execute(
        RunRequest(code="1 + 1", filename="main.py", limits=Limits()), bwrap.BwrapBackend()
    )
    assert result.return_value == 2
    kinds = [json.loads(line)["kind"] for line in parsed if line]
    assert kinds == ["ready", "result", "end"], parsed  # each line once


def test_the_self_test_runs_through_the_engine_not_the_facade(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the self-test went through the Sandbox facade")

    monkeypatch.setattr(Sandbox, "run", refuse)
    report = selftest.run_probes(bwrap.BwrapBackend())
    assert report.backend == "bwrap" and report.passed, report
