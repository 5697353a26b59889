"""Per-run cgroups: the memory, process and CPU limits of a sandbox as a whole.

Which mechanism enforces what, best first:

| limit      | cgroup v1 / v2 (when writable)       | fallback (`codecage.isolation.rlimits`)   |
|------------|--------------------------------------|-------------------------------------------|
| memory     | memory.limit_in_bytes / memory.max   | RLIMIT_AS per process                     |
| processes  | pids.max, and RLIMIT_NPROC beside it | RLIMIT_NPROC (see below)                  |
| CPU time   | host polls cpuacct.usage / cpu.stat  | RLIMIT_CPU per process                    |

The cgroup is created and filled by the host, which is also the one that reads usage and
OOM kills from it: the guest is never asked.

RLIMIT_NPROC is counted per user of the sandbox's own user namespace, so each run has its
own count; it applies because the sandbox is never host root (`isolation.identity`: the
kernel exempts root). It holds whether or not a pids cgroup does.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from codecage.errors import HostError
from codecage.isolation import rlimits
from codecage.models import LayerStatus, Limits

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
_V1_CONTROLLERS = ("memory", "pids", "cpuacct")
_V2_CONTROLLERS = ("memory", "pids", "cpu")
MiB = 1024 * 1024

# bwrap's init (PID 1 of the sandbox) lives in the cgroup too and takes one pid.
_INIT_PIDS = rlimits.SANDBOX_INIT_PROCESSES


@dataclass(frozen=True, slots=True)
class CgroupSupport:
    """Where this host lets us create per-run cgroups."""

    version: Literal[1, 2]
    parents: dict[str, Path]  # controller -> parent dir (v2: the single key "unified")


@dataclass(frozen=True, slots=True)
class CgroupHandle:
    """The cgroup(s) of one run."""

    version: Literal[1, 2]
    dirs: dict[str, Path]  # controller -> this run's dir (v2: "unified")
    # What the backend's own processes take besides the guest's (backends.base.HostOverhead)
    extra_pids: int = _INIT_PIDS
    pids_per_process: int = 1
    extra_memory_mb: int = 0


# --- detection -------------------------------------------------------------------------


@functools.cache
def detect() -> CgroupSupport | None:
    """Find a cgroup hierarchy where we may create per-run groups, or None."""
    own = _own_cgroups()
    v1 = _detect_v1(own)
    if v1 is not None:
        return v1
    return _detect_v2(own)


def _own_cgroups() -> dict[str, str]:
    """controller -> this process's cgroup path, from /proc/self/cgroup ("" key for v2)."""
    result: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text(encoding="utf-8").splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(","):
                result[controller] = path
    return result


@functools.cache
def why_unavailable() -> str | None:
    """Why no per-run cgroup can be made here, for a person; None when one can."""
    if detect() is not None:
        return None
    who = f"uid {os.geteuid()}"
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return (
            f"cgroup v2 without a subtree delegated to {who} that has the memory, pids and "
            "cpu controllers"
        )
    if any((CGROUP_ROOT / c / "cgroup.procs").exists() for c in _V1_CONTROLLERS):
        if os.geteuid() != 0:
            return f"cgroup v1, whose hierarchies belong to root: {who} cannot make groups"
        return "cgroup v1 hierarchies that are not writable here"
    return f"no cgroup hierarchy at {CGROUP_ROOT}"


def _detect_v1(own: dict[str, str]) -> CgroupSupport | None:
    parents: dict[str, Path] = {}
    for controller in _V1_CONTROLLERS:
        mount = CGROUP_ROOT / controller
        if controller not in own or not (mount / "cgroup.procs").exists():
            return None
        parent = mount / own[controller].lstrip("/") / "codecage"
        if not _can_create_under(parent):
            return None
        parents[controller] = parent
    return CgroupSupport(1, parents)


