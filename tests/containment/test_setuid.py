"""No setuid or setgid file outlives a run in a workspace the user keeps.

The guest's uid (1000 inside) is the host uid that started bwrap: root, when codecage runs
as root. A file the guest made setuid in a `--workspace DIR` would then be a setuid-root
binary on the host once the run is over. Two layers stop it: the seccomp filter refuses
S_ISUID/S_ISGID in any mode (tests/test_seccomp.py), and the engine takes both bits off
the workspace after the run (`workspace.strip_privilege_bits`, tests/test_workspace.py).
Either is enough for these tests.

Each test runs twice: in a real sandbox with `tmp_path` mounted at /workspace, and in a
plain subprocess whose cwd is `tmp_path` (no isolation), where it is expected to fail.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from codecage import Sandbox

from ._support import WORKSPACE_RUNNERS, WorkspaceRunner, guest, report, workspace_runner

pytestmark = pytest.mark.timeout(60)

SETID = stat.S_ISUID | stat.S_ISGID

PLANT = """
import errno, json, os

answers = {}


def attempt(name, make):
    try:
        make()
    except OSError as exc:
        answers[name] = errno.errorcode.get(exc.errno, exc.errno)
    else:
        answers[name] = "ok"


with open("f", "w", encoding="utf-8") as f:
    f.write("#!/bin/sh\\n")
attempt("chmod", lambda: os.chmod("f", 0o4755))
attempt("open", lambda: os.close(os.open("g", os.O_CREAT | os.O_WRONLY, 0o6755)))
attempt("mkdir", lambda: os.mkdir("d", 0o2775))
os.makedirs("nested/deeper", exist_ok=True)
attempt("nested_chmod", lambda: os.chmod("nested/deeper", 0o2755))
attempt("fchmod", lambda: os.fchmod(os.open("f", os.O_RDONLY), 0o6755))
attempt("plain_chmod", lambda: os.chmod("f", 0o750))
print(json.dumps(answers))
"""


@pytest.fixture(params=WORKSPACE_RUNNERS)
def run_in_workspace(request: pytest.FixtureRequest, sandbox: Sandbox) -> WorkspaceRunner:
    return workspace_runner(request.param, sandbox, 20)


def setid_entries(root: Path) -> dict[str, str]:
    """Everything under `root` (itself included, symlinks not followed) with S_ISUID or
    S_ISGID, by relative path, with its mode as the host sees it."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in [".", *dirnames, *filenames]:
            path = Path(dirpath, name)
            mode = os.lstat(path).st_mode
            if mode & SETID:
                found[str(path.relative_to(root))] = oct(mode)
    return found


def test_no_setuid_or_setgid_file_is_left_in_the_workspace(
    run_in_workspace: WorkspaceRunner, tmp_path: Path
) -> None:
    seen = run_in_workspace(guest(PLANT), tmp_path)

    assert seen.status == "ok", seen.stderr
    assert (tmp_path / "f").is_file()  # the run really wrote here
    assert setid_entries(tmp_path) == {}


def test_the_guest_is_refused_setuid_and_setgid_and_carries_on(
    run_in_workspace: WorkspaceRunner, tmp_path: Path
) -> None:
    seen = run_in_workspace(guest(PLANT), tmp_path)

    assert report(seen) == {
        "chmod": "EPERM",
        "open": "EPERM",
        "mkdir": "EPERM",
        "nested_chmod": "EPERM",
        "fchmod": "EPERM",
        "plain_chmod": "ok",
    }
    assert stat.S_IMODE(os.lstat(tmp_path / "f").st_mode) == 0o750
