"""Can this process make user namespaces, and if not, what to change so it can.

The bwrap backend needs an unprivileged user namespace (unless bwrap is installed setuid).
Where there is none (a sysctl, Docker's default seccomp profile, an unprivileged
container, Ubuntu's AppArmor restriction), `auto` does not start bwrap to fail later: it
says so, with `remedy()`, and picks the Landlock fallback only when degraded isolation was
allowed.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

_SYSCTLS = {
    "/proc/sys/user/max_user_namespaces": (
        "0",
        "sysctl -w user.max_user_namespaces=15000 (it is 0: user namespaces are off)",
    ),
    "/proc/sys/kernel/unprivileged_userns_clone": (
        "0",
        "sysctl -w kernel.unprivileged_userns_clone=1 (Debian/Ubuntu kernels: it is 0)",
    ),
    "/proc/sys/kernel/apparmor_restrict_unprivileged_userns": (
        "1",
        "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile "
        "for /usr/bin/bwrap with `userns,` (Ubuntu 23.10+ restricts them: it is 1)",
    ),
}

_CHILD = (
    "import ctypes,sys;libc=ctypes.CDLL(None,use_errno=True);"
    "sys.exit(0 if libc.unshare(0x10000000)==0 else ctypes.get_errno() or 1)"
)


@functools.cache
def available() -> tuple[bool, str]:
    """Whether a child of this process can make a user namespace (or bwrap is setuid
    and needs none), and why not; tried once per process in a short-lived child."""
    bwrap = shutil.which("bwrap")
    if bwrap is not None and Path(bwrap).stat().st_mode & stat.S_ISUID:
        return True, "bwrap is setuid"
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _CHILD],
            capture_output=True,
            timeout=30,
            env={},
            cwd="/",
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"cannot try: {exc}"
    if proc.returncode == 0:
        return True, "unshare(CLONE_NEWUSER) works"
    reason = os.strerror(proc.returncode) if 0 < proc.returncode < 134 else "it failed"
    return False, f"unshare(CLONE_NEWUSER) fails: {reason}"


def in_container() -> bool:
    """A guess: Docker's or Podman's marker file, or a container's cgroup path."""
    if Path("/.dockerenv").exists() or Path("/run/.containerenv").exists():
        return True
    try:
        text = Path("/proc/1/cgroup").read_text(encoding="utf-8")
    except OSError:
        return False
    return any(word in text for word in ("docker", "kubepods", "containerd", "libpod"))


def changes() -> list[str]:
    """What to change on this host to get user namespaces back, most specific first."""
    found: list[str] = []
    for path, (bad, advice) in _SYSCTLS.items():
        try:
            value = Path(path).read_text(encoding="ascii").strip()
        except OSError:
            continue
        if value == bad:
            found.append(advice)
    container = [
        "Docker/Podman: start the container with a seccomp profile that allows unshare and "
        "clone with CLONE_NEWUSER (e.g. --security-opt seccomp=unconfined, or Docker's "
        "default profile with those allowed) and, on AppArmor hosts, "
        "--security-opt apparmor=unconfined; or run the engine with --userns-remap",
        "Kubernetes: set the pod's `hostUsers: false` (user namespaces for the pod) and a "
        "seccompProfile that allows unshare",
    ]
    if in_container() or not found:
        found += container
    return found


def remedy() -> str:
    """One hint: what to change for full isolation, or how to run the labelled fallback."""
    steps = "; ".join(changes())
    return (
        f"to get full isolation (bwrap): {steps}. Or run without namespaces, weaker and "
        "labelled: --backend landlock, or --allow-degraded (library: "
        "Sandbox(backend='landlock') or Sandbox(options=Options(allow_degraded=True)))"
    )


_HOLDER = (
    # In the new user namespace: no user namespace may be made inside it (bwrap's
    # --disable-userns cannot be used with --userns), then wait for the host to map it.
    "echo 0 > /proc/sys/user/max_user_namespaces && echo ready && exec cat >/dev/null"
)


def mapped(first: int, count: int, inside: int) -> int:
    """An fd of a new user namespace owned by host id `first` (uid and gid), in which
    inside ids `inside + k` are host ids `first + k` for k < `count`, and no further user
    namespace can be made. A fork server's template joins it (bwrap --userns): it runs as
    `inside` and can drop each forked run to an id of its own. Root only (the map of
    several ids needs CAP_SETUID on the host).

    Raises:
        OSError: the namespace cannot be made or mapped (the message says which step).
    """
    setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
    unshare = shutil.which("unshare") or "/usr/bin/unshare"
    holder = subprocess.Popen(
        [
            setpriv,
            f"--reuid={first}",
            f"--regid={first}",
            "--clear-groups",
            "--",
            unshare,
            "--user",
            "--keep-caps",  # the shell keeps its capabilities there, for the sysctl
            "--",
            "/bin/sh",
            "-c",
            _HOLDER,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin"},
        cwd="/",
        process_group=0,
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None  # noqa: S101 - piped
        if holder.stdout.readline() != b"ready\n":
            said = holder.stderr.read(500) if holder.stderr else b""
            raise OSError(f"user namespace: {said.decode('utf-8', 'replace').strip()}")
        line = f"{inside} {first} {count}\n".encode()
        for name in ("uid_map", "gid_map"):
            fd = os.open(f"/proc/{holder.pid}/{name}", os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        return os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        # The namespace lives on while an fd or a process holds it: the holder may go.
        holder.kill()
        holder.wait()
        for stream in (holder.stdin, holder.stdout, holder.stderr):
            if stream is not None:
                stream.close()
