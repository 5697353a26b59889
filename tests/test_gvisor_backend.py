"""The gVisor backend (backends/gvisor.py): what the containment suite cannot see from inside.

Real sandboxes (runsc, as root); the pure parts (the OCI profile, the guest's argv) without.
The containment suite runs on gVisor too (tests/containment/_backends.py).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests._proc import Sampling
from tests._runsc import needs_runsc

from codecage import Options, Sandbox
from codecage.backends import gvisor
from codecage.backends.base import LaunchSpec, load_backend
from codecage.errors import HostError
from codecage.isolation import identity, seccomp

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    with Sandbox(
        backend="gvisor", pool=False, options=Options(import_policy=False, scrub=False)
    ) as sb:
        yield sb


# --- pure -------------------------------------------------------------------------------


def test_the_oci_profile_carries_every_rule_of_the_plan() -> None:
    profile = seccomp.oci_profile(seccomp.plan(network=False))
    assert profile["defaultAction"] == "SCMP_ACT_ALLOW"
    names = [entry["names"][0] for entry in profile["syscalls"]]
    for name in ("ptrace", "mount", "unshare", "bpf", "keyctl", "io_uring_setup"):
        assert name in names
    clone3 = next(e for e in profile["syscalls"] if e["names"] == ["clone3"])
    assert clone3["errnoRet"] == errno.ENOSYS
    # S_ISUID on chmod: libseccomp's MASKED_EQ takes the mask in value, the datum in valueTwo.
    chmod = [e for e in profile["syscalls"] if e["names"] == ["chmod"]]
    assert {"index": 1, "op": "SCMP_CMP_MASKED_EQ", "value": 0o4000, "valueTwo": 0o4000} in [
        e["args"][0] for e in chmod
    ]
    sockets = [e for e in profile["syscalls"] if e["names"] == ["socket"]]
    assert sockets == [
        {
            "names": ["socket"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": errno.EPERM,
            "args": [{"index": 0, "op": "SCMP_CMP_NE", "value": 1, "valueTwo": 0}],
        }
    ]


def test_the_guest_is_told_where_its_channels_are_instead_of_fd_numbers() -> None:
    argv = ("/opt/python/bin/python3", "-I", "boot.pyc", "--control-fd", "9", "--bridge-fd", "11")
    assert gvisor._guest_argv((*argv, "--pooled")) == (
        "/opt/python/bin/python3",
        "-I",
        "boot.pyc",
        "--fds-from",
        f"{gvisor.HANDOFF_DIR}/channels.sock",
        "--pooled",
    )


def test_a_missing_runsc_is_a_host_error_naming_the_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gvisor.shutil, "which", lambda _name: None)
    monkeypatch.setattr(gvisor.os, "access", lambda _path, _mode: False)
    with pytest.raises(HostError) as caught:
        load_backend("gvisor")
    assert "apt-get install runsc" in (caught.value.hint or "")


# --- real sandboxes ---------------------------------------------------------------------


@needs_runsc
def test_a_run_has_the_guest_and_its_channels(sandbox: Sandbox) -> None:
    r = sandbox.run(
        "import os\nprint(os.getuid(), sorted(os.listdir('/opt/codecage-channels')))\n6 * 7"
    )
    assert (r.status, r.return_value, r.backend) == ("ok", 42, "gvisor")
    # The handover socket is gone before the code runs: nothing left to connect to. Rootless
    # runsc (as root: the sandbox's host id) has its gofer show that id's files as uid 0 of
    # the Sentry: the code is 0 there, with no capability (the test below), and its files
    # are the sandbox's host id's on the host.
    expected = 0 if os.geteuid() == 0 else identity.plan().identity.uid
    assert r.stdout == f"{expected} []\n"


@needs_runsc
def test_runsc_its_gofer_and_the_sentry_run_as_the_sandboxs_host_id_never_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: runsc and its gofer ran as host root (the Sentry as 65534). Now every host
    process of a gVisor sandbox is the sandbox's own unprivileged id (`runsc --rootless`),
    seen on the host while the code runs, and the code has no capability in the Sentry.
    The code waits for the host's word (a file in its lent workspace): no timing."""
    bundles: list[gvisor._Bundle] = []
    ids: list[int] = []  # the run's own host id (one per run, leased from the range)
    write = gvisor._Bundle.write

    def recording_write(spec: LaunchSpec) -> gvisor._Bundle:
        bundle = write(spec)
        bundles.append(bundle)
        ids.append(spec.identity.uid if spec.identity is not None else -1)
        return bundle

    monkeypatch.setattr(gvisor._Bundle, "write", staticmethod(recording_write))
    lent = tmp_path / "lent"
    lent.mkdir()
    code = (
        "import os, time\n"
        "open('ready', 'w').close()\n"
        "deadline = time.monotonic() + 60\n"
        "while not os.path.exists('go') and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "[l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff', 'CapBnd'))]"
    )
    seen: dict[int, tuple[int, ...]] = {}

    def watch() -> None:
        deadline = time.monotonic() + 60
        while not (lent / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        for bundle in bundles:
            pids = gvisor._with_descendants(bundle.sandbox_pids())
            for pid in {*pids, *_processes_naming(bundle.container_id)}:
                seen[pid] = _uids(pid)
        (lent / "go").touch()

    watcher = threading.Thread(target=watch)
    watcher.start()
    with Sandbox(
        backend="gvisor", pool=False, options=Options(import_policy=False, scrub=False)
    ) as sb:
        r = sb.run(code, workspace=lent)
    watcher.join()
    assert r.status == "ok", r
    assert r.return_value == ["0000000000000000", "0000000000000000"]
    assert len(seen) >= 3, seen  # runsc, the gofer, the Sentry (and its stubs)
    if os.geteuid() == 0:
        assert len(ids) == 1 and ids[0] > 0, ids
        assert {uids for uids in seen.values() if uids} == {(ids[0],) * 4}, seen


def _uids(pid: int) -> tuple[int, ...]:
    """The real, effective, saved and filesystem uids of `pid` (empty: it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text("ascii", errors="replace")
    except OSError:
        return ()
    line = next(line for line in status.splitlines() if line.startswith("Uid:"))
    return tuple(int(v) for v in line.split()[1:])


@needs_runsc
def test_the_probe_names_the_user_space_kernel_and_its_platform() -> None:
    layers = {layer.name: layer for layer in load_backend("gvisor").probe()}
    kernel = layers["user-space kernel"]
    assert kernel.active, kernel.detail
    assert "platform ptrace" in kernel.mechanism
    assert layers["network"].active


class _Recorder(Sampling):
    """The bundles the backend writes, and every host process of their sandboxes seen
    while they ran (the Sentry, the gofer, the Sentry's stubs)."""

    def __init__(self) -> None:
        super().__init__(interval=0.05)
        self.bundles: list[gvisor._Bundle] = []
        self.pids: set[int] = set()

    def sample(self) -> None:
        for bundle in list(self.bundles):
            self.pids.update(gvisor._with_descendants(bundle.sandbox_pids()))


@needs_runsc
def test_nothing_of_a_sandbox_is_left_after_a_timeout(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = _Recorder()
    write = gvisor._Bundle.write

    def recording_write(spec: LaunchSpec) -> gvisor._Bundle:
        bundle = write(spec)
        recorder.bundles.append(bundle)
        return bundle

    monkeypatch.setattr(gvisor._Bundle, "write", staticmethod(recording_write))
    code = "import os\nfor _ in range(3):\n    os.fork()\nwhile True:\n    pass\n"
    with recorder:
        r = sandbox.run(code, limits={"timeout": 2})
    assert r.status == "timeout"
    (bundle,) = recorder.bundles
    assert len(recorder.pids) >= 3  # the Sentry, the gofer, stubs: they were seen
    assert [p for p in recorder.pids if gvisor._running(p)] == []
    for word in (bundle.container_id, str(bundle.dir)):
        assert _processes_naming(word) == []
    assert not bundle.dir.exists()
    assert str(bundle.dir.parent) not in Path("/proc/self/mountinfo").read_text()


def _processes_naming(word: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if word.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@needs_runsc
def test_a_setuid_chmod_in_the_workspace_is_refused_by_the_sentry(sandbox: Sandbox) -> None:
    code = (
        "import errno, os\nopen('f', 'w').close()\n"
        "try:\n    os.chmod('f', 0o4755)\n    got = 'changed'\n"
        "except OSError as e:\n    got = errno.errorcode[e.errno]\ngot\n"
    )
    assert sandbox.run(code).return_value == "EPERM"


@needs_runsc
def test_the_warm_pool_runs_on_gvisor() -> None:
    with Sandbox(
        backend="gvisor", pool=True, options=Options(import_policy=False, scrub=False)
    ) as sb:
        sb.warm()
        results = [sb.run(f"{i} * 2") for i in range(3)]
    assert [(r.status, r.return_value) for r in results] == [("ok", 0), ("ok", 2), ("ok", 4)]


@needs_runsc
def test_the_codes_uid_has_a_name(sandbox: Sandbox) -> None:
    """gVisor maps no ids: /etc/passwd names the uid the code really has."""
    r = sandbox.run("import os, pwd\nprint(pwd.getpwuid(os.getuid()).pw_name)")
    assert (r.status, r.stdout) == ("ok", "sandbox\n"), r.error


def test_threads_start_and_clone3_still_answers_enosys(sandbox: Sandbox) -> None:
    """runsc answers an ERRNO rule with EPERM whatever errno it names: a clone3 rule made
    pthread_create fail (no thread, no numpy). Left to the Sentry, clone3 and openat2 are
    ENOSYS (not implemented there), so libc falls back to clone, which the rules check."""
    code = (
        "import ctypes, errno, threading\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "answers = []\n"
        "for number, args in ((435, (None, 0)), (437, (-100, b'/', None, 0))):\n"
        "    libc.syscall(number, *args)\n"
        "    answers.append(errno.errorcode[ctypes.get_errno()])\n"
        "started = []\n"
        "t = threading.Thread(target=lambda: started.append(1))\n"
        "t.start(); t.join()\n"
        "answers, started"
    )
    result = sandbox.run(code)
    assert result.status == "ok", result
    assert result.return_value == [["ENOSYS", "ENOSYS"], [1]]
