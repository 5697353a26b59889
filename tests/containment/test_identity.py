"""Namespaces and identity: the code runs as an unprivileged user with no capabilities,
no_new_privs and a seccomp filter, in its own user, pid, net, mount, ipc, uts and cgroup
namespaces, in a session of its own, and cannot make new namespaces."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from codecage import Sandbox
from codecage.engine import guardian

from ._support import Runner, guest, report

pytestmark = pytest.mark.timeout(60)

CLONE_NEWUSER = 0x10000000
IPC_CREAT = 0o1000
IPC_EXCL = 0o2000
IPC_RMID = 0


def _status_fields(*names: str) -> str:
    return guest(
        """
        import json
        fields = {}
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in $names:
                    fields[name] = value.strip()
        print(json.dumps(fields))
        """,
        names=names,
    )


def test_the_code_runs_as_an_unprivileged_user_and_group(
    runner: Runner, request: pytest.FixtureRequest
) -> None:
    """Rootless gVisor (codecage as root) is the exception, by runsc's design: its gofer
    shows the sandbox's host id's files as uid 0 of the Sentry, so the code is uid 0 there,
    the owner of its own files, with no capability at all (checked here); on the host every
    process of it is the sandbox's unprivileged id (`test_the_sandbox_is_not_host_root`)."""
    code = """
import json, os
caps = {l.split(":")[0]: l.split()[1] for l in open("/proc/self/status") if l.startswith("Cap")}
print(json.dumps({"uid": os.getresuid(), "gid": os.getresgid(), "groups": os.getgroups(),
                  "caps": caps}))
"""
    ids = report(runner(code, timeout=10))
    if request.node.callspec.params.get("runner") == "gvisor" and os.geteuid() == 0:
        assert set(ids["caps"].values()) == {"0000000000000000"}, ids
        return
    assert 0 not in ids["uid"]
    assert 0 not in ids["gid"]
    assert 0 not in ids["groups"]


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    todo = [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = {int(p) for p in (task / "children").read_text().split()}
                todo += sorted(kids - found)
                found |= kids
    return found


def _host_ids(pid: int) -> list[int]:
    """Real, effective, saved and filesystem uids and gids of `pid`, as the host sees them."""
    ids: list[int] = []
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("Uid:", "Gid:")):
                ids += [int(v) for v in line.split()[1:]]
    return ids


# Every process of a sandbox counts, gVisor's runsc and gofer too: rootless, they are the
# sandbox's host id like the Sentry (they ran as host root before).
_RUN_NO_CODE: dict[str, tuple[bytes, ...]] = {}


def _runs_code(pid: int, backend: str) -> bool:
    if pid in guardian.watcher_pids():  # this process's own watcher (engine/guardian.py)
        return False
    with contextlib.suppress(OSError):
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        return argv0 not in _RUN_NO_CODE.get(backend, ())
    return False


def test_the_sandbox_is_not_host_root(sandbox: Sandbox) -> None:
    """Seen from the host, while the run is still there: every process of the sandbox (its
    launcher included, gVisor's runsc and gofer too) and every file the code made
    belong to an id other than 0. Inside, /proc/self/uid_map cannot tell: it shows the
    parent namespace's view, which bwrap's intermediate namespace makes "0" whoever the
    host id is."""
    seen: dict[str, object] = {}

    def look(workspace: Path, _files: object) -> None:
        made = (workspace / "made-by-the-code").stat()
        seen["file"] = (made.st_uid, made.st_gid)
        seen["processes"] = {
            pid: _host_ids(pid)
            for pid in _descendants(os.getpid())
            if _runs_code(pid, sandbox.host.backend.name)
        }

    r = sandbox.run(
        "open('made-by-the-code', 'w').write('x')", on_files=look, limits={"timeout": 10}
    )
    assert r.status == "ok", r.stderr
    assert 0 not in seen["file"], seen  # type: ignore[operator]
    processes: dict[int, list[int]] = seen["processes"]  # type: ignore[assignment]
    assert processes, "no process of the sandbox was seen"
    for pid, ids in processes.items():
        assert ids and 0 not in ids, (pid, ids)


def test_rlimit_nproc_applies_to_the_sandbox_user(runner: Runner) -> None:
    """RLIMIT_NPROC holds (the kernel exempts host root from it, so it does only because
    the sandbox is not host root): at a limit of 1, a fork is refused with EAGAIN."""
    code = """
import errno, json, os, resource
resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))
try:
    pid = os.fork()
except OSError as exc:
    outcome = errno.errorcode.get(exc.errno, str(exc.errno))
else:
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    outcome = "forked"
print(json.dumps({"fork": outcome}))
"""
    assert report(runner(code, timeout=10)) == {"fork": "EAGAIN"}


def test_the_code_starts_with_rlimit_nproc_at_max_processes(
    runner: Runner, request: pytest.FixtureRequest
) -> None:
    code = """
import json, resource
print(json.dumps({"nproc": resource.getrlimit(resource.RLIMIT_NPROC)}))
"""
    got = report(runner(code, max_processes=40, timeout=10))
    # bwrap's init counts too, as in pids.max; on gVisor's own kernel the code is PID 1.
    expected = 40 if request.node.callspec.params.get("runner") == "gvisor" else 41
    assert got == {"nproc": [expected, expected]}


