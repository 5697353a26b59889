"""Which backends the containment suite runs on, and what each cannot meet, by test name.

A gap names a test, or one case of a parametrised one ("test_x[mnt]"). A gap is a strict
xfail: the test keeps running on that backend and must keep failing there; when a backend
closes a gap, the XPASS says to remove the line. Every entry names why
(docs/security-model.md says the same to users).
"""

from __future__ import annotations

BACKENDS_UNDER_TEST: tuple[str, ...] = ("bwrap", "bwrap-fork", "gvisor", "landlock")
"""`bwrap-fork`: bwrap's sandboxes forked from a fork server's template
(engine/forkserver.py); `bwrap`: each started anew (the fork server off)."""

_GVISOR_PROC = (
    "gVisor's /proc is the Sentry's own, not Linux's: it has no {what}; "
    "the property itself holds (tests/test_gvisor_backend.py checks it another way)"
)
_GVISOR_MEMORY = (
    "the Sentry enforces memory per guest process (RLIMIT_AS, MemoryError); the host "
    "cgroup bounds the sandbox as a whole, the Sentry included, at memory_mb + 256 MiB "
    "(backends/gvisor.py _HOST_MEMORY_MB): {what}"
)

KNOWN_GAPS: dict[str, dict[str, str]] = {
    "gvisor": {
        "test_nothing_is_left_after_a_timeout": (
            "the test finds the host run dir in bwrap's argv (/proc/1/cmdline); under gVisor "
            "PID 1 is the guest's interpreter, which names no host path "
            "(tests/test_gvisor_backend.py checks that nothing is left after a timeout)"
        ),
        "test_a_memory_bomb_ends_as_memory_limit": _GVISOR_MEMORY.format(
            what="a bomb ends in MemoryError (status error), not in an OOM kill"
        ),
        "test_memory_held_in_tmpfs_or_memfd_counts_against_the_limit": _GVISOR_MEMORY.format(
            what="tmpfs and memfd pages are the Sentry's memory, not the process's address "
            "space: RLIMIT_FSIZE (64 MiB) stops them before memory_mb does"
        ),
        "test_kernel_memory_of_many_empty_files_counts_against_the_limit": _GVISOR_MEMORY.format(
            what="the inodes are the Sentry's heap, inside the 256 MiB allowance"
        ),
        "test_the_limit_is_for_the_sandbox_as_a_whole_not_per_process": _GVISOR_MEMORY.format(
            what="four processes of 24 MiB under 64 MiB each all succeed"
        ),
        "test_host_home_root_shadow_var_and_run_do_not_exist": (
            "runsc always mounts the Sentry's own sysfs at /sys (synthetic, no host "
            "device or setting in it); /root, /home, /etc/shadow, /var and /run do not exist"
        ),
        "test_host_kernel_settings_under_proc_sys_cannot_be_written": _GVISOR_PROC.format(
            what="/proc/sys/kernel/core_pattern (its /proc/sys has a few read-only files)"
        ),
        "test_every_capability_set_is_empty": _GVISOR_PROC.format(
            what="CapAmb line in /proc/self/status (the OCI ambient set is empty)"
        ),
        "test_no_new_privs_is_set": _GVISOR_PROC.format(
            what="NoNewPrivs line in /proc/self/status (prctl(PR_GET_NO_NEW_PRIVS) says 1: "
            "the self-test reads it there)"
        ),
        **{
            f"test_the_sandbox_has_a_namespace_of_its_own[{ns}]": _GVISOR_PROC.format(
                what=f"/proc/self/ns/{ns} (only pid, user and net): the whole kernel, its "
                "mounts, IPC, hostname and cgroups included, is the sandbox's own"
            )
            for ns in ("mnt", "ipc", "uts", "cgroup")
        },
        "test_only_the_sandboxs_own_processes_are_visible": (
            "there is no bwrap init: the guest interpreter is PID 1 and the only process "
            "(the test expects bwrap as 1 and python3 as 2)"
        ),
        "test_sysv_ipc_of_the_host_is_out_of_reach": _GVISOR_PROC.format(
            what="/proc/sysvipc (shmget of the host's key gives ENOENT: the Sentry's IPC "
            "is its own)"
        ),
    },
    "landlock": {
        "test_nothing_is_left_after_a_timeout": (
            "no pid namespace: /proc/1 is the host's init, not a launcher whose argv names the "
            "run dir (cleanup itself is test_cleanup's other cases)"
        ),
        "test_memory_held_in_tmpfs_or_memfd_counts_against_the_limit[tmp-tmpfs]": (
            "no mount namespace: a literal /tmp or /dev/shm is the host's, which Landlock refuses"
            " (PermissionError, not the memory kill); the guest's tmp is $TMPDIR"
        ),
        "test_memory_held_in_tmpfs_or_memfd_counts_against_the_limit[dev-shm]": (
            "no mount namespace: a literal /tmp or /dev/shm is the host's, which Landlock refuses"
            " (PermissionError, not the memory kill); the guest's tmp is $TMPDIR"
        ),
        "test_kernel_memory_of_many_empty_files_counts_against_the_limit": (
            "no mount namespace: the literal /tmp is the host's, which Landlock refuses before "
            "any memory is used"
        ),
        "test_a_refused_socket_leaves_a_network_denied_event": (
            "every result on this backend also carries degraded_isolation events; the test "
            "asserts network_denied is the only event"
        ),
        "test_a_fork_bomb_is_held_to_max_processes": (
            "no pid namespace: the guest counts /proc, which lists every host process (the pids "
            "cgroup still holds the fork bomb)"
        ),
        "test_the_environment_is_exactly_a_small_allow_list": (
            "HOME, TMPDIR and PATH name the run's tree on the host, not /workspace, /tmp and "
            "/opt/python (the variables themselves are the allow-list)"
        ),
        "test_host_home_root_shadow_var_and_run_do_not_exist": (
            "no mount namespace: the host's /root, /home, /etc/shadow, /var and /run exist (stat "
            "works); Landlock refuses opening them"
        ),
        "test_etc_holds_only_the_synthetic_passwd_group_hosts_and_hostname": (
            "no mount namespace: /etc is the host's (Landlock refuses reading it; the synthetic "
            "files are in the run's tree)"
        ),
        "test_tmp_starts_empty_and_shows_nothing_of_the_host_tmp": (
            "no mount namespace: the literal /tmp is the host's, which Landlock refuses listing; "
            "the guest's private tmp is $TMPDIR"
        ),
        "test_the_workspace_is_the_cwd_and_is_writable": (
            "no mount namespace: the workspace is the cwd but not at /workspace (its host path)"
        ),
        "test_tmp_is_a_private_tmpfs_of_the_configured_size": (
            "no mount namespace: the private tmp is a directory in the run dir, not a "
            "size-limited tmpfs at /tmp"
        ),
        "test_a_second_run_sees_nothing_of_the_first_runs_workspace_or_tmp": (
            "no mount namespace: the literal /tmp is the host's, which Landlock refuses writing "
            "(each run's $TMPDIR is still its own)"
        ),
        "test_a_symlink_to_a_host_file_does_not_reach_the_host_file": (
            "no mount namespace: the host file exists, so the refusal is Landlock's "
            "PermissionError, not FileNotFoundError (its content still does not leak)"
        ),
        "test_the_sandbox_has_a_namespace_of_its_own": (
            "no namespaces at all on the Landlock fallback: that is what it is for"
        ),
        "test_only_the_sandboxs_own_processes_are_visible": (
            "no pid namespace: /proc lists the host's processes (Landlock refuses ptrace and "
            "signals to them)"
        ),
        "test_the_hostname_is_sandbox": ("no uts namespace: the hostname is the host's"),
        "test_sysv_ipc_of_the_host_is_out_of_reach": (
            "no ipc namespace: the host's SysV IPC is shared"
        ),
        "test_dev_shm_is_empty_and_private": (
            "no mount namespace: /dev/shm is the host's, which Landlock refuses (no private one)"
        ),
        "test_there_is_no_network_interface_but_loopback": (
            "no network namespace: the host's interfaces are listed (seccomp refuses "
            "AF_INET/AF_INET6 sockets, Landlock TCP bind/connect)"
        ),
        "test_a_host_abstract_unix_socket_cannot_be_reached": (
            "refused by Landlock's abstract-socket scope with PermissionError, not "
            "ConnectionRefusedError (no network namespace)"
        ),
    },
}


