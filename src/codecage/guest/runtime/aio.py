"""`run_async`: a coroutine run to the end, with or without a running event loop."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")


def run_async(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run `coro` to completion and return its value (or raise its exception).

    Works with or without an event loop running in this thread: the code of a run with
    top-level `await` runs inside one, and there the coroutine runs on a new loop in a
    thread of its own while this thread waits (so it must not need this thread's loop).

    Raises:
        Whatever `coro` raises. TypeError: `coro` is not a coroutine.
    """
    import asyncio
    import threading

    if not asyncio.iscoroutine(coro):
        raise TypeError(f"run_async() takes a coroutine, not {type(coro).__name__}")
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append((True, asyncio.run(coro)))
        except BaseException as exc:
            outcome.append((False, exc))

    thread = threading.Thread(target=target, name="codecage-run-async")
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]
