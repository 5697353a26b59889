"""Who the sandbox is on the host (isolation/identity.py), what it can reach
(isolation/staging.py) and a lent workspace changing hands (engine/workspace/ownership.py).
The containment side (seen from the host while a run is there) is in
tests/containment/test_identity.py."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from unittest import mock

import pytest

from codecage import Options, Sandbox
from codecage import host as host_module
from codecage.backends.base import Identity, load_backend
from codecage.config import Settings, load
from codecage.engine import selftest
from codecage.engine.workspace import ownership
from codecage.errors import ConfigError, HostError, SandboxError
from codecage.isolation import identity, staging
from codecage.models import DoctorReport, ProbeResult

SANDBOX = Identity(identity.DEFAULT_ID, identity.DEFAULT_ID)
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="only root can give files away")
needs_runsc = pytest.mark.skipif(
    shutil.which("runsc") is None or os.geteuid() != 0, reason="the gVisor backend needs root"
)


def test_root_gets_a_dedicated_range_and_an_ordinary_user_keeps_their_own() -> None:
    default = identity.IdRange(identity.DEFAULT_ID, identity.DEFAULT_ID_COUNT)
    assert identity.plan(euid=0) == identity.IdentityPlan(SANDBOX, "range", default)
    assert identity.plan(4242, 4343, euid=0).identity == Identity(4242, 4343)
    assert identity.plan(4242, 4343, euid=0).range is None  # one id for all, as configured
    as_user = identity.plan(4242, 4343, euid=1000)
    assert as_user.source == "caller"
    assert as_user.identity == Identity(os.getuid(), os.getgid())


@pytest.mark.parametrize("uid", [0, 2**32 - 1, -5])
def test_a_configured_id_of_root_or_out_of_range_is_refused(uid: int) -> None:
    with pytest.raises(ConfigError, match="never be host"):
        identity.plan(uid, None, euid=0)


def test_the_config_file_sets_the_ids_and_refuses_zero(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text("[sandbox]\nuid = 1234567\ngid = 7654321\n", encoding="utf-8")
    good.chmod(0o600)
    settings = load(good, environ={})
    assert (settings.sandbox.uid, settings.sandbox.gid) == (1234567, 7654321)
    bad = tmp_path / "bad.toml"
    bad.write_text("[sandbox]\nuid = 0\n", encoding="utf-8")
    bad.chmod(0o600)
    with pytest.raises(ConfigError, match=r"sandbox\.uid"):
        load(bad, environ={})


def test_ensure_not_root_refuses_a_root_process_and_names_the_ids() -> None:
    if os.geteuid() == 0:
        with pytest.raises(SandboxError, match="host root"):
            identity.ensure_not_root(os.getpid())
    else:
        assert identity.ensure_not_root(os.getpid()).uid == os.getuid()
    with pytest.raises(SandboxError, match="cannot read"):
        identity.ensure_not_root(2**22 + 12345)  # above pid_max's default: no such process


def test_can_read_needs_search_on_every_parent() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as made:
        base = Path(made)
        base.chmod(0o755)
        _check_can_read(base)


def _check_can_read(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    (closed / "inner").mkdir(parents=True)
    target = closed / "inner" / "file"
    target.write_text("x", encoding="utf-8")
    target.chmod(0o644)
    (closed / "inner").chmod(0o755)
    for parent in [tmp_path, *tmp_path.parents]:
        if not parent.stat().st_mode & stat.S_IXOTH:
            pytest.skip(f"{parent} is closed to others already")
    closed.chmod(0o755)
    assert identity.can_read(target, SANDBOX)
    closed.chmod(0o700)
    assert not identity.can_read(target, SANDBOX)
    assert not identity.can_read(tmp_path / "missing", SANDBOX)


@root_only
def test_staging_makes_a_verified_world_readable_copy_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(staging, "STAGE_ROOT", tmp_path / "stage")
    source = tmp_path / "home" / "lib"
    (source / "site-packages").mkdir(parents=True)
    (source / "site-packages" / "big.py").write_text("skip me", encoding="utf-8")
    (source / "pkg").mkdir()
    (source / "pkg" / "mod.py").write_text("print(1)", encoding="utf-8")
    (source / "private.py").write_text("secret-ish", encoding="utf-8")
    (source / "private.py").chmod(0o600)
    (source / "link").symlink_to("pkg/mod.py")
    (tmp_path / "home").chmod(0o700)
    tmp_path.chmod(0o755)

    staged = staging.readable(source, SANDBOX, skip=("site-packages",))

    assert staged != source and staged.is_relative_to(tmp_path / "stage")
    assert (staged / "pkg" / "mod.py").read_text(encoding="utf-8") == "print(1)"
    assert (staged / "private.py").stat().st_mode & 0o777 == 0o644  # a copy, readable
    assert (staged / "link").is_symlink()
    assert list((staged / "site-packages").iterdir()) == []  # kept as an empty mount point
    assert staging.readable(source, SANDBOX, skip=("site-packages",)) == staged  # once
    # A tree whose source is gone is pruned when another is made (once per process).
    gone = tmp_path / "gone"
    gone.write_text("x", encoding="utf-8")
    gone_stage = staging.readable(gone, SANDBOX)
    gone.unlink()
    staging._prune_once.cache_clear()
    staging.readable(tmp_path / "home" / "lib" / "pkg", SANDBOX)  # makes a new tree
    assert not gone_stage.parent.exists()
    assert staged.exists()

    # Every sandbox id passes through to a tree it is given by name; nobody lists it.
    stage_root = (tmp_path / "stage").stat()
    assert (stage_root.st_uid, stage_root.st_gid) == (0, 0)
    assert stat.S_IMODE(stage_root.st_mode) == 0o711


@root_only
def test_a_lent_directory_is_given_to_the_sandbox_and_back(tmp_path: Path) -> None:
    lent = tmp_path / "lent"
    (lent / "sub").mkdir(parents=True)
    (lent / "sub" / "f").write_text("x", encoding="utf-8")
    (lent / "dangling").symlink_to("/etc/passwd")
    passwd_owner = Path("/etc/passwd").stat().st_uid

    assert ownership.give(lent, SANDBOX.uid, SANDBOX.gid) == 4
    assert {p.lstat().st_uid for p in [lent, *lent.rglob("*")]} == {SANDBOX.uid}
    assert Path("/etc/passwd").stat().st_uid == passwd_owner  # a symlink is not followed

    ownership.give(lent, 0, 0)
    assert {p.lstat().st_uid for p in [lent, *lent.rglob("*")]} == {0}


@root_only
def test_a_file_linked_from_elsewhere_is_not_lent(tmp_path: Path) -> None:
    """A hard link in a lent directory may be a host file too: giving it to the sandbox's id
    would let the code write the host's copy."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("the host's", encoding="utf-8")
    lent = tmp_path / "lent"
    lent.mkdir()
    os.link(elsewhere, lent / "linked")
    (lent / "own").write_text("x", encoding="utf-8")

    ownership.give(lent, SANDBOX.uid, SANDBOX.gid, skip_linked=True)

    assert (lent / "own").stat().st_uid == SANDBOX.uid
    assert elsewhere.stat().st_uid == 0


