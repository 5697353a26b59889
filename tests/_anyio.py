"""The async tests' event loop: one asyncio loop a module, so that a module-scoped fixture
(a server, its client) serves every test of the module. A module takes it with
`from tests._anyio import anyio_backend`."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """asyncio (not anyio's parametrized choice), one loop for the whole module."""
    return "asyncio"