NEEDS_ROOT: dict[str, str] = {
    "gvisor": "codecage switches runsc (rootless) to the sandbox's own id: only root can",
    "bwrap-fork": "the fork server needs tmpfs workspaces and per-run cgroups (root)",
}
"""Backends an ordinary user cannot run: skipped as non-root, even under CI."""

WITH_CGROUP_KNOWN_GAPS: dict[str, dict[str, str]] = {
    "landlock": {
        "test_the_code_starts_with_rlimit_nproc_at_max_processes": (
            "as an ordinary user every run is the caller's uid in the host's user namespace, "
            "where RLIMIT_NPROC counts every process of that uid on the host: with a pids "
            "cgroup, that alone bounds the run's processes (test_pids checks the bound "
            "holds); without one the rlimit stays. As root each run has a uid of its own"
        ),
    },
}
"""Gaps of a backend only where codecage has a cgroup per run but runs share one host id
(an ordinary user with a delegated cgroup): strict xfails."""

NONROOT_KNOWN_GAPS: dict[str, dict[str, str]] = {
    "landlock": {
        "test_every_capability_set_is_empty": (
            "as non-root the launcher cannot empty the bounding set (that needs CAP_SETPCAP); "
            "no_new_privs keeps the code from ever gaining a capability in it"
        ),
        "test_a_double_forked_daemon_ignoring_sigterm_is_gone_after_the_run": (
            "no pid namespace and, as non-root, no cgroup: a daemon that left the run's "
            "session is not found when the run ends (racy: sometimes it is gone by then)"
        ),
    },
}
"""Gaps of a backend only when codecage runs as an ordinary user: xfails, not strict (a
daemon's race can make one pass by chance)."""