@root_only
def test_a_lent_workspace_comes_back_owned_by_its_owner(tmp_path: Path) -> None:
    owner_uid, owner_gid = 4321, 4321
    lent = tmp_path / "lent"
    lent.mkdir()
    (lent / "input.csv").write_text("a,b\n", encoding="utf-8")
    for path in (lent, lent / "input.csv"):
        os.chown(path, owner_uid, owner_gid)
    tmp_path.chmod(0o700)  # the sandbox's id could not pass through: the bind brings it

    r = Sandbox(pool=False, options=Options(import_policy=False)).run(
        "open('input.csv', 'a').write('1,2\\n'); open('made.txt', 'w').write('hi')",
        workspace=lent,
    )

    assert r.status == "ok", r.stderr
    assert (lent / "input.csv").read_text(encoding="utf-8") == "a,b\n1,2\n"
    owners = {(p.lstat().st_uid, p.lstat().st_gid) for p in [lent, *lent.rglob("*")]}
    assert owners == {(owner_uid, owner_gid)}
    assert not any(line.split()[4].startswith(str(tmp_path)) for line in _mountinfo())


def _mountinfo() -> list[str]:
    return Path("/proc/self/mountinfo").read_text(encoding="utf-8").splitlines()


# --- auto: the strongest backend whose self-test passes (issue 20, item 5) --------------


