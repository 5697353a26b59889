"""The run's workspace on the host side, and the one way files leave it (codecage.engine.workspace).

Everything here is done on real files, FIFOs, sockets and (as root) real tmpfs mounts.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import codecage
from codecage.engine.workspace import (
    MAX_DEPTH,
    Workspace,
    create_ephemeral,
    destroy,
    list_files,
    read_file,
    strip_privilege_bits,
    use_existing,
)
from codecage.errors import ConfigError, SandboxError
from codecage.isolation.tmpfs import can_mount_tmpfs

IS_ROOT = os.geteuid() == 0
SETID = stat.S_ISUID | stat.S_ISGID
root_only = pytest.mark.skipif(not IS_ROOT, reason="needs root")


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    path = tmp_path / "ws"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory next to the workspace, standing for the host's files."""
    path = tmp_path / "outside"
    path.mkdir()
    (path / "secret.txt").write_text("host secret")
    return path


def listed_paths(ws_path: Path) -> list[str]:
    files, _ = list_files(ws_path)
    return [f.path for f in files]


def mounts_at(path: Path) -> list[tuple[str, str, str]]:
    """(fstype, mount options, superblock options) of each mount at `path`."""
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as mountinfo:
        for line in mountinfo:
            before, _, after = line.partition(" - ")
            fields = before.split()
            mount_point = fields[4].encode().decode("unicode_escape")
            if mount_point == str(path):
                fstype, _source, super_opts = after.split()[:3]
                found.append((fstype, fields[5], super_opts))
    return found


def run_unprivileged(code: str, cwd: Path) -> None:
    """Run `code` in a child Python without privileges, for the paths only a non-root
    codecage takes (root ignores file permissions). As root, the child keeps uid 0 but
    drops every capability (setpriv), so permissions apply to it as to any owner."""
    prefix: list[str] = []
    if IS_ROOT:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("setpriv (util-linux) is needed to drop root's capabilities")
        prefix = [setpriv, "--bounding-set=-all", "--"]
    package_root = str(Path(codecage.__file__).parent.parent)
    subprocess.run(
        [*prefix, sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        env={"PYTHONPATH": package_root, "PATH": "/usr/bin:/bin"},
        check=True,
        timeout=60,
    )


# --- listing ------------------------------------------------------------------------------


def test_files_are_listed_recursively_sorted_relative_with_size_and_sha256(ws: Path) -> None:
    (ws / "b.txt").write_text("bee")
    (ws / "a").mkdir()
    (ws / "a" / "z.csv").write_text("x,y\n1,2\n")
    (ws / "a" / "deeper").mkdir()
    (ws / "a" / "deeper" / "c.json").write_text("{}")
    (ws / "empty_dir").mkdir()

    files, truncated = list_files(ws)

    assert not truncated
    assert [f.path for f in files] == ["a/deeper/c.json", "a/z.csv", "b.txt"]
    by_path = {f.path: f for f in files}
    assert by_path["b.txt"].size == 3
    assert by_path["b.txt"].sha256 == hashlib.sha256(b"bee").hexdigest()
    assert by_path["a/z.csv"].mime == "text/csv"
    assert by_path["a/deeper/c.json"].mime == "application/json"


def test_symlink_to_etc_passwd_inside_the_workspace_is_not_listed(ws: Path) -> None:
    (ws / "passwd").symlink_to("/etc/passwd")
    (ws / "real.txt").write_text("mine")
    assert listed_paths(ws) == ["real.txt"]


def test_symlinked_directory_is_not_descended(ws: Path, outside: Path) -> None:
    (ws / "escape").symlink_to(outside)
    (ws / "etc").symlink_to("/etc")
    assert listed_paths(ws) == []


@pytest.mark.timeout(10)
def test_fifo_is_skipped_without_blocking(ws: Path) -> None:
    os.mkfifo(ws / "pipe")
    (ws / "after.txt").write_text("still listed")
    assert listed_paths(ws) == ["after.txt"]


def test_unix_socket_is_skipped(tmp_path: Path) -> None:
    ws = tmp_path / "w"  # short: a socket path must fit in 108 bytes
    ws.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(ws / "s"))
        assert listed_paths(ws) == []


