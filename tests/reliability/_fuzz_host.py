"""What the fuzz tests of the host's readers share: a Sandbox per backend, as the
containment suite parametrises them (tests/containment/_backends.py), made once per
module and closed at its end (the leak guard then finds nothing of them).

A backend this host lacks is skipped, except under CI, where every backend is installed
and a missing one fails (as in tests/containment/conftest.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from codecage import Options, Sandbox
from codecage.errors import CodecageError
from containment._backends import BACKENDS_UNDER_TEST, NEEDS_ROOT

BACKENDS = BACKENDS_UNDER_TEST


class BackendSandboxes:
    """One Sandbox per backend name (`bwrap-fork`: bwrap with the fork server), made at
    first use; the import policy and scrubbing off, so the code may write to any fd and
    what comes back is what the host made of it."""

    def __init__(self, **options: Any) -> None:
        self._made: dict[str, Sandbox | str] = {}
        self._options = options  # more Options() fields

    def get(self, backend: str) -> Sandbox:
        if os.geteuid() != 0 and backend in NEEDS_ROOT:
            pytest.skip(f"not as an ordinary user: {NEEDS_ROOT[backend]}")
        if backend not in self._made:
            self._made[backend] = self._make(backend, self._options)
        found = self._made[backend]
        if isinstance(found, str):
            if os.environ.get("CI") == "true":
                pytest.fail(found + " (CI installs every backend: scripts/setup --test)")
            pytest.skip(found)
        return found

    @staticmethod
    def _make(backend: str, options: dict[str, Any]) -> Sandbox | str:
        forked = backend == "bwrap-fork"
        try:
            made = Sandbox(
                backend="bwrap" if forked else backend,
                options=Options(
                    import_policy=False,
                    scrub=False,
                    fork_server=forked,
                    allow_degraded=backend == "landlock",
                    **options,
                ),
            )
        except CodecageError as exc:
            return f"backend {backend!r} is not available here: {exc}"
        if forked and made.host.templates is None:
            made.close()
            return f"no fork server here: {made.host.fork_server_off}"
        return made

    def close(self) -> None:
        for made in self._made.values():
            if isinstance(made, Sandbox):
                made.close()
        self._made.clear()


def backend_sandboxes(**options: Any) -> Iterator[BackendSandboxes]:
    """The body of a module-scoped fixture: the sandboxes, closed after the module."""
    sandboxes = BackendSandboxes(**options)
    try:
        yield sandboxes
    finally:
        sandboxes.close()