def test_every_capability_set_is_empty(runner: Runner) -> None:
    fields = report(runner(_status_fields("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")))
    assert fields == dict.fromkeys(["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"], "0" * 16)


def test_no_new_privs_is_set(runner: Runner) -> None:
    assert report(runner(_status_fields("NoNewPrivs"), timeout=10)) == {"NoNewPrivs": "1"}


def test_a_seccomp_filter_is_in_force(runner: Runner) -> None:
    assert report(runner(_status_fields("Seccomp"), timeout=10)) == {"Seccomp": "2"}


@pytest.mark.parametrize("namespace", ["user", "pid", "net", "mnt", "ipc", "uts", "cgroup"])
def test_the_sandbox_has_a_namespace_of_its_own(runner: Runner, namespace: str) -> None:
    host_inode = os.stat(f"/proc/self/ns/{namespace}").st_ino
    code = guest(
        """
        import json, os
        print(json.dumps(os.stat("/proc/self/ns/" + $namespace).st_ino))
        """,
        namespace=namespace,
    )
    assert report(runner(code, timeout=10)) != host_inode


def test_only_the_sandboxs_own_processes_are_visible(runner: Runner) -> None:
    code = """
import json, os
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
names = {}
for pid in pids:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        names[pid] = os.path.basename(f.read().split(b"\\0")[0].decode())
print(json.dumps({"me": os.getpid(), "pids": pids, "names": names}))
"""
    got = report(runner(code, timeout=10))
    assert got["me"] == 2  # the sandbox's init is 1, the guest interpreter 2
    assert got["pids"] == [1, 2]
    # The init is bwrap's, or a forked sandbox's (engine/forkserver.py: the interpreter).
    assert got["names"] in ({"1": "bwrap", "2": "python3"}, {"1": "python3", "2": "python3"})


def test_the_code_runs_in_a_new_session_without_a_controlling_terminal(runner: Runner) -> None:
    host_session = os.getsid(0)
    code = """
import json, os
try:
    os.close(os.open("/dev/tty", os.O_RDWR))
    tty = "opened"
except OSError as exc:
    tty = type(exc).__name__
with open("/proc/self/stat", encoding="ascii") as f:
    tty_nr = int(f.read().rsplit(")", 1)[1].split()[4])
print(json.dumps({"session": os.getsid(0), "tty": tty, "tty_nr": tty_nr}))
"""
    got = report(runner(code, timeout=10))
    assert got["session"] != host_session
    assert got["tty"] == "OSError"  # ENXIO: no controlling terminal
    assert got["tty_nr"] == 0


def test_the_hostname_is_sandbox(runner: Runner) -> None:
    code = """
import json, os, socket
print(json.dumps([os.uname().nodename, socket.gethostname()]))
"""
    assert report(runner(code, timeout=10)) == ["sandbox", "sandbox"]


def test_a_nested_user_namespace_cannot_be_created(runner: Runner) -> None:
    code = guest(
        """
        import ctypes, errno, json
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.unshare($flag)
        print(json.dumps([rc, errno.errorcode.get(ctypes.get_errno())]))
        """,
        flag=CLONE_NEWUSER,
    )
    assert report(runner(code, timeout=10)) == [-1, "EPERM"]


@pytest.fixture
def host_shm_segment() -> Iterator[int]:
    """A world-readable SysV shared-memory segment on the host, by its key."""
    libc = ctypes.CDLL(None, use_errno=True)
    key = secrets.randbelow(2**30) + 1
    shmid = libc.shmget(key, 4096, IPC_CREAT | IPC_EXCL | 0o666)
    if shmid < 0:
        err = ctypes.get_errno()
        pytest.fail(f"shmget on the host failed: {errno.errorcode.get(err, err)}")
    try:
        yield key
    finally:
        libc.shmctl(shmid, IPC_RMID, None)


def test_sysv_ipc_of_the_host_is_out_of_reach(runner: Runner, host_shm_segment: int) -> None:
    code = guest(
        """
        import ctypes, errno, json
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.shmget($key, 0, 0)
        with open("/proc/sysvipc/shm", encoding="ascii") as f:
            keys = [int(line.split()[0]) for line in f.readlines()[1:]]
        print(json.dumps({"shmget": [rc, errno.errorcode.get(ctypes.get_errno())],
                          "listed": $key in keys}))
        """,
        key=host_shm_segment,
    )
    assert report(runner(code, timeout=10)) == {"shmget": [-1, "ENOENT"], "listed": False}


@pytest.fixture
def host_dev_shm() -> Iterator[tuple[Path, Path]]:
    """A file in the host's /dev/shm, and the name the guest will write in its own."""
    token = secrets.token_hex(8)
    planted = Path("/dev/shm") / f"codecage-host-{token}"
    planted.write_text("host")
    written = Path("/dev/shm") / f"codecage-guest-{token}"
    try:
        yield planted, written
    finally:
        planted.unlink(missing_ok=True)
        written.unlink(missing_ok=True)


def test_dev_shm_is_empty_and_private(runner: Runner, host_dev_shm: tuple[Path, Path]) -> None:
    _, written = host_dev_shm
    code = guest(
        """
        import json, os
        listing = sorted(os.listdir("/dev/shm"))
        with open($written, "w") as f:
            f.write("guest")
        print(json.dumps(listing))
        """,
        written=str(written),
    )
    seen = runner(code, timeout=10)
    assert report(seen) == []
    assert not written.exists()
