"""Issue 17, items 6, 7 and 15: the workspace and the run directories around the sandbox.

6: files uploaded to the MCP tool land in the run's size-limited workspace, never in a plain
   host directory without a quota.
7: run directories (and generated tool trees) live in a 0700 parent of the effective uid,
   not in /tmp; the stale-run sweep goes by descriptors, follows no symlink and touches only
   directories of ours; a killed process's tool tree is swept too.
15: a --workspace DIR gets its own mode back after the run, and keeps the setgid bit its
   operator set.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mcp import Client
from mcp_types import CallToolResult, TextContent
from tests._anyio import anyio_backend  # noqa: F401 - a fixture

from codecage import Options, Sandbox, engine
from codecage.engine import owner, workspace
from codecage.engine.workspace import lifecycle
from codecage.isolation import tmpfs
from codecage.mcp.server import build_server
from codecage.models import Limits

IS_ROOT = os.geteuid() == 0
needs_tmpfs = pytest.mark.skipif(
    not tmpfs.can_mount_tmpfs(), reason="the workspace quota needs a tmpfs (root)"
)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _dead_owner() -> str:
    """The owner key of a process that is gone: its owner file is there, and unlocked
    (engine.owner), as a killed process leaves it."""
    key = f"{_dead_pid()}-{secrets.token_hex(8)}"
    (workspace.private_parent() / f"{owner.LOCK_PREFIX}{key}").touch(mode=0o600)
    return key


def _text(result: CallToolResult) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, TextContent))


# --- 6: uploads stay within the workspace quota ------------------------------------------

# Writes 1 MiB files until the workspace is full (or 64 MiB, four times its size), and says
# how much it wrote. No imports: it runs under the server's default profile.
FILL = textwrap.dedent(
    """
    written = 0
    stop = ""
    try:
        while written < 64 * 2**20:
            with open(f"fill-{written >> 20}", "wb") as f:
                f.write(b"x" * 2**20)
            written += 2**20
    except OSError as exc:
        stop = exc.strerror
    print(open("in/note.txt").read(), written >> 20, stop)
    """
)


@needs_tmpfs
@pytest.mark.anyio
async def test_an_upload_run_stops_at_the_workspace_quota() -> None:
    server = build_server(Sandbox(pool=False, limits=Limits(workspace_mb=16)).host)
    async with Client(server, read_timeout_seconds=120) as client:
        result = await client.call_tool(
            "execute_code", {"code": FILL, "files": {"in/note.txt": "hello"}, "timeout": 60}
        )
    assert not result.is_error, _text(result)
    assert result.structured_content is not None
    assert result.structured_content["status"] == "ok", result.structured_content
    # The output is in the text (the structured content does not repeat it: issue 18).
    note, mib, *why = _text(result).split(maxsplit=2)
    assert note == "hello"
    # On the old code the run moved to a plain host directory and wrote all 64 MiB.
    assert int(mib) <= 16, _text(result)
    assert "No space left" in " ".join(why)


@pytest.mark.anyio
async def test_an_upload_larger_than_the_workspace_is_refused_clearly() -> None:
    server = build_server(Sandbox(pool=False, limits=Limits(workspace_mb=1)).host)
    async with Client(server, read_timeout_seconds=120) as client:
        result = await client.call_tool(
            "execute_code", {"code": "print('ran')", "files": {"big.bin": "x" * (2 * 2**20)}}
        )
    assert result.is_error
    assert "more than the workspace's 1 MiB" in _text(result)


@needs_tmpfs
def test_library_files_go_into_the_tmpfs_workspace_warm_or_cold() -> None:
    seen: list[tuple[Path, bool]] = []

    def look(path: Path, _files: object) -> None:
        seen.append((path, os.path.ismount(path)))

    code = "print(open('a/b.txt').read(), open('c.bin', 'rb').read())"
    files: dict[str, bytes | str] = {"a/b.txt": "text", "c.bin": b"\x00\x01"}
    for pool in (False, True):
        with Sandbox(pool=pool, options=Options(import_policy=False)) as sandbox:
            sandbox.warm(60)
            result = sandbox.run(code, files=files, on_files=look)
        assert result.status == "ok", result
        assert result.stdout == "text b'\\x00\\x01'\n"
    assert [mounted for _, mounted in seen] == [True, True]
    assert all(not path.exists() for path, _ in seen)


def test_files_that_escape_or_collide_are_refused(sandbox: Sandbox) -> None:
    from codecage.errors import ConfigError

    for name in ("../x", "/etc/x", "a/./b", "a//b", "x\x00"):
        with pytest.raises(ConfigError):
            sandbox.run("1", files={name: b""})
    with pytest.raises(ConfigError, match="same name"):
        sandbox.run("1", files={"a": b"", "a/b": b""})


# --- 7: a private parent, and a sweep by descriptors ----------------------------------------


def test_run_dirs_live_in_a_private_parent_owned_by_this_user(sandbox: Sandbox) -> None:
    """0700, or 0711 for root: its sandboxes are another host id (issue 20) whose launcher
    must pass through to its own run directory, and cannot list the others."""
    parents: list[Path] = []
    result = sandbox.run("1", on_files=lambda path, _files: parents.append(path.parent.parent))
    assert result.status == "ok"
    [parent] = parents
    st = parent.lstat()
    assert stat.S_ISDIR(st.st_mode)
    assert st.st_uid == os.geteuid()
    expected = 0o711 if os.geteuid() == 0 else 0o700
    assert stat.S_IMODE(st.st_mode) == expected  # on the old code: /tmp, 01777
    assert parent == workspace.private_parent()


def test_a_private_parent_that_someone_else_made_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not IS_ROOT:
        pytest.skip("planting a directory of another uid needs root")
    monkeypatch.setattr(lifecycle, "_SYSTEM_RUN_DIR", tmp_path / "no-run")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    planted = tmp_path / f"codecage-{os.geteuid()}"
    planted.mkdir(mode=0o777)
    os.chown(planted, 65534, 65534)
    from codecage.errors import HostError

    with pytest.raises(HostError, match="belongs to uid 65534"):
        workspace.private_parent()
    planted.rmdir()
    planted.symlink_to(tmp_path)
    with pytest.raises(HostError):
        workspace.private_parent()


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[Path]:
    """A directory of someone else's with a `workspace` subdir and a file in it."""
    target = tmp_path / "victim"
    (target / "workspace").mkdir(parents=True)
    (target / "workspace" / "precious").write_text("keep me")
    yield target
    assert (target / "workspace" / "precious").read_text() == "keep me"