@pytest.mark.needs_root
@root_only
def test_device_node_is_skipped(ws: Path) -> None:
    try:
        os.mknod(ws / "null", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("this root cannot create device nodes (no CAP_MKNOD)")
    assert listed_paths(ws) == []


def test_file_names_with_escape_sequences_or_invalid_utf8_are_neutralised(ws: Path) -> None:
    raw_root = os.fsencode(ws)
    for raw_name in (b"evil\x1b[2J\x07.txt", b"bad\xff\xfe", "rtl\u202etxt.exe".encode()):
        with open(raw_root + b"/" + raw_name, "wb") as f:
            f.write(b"x")

    paths = listed_paths(ws)

    assert paths == ["bad\\xff\\xfe", "evil\\x1b[2J\\x07.txt", "rtl\\u202etxt.exe"]
    for path in paths:
        path.encode("utf-8", errors="strict")


def test_listing_bounded_by_max_files_says_truncated(ws: Path) -> None:
    for i in range(5):
        (ws / f"f{i}").write_text(str(i))

    files, truncated = list_files(ws, max_files=3)

    assert truncated
    assert [f.path for f in files] == ["f0", "f1", "f2"]


def test_listing_exactly_max_files_is_not_truncated(ws: Path) -> None:
    for i in range(3):
        (ws / f"f{i}").write_text(str(i))
    files, truncated = list_files(ws, max_files=3)
    assert (len(files), truncated) == (3, False)


def test_directories_deeper_than_the_bound_are_left_out_and_flagged(ws: Path) -> None:
    deepest_listed = ws.joinpath(*["d"] * MAX_DEPTH)
    deepest_listed.mkdir(parents=True)
    (deepest_listed / "kept.txt").write_text("at the bound")
    (deepest_listed / "d").mkdir()
    (deepest_listed / "d" / "lost.txt").write_text("past the bound")

    files, truncated = list_files(ws)

    assert truncated
    assert [f.path for f in files] == ["d/" * MAX_DEPTH + "kept.txt"]


def test_file_over_the_hash_bound_is_listed_without_a_hash(ws: Path) -> None:
    (ws / "big.bin").write_bytes(b"x" * 1000)
    files, truncated = list_files(ws, max_hash_bytes=999)
    assert (files[0].size, files[0].sha256, truncated) == (1000, None, False)


def test_hashing_stops_when_the_total_byte_budget_is_spent(ws: Path) -> None:
    (ws / "a").write_bytes(b"a" * 600)
    (ws / "b").write_bytes(b"b" * 600)

    files, truncated = list_files(ws, max_total_bytes=1000)

    assert truncated
    assert files[0].sha256 == hashlib.sha256(b"a" * 600).hexdigest()
    assert (files[1].path, files[1].size, files[1].sha256) == ("b", 600, None)


@pytest.mark.parametrize(
    ("name", "content", "mime"),
    [
        ("table.csv", b"a,b\n", "text/csv"),
        ("picture", b"\x89PNG\r\n\x1a\n" + b"\x00" * 20, "image/png"),
        ("photo", b"\xff\xd8\xff\xe0" + b"\x00" * 20, "image/jpeg"),
        ("anim", b"GIF89a" + b"\x00" * 20, "image/gif"),
        ("doc", b"%PDF-1.7\n", "application/pdf"),
        ("archive", b"PK\x03\x04" + b"\x00" * 20, "application/zip"),
        ("packed", b"\x1f\x8b\x08\x00" + b"\x00" * 20, "application/gzip"),
        ("data.csv.gz", b"\x1f\x8b\x08\x00", "application/gzip"),
        ("picture.bin", b"\x89PNG\r\n\x1a\n", "image/png"),
        ("notes", "héllo\n".encode(), "text/plain"),
        ("README.md", b"# title\n", "text/markdown"),
        ("blob", b"\x00\x01\x02\xff", "application/octet-stream"),
        ("latin1", b"caf\xe9", "application/octet-stream"),
        ("big_text", b"a" * (64 * 1024 + 1), "application/octet-stream"),
        ("data:,x", b"\x00\xff", "application/octet-stream"),
    ],
)
def test_mime_comes_from_the_name_then_magic_numbers_then_a_utf8_check(
    ws: Path, name: str, content: bytes, mime: str
) -> None:
    (ws / name).write_bytes(content)
    files, _ = list_files(ws)
    assert files[0].mime == mime


def test_listing_a_workspace_that_is_a_symlink_is_refused(tmp_path: Path, ws: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(ws)
    with pytest.raises(SandboxError):
        list_files(link)


# --- taking S_ISUID and S_ISGID away ----------------------------------------------------


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_setuid_files_and_setgid_directories_are_stripped_at_every_level(ws: Path) -> None:
    (ws / "tool").write_text("#!/bin/sh\n")
    (ws / "tool").chmod(0o4755)
    (ws / "shared").mkdir()
    (ws / "shared").chmod(0o2775)
    nested = ws / "shared" / "a" / "b"
    nested.mkdir(parents=True)  # "a" inherits S_ISGID from "shared", as the kernel does
    nested.chmod(0o2755)
    (nested / "both").write_text("x")
    (nested / "both").chmod(0o6711)
    (nested / "plain.txt").write_text("x")
    (nested / "plain.txt").chmod(0o640)
    (ws / "sticky").mkdir()
    (ws / "sticky").chmod(0o3777)

    changed = strip_privilege_bits(ws)

    assert changed == 6
    assert mode_of(ws / "tool") == 0o755
    assert mode_of(ws / "shared") == 0o775
    assert not mode_of(ws / "shared" / "a") & SETID
    assert mode_of(nested) == 0o755
    assert mode_of(nested / "both") == 0o711
    assert mode_of(nested / "plain.txt") == 0o640
    assert mode_of(ws / "sticky") == 0o1777  # S_ISVTX is harmless and stays
    assert strip_privilege_bits(ws) == 0


def test_the_workspace_directory_itself_is_stripped(ws: Path) -> None:
    ws.chmod(0o2700)
    assert strip_privilege_bits(ws) == 1
    assert mode_of(ws) == 0o700


def test_a_symlink_to_a_setuid_host_file_is_not_followed(ws: Path, outside: Path) -> None:
    host_tool = outside / "host-tool"
    host_tool.write_text("#!/bin/sh\n")
    host_tool.chmod(0o4755)
    (outside / "host-dir").mkdir()
    (outside / "host-dir").chmod(0o2755)
    (ws / "tool").symlink_to(host_tool)
    (ws / "dir").symlink_to(outside / "host-dir")
    (ws / "outside").symlink_to(outside)

    assert strip_privilege_bits(ws) == 0

    assert mode_of(host_tool) == 0o4755
    assert mode_of(outside / "host-dir") == 0o2755


@pytest.mark.timeout(10)
def test_stripping_does_not_open_a_fifo(ws: Path) -> None:
    os.mkfifo(ws / "pipe")
    (ws / "pipe").chmod(0o4644)
    assert strip_privilege_bits(ws) == 0
    assert mode_of(ws / "pipe") == 0o4644  # a FIFO cannot be run; it is left as it is


def test_stripping_reaches_as_deep_as_the_listing_and_warns_past_it(
    ws: Path, caplog: pytest.LogCaptureFixture
) -> None:
    deepest = ws.joinpath(*["d"] * MAX_DEPTH)
    deepest.mkdir(parents=True)
    (deepest / "at-the-bound").write_text("x")
    (deepest / "at-the-bound").chmod(0o4755)
    (deepest / "past").mkdir()
    (deepest / "past").chmod(0o2755)
    (deepest / "past" / "beyond").write_text("x")
    (deepest / "past" / "beyond").chmod(0o4755)

    with caplog.at_level(logging.WARNING, logger="codecage.engine.workspace.privileges"):
        changed = strip_privilege_bits(ws)

    assert changed == 2
    assert mode_of(deepest / "at-the-bound") == 0o755
    assert mode_of(deepest / "past") == 0o755  # the directory at the bound itself
    assert mode_of(deepest / "past" / "beyond") == 0o4755  # not walked: said so
    messages = [record.getMessage() for record in caplog.records]
    assert "workspace_privilege_bits_not_all_checked" in messages
    assert "workspace_privilege_bits_stripped" in messages


def test_stripping_leaves_no_fd_open(ws: Path, outside: Path) -> None:
    (ws / "sub").mkdir()
    (ws / "sub" / "f").write_text("f")
    (ws / "sub" / "f").chmod(0o4755)
    (ws / "escape").symlink_to(outside)
    before = sorted(os.listdir("/proc/self/fd"))

    strip_privilege_bits(ws)

    assert sorted(os.listdir("/proc/self/fd")) == before


def test_stripping_a_workspace_that_is_a_symlink_is_refused(tmp_path: Path, ws: Path) -> None:
    (tmp_path / "link").symlink_to(ws)
    with pytest.raises(SandboxError) as refused:
        strip_privilege_bits(tmp_path / "link")
    assert refused.value.hint


def test_unreadable_setuid_files_are_stripped_without_privileges(tmp_path: Path) -> None:
    run_unprivileged(
        """
        import stat
        from pathlib import Path
        from codecage.engine.workspace import strip_privilege_bits
        Path("ws/sub").mkdir(parents=True)
        Path("ws/sub/tool").write_text("x")
        Path("ws/sub/tool").chmod(0o4111)  # no read for anyone, still runnable
        Path("ws/locked").mkdir()
        Path("ws/locked").chmod(0o2311)  # cannot be listed, so not walked; itself stripped
        assert strip_privilege_bits(Path("ws")) == 2
        assert stat.S_IMODE(Path("ws/sub/tool").lstat().st_mode) == 0o111
        assert stat.S_IMODE(Path("ws/locked").lstat().st_mode) == 0o311
        """,
        cwd=tmp_path,
    )


# --- reading ------------------------------------------------------------------------------


def test_read_file_returns_the_content_of_a_regular_file(ws: Path) -> None:
    (ws / "out").mkdir()
    (ws / "out" / "report.csv").write_bytes(b"a,b\n1,2\n")
    assert read_file(ws, "out/report.csv", max_bytes=100) == b"a,b\n1,2\n"


def test_read_file_refuses_a_symlink_to_etc_passwd(ws: Path) -> None:
    (ws / "passwd").symlink_to("/etc/passwd")
    with pytest.raises(ConfigError, match="symlink") as refused:
        read_file(ws, "passwd", max_bytes=1 << 20)
    assert "root:" not in str(refused.value)
    assert refused.value.hint


def test_read_file_refuses_a_path_through_a_symlinked_directory(ws: Path, outside: Path) -> None:
    (ws / "escape").symlink_to(outside)
    with pytest.raises(ConfigError):
        read_file(ws, "escape/secret.txt", max_bytes=1 << 20)


@pytest.mark.parametrize(
    "relpath",
    ["../x", "/etc/passwd", "", "a//b", "./a", "a/", "a/./b", "a/../a", "..", "a\x00b"],
)
def test_read_file_refuses_paths_that_are_not_plain_relative(ws: Path, relpath: str) -> None:
    (ws / "a").mkdir()
    (ws / "a" / "b").write_text("b")
    with pytest.raises(ConfigError):
        read_file(ws, relpath, max_bytes=100)


def test_read_file_refuses_paths_deeper_than_the_bound(ws: Path) -> None:
    with pytest.raises(ConfigError, match="deeper"):
        read_file(ws, "/".join(["d"] * (MAX_DEPTH + 1) + ["f"]), max_bytes=100)


@pytest.mark.timeout(10)
def test_read_file_refuses_a_fifo_without_blocking(ws: Path) -> None:
    os.mkfifo(ws / "pipe")
    with pytest.raises(ConfigError, match="not a regular file"):
        read_file(ws, "pipe", max_bytes=100)


def test_read_file_refuses_a_directory_and_a_missing_file(ws: Path) -> None:
    (ws / "d").mkdir()
    with pytest.raises(ConfigError, match="not a regular file"):
        read_file(ws, "d", max_bytes=100)
    with pytest.raises(ConfigError, match="does not exist"):
        read_file(ws, "missing", max_bytes=100)


def test_read_file_refuses_a_file_larger_than_max_bytes(ws: Path) -> None:
    (ws / "big").write_bytes(b"x" * 101)
    assert read_file(ws, "big", max_bytes=101) == b"x" * 101
    with pytest.raises(ConfigError, match="101 bytes"):
        read_file(ws, "big", max_bytes=100)


def test_read_file_finds_a_file_by_the_name_the_listing_gives_when_it_is_plain(ws: Path) -> None:
    (ws / "sub").mkdir()
    (ws / "sub" / "r.txt").write_text("r")
    for info in list_files(ws)[0]:
        assert read_file(ws, info.path, max_bytes=10) == b"r"


def test_listing_reading_and_refusing_leave_no_fd_open(ws: Path, outside: Path) -> None:
    (ws / "sub").mkdir()
    (ws / "sub" / "f.txt").write_text("f")
    (ws / "escape").symlink_to(outside)
    os.mkfifo(ws / "pipe")
    before = sorted(os.listdir("/proc/self/fd"))

    list_files(ws)
    list_files(ws, max_files=0)
    read_file(ws, "sub/f.txt", max_bytes=10)
    for refused in ("escape/secret.txt", "pipe", "sub/missing", "sub/f.txt/x", "sub"):
        with pytest.raises(ConfigError):
            read_file(ws, refused, max_bytes=10)
    with pytest.raises(ConfigError):
        read_file(ws, "sub/f.txt", max_bytes=0)

    assert sorted(os.listdir("/proc/self/fd")) == before


@pytest.fixture(scope="module")
def escape_layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """root/secret.txt holds a canary; root/ws holds files and symlinks pointing out."""
    root = tmp_path_factory.mktemp("escape")
    (root / "secret.txt").write_text("CANARY-7f3a")
    ws = root / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / "inside.txt").write_text("inside")
    (ws / "sub" / "inner.txt").write_text("inner")
    (ws / "up").symlink_to("..")
    (ws / "secret").symlink_to("../secret.txt")
    (ws / "sub" / "abs").symlink_to(root / "secret.txt")
    return ws


path_parts = st.sampled_from(
    ["..", ".", "", "sub", "inside.txt", "inner.txt", "up", "secret", "secret.txt", "abs", "ws"]
)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.booleans(), st.lists(path_parts, min_size=1, max_size=6))
def test_read_file_never_returns_content_from_outside_the_workspace(
    escape_layout: Path, absolute: bool, parts: list[str]
) -> None:
    relpath = ("/" if absolute else "") + "/".join(parts)
    try:
        content = read_file(escape_layout, relpath, max_bytes=1000)
    except ConfigError:
        return
    assert content in (b"inside", b"inner")


