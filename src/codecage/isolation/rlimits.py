"""The rlimits each process of the guest sets on itself, before any user code runs.

RLIMIT_CPU, RLIMIT_NOFILE, RLIMIT_FSIZE and RLIMIT_CORE are always set (by the guest
bootstrap). RLIMIT_AS and RLIMIT_NPROC stand in for memory and processes only where no
per-run cgroup does (`codecage.isolation.cgroups`): RLIMIT_NPROC counts processes of the
*host* user the sandbox maps to, and the kernel exempts root from it.
"""

from __future__ import annotations

from codecage.models import GuestLimits, Limits

_MiB = 1024 * 1024


def guest_limits(limits: Limits, *, by_cgroup: bool) -> GuestLimits:
    """The rlimits the guest applies to itself before running user code (pure).

    With a cgroup, memory and processes are limited for the sandbox as a whole, and the
    per-process RLIMIT_AS / RLIMIT_NPROC would only get in the way (threads' stacks count
    against RLIMIT_AS; RLIMIT_NPROC counts every process of the host user).
    """
    return GuestLimits(
        cpu_seconds=limits.cpu_seconds,
        max_open_files=limits.max_open_files,
        max_file_size_bytes=limits.max_file_size_mb * _MiB,
        max_processes=None if by_cgroup else limits.max_processes,
        address_space_bytes=None if by_cgroup else limits.memory_mb * _MiB,
    )
