"""What a started sandbox's processes hold in memory (RSS and PSS, from /proc): the warm
pool's and the fork server's rows of `info` (an idle sandbox, a template)."""

from __future__ import annotations

from codecage.isolation import cgroups
from codecage.isolation.cgroups import CgroupHandle


def sandbox_memory(
    launcher_pid: int, cgroup: CgroupHandle | None
) -> tuple[float | None, float | None]:
    """RSS and PSS of every process of one sandbox: its launcher (`launcher_pid`: bwrap)
    outside, its init and the guest inside (found in the sandbox's `cgroup`)."""
    pids = {launcher_pid}
    if cgroup is not None:
        pids.update(cgroups.pids_in(cgroup))
    rss = [rss_mb(pid) for pid in pids]
    pss = [_pss_mb(pid) for pid in pids]
    if any(v is None for v in rss):
        return None, None
    total_pss = None if any(v is None for v in pss) else round(sum(filter(None, pss)), 1)
    return round(sum(filter(None, rss)), 1), total_pss


def rss_mb(pid: int) -> float | None:
    """The resident memory (MB) of process `pid`, None when it cannot be read."""
    return _status_kb(f"/proc/{pid}/status", "VmRSS:")


def _pss_mb(pid: int) -> float | None:
    return _status_kb(f"/proc/{pid}/smaps_rollup", "Pss:")


def _status_kb(path: str, field_name: str) -> float | None:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(field_name):
                    return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        return None
    return None
