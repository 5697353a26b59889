"""This process's owner lock: what tells a sweeper, in any PID namespace, that the codecage
process that made a run directory, a tool tree or a run cgroup is still alive.

A pid is no proof of life: a sweeper in another PID namespace sees none of this one's
processes (`kill(pid, 0)` said "gone" of every live run of the host), and two namespaces
reuse the same pids. A lock is: the kernel drops a `flock` when the last descriptor of its
open file is closed, that is when its holder ends, however it ends, and every process that
opens the same file sees it, whatever namespace it is in.

So every entry this process makes is named after its *owner key*, ``<pid>-<token>`` (the
pid for a person reading ``ls``; the random token because pids repeat across namespaces),
and the key has a lock file in the private parent (`workspaces.private_parent()`),
``codecage-owner-<key>``, on which this process holds an exclusive `flock` for its whole
life (one descriptor per process). A sweeper (`dead_owners`) takes the lock of each owner
file it finds, non-blocking, and keeps it while it removes what that owner's key names: it
removes only entries whose owner lock it holds. An entry whose owner file it cannot lock (a
live owner) or cannot find (another user's entries in a shared cgroup, a sweeper with
another private parent, a codecage from before owner locks) is left alone.

Race-free by order:
- the key names nothing before its lock is held: the owner file is created (O_EXCL) then
  locked, and kept only if it is still linked once locked (a sweeper that took the lock of
  the fresh file in between deletes it: a new key is made then);
- a sweeper deletes an owner file only while it holds its lock and once nothing named after
  the key is left, so an entry whose owner file is missing has no owner codecage could know;
- a forked child closes its copy of the descriptor (the parent's lock stays held: a flock
  belongs to the open file, which the parent still has open) and makes its own key when it
  first needs one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from codecage import forks
from codecage.engine import workspace as workspaces
from codecage.errors import HostError
from codecage.fdio import lock_if_unheld

log = logging.getLogger(__name__)

LOCK_PREFIX = "codecage-owner-"
"""Followed by the owner key, in the private parent."""

_ATTEMPTS = 8  # each lost only to a sweeper taking a fresh file's lock: never many in a row


@dataclass(frozen=True, slots=True)
class _Owned:
    key: str
    fd: int


def key() -> str:
    """This process's owner key (its lock taken at first use, held until it ends): the
    prefix of every entry it makes that a sweeper may remove (``<key>-...``).

    Raises:
        HostError: the private parent cannot be used, or the owner file cannot be made.
    """
    return _owned.get().key


def _acquire() -> _Owned:
    parent = workspaces.private_parent()
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_ATTEMPTS):
        name = f"{os.getpid()}-{secrets.token_hex(8)}"
        try:
            fd = os.open(parent / f"{LOCK_PREFIX}{name}", flags, 0o600)
        except OSError as exc:
            raise HostError(
                f"cannot make codecage's owner lock in {parent}: {exc.strerror}",
                hint=f"check that {parent} is writable by this user (uid {os.geteuid()})",
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_nlink > 0:
                return _Owned(name, fd)
        except OSError:
            pass  # a sweeper took the fresh file first (and deletes it): another key
        os.close(fd)
    raise HostError(
        f"cannot hold an owner lock in {parent}: taken away {_ATTEMPTS} times",
        hint="another process keeps deleting codecage's owner files there: find it",
    )


def _forget(owned: _Owned) -> None:
    """In a forked child: close the copy; the lock stays the parent's."""
    os.close(owned.fd)


_owned: forks.PerProcess[_Owned] = forks.PerProcess(_acquire, _forget)


@dataclass(slots=True)
class DeadOwners:
    """The owners whose lock a sweeper holds (they are gone) during one sweep."""

    keys: frozenset[str]
    _named: set[str] = field(default_factory=set)

    def owns(self, name: str) -> bool:
        """Whether `name` ("<key>-...", its prefix removed) is one of these owners'."""
        return self.owner_of(name) is not None

    def owner_of(self, name: str) -> str | None:
        pid, _, rest = name.partition("-")
        token, sep, _ = rest.partition("-")
        found = f"{pid}-{token}"
        return found if sep and found in self.keys else None

    def still_named(self, names: Iterable[str]) -> None:
        """What is left after the sweep (names, prefixes removed): their owners' files stay,
        so the next sweep retries them."""
        for name in names:
            owner = self.owner_of(name)
            if owner is not None:
                self._named.add(owner)


@contextlib.contextmanager
def dead_owners(only: str | None = None) -> Iterator[DeadOwners]:
    """Lock every owner file of the private parent that can be locked (its owner is gone),
    or only `only`'s; yield those owners; then delete the files of those of which nothing
    is left (`DeadOwners.still_named`) and release the locks.

    Raises:
        Nothing: a private parent that cannot be used yields no owners (logged).
    """
    try:
        parent = workspaces.private_parent()
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (HostError, OSError) as exc:
        log.warning("owner.sweep_skipped", extra={"error": str(exc)})
        yield DeadOwners(frozenset())
        return
    locked: dict[str, int] = {}
    try:
        with os.scandir(parent_fd) as entries:
            names = sorted(entry.name for entry in entries)
        for name in names:
            owner = name.removeprefix(LOCK_PREFIX)
            if owner == name or (only is not None and owner != only):
                continue
            fd = _lock_if_dead(parent_fd, name)
            if fd is not None:
                locked[owner] = fd
        dead = DeadOwners(frozenset(locked))
        yield dead
        for owner in locked.keys() - dead._named:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{LOCK_PREFIX}{owner}", dir_fd=parent_fd)
    finally:
        for fd in locked.values():
            os.close(fd)
        os.close(parent_fd)


def _lock_if_dead(parent_fd: int, name: str) -> int | None:
    """An fd of the owner file `name` holding its lock, or None: its owner lives, it is
    not a regular file of ours, or another sweeper deleted it meanwhile."""
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=parent_fd
        )
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ELOOP):
            log.warning("owner.file_unreadable", extra={"file": name, "error": exc.strerror})
        return None
    st = os.fstat(fd)
    if not (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()):
        os.close(fd)
        return None
    return lock_if_unheld(fd)
