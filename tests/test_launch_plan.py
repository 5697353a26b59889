"""A sandbox's launch is one pure plan, then one start (engine/plan.py, engine/run.py).

The plan is computed from real host facts and resources really acquired (a run directory,
a workspace, a lent id, channels), then checked for purity; the sandbox is a real bwrap one,
its mount table read from inside.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from codecage.backends.base import load_backend
from codecage.engine import RunRequest, SandboxSpec, launch, run_in, start
from codecage.engine import plan as plans
from codecage.models import Limits

# What Python reports before it writes, creates, removes or runs something (PEP 578's
# audit events: open() with any mode, os.mkdir/remove/rename/chmod/..., subprocess,
# fork, sockets). os.stat has no event, so reads of metadata are not seen here; the
# temporary cwd staying empty and the equal plans are the rest of the check.
_EFFECTS = (
    "open",
    "os.",
    "shutil.",
    "subprocess.",
    "socket.",
    "ctypes.",
    "fcntl.",
    "mmap.",
    "tempfile.",
    "glob.",
)
_watching = threading.local()


def _audit(event: str, _args: tuple[object, ...]) -> None:
    seen: list[str] | None = getattr(_watching, "seen", None)
    if seen is not None and event.startswith(_EFFECTS):
        seen.append(event)


sys.addaudithook(_audit)  # for the life of this worker; silent unless a block watches


@contextlib.contextmanager
def effects() -> Iterator[list[str]]:
    """The audit events with an effect raised on this thread within the block."""
    _watching.seen = []
    try:
        yield _watching.seen
    finally:
        del _watching.seen


@pytest.fixture
def acquired(tmp_path: Path) -> Iterator[tuple[SandboxSpec, plans.HostFacts, launch.Acquired]]:
    spec = SandboxSpec(preload=("json",))
    backend = load_backend("bwrap")
    found = launch.facts(spec)
    with contextlib.ExitStack() as cleanup:
        held = launch.acquire(spec, found, backend, cleanup, execution_id="plan-test")
        yield spec, found, held


def test_the_watcher_sees_what_acquiring_does() -> None:
    """The check below can fail: the same watcher sees acquire make its run directory."""
    spec = SandboxSpec()
    found = launch.facts(spec)
    with contextlib.ExitStack() as cleanup, effects() as seen:
        launch.acquire(spec, found, load_backend("bwrap"), cleanup, execution_id="plan-test")
    assert "os.mkdir" in seen and "open" in seen, seen


def test_the_plan_is_pure(
    acquired: tuple[SandboxSpec, plans.HostFacts, launch.Acquired],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec, found, held = acquired
    backend = load_backend("bwrap")
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(held.resources.run_dir))
    with effects() as seen:
        first = plans.plan(spec, Limits(), backend, found, held.resources, pooled=True)
        second = plans.plan(spec, Limits(), backend, found, held.resources, pooled=True)
        template = plans.plan(spec, Limits(), backend, found, held.resources, as_template=True)
        sources = plans.host_sources(found)
    assert seen == []
    assert template.template and template.seccomp != first.seccomp
    assert first == second
    assert sources == plans.host_sources(found)
    assert os.listdir(tmp_path) == []
    assert sorted(os.listdir(held.resources.run_dir)) == before
    # It is the plan of this run: its ids, its run directory, its channels, its limits.
    assert first.identity == held.resources.identity
    assert first.cwd == held.resources.run_dir
    assert str(held.resources.control_fd) in first.argv
    assert first.argv[-2:] == ("--preload", "json")
    assert first.cgroup.limits == Limits()
    assert ("/workspace", str(held.workspace.bind_source)) in {
        (m.dest, m.source) for m in first.mounts
    }


def test_the_plan_follows_its_inputs(
    acquired: tuple[SandboxSpec, plans.HostFacts, launch.Acquired],
) -> None:
    """Equal plans are not a constant: another spec, limits or run directory changes it."""
    spec, found, held = acquired
    backend = load_backend("bwrap")
    base = plans.plan(spec, Limits(), backend, found, held.resources)
    other_tmp = plans.plan(
        SandboxSpec(tmp_mb=spec.tmp_mb + 1), Limits(), backend, found, held.resources
    )
    assert other_tmp.mounts != base.mounts
    assert plans.plan(spec, Limits(timeout=5), backend, found, held.resources) != base


_MOUNT_POINTS = """
import json
with open("/proc/self/mountinfo") as f:
    print(json.dumps([line.split()[4] for line in f]))
"""


def test_a_sandboxs_mounts_are_its_plans() -> None:
    """Every mount point inside a bwrap sandbox is one its plan made, and every mount its
    plan made is there: bwrap's own root and its --dev's nodes (/dev/null, /dev/pts, ...)
    aside; a symlink in the plan is not a mount."""
    backend = load_backend("bwrap")
    sandbox = start(SandboxSpec(), Limits(), backend)
    try:
        request = RunRequest(code=_MOUNT_POINTS, filename="m.py", limits=Limits())
        result = run_in(sandbox, request, backend_name=backend.name)
    finally:
        sandbox.destroy()
    assert result.status == "ok", result.stderr
    assert sandbox.plan is not None
    planned = {m.dest for m in sandbox.plan.mounts if m.kind not in ("symlink", "remount-ro")}
    seen = set(json.loads(result.stdout)) - {"/"}
    seen = {p for p in seen if not p.startswith("/dev/")}
    assert seen == planned, (sorted(seen - planned), sorted(planned - seen))