def _detect_v2(own: dict[str, str]) -> CgroupSupport | None:
    if "" not in own or not (CGROUP_ROOT / "cgroup.controllers").exists():
        return None
    base = CGROUP_ROOT / own[""].lstrip("/")
    parent = base / "codecage"
    try:
        available = (base / "cgroup.controllers").read_text(encoding="utf-8").split()
        if not set(_V2_CONTROLLERS) <= set(available):
            return None
        # Controllers must be enabled for our children. This fails with EBUSY when our own
        # cgroup has processes and is not the root (the "no internal processes" rule): then
        # the host has not delegated a subtree to us, and we fall back to rlimits.
        enable = " ".join(f"+{c}" for c in _V2_CONTROLLERS)
        (base / "cgroup.subtree_control").write_text(enable, encoding="utf-8")
        parent.mkdir(exist_ok=True)
        (parent / "cgroup.subtree_control").write_text(enable, encoding="utf-8")
    except OSError as exc:
        log.debug("cgroup.v2_unusable", extra={"path": str(base), "error": str(exc)})
        return None
    return CgroupSupport(2, {"unified": parent})


def _can_create_under(parent: Path) -> bool:
    try:
        parent.mkdir(exist_ok=True)
        probe_dir = parent / f"probe-{os.getpid()}"
        probe_dir.mkdir()
        probe_dir.rmdir()
    except OSError:
        return False
    return True


# --- one run's cgroup ------------------------------------------------------------------


def create(
    run_id: str,
    limits: Limits,
    *,
    extra_pids: int = _INIT_PIDS,
    pids_per_process: int = 1,
    extra_memory_mb: int = 0,
) -> CgroupHandle | None:
    """Create this run's cgroup(s) with the memory and pids limits, or None without support.

    Raises:
        HostError: the cgroup could not be created or configured although the host supports it.
    """
    support = detect()
    if support is None:
        return None
    _retry_removals()
    dirs = {name: parent / run_id for name, parent in support.parents.items()}
    handle = CgroupHandle(support.version, dirs, extra_pids, pids_per_process, extra_memory_mb)
    try:
        for d in dirs.values():
            d.mkdir()
        _write_limits(handle, limits)
    except OSError as exc:
        remove(handle)
        raise HostError(f"cannot set up the run's cgroup: {exc}") from exc
    log.debug("cgroup.created", extra={"dirs": {k: str(v) for k, v in dirs.items()}})
    return handle


def _write_limits(handle: CgroupHandle, limits: Limits, *, raising: bool = False) -> None:
    """Write the memory and pids limits. v1 insists that memsw >= memory at every moment,
    so when `raising` a limit, memsw goes first; when lowering, memory goes first."""
    memory = str((limits.memory_mb + handle.extra_memory_mb) * MiB)
    pids = str(limits.max_processes * handle.pids_per_process + handle.extra_pids)
    if handle.version == 1:
        mem_dir = handle.dirs["memory"]
        memsw = mem_dir / "memory.memsw.limit_in_bytes"
        # No escaping the limit into swap.
        order = [memsw, mem_dir / "memory.limit_in_bytes"]
        for path in order if raising else reversed(order):
            if path.exists():
                path.write_text(memory, encoding="utf-8")
        (handle.dirs["pids"] / "pids.max").write_text(pids, encoding="utf-8")
    else:
        d = handle.dirs["unified"]
        (d / "memory.max").write_text(memory, encoding="utf-8")
        (d / "memory.swap.max").write_text("0", encoding="utf-8")
        (d / "pids.max").write_text(pids, encoding="utf-8")


def attach(handle: CgroupHandle, pid: int) -> None:
    """Move `pid` into the run's cgroup(s); its future children inherit them.

    Raises:
        HostError: the kernel refused the move.
    """
    try:
        for d in handle.dirs.values():
            (d / "cgroup.procs").write_text(str(pid), encoding="utf-8")
    except OSError as exc:
        raise HostError(f"cannot move the sandbox into its cgroup: {exc}") from exc


