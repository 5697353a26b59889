"""Nothing a run writes in a lent directory is run by the host (isolation/lending.py).

Code in a real sandbox with a ``--workspace DIR`` tries, for every protected entry, to
write it, create in it, replace it (rename over), remove it (unlink, rmdir, rmtree) and
rename it away, then to create it again; the host's file must be unchanged and a missing
one must not exist afterwards. One sandbox run per backend and directory (every entry in
it), one test per entry.

Each test also runs on a plain subprocess whose cwd is the directory (no isolation), where
it must fail (a strict xfail). Landlock lends no directory: `test_landlock_lends_none`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from codecage import Sandbox
from codecage.errors import ConfigError
from codecage.isolation import lending

from ._support import WORKSPACE_RUNNERS, Outcome, WorkspaceRunner, guest, workspace_runner

pytestmark = pytest.mark.timeout(300)

NAMES = sorted(lending.PROTECTED)
DIR_NAMES = {
    *(".git", ".husky", ".githooks", ".venv", "venv", ".direnv", ".pip", ".config"),
    *(".local", ".ssh", ".vscode", ".idea", ".devcontainer", ".claude", ".cursor"),
    *(".hg", ".mise", ".gnupg", ".docker", ".kube", ".aws", ".ipython", ".jupyter"),
    *(".zed", ".gemini", ".codex", ".amazonq", ".roo", ".kiro", ".continue", ".windsurf"),
    *(".vim", ".emacs.d"),
}
"""The names made as directories on the host (the others as files)."""
HOST = "host's own\n"

ATTACK = """
import json, os, shutil

done = {}


def attempt(name, act):
    try:
        act()
    except Exception as exc:
        done[name] = type(exc).__name__
    else:
        done[name] = "ok"


def write(path, text="evil\\n"):
    with open(path, "w") as f:
        f.write(text)


for path in $targets:
    away = path + ".away"
    attempt(path + " write", lambda: write(path))
    attempt(path + " inner", lambda: write(os.path.join(path, "inner")))
    attempt(path + " new", lambda: write(os.path.join(path, "new")))
    attempt(path + " mkdir", lambda: os.makedirs(os.path.join(path, "sub"), exist_ok=True))
    write("swap")
    attempt(path + " replace", lambda: os.replace("swap", path))
    os.makedirs("swapdir", exist_ok=True)
    attempt(path + " replace_dir", lambda: os.rename("swapdir", path))
    attempt(path + " rename_away", lambda: os.rename(path, away))
    attempt(path + " unlink", lambda: os.unlink(path))
    attempt(path + " rmdir", lambda: os.rmdir(path))
    attempt(path + " rmtree", lambda: shutil.rmtree(path))
    attempt(path + " create_file", lambda: write(path))
    attempt(path + " create_dir", lambda: os.makedirs(os.path.join(path, "hooks")))
    attempt(path + " create_in", lambda: write(os.path.join(path, "hooks", "pre-commit")))
    attempt(path + " symlink", lambda: os.symlink("elsewhere", path))
