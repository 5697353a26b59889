"""Which backends the containment suite runs on, and what each cannot meet, by test name.

A gap is a strict xfail: the test keeps running on that backend and must keep failing
there; when a backend closes a gap, the XPASS says to remove the line. Every entry names
why (docs/security-model.md says the same to users).
"""

from __future__ import annotations

BACKENDS_UNDER_TEST: tuple[str, ...] = ("bwrap", "landlock")

KNOWN_GAPS: dict[str, dict[str, str]] = {
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
