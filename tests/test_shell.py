"""The shell and the command-line tools agents call: there, working, and read-only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from codecage import Sandbox
from codecage.isolation import rootfs, shell

pytestmark = pytest.mark.timeout(60)

# What issue 18 names as the tools agents call; the host (Debian) has them all.
ESSENTIAL = (
    "sh", "ls", "cat", "head", "tail", "wc", "grep", "sed", "awk", "sort", "uniq", "cut",
    "find", "xargs", "tar", "gzip", "env",
)  # fmt: skip


def test_the_essential_tools_are_found_on_this_host() -> None:
    assert set(ESSENTIAL) <= set(shell.find().names), shell.find().missing


def test_every_offered_command_resolves_inside_the_sandbox(sandbox: Sandbox) -> None:
    names = shell.find().names
    code = f"""
import json, shutil
json.dumps({{n: shutil.which(n) for n in {list(names)!r}}})
"""
    r = sandbox.run(code, limits={"timeout": 20})
    assert r.status == "ok", r.stderr
    where = json.loads(r.return_value)
    assert where == {n: f"/usr/bin/{n}" for n in names}


def test_what_agents_write_with_subprocess_and_os_system_runs(sandbox: Sandbox) -> None:
    code = """
import os, subprocess
with open("data.csv", "w") as f:
    f.write("name,score\\nb,2\\na,1\\nb,3\\n")
piped = subprocess.run(
    "tail -n +2 data.csv | cut -d, -f1 | sort | uniq -c | awk '{print $2 \\"=\\" $1}'",
    shell=True, capture_output=True, text=True, check=True).stdout.split()
counted = subprocess.run(["wc", "-l", "data.csv"], capture_output=True, text=True).stdout
listed = subprocess.check_output("ls -la", shell=True, text=True)
found = subprocess.check_output("find . -name '*.csv' | xargs grep -l score", shell=True,
                                text=True)
archived = subprocess.check_output(
    "tar czf d.tgz data.csv && gzip -dc d.tgz | tar t && sed -n 2p data.csv | head -c 3",
    shell=True, text=True)
status = os.system("env | grep -q HOME=/workspace && [ -f data.csv ]")
(piped, counted.split()[0], "data.csv" in listed, found.strip(), archived.split(), status)
"""
    r = sandbox.run(code, limits={"timeout": 20})
    assert r.status == "ok", r.stderr
    assert r.return_value == [["a=1", "b=2"], "4", True, "./data.csv", ["data.csv", "b,2"], 0]


def test_the_tools_and_their_directory_are_read_only(sandbox: Sandbox) -> None:
    code = """
import errno, os
seen = {}
for path in ("/usr/bin/ls", "/bin/sh", "/usr/bin/new-tool"):
    try:
        with open(path, "wb") as f:
            f.write(b"#!/bin/sh\\necho pwned\\n")
        seen[path] = "written"
    except OSError as exc:
        seen[path] = errno.errorcode[exc.errno]
seen
"""
    r = sandbox.run(code, limits={"timeout": 20})
    assert r.status == "ok", r.stderr
    assert r.return_value == {
        "/usr/bin/ls": "EROFS",
        "/bin/sh": "EROFS",
        "/usr/bin/new-tool": "EROFS",
    }


def test_the_mount_plan_binds_the_gathered_tools_and_skips_libraries_already_bound() -> None:
    tools = shell.ShellTools(
        binaries=(("ls", Path("/usr/bin/ls")), ("sh", Path("/usr/bin/dash"))),
        libraries=(Path("/lib/libc.so.6"), Path("/lib/libselinux.so.1")),
        missing=(),
        directory=Path("/cache/shell-abc"),
    )
    plan = shell.mounts(tools, already_bound=frozenset({"/lib/libc.so.6"}))
    assert plan == (
        rootfs.Mount("ro-bind", "/lib/libselinux.so.1", "/lib/libselinux.so.1"),
        rootfs.Mount("ro-bind", "/usr/bin", "/cache/shell-abc"),
        rootfs.Mount("symlink", "/bin", "usr/bin"),
    )


def test_a_host_without_tools_gets_no_bin_directory() -> None:
    assert shell.mounts(shell.ShellTools((), (), ("sh",)), already_bound=frozenset()) == ()


def test_the_gathered_directory_holds_the_host_binaries_under_their_command_names() -> None:
    tools = shell.find()
    assert tools.directory is not None
    for name, path in tools.binaries:
        assert (tools.directory / name).read_bytes() == path.read_bytes(), name