def _settings_with(tmp_path: Path, text: str) -> Settings:
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    path.chmod(0o600)
    return load(path, environ={})


@needs_runsc
def test_auto_takes_the_configured_order_and_the_first_that_passes_its_selftest(
    tmp_path: Path,
) -> None:
    settings = _settings_with(tmp_path, '[sandbox]\nbackends = ["gvisor", "bwrap"]\n')
    host = host_module.build(Options(pool=False).resolve(settings))
    assert host.backend.name == "gvisor"  # its self-test really ran (or its cache passed)

    # A failing self-test cannot be made for real here (every layer holds on this host):
    # its verdict is planted where the host keeps it, and the choice must move on.
    gvisor = load_backend("gvisor")
    key = selftest.cache_key(gvisor, host.identity.identity)
    failing = DoctorReport(
        backend="gvisor",
        passed=False,
        probes=[ProbeResult(layer="seccomp", passed=False, detail="pretend: not in force")],
    )
    with mock.patch.dict(host_module._PROCESS.verdicts, {key: failing}):
        assert host_module.build(Options(pool=False).resolve(settings)).backend.name == "bwrap"


def test_an_unknown_backend_in_the_order_is_a_clear_error(tmp_path: Path) -> None:
    settings = _settings_with(tmp_path, '[sandbox]\nbackends = ["firecracker"]\n')
    with pytest.raises(ConfigError, match="firecracker") as caught:
        host_module.build(Options(pool=False).resolve(settings))
    assert "bwrap" in (caught.value.hint or "")


# --- one id per sandbox: the range and its leases ------------------------------------------


def test_a_range_over_root_an_account_or_the_largest_id_is_refused() -> None:
    with pytest.raises(ConfigError, match="within 1 to"):
        identity.check_range(0, 10)
    with pytest.raises(ConfigError, match="within 1 to"):
        identity.check_range(identity.MAX_ID - 5, 10)
    with pytest.raises(ConfigError, match="overlap user") as caught:
        identity.check_range(1, 100)  # daemon, bin, sys...: real accounts
    assert "id_base" in (caught.value.hint or "")


def test_a_range_over_a_subordinate_range_is_refused(tmp_path: Path) -> None:
    subuid = Path("/etc/subuid")
    ranges = identity._subordinate(subuid)
    if not ranges:
        pytest.skip("no /etc/subuid ranges on this host")
    owner, start, _count = ranges[0]
    with pytest.raises(ConfigError, match=owner):
        identity.check_range(start, 10)


def _allocator(tmp_path: Path, count: int) -> identity._Allocator:
    state = tmp_path / "ids"
    state.mkdir(mode=0o700)
    return identity._Allocator(identity.IdRange(identity.DEFAULT_ID, count), state)


