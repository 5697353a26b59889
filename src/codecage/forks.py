"""What a forked child may touch of its parent's codecage objects: nothing that has threads.

A pre-forking server or `multiprocessing` (fork) copies this process's memory but only the
thread that called fork(). An object whose work is done by its own threads (the warm pool,
the broker's upstream sessions, the bridge watcher) is a dead copy in the child: its
threads are gone, a lock one of them held stays held, and what it owns (idle sandboxes,
sessions) is the parent's, still in use there. So one rule, written here once:

- an object made by a process belongs to that process: `ForkGuard.owned_here()` says
  whether this process made it; in a child the object refuses work and leaves what it owns
  alone (its close does nothing);
- a process-wide helper (`PerProcess`) is made anew in the child at first use;
- `close_at_exit` closes at interpreter exit what this process made, never the parent's.

All three follow one `os.register_at_fork` hook, which counts the forks of this process's
line (`_generation`): a copy made before the fork carries the older count.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

log = logging.getLogger(__name__)

_generation = 0  # forks since the interpreter started, along this process's line
_in_child: list[Callable[[], None]] = []


def on_fork_in_child(callback: Callable[[], None]) -> None:
    """Run `callback` in every child forked from now on (before any other code there)."""
    _in_child.append(callback)


class ForkGuard:
    """Whether this process is the one that made the guard's owner.

    >>> self._process = ForkGuard()            # in the owner's __init__
    >>> if not self._process.owned_here(): ... # refuse, touch nothing
    """

    __slots__ = ("_generation", "owner_pid")

    def __init__(self) -> None:
        self._generation = _generation
        self.owner_pid = os.getpid()

    def owned_here(self) -> bool:
        """False in a forked child (and its children): the owner is the parent's."""
        return self._generation == _generation


_T = TypeVar("_T")


class PerProcess(Generic[_T]):
    """One `make()` per process, made at first use. A forked child has the parent's copy
    but not its threads: it lets go of it (`forget`, e.g. closing a copied fd) and makes its
    own at its first use."""

    def __init__(self, make: Callable[[], _T], forget: Callable[[_T], None]) -> None:
        self._make = make
        self._forget = forget
        self._value: _T | None = None
        self._lock = threading.Lock()
        on_fork_in_child(self._after_fork)

    def get(self) -> _T:
        with self._lock:
            if self._value is None:
                self._value = self._make()
            return self._value

    def _after_fork(self) -> None:
        # A new lock: a thread of the parent may have held the old one at the fork.
        copy, self._value, self._lock = self._value, None, threading.Lock()
        if copy is not None:
            self._forget(copy)


class _Closeable(Protocol):
    def close(self) -> None: ...


# What this process made and closes at exit, in the order it was made (closed in reverse).
_to_close: weakref.WeakValueDictionary[int, _Closeable] = weakref.WeakValueDictionary()
_order = itertools.count()


def close_at_exit(owner: _Closeable) -> None:
    """Close `owner` at interpreter exit (if it is still alive then), so nothing it started
    (a pooled sandbox, a stdio upstream server) outlives the host; in this process only."""
    _to_close[next(_order)] = owner


@atexit.register
def _close_at_exit() -> None:
    for _, owner in sorted(_to_close.items(), reverse=True):
        try:
            owner.close()
        except Exception:  # the others still close
            log.exception("fork.close_at_exit_failed")


def _after_fork_in_child() -> None:
    global _generation, _to_close
    _generation += 1
    _to_close = weakref.WeakValueDictionary()  # the parent's: it closes them itself
    for callback in _in_child:
        try:
            callback()
        except Exception:  # one failing must not leave the others' copies in place
            log.exception("fork.child_callback_failed")


os.register_at_fork(after_in_child=_after_fork_in_child)