print(json.dumps(done))
"""

# Below the top: found by the scan. Each is (path, kind) as made on the host.
NESTED = {
    "proj/.git": "dir",  # a nested repository
    "proj/tools/fsmon.sh": "file",  # its core.fsmonitor
    "proj/githooks": "missing",  # its core.hooksPath, not made yet
    "proj/scripts/clean.sh": "file",  # a later word of a filter's command (sh scripts/...)
    "proj/pager": "missing",  # a pager's program (pager.log), not made yet
    "proj/shared.inc": "file",  # a config the repository's config includes
    "proj/inc-tools": "missing",  # what that included config names (diff.external)
    "gitdirs/wt": "dir",  # what the .git file of a linked worktree points to
    "data/legacy.pth": "file",
    "deep/er/site-packages": "dir",
    "envs/env1": "dir",  # a virtualenv by its pyvenv.cfg, whatever its name
    "repos/store.git": "dir",  # a bare repository by its HEAD, objects/ and refs/
}


def _make_existing(root: Path) -> dict[str, str]:
    """Every protected name (and the nested ones) made on the host, with `HOST` content."""
    kinds: dict[str, str] = {}
    for name in NAMES:
        path = root / name
        if name in DIR_NAMES:
            path.mkdir()
            (path / "inner").write_text(HOST)
            kinds[name] = "dir"
        else:
            path.write_text(HOST)
            kinds[name] = "file"
    (root / "proj" / ".git").mkdir(parents=True)
    (root / "proj" / ".git" / "inner").write_text(HOST)
    (root / "proj" / ".git" / "config").write_text(
        "[core]\n\thooksPath = githooks\n\tfsmonitor = tools/fsmon.sh\n"
        '[filter "x"]\n\tclean = sh scripts/clean.sh\n[pager]\n\tlog = pager/less.sh\n'
        "[include]\n\tpath = ../shared.inc\n"
    )
    (root / "proj" / "shared.inc").write_text("[diff]\n\texternal = inc-tools/diff.sh\n")
    (root / "proj" / "scripts").mkdir()
    (root / "proj" / "scripts" / "clean.sh").write_text(HOST)
    (root / "proj" / "tools").mkdir()
    (root / "proj" / "tools" / "fsmon.sh").write_text(HOST)
    (root / "wt").mkdir()
    (root / "wt" / ".git").write_text("gitdir: ../gitdirs/wt\n")
    (root / "gitdirs" / "wt").mkdir(parents=True)
    (root / "gitdirs" / "wt" / "inner").write_text(HOST)
    (root / "data").mkdir()
    (root / "data" / "legacy.pth").write_text(HOST)
    (root / "deep" / "er" / "site-packages").mkdir(parents=True)
    (root / "deep" / "er" / "site-packages" / "inner").write_text(HOST)
    (root / "envs" / "env1").mkdir(parents=True)
    (root / "envs" / "env1" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (root / "envs" / "env1" / "inner").write_text(HOST)
    bare = root / "repos" / "store.git"
    for sub in ("objects", "refs", "hooks"):
        (bare / sub).mkdir(parents=True)
    (bare / "HEAD").write_text("ref: refs/heads/main\n")
    (bare / "inner").write_text(HOST)
    kinds.update(NESTED)
    kinds["wt/.git"] = "file"
    return kinds


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` (links not followed) with its content or kind."""
    seen: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath, name)
            rel = str(path.relative_to(root))
            if path.is_symlink():
                seen[rel] = "link"
            elif path.is_dir():
                seen[rel] = "dir"
            else:
                seen[rel] = path.read_text(errors="replace")
    return seen


_ATTACKED: dict[tuple[str, str], tuple[Path, dict[str, str], dict[str, str], Outcome]] = {}


@pytest.fixture(params=WORKSPACE_RUNNERS)
def attacked(
    request: pytest.FixtureRequest, sandbox: Sandbox, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Path, dict[str, str], dict[str, str], Outcome]]:
    """attacked(which) -> (directory, kinds made, snapshot before, outcome): `which` is
    "existing" (every entry made) or "missing" (none made); one run per backend each."""
    run = workspace_runner(request.param, sandbox, 120)
    label = request.param if request.param == "null" else f"{id(sandbox)}"

    def get(which: str) -> tuple[Path, dict[str, str], dict[str, str], Outcome]:
        key = (label, which)
        if key not in _ATTACKED:
            root = tmp_path_factory.mktemp(f"lent-{which}")
            kinds = _make_existing(root) if which == "existing" else dict.fromkeys(NAMES, "missing")
            before = _snapshot(root)
            targets = sorted(kinds)
            seen = run(guest(ATTACK, targets=targets), root)
            _ATTACKED[key] = (root, kinds, before, seen)
        return _ATTACKED[key]

    return get


def _changed_under(root: Path, rel: str, before: dict[str, str]) -> dict[str, tuple[str, str]]:
    """What differs at `rel` or below it (or its '.away' twin) from `before`."""
    after = _snapshot(root)
    mine = {rel, f"{rel}.away"}

    def ours(path: str) -> bool:
        return any(path == m or path.startswith(m + "/") for m in mine)

    keys = {k for k in (*before, *after) if ours(k)}
    return {
        k: (before.get(k, "-"), after.get(k, "-")) for k in keys if before.get(k) != after.get(k)
    }


@pytest.mark.parametrize("name", [*NAMES, *NESTED, "wt/.git"])
def test_an_existing_protected_entry_cannot_be_changed(
    attacked: Callable[[str], tuple[Path, dict[str, str], dict[str, str], Outcome]], name: str
) -> None:
    root, kinds, before, seen = attacked("existing")

    assert seen.status == "ok", seen.stderr[-2000:]
    assert _changed_under(root, name, before) == {}
    if kinds[name] == "missing":
        assert not os.path.lexists(root / name)


