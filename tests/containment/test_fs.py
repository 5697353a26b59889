"""Filesystem layer: a minimal read-only root built for the interpreter; nothing of the
host's files but what the interpreter needs; /workspace and a private, size-limited /tmp
are the only writable places, and neither outlives its run."""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

import pytest

from codecage import Sandbox

from ._support import HostCanary, Runner, Seen, assert_absent, guest, report

pytestmark = pytest.mark.timeout(60)

MiB = 1024 * 1024


def test_the_host_canary_files_cannot_be_read(runner: Runner, host_canary: HostCanary) -> None:
    code = guest(
        """
        import json, os
        seen = []
        for path in $paths:  # the file names hold the token too: never echo them
            try:
                with open(path, encoding="utf-8") as f:
                    seen.append(f.read())
            except OSError as exc:
                seen.append(type(exc).__name__)
            try:
                seen.append(os.listdir(os.path.dirname(path)))
            except OSError as exc:
                seen.append(type(exc).__name__)
        print(json.dumps(seen))
        seen
        """,
        paths=[str(p) for p in host_canary.paths],
    )
    seen: Seen = runner(code, timeout=10)
    assert seen.status == "ok", seen.stderr
    assert_absent(host_canary.token, seen)


def test_the_host_canary_is_absent_from_every_field_of_the_result(
    sandbox: Sandbox, host_canary: HostCanary
) -> None:
    # Whatever the code could read, it copies to every channel a result has.
    template = """
        import os, sys
        found = []
        for path in $paths:
            try:
                with open(path, encoding="utf-8") as f:
                    found.append(f.read())
            except OSError as exc:
                found.append(type(exc).__name__)
        text = " ".join(found)
        print(text)
        print(text, file=sys.stderr)
        with open("found.txt", "w") as f:
            f.write(text)
        os.makedirs(text[:100].replace("/", "_"), exist_ok=True)
        if $raise_it:
            raise RuntimeError(text)
        text
        """
    for raise_it in (False, True):
        code = guest(template, paths=[str(p) for p in host_canary.paths], raise_it=raise_it)
        r = sandbox.run(code)
        assert r.status == ("error" if raise_it else "ok"), r.stderr
        assert host_canary.token not in r.model_dump_json()
        assert host_canary.token.encode() not in r.raw_stdout() + r.raw_stderr()


def test_host_home_root_shadow_var_and_run_do_not_exist(runner: Runner) -> None:
    paths = ["/root", "/home", "/etc/shadow", "/var", "/run", "/sys", "/boot", str(Path.home())]
    code = guest(
        """
        import json, os
        print(json.dumps({p: os.path.lexists(p) for p in $paths}))
        """,
        paths=paths,
    )
    seen = runner(code, timeout=10)
    assert report(seen) == dict.fromkeys(paths, False)


def test_etc_holds_only_the_synthetic_passwd_group_hosts_and_hostname(runner: Runner) -> None:
    code = """
import json, os
with open("/etc/passwd", encoding="utf-8") as f:
    users = [line.split(":")[0] for line in f if line.strip()]
print(json.dumps({"etc": sorted(os.listdir("/etc")), "users": users}))
"""
    seen = runner(code, timeout=10)
    assert report(seen) == {
        "etc": ["group", "hostname", "hosts", "passwd"],
        "users": ["sandbox"],
    }


def test_tmp_starts_empty_and_shows_nothing_of_the_host_tmp(
    runner: Runner, host_canary: HostCanary
) -> None:
    code = """
import json, os
print(json.dumps(sorted(os.listdir("/tmp"))))
"""
    seen = runner(code, timeout=10)
    assert report(seen) == []
    assert_absent(host_canary.token, seen)


@pytest.mark.parametrize("folder", ["/", "/etc", "/opt", "/usr", "/usr/share/zoneinfo"])
def test_nothing_can_be_created_outside_workspace_and_tmp(runner: Runner, folder: str) -> None:
    target = Path(folder) / f"codecage-probe-{secrets.token_hex(8)}"
    code = guest(
        """
        import errno, json, os
        try:
            fd = os.open($target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            outcome = errno.errorcode[exc.errno]
        else:
            os.close(fd)
            os.unlink($target)
            outcome = "created"
        print(json.dumps(outcome))
        """,
        target=str(target),
    )
    try:
        seen = runner(code, timeout=10)
    finally:
        target.unlink(missing_ok=True)  # the null runner, as root, may create it
    assert report(seen) in ("EROFS", "EACCES")


def test_host_kernel_settings_under_proc_sys_cannot_be_written(runner: Runner) -> None:
    """Regression: run as root the sandbox user is host uid 0, which passes the sysctl
    permission check; /proc is mounted read-only so that uid 0 cannot change the host."""
    # The guest writes back the value the setting already has: should the write go
    # through (as it does on the null runner, and as the bug lets it), nothing changes.
    code = """
import errno, json
path = "/proc/sys/kernel/core_pattern"
with open(path, encoding="ascii") as f:
    current = f.read()
try:
    with open(path, "w", encoding="ascii") as f:
        f.write(current)
    outcome = "written"
except OSError as exc:
    outcome = errno.errorcode[exc.errno]
print(json.dumps(outcome))
"""
    assert report(runner(code, timeout=10)) in ("EACCES", "EPERM", "EROFS")


def test_the_workspace_is_the_cwd_and_is_writable(runner: Runner) -> None:
    code = """
import json, os
with open("probe.txt", "w", encoding="utf-8") as f:
    f.write("hello")
print(json.dumps({"cwd": os.getcwd(), "there": os.path.isfile("/workspace/probe.txt")}))
"""
    seen = runner(code, timeout=10)
    assert report(seen) == {"cwd": "/workspace", "there": True}


