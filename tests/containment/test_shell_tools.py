"""The shell and command-line tools inside the sandbox: present for agent code, and no way
around any layer. Each test runs the commands through /bin/sh, so on the null runner (the
host's own shell, no isolation) the host's files and network are there and the test fails."""

from __future__ import annotations

import pytest

from ._support import HostCanary, NetCanary, Runner, Seen, assert_absent, guest

pytestmark = pytest.mark.timeout(60)


def test_a_shell_pipeline_cannot_read_the_host_canary(
    runner: Runner, host_canary: HostCanary
) -> None:
    code = guest(
        """
        import subprocess
        for path in $paths:
            p = subprocess.run(f"cat {path}; grep -r canary- {path} ; head -c 100 {path}",
                               shell=True, capture_output=True, text=True)
            print(p.returncode, p.stdout)
        """,
        paths=[str(p) for p in host_canary.paths],
    )
    seen: Seen = runner(code, timeout=20)
    assert seen.status == "ok", seen.stderr
    assert_absent(host_canary.token, seen)


def test_find_and_ls_see_no_host_home_or_tmp(runner: Runner, host_canary: HostCanary) -> None:
    code = """
import subprocess
p = subprocess.run("find /tmp /root /home -maxdepth 1 2>/dev/null; ls -a ~ /tmp",
                   shell=True, capture_output=True, text=True)
print(p.stdout)
"""
    seen: Seen = runner(code, timeout=30)
    assert seen.status == "ok", seen.stderr
    assert_absent(host_canary.token, seen)


def test_a_shell_cannot_reach_a_loopback_listener(runner: Runner, net_canary: NetCanary) -> None:
    # No nc or curl is offered; the shell's own redirection to /dev/tcp is bash-only and
    # dash has none, so the code reaches for python from the shell (any native program
    # would meet the same empty network namespace and seccomp filter).
    code = guest(
        """
        import subprocess, sys
        probe = ("import socket;s=socket.create_connection(('127.0.0.1',%d),timeout=2);"
                 "print(s.recv(100).decode())" % $port)
        p = subprocess.run(f"{sys.executable} -c \\"{probe}\\"", shell=True,
                           capture_output=True, text=True)
        print(p.returncode, p.stdout)
        """,
        port=net_canary.port,
    )
    seen: Seen = runner(code, timeout=20)
    assert seen.status == "ok", seen.stderr
    assert net_canary.token not in seen.stdout
    assert not net_canary.connections
