"""The bubblewrap backend: Linux namespaces, a minimal read-only root, seccomp.

Every sandbox gets new user, pid, net, mount, ipc, uts and cgroup namespaces. Inside, the
program runs as uid/gid 1000 with every capability dropped and no_new_privs set, in a new
session (no controlling terminal), as a child of bwrap's init (PID 1), which is killed with
SIGKILL when bwrap or its parent (the host engine) dies; killing PID 1 kills the namespace.
User namespaces are disabled inside (`--disable-userns`), and seccomp refuses unshare/setns
and namespace clone flags, so nested namespaces cannot be made.
"""

from __future__ import annotations

import functools
import shutil
import subprocess

from codecage.backends.base import LaunchPlan, LaunchSpec
from codecage.errors import HostError
from codecage.isolation import network, rootfs
from codecage.models import LayerStatus

_NAMESPACES = ("--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-uts")
_NAMESPACES_TRY = ("--unshare-cgroup-try",)


class BwrapBackend:
    """Namespaces via bubblewrap; see the module docstring for what is in force."""

    name = "bwrap"

    def __init__(self) -> None:
        self.executable = _find_bwrap()

    def probe(self) -> list[LayerStatus]:
        ok, detail = _namespaces_work(self.executable)
        return [
            LayerStatus(
                name="namespaces",
                active=ok,
                mechanism=f"bubblewrap {bwrap_version(self.executable) or '?'}",
                detail=detail,
            ),
            network.probe(ok),
        ]

    def launch_plan(self, spec: LaunchSpec) -> LaunchPlan:
        argv = [
            self.executable,
            *_NAMESPACES,
            *_NAMESPACES_TRY,
            *network.bwrap_args(network.plan(allow_network=spec.network)),
            "--disable-userns",
            "--uid",
            str(rootfs.SANDBOX_UID),
            "--gid",
            str(rootfs.SANDBOX_GID),
            "--cap-drop",
            "ALL",
            "--die-with-parent",
            "--new-session",
            "--hostname",
            "sandbox",
            *rootfs.bwrap_args(spec.mounts),
            "--chdir",
            rootfs.WORKSPACE,
            "--info-fd",
            str(spec.info_fd),
            "--block-fd",
            str(spec.block_fd),
            "--seccomp",
            str(spec.seccomp_fd),
            *spec.guest_argv,
        ]
        return LaunchPlan(
            argv=argv,
            pass_fds=(
                spec.info_fd,
                spec.block_fd,
                spec.seccomp_fd,
                spec.control_fd,
                spec.bridge_fd,
            ),
        )


def _find_bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise HostError(
            "bubblewrap (bwrap) is not installed",
            hint="install it: apt-get install bubblewrap (or run scripts/setup as root)",
        )
    return path


@functools.cache
def bwrap_version(executable: str) -> str | None:
    try:
        out = subprocess.run(
            [executable, "--version"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
            env={},
            cwd="/",
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.split()[-1] if out.split() else None


@functools.cache
def _namespaces_work(executable: str) -> tuple[bool, str]:
    """Can bwrap create every namespace we ask for here? (one real, empty sandbox)"""
    argv = [
        executable,
        *_NAMESPACES,
        "--unshare-net",
        "--disable-userns",
        "--ro-bind",
        "/",
        "/",
        "true",
    ]
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=30, env={}, cwd="/", check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"bwrap could not start: {exc}"
    if proc.returncode != 0:
        return False, f"bwrap failed: {proc.stderr.strip()[:300]}"
    return True, "user, pid, net, mount, ipc, uts and cgroup namespaces; nested userns disabled"