def test_a_file_written_in_the_workspace_is_listed_in_the_result(sandbox: Sandbox) -> None:
    r = sandbox.run("import os\nos.makedirs('out')\nopen('out/a.txt', 'w').write('hello')")
    assert r.status == "ok"
    assert [(f.path, f.size, f.sha256) for f in r.files] == [
        ("out/a.txt", 5, hashlib.sha256(b"hello").hexdigest())
    ]


def _fill(path: str) -> str:
    """Guest code that writes 3 MiB to `path`, 1 MiB at a time, and removes the file; it
    leaves `outcome` ("fits", or the name of the errno that stopped it) and `written` (bytes)
    set."""
    return guest(
        """
        import errno, json, os
        written, outcome = 0, "fits"
        try:
            with open($path, "wb") as f:
                for _ in range(3):
                    f.write(b"x" * (1 << 20))
                    f.flush()
                    written += 1 << 20
        except OSError as exc:
            outcome = errno.errorcode[exc.errno]
        finally:
            if os.path.exists($path):
                os.unlink($path)
        """,
        path=path,
    )


def test_tmp_is_a_private_tmpfs_of_the_configured_size(runner: Runner) -> None:
    name = f"/tmp/codecage-fill-{secrets.token_hex(8)}"
    probe = guest(
        """
        import json, os
        fstype = None
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if fields[4] == "/tmp":
                    fstype = fields[fields.index("-") + 1]
        st = os.statvfs("/tmp")
        """,
    )
    said = "fstype=fstype, size=st.f_blocks * st.f_frsize, outcome=outcome, written=written"
    code = probe + _fill(name) + f"print(json.dumps(dict({said})))\n"
    try:
        seen = runner(code, tmp_mb=2, timeout=10)
    finally:
        Path(name).unlink(missing_ok=True)
    got = report(seen)
    assert got["fstype"] == "tmpfs"
    assert got["size"] == 2 * MiB
    assert got["outcome"] == "ENOSPC"
    assert got["written"] <= 2 * MiB


def test_writing_past_workspace_mb_gives_enospc(runner: Runner) -> None:
    code = _fill("fill.bin") + "print(json.dumps(dict(outcome=outcome, written=written)))\n"
    got = report(runner(code, workspace_mb=1, timeout=10))
    assert got["outcome"] == "ENOSPC"
    assert got["written"] <= 1 << 20


def test_a_full_workspace_leaves_a_workspace_full_event(sandbox: Sandbox) -> None:
    r = sandbox.run(
        "refused = None\n"
        "try:\n"
        "    open('fill.bin', 'wb').write(b'x' * (2 << 20))\n"
        "except OSError as exc:\n"
        "    refused = exc.errno\n"
        "refused",
        limits={"workspace_mb": 1},
    )
    assert r.status == "ok"
    assert r.return_value == 28  # ENOSPC
    assert "workspace_full" in [e.kind for e in r.events]


def test_a_second_run_sees_nothing_of_the_first_runs_workspace_or_tmp(runner: Runner) -> None:
    name = f"codecage-first-run-{secrets.token_hex(8)}"
    first = guest(
        """
        import json, os
        for path in ($name, "/tmp/" + $name):
            with open(path, "w", encoding="utf-8") as f:
                f.write("first run")
        print(json.dumps(sorted(os.listdir("/tmp"))))
        """,
        name=name,
    )
    second = guest(
        """
        import json, os
        print(json.dumps({
            "workspace": os.path.exists($name),
            "tmp": os.path.exists("/tmp/" + $name),
            "tmp_listing": sorted(os.listdir("/tmp")),
            "cwd_listing": sorted(os.listdir(".")),
        }))
        """,
        name=name,
    )
    try:
        assert name in report(runner(first, timeout=10))
        got = report(runner(second, timeout=10))
    finally:
        Path("/tmp", name).unlink(missing_ok=True)  # the null runner writes the host's /tmp
    assert got == {"workspace": False, "tmp": False, "tmp_listing": [], "cwd_listing": []}


def test_a_symlink_to_a_host_file_does_not_reach_the_host_file(
    runner: Runner, host_canary: HostCanary
) -> None:
    code = guest(
        """
        import json, os
        os.symlink($target, "link")
        try:
            with open("link", encoding="utf-8") as f:
                outcome = f.read()
        except OSError as exc:
            outcome = type(exc).__name__
        print(json.dumps(outcome))
        """,
        target=str(host_canary.paths[0]),
    )
    seen = runner(code, timeout=10)
    assert report(seen) == "FileNotFoundError"
    assert_absent(host_canary.token, seen)


def test_symlinks_in_the_workspace_are_not_followed_by_the_files_listing(
    sandbox: Sandbox, host_canary: HostCanary
) -> None:
    # The host lists the workspace after the run, outside the sandbox, where these links
    # would resolve to host files.
    code = guest(
        """
        import os
        os.symlink("/etc/passwd", "passwd")
        os.symlink($canary, "canary.txt")
        os.symlink("/etc", "etc")
        os.symlink("/", "root")
        os.mkdir("sub")
        os.symlink("../../../../../../../../etc/passwd", "sub/up.txt")
        with open("real.txt", "w") as f:
            f.write("mine")
        """,
        canary=str(host_canary.paths[0]),
    )
    r = sandbox.run(code)
    assert r.status == "ok", r.error
    assert [f.path for f in r.files] == ["real.txt"]
    host_passwd = hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest()
    assert host_passwd not in r.model_dump_json()
    assert host_canary.token not in r.model_dump_json()
