"""The containment suite runs on every backend (parametrised, not copied).

Here `sandbox` and `runner` are overridden: each containment test runs once per backend in
`BACKENDS_UNDER_TEST`, and (for `runner`) once more on the null runner, where it must fail.
A backend that cannot meet a test says so by name in `_backends.KNOWN_GAPS`: that test is
a strict xfail on that backend (it must keep failing there, and it is listed, not
skipped). A backend not available on this host is skipped, except under CI, where
`scripts/setup --test` installs them all and a missing one is a failure.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from codecage import Options, Sandbox
from codecage.errors import CodecageError
from codecage.isolation import cgroups, tmpfs
from conftest import _run_sandboxed, _run_unsandboxed

from ._backends import (
    BACKENDS_UNDER_TEST,
    KNOWN_GAPS,
    NEEDS_ROOT,
    NONROOT_KNOWN_GAPS,
    WITH_CGROUP_KNOWN_GAPS,
)
from ._hostmode import NONROOT_GAPS, null_baseline_holds
from ._support import Runner

_sandboxes: dict[str, Sandbox | str] = {}
_BACKEND_PARAMS = ("runner", "sandbox")


def sandbox_on(backend: str) -> Sandbox:
    """One Sandbox per backend for the whole session (the import policy and scrubbing off,
    as in the root conftest: the OS layers are what is tested)."""
    if os.geteuid() != 0 and backend in NEEDS_ROOT:
        pytest.skip(f"not as an ordinary user: {NEEDS_ROOT[backend]}")
    if backend not in _sandboxes:
        forked = backend == "bwrap-fork"
        try:
            _sandboxes[backend] = made = Sandbox(
                backend="bwrap" if forked else backend,
                options=Options(import_policy=False, scrub=False, fork_server=forked),
            )
            if forked and made.host.templates is None:
                _sandboxes[backend] = f"no fork server here: {made.host.fork_server_off}"
        except CodecageError as exc:
            _sandboxes[backend] = f"backend {backend!r} is not available here: {exc}"
    found = _sandboxes[backend]
    if isinstance(found, str):
        if os.environ.get("CI") == "true":
            pytest.fail(found + " (CI installs every backend: scripts/setup --test)")
        pytest.skip(found)
    return found


@pytest.fixture(scope="session", params=BACKENDS_UNDER_TEST)
def sandbox(request: pytest.FixtureRequest) -> Sandbox:
    return sandbox_on(request.param)


_NULL_RUNNER = pytest.param(
    "null",
    marks=pytest.mark.xfail(
        strict=True, reason="null runner has no isolation: the test must fail there"
    ),
)


@pytest.fixture(params=[*BACKENDS_UNDER_TEST, _NULL_RUNNER])
def runner(request: pytest.FixtureRequest) -> Runner:
    if request.param == "null":
        return _run_unsandboxed
    return _run_sandboxed(sandbox_on(request.param))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each known gap of a backend becomes a strict xfail of that test on that backend;
    as non-root, so does each limit the rlimit/plain-directory fallback cannot keep, and a
    null baseline the host itself already refuses is skipped (`_hostmode`)."""
    nonroot = os.geteuid() != 0
    has_cgroup = cgroups.detect() is not None
    missing: set[str] = set()
    if nonroot:
        missing |= {"cgroup"} if not has_cgroup else set()
        missing |= {"tmpfs"} if not tmpfs.can_mount_tmpfs() else set()
    null_holds = null_baseline_holds() if nonroot else {}
    for item in items:
        callspec: Any = getattr(item, "callspec", None)
        if callspec is None:
            continue
        backend = callspec.params.get("runner", callspec.params.get("sandbox"))
        name = getattr(item, "originalname", item.name)
        # A gap names a test, or one of its cases: "test_x[mnt]" (its other parameters).
        case = "-".join(str(v) for k, v in callspec.params.items() if k not in _BACKEND_PARAMS)
        gaps = KNOWN_GAPS.get(backend, {})
        gap = (
            gaps.get(name)
            or gaps.get(f"{name}[{case}]")
            or gaps.get(item.name.replace(f"[{backend}-", "[", 1))  # the id, less the backend
        )
        if gap is None and has_cgroup and nonroot:  # as root each run has its own id
            gap = WITH_CGROUP_KNOWN_GAPS.get(backend, {}).get(name)
        racy = NONROOT_KNOWN_GAPS.get(backend, {}).get(name) if gap is None and nonroot else None
        if racy is not None:  # may hold by chance: an xfail that is not strict
            item.add_marker(pytest.mark.xfail(strict=False, reason=f"{backend}: {racy}"))
        if gap is not None:
            item.add_marker(pytest.mark.xfail(strict=True, reason=f"{backend}: {gap}"))
        if backend == "null":
            held = null_holds.get(item.name, null_holds.get(name))
            if held is not None:
                item.add_marker(pytest.mark.skip(reason=held))
        elif name in NONROOT_GAPS and NONROOT_GAPS[name][0] in missing:
            item.add_marker(pytest.mark.xfail(strict=True, reason=NONROOT_GAPS[name][1]))