# --- creating and destroying ----------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "run"
    path.mkdir(mode=0o700)
    yield path
    # A failed test must not leave a mount behind for the next ones.
    if mounts_at(path / "workspace"):
        destroy(Workspace(path / "workspace", tmpfs=True, owned=True))


def test_create_ephemeral_makes_a_0700_workspace_and_destroy_leaves_nothing(run_dir: Path) -> None:
    ws = create_ephemeral(run_dir, 8)

    assert ws.path == run_dir / "workspace"
    assert ws.owned
    assert stat.S_IMODE(ws.path.stat().st_mode) == 0o700
    (ws.path / "sub").mkdir()
    (ws.path / "sub" / "f.txt").write_text("data")

    destroy(ws)

    assert list(run_dir.iterdir()) == []
    assert mounts_at(ws.path) == []


def test_destroy_twice_does_not_raise(run_dir: Path) -> None:
    ws = create_ephemeral(run_dir, 1)
    destroy(ws)
    destroy(ws)
    assert list(run_dir.iterdir()) == []


@pytest.fixture
def mounting_run_dir(run_dir: Path) -> Path:
    """`run_dir`, where the test may mount a tmpfs: skips unless root that can mount here."""
    if not IS_ROOT:
        pytest.skip("needs root")
    if not can_mount_tmpfs():
        pytest.skip("root here cannot mount (no CAP_SYS_ADMIN over this mount namespace)")
    return run_dir


