"""The rlimits each process of the guest sets on itself, before any user code runs.

RLIMIT_CPU, RLIMIT_NOFILE, RLIMIT_FSIZE, RLIMIT_CORE and RLIMIT_NPROC are always set (by
the guest bootstrap). RLIMIT_NPROC holds beside the pids cgroup, not only in its place: the
kernel counts it per user of the sandbox's own user namespace (so runs do not share a
count), and it applies because the sandbox is never host root (`isolation.identity`; root
is exempt). RLIMIT_AS stands in for memory only where no per-run cgroup does
(`codecage.isolation.cgroups`): threads' stacks count against it.
"""

from __future__ import annotations

from codecage.models import GuestLimits, Limits

_MiB = 1024 * 1024

SANDBOX_INIT_PROCESSES = 1
"""The sandbox's PID 1 (bwrap's init) counts in the sandbox's processes but is not the
code's: pids.max and RLIMIT_NPROC are max_processes plus this."""


def guest_limits(
    limits: Limits,
    *,
    by_cgroup: bool,
    session_cpu_seconds: int | None = None,
    init_processes: int = SANDBOX_INIT_PROCESSES,
) -> GuestLimits:
    """The rlimits the guest applies to itself before running user code (pure).

    With a cgroup, memory is limited for the sandbox as a whole, and the per-process
    RLIMIT_AS would only get in the way (threads' stacks count against it). Processes are
    held by both: RLIMIT_NPROC counts the same tasks as pids.max, the sandbox's init
    included (`SANDBOX_INIT_PROCESSES`).
    """
    return GuestLimits(
        cpu_seconds=limits.cpu_seconds,
        max_open_files=limits.max_open_files,
        max_file_size_bytes=limits.max_file_size_mb * _MiB,
        max_processes=limits.max_processes + init_processes,
        address_space_bytes=None if by_cgroup else limits.memory_mb * _MiB,
        session_cpu_seconds=session_cpu_seconds,
    )