@pytest.mark.parametrize("name", NAMES)
def test_a_missing_protected_name_cannot_be_created(
    attacked: Callable[[str], tuple[Path, dict[str, str], dict[str, str], Outcome]], name: str
) -> None:
    root, _, _, seen = attacked("missing")

    assert seen.status == "ok", seen.stderr[-2000:]
    assert not os.path.lexists(root / name)
    assert not os.path.lexists(root / f"{name}.away")


PTH_ATTACK = """
import glob, json, os
site = glob.glob("proj/.venv/lib/python*/site-packages")[0]
other = glob.glob("proj/env2/lib/python*/site-packages")[0]
done = {}
for where in (site, other):
    try:
        with open(os.path.join(where, "zz_evil.pth"), "w") as f:
            f.write("import os; open($marker, 'w').write('ran')\\n")
        done[where] = "written"
    except OSError as exc:
        done[where] = exc.strerror
open("ok.txt", "w").write("data")  # the directory itself stays writable
print(json.dumps(done))
"""


@pytest.fixture(params=WORKSPACE_RUNNERS)
def run_in_workspace(request: pytest.FixtureRequest, sandbox: Sandbox) -> WorkspaceRunner:
    return workspace_runner(request.param, sandbox, 120)


def test_a_pth_file_written_into_a_virtualenv_in_the_workspace_never_reaches_the_host(
    run_in_workspace: WorkspaceRunner, tmp_path: Path
) -> None:
    """The original attack: a .pth in a virtualenv inside the lent directory, run by the
    host's next start of that Python."""
    lent = tmp_path / "lent"
    for env in ("proj/.venv", "proj/env2"):
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(lent / env)],
            check=True,
            capture_output=True,
        )
    marker = tmp_path / "ran"

    seen = run_in_workspace(guest(PTH_ATTACK, marker=str(marker)), lent)

    assert seen.status == "ok", seen.stderr[-2000:]
    assert (lent / "ok.txt").read_text() == "data"
    assert list(lent.glob("proj/*/lib/python*/site-packages/zz_evil.pth")) == []
    for env in ("proj/.venv", "proj/env2"):
        subprocess.run([str(lent / env / "bin" / "python"), "-c", "pass"], check=True)
    assert not marker.exists()


OUTER_ATTACK = """
import json, os
done = {}
for path in ("hooks/pre-commit", "tools/clean.sh"):
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("#!/bin/sh\\ntouch " + $marker + "\\n")
        done[path] = "written"
    except OSError as exc:
        done[path] = exc.strerror
print(json.dumps(done))
"""


def test_a_hook_named_by_the_repository_around_the_lent_directory_cannot_be_written(
    run_in_workspace: WorkspaceRunner, tmp_path: Path
) -> None:
    """The lent directory is a subdirectory of a repository whose config (outside it)
    names hooks and a filter's script inside it: the code wrote sub/hooks/pre-commit, and
    the operator's next commit in the repository ran it."""
    repo = tmp_path / "repo"
    lent = repo / "sub"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    for key, value in (
        ("core.hooksPath", "sub/hooks"),
        ("filter.x.clean", "sh sub/tools/clean.sh"),
    ):
        subprocess.run(["git", "-C", str(repo), "config", key, value], check=True)
    (lent / "tools").mkdir(parents=True)
    (lent / "tools" / "clean.sh").write_text(HOST)
    marker = tmp_path / "ran"

    seen = run_in_workspace(guest(OUTER_ATTACK, marker=str(marker)), lent)

    assert seen.status == "ok", seen.stderr[-2000:]
    assert not (lent / "hooks").exists()
    assert (lent / "tools" / "clean.sh").read_text() == HOST
    (repo / "f").write_text("x")
    subprocess.run(["git", "-C", str(repo), "add", "f"], check=True)
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"],
        check=False,
    )
    assert not marker.exists()


def test_landlock_lends_none(tmp_path: Path) -> None:
    """Landlock's rules only add access: it cannot keep anything inside a writable
    directory read-only, so it refuses to lend one (and nothing is made in it)."""
    from .conftest import sandbox_on

    sandbox = sandbox_on("landlock")
    with pytest.raises(ConfigError, match="cannot lend a directory") as raised:
        sandbox.run("open('x', 'w').write('x')", workspace=tmp_path)
    assert "workspace" in raised.value.hint
    assert list(tmp_path.iterdir()) == []