def test_threads_never_get_the_same_id_and_a_returned_one_comes_back_last(tmp_path: Path) -> None:
    ids = _allocator(tmp_path, 9)  # the base, and 8 ids for sandboxes
    leases: list[identity.Lease] = []
    lock = threading.Lock()

    def take_two() -> None:
        for _ in range(2):
            lease = ids.take()
            with lock:
                leases.append(lease)

    threads = [threading.Thread(target=take_two) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    uids = sorted(lease.identity.uid for lease in leases)
    assert uids == list(range(identity.DEFAULT_ID + 1, identity.DEFAULT_ID + 9))
    assert all(lease.identity.gid == lease.identity.uid and lease.own for lease in leases)
    with pytest.raises(HostError, match="in use") as caught:
        ids.take()
    assert "id_count" in (caught.value.hint or "")
    leases[3].release()
    again = ids.take()
    assert again.identity == leases[3].identity
    for lease in [*leases, again]:
        lease.release()


_HOLDER = """
import sys, time
from pathlib import Path
from codecage.isolation import identity
ids = identity._Allocator(identity.IdRange(int(sys.argv[2]), int(sys.argv[3])), Path(sys.argv[1]))
try:
    lease = ids.take()
except Exception as exc:
    print("refused", type(exc).__name__, flush=True)
    sys.exit(0)
print(lease.identity.uid, flush=True)
time.sleep(600)
"""


def _holder(ids: identity._Allocator) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(ids.state), str(ids.ids.base), str(ids.ids.count)],
        stdout=subprocess.PIPE,
        text=True,
    )


@root_only
def test_another_process_never_gets_an_id_held_and_gets_it_once_its_holder_died(
    tmp_path: Path,
) -> None:
    ids = _allocator(tmp_path, 3)  # two ids
    mine = ids.take()
    other = _holder(ids)
    try:
        assert other.stdout is not None
        theirs = int(other.stdout.readline())
        assert theirs != mine.identity.uid
        third = _holder(ids)
        assert third.stdout is not None
        assert third.stdout.readline().startswith("refused HostError")  # both in use
        third.wait()
        third.stdout.close()
        other.kill()  # a crash: its lock goes with its process
        other.wait()
        with ids.take() as freed:
            assert freed.identity.uid == theirs
    finally:
        other.kill()
        other.wait()
        if other.stdout is not None:
            other.stdout.close()
        mine.release()


def test_info_names_the_range_in_force_or_says_runs_share_the_callers_id() -> None:
    as_root = identity.probe(identity.plan(euid=0))
    assert as_root.active
    assert f"from {identity.DEFAULT_ID + 1} to {identity.DEFAULT_ID + 65535}" in as_root.mechanism
    assert "id_count = 65536" in as_root.detail
    as_user = identity.probe(identity.plan(euid=1000))
    assert "every run has this one id" in as_user.detail


@root_only
def test_an_id_is_lent_again_only_without_the_sysv_ipc_objects_a_killed_holder_left(
    tmp_path: Path,
) -> None:
    """A process of the id makes a shared memory segment and dies, its holder killed
    before `release` could clear it (SIGKILL): the next `take` of that id removes it first,
    so the next run of the id cannot read it. Real SysV IPC of this host; an id far from
    the default range, so no live run's objects are touched."""
    base = 3_000_000_000
    ids = identity._Allocator(identity.IdRange(base, 2), tmp_path)
    tmp_path.chmod(0o700)
    code = (
        "import ctypes, os, sys\n"
        f"os.setgid({base + 1}); os.setuid({base + 1})\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.shmget(0, 4096, 0o1000 | 0o600))\n"
    )
    made = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    shmid = int(made.stdout)
    assert shmid >= 0, made.stderr
    try:
        assert _shm_ids_of(base + 1) == [shmid]
        with ids.take() as lease:
            assert lease.identity.uid == base + 1
            assert _shm_ids_of(base + 1) == [], "the id was lent with the last holder's segment"
    finally:
        subprocess.run(["ipcrm", "-m", str(shmid)], capture_output=True)


def _shm_ids_of(uid: int) -> list[int]:
    rows = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return [int(cols[1]) for cols in map(str.split, rows) if cols[7] == str(uid)]