def test_create_ephemeral_refuses_a_size_below_one_megabyte(run_dir: Path) -> None:
    with pytest.raises(ConfigError, match="size_mb=0"):
        create_ephemeral(run_dir, 0)


@pytest.mark.needs_root
def test_ephemeral_workspace_is_a_size_limited_tmpfs_gone_after_destroy(
    mounting_run_dir: Path,
) -> None:
    ws = create_ephemeral(mounting_run_dir, 3)
    try:
        assert ws.tmpfs
        [(fstype, mount_opts, super_opts)] = mounts_at(ws.path)
        assert fstype == "tmpfs"
        assert {"nosuid", "nodev"} <= set(mount_opts.split(","))
        assert {"size=3072k", "mode=700"} <= set(super_opts.split(","))
    finally:
        destroy(ws)
    assert mounts_at(ws.path) == []
    assert not ws.path.exists()


@pytest.mark.needs_root
def test_writing_past_the_tmpfs_size_gives_enospc(mounting_run_dir: Path) -> None:
    ws = create_ephemeral(mounting_run_dir, 1)
    try:
        fd = os.open(ws.path / "fill", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            with pytest.raises(OSError) as full:
                for _ in range(3):
                    os.write(fd, b"\x00" * 2**20)
            assert full.value.errno == errno.ENOSPC
        finally:
            os.close(fd)
    finally:
        destroy(ws)


def test_destroy_does_not_follow_symlinks_out_of_the_workspace(
    run_dir: Path, outside: Path
) -> None:
    ws = create_ephemeral(run_dir, 1)
    (ws.path / "escape").symlink_to(outside)
    (ws.path / "file_link").symlink_to(outside / "secret.txt")

    destroy(ws)

    assert (outside / "secret.txt").read_text() == "host secret"
    assert list(run_dir.iterdir()) == []


def test_destroy_removes_a_tree_deeper_than_the_recursion_limit(tmp_path: Path) -> None:
    path = tmp_path / "workspace"
    path.mkdir()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(3 * sys.getrecursionlimit()):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        with open("leaf", "w", opener=lambda name, flags: os.open(name, flags, dir_fd=fd)) as f:
            f.write("deep")
    finally:
        os.close(fd)

    destroy(Workspace(path, tmpfs=False, owned=True))

    assert not path.exists()


def test_destroy_removes_directories_chmod_ed_to_zero(tmp_path: Path) -> None:
    path = tmp_path / "workspace"
    (path / "locked" / "inner").mkdir(parents=True)
    (path / "locked" / "inner" / "f").write_text("x")
    (path / "locked" / "inner").chmod(0)
    (path / "locked").chmod(0)

    destroy(Workspace(path, tmpfs=False, owned=True))

    assert not path.exists()


def test_destroy_removes_directories_chmod_ed_to_zero_without_privileges(tmp_path: Path) -> None:
    run_unprivileged(
        """
        from pathlib import Path
        from codecage.engine.workspace import create_ephemeral, destroy
        Path("run").mkdir()
        ws = create_ephemeral(Path("run"), 1)
        assert not ws.tmpfs
        (ws.path / "locked" / "inner").mkdir(parents=True)
        (ws.path / "locked" / "inner" / "f").write_text("x")
        (ws.path / "locked" / "inner").chmod(0)
        (ws.path / "locked").chmod(0)
        ws.path.chmod(0)
        destroy(ws)
        assert not ws.path.exists()
        """,
        cwd=tmp_path,
    )
    assert list((tmp_path / "run").iterdir()) == []


def test_unreadable_file_is_listed_without_a_hash(tmp_path: Path) -> None:
    run_unprivileged(
        """
        from pathlib import Path
        from codecage.engine.workspace import list_files
        Path("ws").mkdir()
        Path("ws/locked.csv").write_text("a,b")
        Path("ws/locked.csv").chmod(0)
        files, truncated = list_files(Path("ws"))
        assert [(f.path, f.size, f.sha256, f.mime) for f in files] == [
            ("locked.csv", 3, None, "text/csv")
        ], files
        """,
        cwd=tmp_path,
    )


def test_destroy_keeps_a_workspace_the_user_gave(ws: Path) -> None:
    (ws / "keep.txt").write_text("mine")
    given = use_existing(ws)
    assert (given.owned, given.tmpfs) == (False, False)

    destroy(given)

    assert (ws / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("kind", ["missing", "symlink", "file"])
def test_use_existing_refuses_what_is_not_a_real_directory(
    tmp_path: Path, ws: Path, kind: str
) -> None:
    target = tmp_path / kind
    if kind == "symlink":
        target.symlink_to(ws)
    elif kind == "file":
        target.write_text("not a dir")
    with pytest.raises(ConfigError) as refused:
        use_existing(target)
    assert refused.value.hint