# A local user swaps a name the sweep looks at between a directory and a symlink to the
# victim, as fast as it can (renameat2 RENAME_EXCHANGE), recreating the directory when the
# sweep removed it. With fs.protected_symlinks=0, the old sweep (is_symlink, then paths)
# followed the symlink within a few hundred sweeps and removed the victim's `workspace`.
FLIPPER = textwrap.dedent(
    """
    import ctypes, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    entry, other, victim, stop = sys.argv[1:]
    exchange = libc.renameat2
    a, b = entry.encode(), other.encode()
    os.symlink(victim, other)
    print("go", flush=True)
    while not os.path.exists(stop):
        for _ in range(2000):
            if exchange(-100, a, -100, b, 2) != 0:  # AT_FDCWD, RENAME_EXCHANGE
                # The sweep removed the directory: make it again (never through the link).
                path = entry if not os.path.islink(entry) else other
                try:
                    os.makedirs(os.path.join(path, "workspace"), exist_ok=True)
                except OSError:
                    pass
    """
)


@contextlib.contextmanager
def _flipping(entry: Path, victim: Path, scratch: Path) -> Iterator[None]:
    stop = scratch / "stop"
    proc = subprocess.Popen(
        [sys.executable, "-c", FLIPPER, str(entry), str(scratch / "other"), str(victim), str(stop)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "go"
        yield
    finally:
        stop.touch()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
        for path in (entry, scratch / "other"):
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                workspace.destroy(workspace.Workspace(path, tmpfs=False, owned=True))


@pytest.mark.parametrize("where", ["tmp", "private"])
def test_the_sweep_never_follows_a_name_swapped_for_a_symlink(
    where: str, victim: Path, tmp_path: Path
) -> None:
    # "tmp": where a local user can plant names (and where the old code kept run dirs);
    # "private": as if they could write in the private parent, the descriptors still hold.
    base = Path("/tmp") if where == "tmp" else workspace.private_parent()
    entry = base / f"{engine.RUN_DIR_PREFIX}{_dead_owner()}-race{os.getpid()}"
    with _flipping(entry, victim, tmp_path):
        deadline = time.monotonic() + 6
        sweeps = 0
        while time.monotonic() < deadline and sweeps < 5000:
            engine.sweep_stale_runs()
            sweeps += 1
            assert (victim / "workspace" / "precious").exists(), f"deleted at sweep {sweeps}"


def test_the_sweep_leaves_entries_of_other_users_and_symlinks_alone(
    victim: Path, tmp_path: Path
) -> None:
    if not IS_ROOT:
        pytest.skip("an entry of another uid needs root to plant")
    parent = workspace.private_parent()
    dead = _dead_owner()
    link = parent / f"{engine.RUN_DIR_PREFIX}{dead}-link"
    theirs = parent / f"{engine.RUN_DIR_PREFIX}{dead}-theirs"
    link.symlink_to(victim)
    (theirs / "workspace").mkdir(parents=True)
    os.chown(theirs, 65534, 65534)
    try:
        engine.sweep_stale_runs()
        assert link.is_symlink()
        assert (theirs / "workspace").is_dir()
    finally:
        link.unlink()
        workspace.destroy(workspace.Workspace(theirs, tmpfs=False, owned=True))


@needs_tmpfs
def test_the_sweep_unmounts_and_removes_a_dead_processs_run_dir() -> None:
    parent = workspace.private_parent()
    run_dir = parent / f"{engine.RUN_DIR_PREFIX}{_dead_owner()}-stale"
    run_dir.mkdir(mode=0o700)
    ws = workspace.create_ephemeral(run_dir, 1)
    (ws.path / "deep" / "er").mkdir(parents=True)
    (run_dir / "etc").mkdir()
    assert os.path.ismount(ws.path)
    assert engine.sweep_stale_runs() >= 1
    assert not run_dir.exists()
    assert str(run_dir) not in Path("/proc/self/mountinfo").read_text()


def test_a_killed_processs_generated_tool_tree_is_swept(tmp_path: Path) -> None:
    # The process makes its temp tree the way `codecage run --mcp-config` does, and dies
    # without its atexit cleanup (as with SIGKILL).
    code = textwrap.dedent(
        """
        import os
        from codecage import toolsetup

        tree = toolsetup._temporary_tree()
        tree.mkdir()
        (tree / "mod.py").write_text("x = 1")
        print(tree.parent, flush=True)
        os._exit(0)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    left = Path(out.stdout.strip())
    assert left.is_dir()
    try:
        engine.sweep_stale_runs()
        assert not left.exists()  # on the old code: /tmp/codecage-servers-*, never swept
        assert left.parent == workspace.private_parent()
    finally:
        if left.exists():
            workspace.destroy(workspace.Workspace(left, tmpfs=False, owned=True))


# --- 15: a --workspace DIR is handed back as it was lent -----------------------------------


@pytest.fixture
def lent(tmp_path: Path) -> Path:
    lent = tmp_path / "lent"
    lent.mkdir()
    lent.chmod(0o2750)  # the operator's own setgid bit (group inheritance)
    return lent


def test_a_run_that_chmods_its_workspace_dir_leaves_its_mode_as_it_was(
    sandbox: Sandbox, lent: Path
) -> None:
    result = sandbox.run(
        "import os; os.chmod('/workspace', 0o1777); print(oct(os.stat('/workspace').st_mode))",
        workspace=lent,
    )
    assert result.status == "ok", result
    assert result.stdout.strip().endswith("1777")  # the code did change it
    assert stat.S_IMODE(lent.stat().st_mode) == 0o2750


def test_the_operators_setgid_bit_on_the_workspace_dir_survives_a_run(
    sandbox: Sandbox, lent: Path
) -> None:
    result = sandbox.run("open('/workspace/out.txt', 'w').write('x')", workspace=lent)
    assert result.status == "ok", result
    assert stat.S_IMODE(lent.stat().st_mode) == 0o2750
    # What the run wrote is still stripped of the bits (the directory's setgid makes a
    # subdirectory inherit it; that one is the run's, not the operator's).
    result = sandbox.run("import os; os.mkdir('/workspace/sub')", workspace=lent)
    assert result.status == "ok", result
    assert not (lent / "sub").stat().st_mode & stat.S_ISGID