def _read_small(path: Path) -> str:
    """One small cgroup file (no text-file wrapper: these are read on every run's path)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks).decode("ascii")
    finally:
        os.close(fd)


def cpu_usage_ms(handle: CgroupHandle) -> int | None:
    """CPU time used by every process of the run so far."""
    try:
        if handle.version == 1:
            return int(_read_small(handle.dirs["cpuacct"] / "cpuacct.usage")) // 1_000_000
        stat = _read_small(handle.dirs["unified"] / "cpu.stat")
        fields = dict(line.split() for line in stat.splitlines())
        return int(fields["usage_usec"]) // 1000
    except (OSError, ValueError, KeyError):
        return None


def peak_memory_mb(handle: CgroupHandle) -> float | None:
    """Peak memory of the run (RAM, tmpfs and memfd included)."""
    name = "memory.max_usage_in_bytes" if handle.version == 1 else "memory.peak"
    key = "memory" if handle.version == 1 else "unified"
    try:
        return round(int(_read_small(handle.dirs[key] / name)) / MiB, 1)
    except (OSError, ValueError):
        return None


def oom_kills(handle: CgroupHandle) -> int:
    """How many times the kernel's OOM killer killed something in this run's cgroup."""
    if handle.version == 1:
        path, key = handle.dirs["memory"] / "memory.oom_control", "oom_kill"
    else:
        path, key = handle.dirs["unified"] / "memory.events", "oom_kill"
    try:
        for line in _read_small(path).splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def oom_killed(handle: CgroupHandle) -> bool:
    """Whether the kernel's OOM killer killed something in this run's cgroup."""
    return oom_kills(handle) > 0


def set_limits(handle: CgroupHandle, limits: Limits, *, previous: Limits) -> None:
    """Change a live cgroup's memory and pids limits (a warm sandbox taking its request).

    Raises:
        OSError: the kernel refused, e.g. the group already uses more memory than asked.
    """
    if handle.version == 2 or limits.memory_mb >= previous.memory_mb:
        _write_limits(handle, limits, raising=True)
    else:
        _write_limits(handle, limits, raising=False)


def reset_peak_memory(handle: CgroupHandle) -> None:
    """Start the peak memory count afresh (v1 only: v2's memory.peak cannot be reset for
    readers of other file descriptors, so a warm run's peak includes its preloading)."""
    if handle.version == 1:
        with contextlib.suppress(OSError):
            (handle.dirs["memory"] / "memory.max_usage_in_bytes").write_text("0", encoding="utf-8")


def pids_in(handle: CgroupHandle) -> list[int]:
    """Processes still in the run's cgroup."""
    key = "pids" if handle.version == 1 else "unified"
    try:
        text = _read_small(handle.dirs[key] / "cgroup.procs")
    except OSError:
        return []
    return [int(p) for p in text.split()]


def kill_all(handle: CgroupHandle, *, deadline_s: float = 5.0) -> None:
    """SIGKILL every process left in the run's cgroup, until it is empty or time runs out.

    From another PID namespace (a sweeper in a container) the processes of this one show
    as pid 0 in cgroup.procs: they are killed by cgroup.kill (v2) and waited for by the
    cgroup's count, never signalled by that 0 (which would be the caller's own group)."""
    end = time.monotonic() + deadline_s
    pause = 0.0002  # killed processes leave within a millisecond or so: poll fast, then back off
    killed: set[int] = set()
    while True:
        if handle.version == 2:
            with contextlib.suppress(OSError):
                (handle.dirs["unified"] / "cgroup.kill").write_text("1", encoding="utf-8")
        pids = pids_in(handle)
        if not pids or time.monotonic() >= end:
            break
        for pid in pids:
            if pid > 0:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        killed.update(pid for pid in pids if pid > 0)
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    if pids:
        log.error("cgroup.kill_incomplete", extra={"pids": pids})
    # A process leaves the cgroup early in its exit, before it has ended: wait for that too,
    # so that nothing killed here still runs when the caller returns.
    while (dying := [pid for pid in killed if _still_exiting(pid)]) and time.monotonic() < end:
        killed = set(dying)
        time.sleep(0.001)


def _still_exiting(pid: int) -> bool:
    """Whether `pid` exists and is not yet a zombie (or a pid reused meanwhile, rarely)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat.rpartition(b")")[2].split()[0] not in (b"Z", b"X")


def destroy(handle: CgroupHandle) -> None:
    """Kill what is left in the run's cgroup(s), then remove them."""
    kill_all(handle)
    remove(handle)


def remove(handle: CgroupHandle) -> None:
    """Remove the run's cgroup(s); processes must be gone (see kill_all)."""
    for d in handle.dirs.values():
        for _ in range(100):
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                # EBUSY: the last killed processes are still being torn down.
                if exc.errno != errno.EBUSY:
                    log.error("cgroup.remove_failed", extra={"dir": str(d), "error": str(exc)})
                    _unremoved.add(d)
                    break
                time.sleep(0.01)


# Run cgroups that could not be removed (e.g. the hierarchy was read-only for a while):
# retried at each new run's cgroup, so a long-lived host does not keep them until it exits
# (its guardian, or the next start, would sweep them only then).
_unremoved: set[Path] = set()


def _retry_removals() -> None:
    for d in list(_unremoved):
        try:
            d.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            continue  # still refused (or busy): kept for the next try
        _unremoved.discard(d)


def run_names() -> list[str]:
    """The names of the per-run cgroups there are (of every codecage process)."""
    support = detect()
    if support is None:
        return []
    names: set[str] = set()
    for parent in support.parents.values():
        with contextlib.suppress(OSError):
            names.update(d.name for d in parent.iterdir() if d.is_dir())
    return sorted(names)


def sweep_stale(is_stale: Callable[[str], bool]) -> int:
    """Kill and remove per-run cgroups whose name `is_stale` (the caller holds the lock of
    their owner, which is gone: engine.owner)."""
    support = detect()
    if support is None:
        return 0
    names = [name for name in run_names() if is_stale(name)]
    for name in names:
        handle = CgroupHandle(support.version, {k: p / name for k, p in support.parents.items()})
        kill_all(handle)
        remove(handle)
    return len(names)


# --- what is in force --------------------------------------------------------------------


def probe() -> list[LayerStatus]:
    """Which mechanism enforces memory, processes and CPU on this host."""
    support = detect()
    if support is None:
        why = f"no cgroup ({why_unavailable()}), so rlimits instead"
        return [
            LayerStatus(
                name="memory",
                active=True,
                mechanism="RLIMIT_AS",
                detail=f"{why}: a per-process address-space limit; processes are not limited "
                "together, tmpfs, memfd and kernel memory are not counted, no peak is measured",
            ),
            LayerStatus(
                name="processes",
                active=os.geteuid() != 0,
                mechanism="RLIMIT_NPROC",
                detail=f"{why}: counted per host user (every process of uid {os.geteuid()})"
                + ("; root is exempt, so not enforced" if os.geteuid() == 0 else ""),
            ),
            LayerStatus(
                name="cpu",
                active=True,
                mechanism="RLIMIT_CPU",
                detail=f"{why}: per process; the run's CPU time is not summed",
            ),
        ]
    mechanism = f"cgroup v{support.version}"
    where = ", ".join(str(p) for p in support.parents.values())
    return [
        LayerStatus(name="memory", active=True, mechanism=mechanism, detail=f"under {where}"),
        LayerStatus(name="processes", active=True, mechanism=mechanism, detail="pids.max"),
        LayerStatus(
            name="cpu",
            active=True,
            mechanism=f"{mechanism} accounting + RLIMIT_CPU",
            detail="the host kills the sandbox when its total CPU time passes the limit",
        ),
    ]


@functools.cache
@functools.cache
def memory_ceiling_mb() -> int:
    """The most memory a run may ask for: the host's physical memory (read once: every
    run's check asks)."""
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError):
        pass
    return 4096
