"""A small watcher process that removes this process's sandboxes if it dies without doing so.

A host process cleans up after itself (its pool's sandboxes, a run in flight) when it exits
or is stopped with SIGTERM; SIGKILL, the OOM killer or an MCP client's stdio close sequence
(stdin closed, SIGTERM two seconds later, SIGKILL two after that) can cut that short and
leave run directories, workspace mounts and cgroups behind. The next codecage process
sweeps them (`launch.sweep_stale_runs`), but that may be much later, or never.

So the first Host of a process starts a guardian: `python -I` in a session of its own that
blocks reading a pipe whose only write end this process holds (close-on-exec, closed in a
forked child). When this process is gone, however it ended, the read returns; the guardian
then looks for entries named after this process's owner key (`engine.owner`; cheap, with the
standard library), and only if there are some imports codecage to sweep them the way the
next start would (`launch.sweep_stale_runs`: once it holds the owner's lock, through
descriptors). It ignores the terminal's and
a service manager's polite signals so that a group-wide SIGTERM does not stop it first.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from codecage import forks
from codecage.engine import owner
from codecage.engine import workspace as workspaces
from codecage.engine.launch import RUN_DIR_PREFIX, SERVERS_DIR_PREFIX, sweep_stale_runs
from codecage.errors import HostError
from codecage.isolation import cgroups

log = logging.getLogger(__name__)

# Runs in the guardian. Standard library only until it knows there is something to sweep.
_WATCH = r"""
import fcntl, os, signal, sys
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
key, source, run_parent, prefixes, lock_prefix = sys.argv[1:6]
cgroup_parents = sys.argv[6:]
sys.stdin.buffer.read()  # returns when the host process is gone
mine = key + "-"
def entries(directory, heads):
    try:
        return [n for n in os.listdir(directory) if n.startswith(heads)]
    except OSError:
        return []
left = entries(run_parent, tuple(p + mine for p in prefixes.split(",")))
for parent in cgroup_parents:
    left += entries(parent, (mine,))
if left:
    sys.path.insert(0, source)
    from codecage.engine.guardian import sweep_after
    sweep_after(key)
else:  # nothing left: only its owner file, deleted once its lock is free (engine.owner)
    try:
        fd = os.open(os.path.join(run_parent, lock_prefix + key), os.O_RDONLY | os.O_NOFOLLOW)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(os.path.join(run_parent, lock_prefix + key))
    except OSError:
        pass
"""


def ensure() -> None:
    """Start this process's guardian, once (a forked child starts its own)."""
    _guardian.get()


def watcher_pids() -> list[int]:
    """The guardian processes this process started (tests tell them from sandboxes)."""
    return [watcher.pid for watcher in _watchers]


def sweep_after(key: str) -> int:
    """In the guardian: remove what the (dead) process of owner `key` left, once its owner
    lock is free (a forked child that still holds it keeps it alive). Returns how many."""
    return sweep_stale_runs(only=key)


def _spawn() -> int:
    """Start the guardian; return the pipe's write end (held until this process ends)."""
    try:
        run_parent = str(workspaces.private_parent())
        key = owner.key()
    except HostError:
        return -1  # no runs can be made here either; nothing to guard
    support = cgroups.detect()
    cgroup_parents = [str(p) for p in support.parents.values()] if support else []
    source = str(Path(__file__).resolve().parents[2])
    read_end, write_end = os.pipe()  # both close-on-exec: no sandbox inherits them
    try:
        watcher = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-c",
                _WATCH,
                key,
                source,
                run_parent,
                f"{RUN_DIR_PREFIX},{SERVERS_DIR_PREFIX}",
                owner.LOCK_PREFIX,
                *cgroup_parents,
            ],
            stdin=read_end,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as exc:
        os.close(write_end)
        log.warning("guardian.not_started", extra={"error": str(exc)})
        return -1
    finally:
        os.close(read_end)
    _watchers.append(watcher)  # kept: it outlives us, and no "still running" warning
    return write_end


def _forget(write_end: int) -> None:
    """In a forked child: let go of the parent's pipe, or its guardian would wait for us."""
    if write_end >= 0:
        os.close(write_end)


_watchers: list[subprocess.Popen[bytes]] = []
_guardian: forks.PerProcess[int] = forks.PerProcess(_spawn, _forget)
