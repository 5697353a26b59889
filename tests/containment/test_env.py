"""Environment layer: nothing of the host's environment, stdin or open files reaches the
code; it gets a fixed allow-list of variables, an empty stdin, and fds 0-2 plus the
control socket and the tool bridge."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from ._support import Runner, assert_absent, report

pytestmark = pytest.mark.timeout(60)

# What engine._sandbox_env sets, and PWD, which bwrap sets for --chdir.
ALLOWED_ENV = {
    "PATH", "HOME", "LANG", "TMPDIR", "LD_LIBRARY_PATH", "PWD", "MPLBACKEND", "MPLCONFIGDIR"
}  # fmt: skip


def test_the_env_canary_is_absent_from_the_environment_and_every_output(
    runner: Runner, env_canary: str
) -> None:
    code = """
import json, os, sys
environ = dict(os.environ)
raw = {}
for pid in ("self", "1", "2"):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw[pid] = f.read().decode("utf-8", "replace")
    except OSError as exc:
        raw[pid] = type(exc).__name__
print(json.dumps(environ), file=sys.stderr)
print(json.dumps({"environ": environ, "proc": raw}))
environ
"""
    seen = runner(code, timeout=10)
    assert seen.status == "ok", seen.stderr
    assert report(seen)["environ"]  # the program did run and print its environment
    assert_absent(env_canary, seen)


def test_the_environment_is_exactly_a_small_allow_list(runner: Runner) -> None:
    code = """
import json, os
print(json.dumps(dict(os.environ)))
"""
    environ = report(runner(code, timeout=10))
    assert set(environ) <= ALLOWED_ENV, sorted(set(environ) - ALLOWED_ENV)
    assert environ["HOME"] == "/workspace"
    assert environ["TMPDIR"] == "/tmp"
    assert environ["PATH"] == "/opt/python/bin:/usr/bin:/bin"  # the interpreter, then the tools


@pytest.fixture
def host_stdin_with_data() -> Iterator[bytes]:
    """This process's fd 0 is, for the test, a pipe holding data (then EOF), so that a
    program that inherited our stdin would read it."""
    data = b"host stdin: must not reach the sandbox\n"
    read_end, write_end = os.pipe()
    os.write(write_end, data)
    os.close(write_end)
    saved = os.dup(0)
    os.dup2(read_end, 0)
    os.close(read_end)
    try:
        yield data
    finally:
        os.dup2(saved, 0)
        os.close(saved)


def test_stdin_is_empty_even_when_the_host_process_has_one(
    runner: Runner, host_stdin_with_data: bytes
) -> None:
    code = """
import json, os, stat, sys, time
started = time.monotonic()
data = sys.stdin.read()
print(json.dumps({"data": data, "seconds": time.monotonic() - started,
                  "is_char_device": stat.S_ISCHR(os.fstat(0).st_mode)}))
"""
    got = report(runner(code, timeout=5))
    assert got["data"] == ""
    assert got["seconds"] < 1
    assert got["is_char_device"]  # /dev/null


def test_only_fds_0_1_2_the_control_socket_and_the_tool_bridge_are_open(runner: Runner) -> None:
    code = """
import json, os, stat
listed = [int(fd) for fd in os.listdir("/proc/self/fd")]
open_fds = {}
for fd in listed:
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        continue  # the fd listdir used, closed by now
    open_fds[fd] = "socket" if stat.S_ISSOCK(mode) else "other"
print(json.dumps(open_fds))
"""
    assert report(runner(code, timeout=10)) == {
        "0": "other",
        "1": "other",
        "2": "other",
        "3": "socket",
        "4": "socket",  # the tool bridge (docs/tool-bridge.md)
    }
