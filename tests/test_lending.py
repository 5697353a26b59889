"""What a lent directory may never be, and what stays read-only in it
(codecage.isolation.lending): the refusals on every face, the scan, the plan, the
placeholders and the one-run-at-a-time hold. The containment itself, in real sandboxes, is
tests/containment/test_lent.py.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
from tests._cli import codecage as run_cli

import codecage
from codecage import ConfigError, Options, Sandbox
from codecage.engine.workspace import private_parent
from codecage.isolation import lending
from codecage.isolation.rootfs import Mount

CODECAGE = [sys.executable, "-m", "codecage.cli"]


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(backend="bwrap", pool=False, options=Options(import_policy=False))


# --- refused as a workspace ---------------------------------------------------------------


def scanned(root: Path) -> dict[str, str]:
    """What `lending.scan` of `root` found: each protected path and its kind."""
    return {e.path: e.kind for e in lending.scan(root).entries}


def lay_out(root: Path, files: dict[str, str]) -> None:
    """Writes each file under `root`, its directories made on the way."""
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_codecages_own_places_are_refused_as_a_workspace() -> None:
    """Checked without lending them (a regression must not hand /usr to a sandbox)."""
    places = lending.own_places(state=[private_parent()])
    for place in (
        Path(sys.prefix),
        Path(sys.base_prefix),
        Path(sys.executable).resolve().parent,
        Path(codecage.__file__).parent,
        Path(codecage.__file__).parent / "guest",  # inside it
        Path(codecage.__file__).parent.parent,  # holds it
        private_parent(),
    ):
        with pytest.raises(ConfigError) as raised:
            lending.check(place, places)
        assert "codecage" in str(raised.value), place
        assert "--workspace" in raised.value.hint_for("cli")
        assert "workspace=" not in raised.value.hint_for("cli")


def test_the_library_refuses_codecages_own_virtualenv_before_touching_it(
    sandbox: Sandbox,
) -> None:
    before = os.stat(sys.prefix).st_ctime_ns
    with pytest.raises(ConfigError, match="codecage's virtualenv") as raised:
        sandbox.run("1", workspace=sys.prefix)
    assert "workspace" in raised.value.hint
    assert os.stat(sys.prefix).st_ctime_ns == before  # never given to the sandbox's id


def test_a_link_to_codecages_virtualenv_is_refused_by_its_real_path(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    link = tmp_path / "innocent"
    link.symlink_to(Path(sys.prefix))
    with pytest.raises(ConfigError, match="virtualenv"):
        sandbox.run("1", workspace=link)


def test_a_directory_that_holds_the_user_site_packages_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user_site = tmp_path / "home" / ".local" / "lib" / "site-packages"
    user_site.mkdir(parents=True)
    monkeypatch.setattr(site, "getusersitepackages", lambda: str(user_site))
    with pytest.raises(ConfigError, match="user site-packages") as raised:
        lending.check(tmp_path / "home", lending.own_places())
    assert "holds" in str(raised.value)


@pytest.mark.parametrize(
    ("kind", "argument"),
    [("state", "state"), ("config", "config"), ("packages", "packages")],
)
def test_state_config_and_packages_directories_are_refused_both_ways(
    tmp_path: Path, kind: str, argument: str
) -> None:
    place = tmp_path / "p" / "codecage"
    place.mkdir(parents=True)
    places = lending.own_places(**{argument: [place]})
    for workspace in (place, tmp_path / "p", place / "inner"):
        workspace.mkdir(exist_ok=True)
        with pytest.raises(ConfigError, match=kind) as raised:
            lending.check(workspace, places)
        assert str(place) in str(raised.value)
    (tmp_path / "apart").mkdir()
    assert lending.check(tmp_path / "apart", places) == (tmp_path / "apart").resolve()


def test_the_config_directory_in_use_is_refused_through_a_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """XDG_CONFIG_HOME/codecage is where the user's config is read from, even before one
    exists; a workspace inside it is refused (config.check_workspace refuses one holding it)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    inside = tmp_path / "xdg" / "codecage" / "ws"
    inside.mkdir(parents=True)
    with pytest.raises(ConfigError, match="configuration") as raised:
        Sandbox(backend="bwrap", pool=False).run("1", workspace=inside)
    assert "lies inside" in str(raised.value)


def test_a_virtualenv_or_a_site_packages_directory_is_refused(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    env = tmp_path / "env"
    (env / "lib" / "site-packages" / "pkg").mkdir(parents=True)
    (env / "pyvenv.cfg").write_text("home = /usr/bin\n")
    for workspace in (env, env / "lib", env / "lib" / "site-packages" / "pkg"):
        with pytest.raises(ConfigError, match=r"virtualenv|site-packages"):
            sandbox.run("1", workspace=workspace)
    dist = tmp_path / "usr" / "dist-packages"
    dist.mkdir(parents=True)
    with pytest.raises(ConfigError, match="site-packages directory"):
        sandbox.run("1", workspace=dist)


@pytest.mark.parametrize(
    "inside", [".git", ".git/hooks", "home/.ssh", "home/.config/git", "proj/.vscode", "bare.git"]
)
def test_a_directory_the_host_runs_from_as_a_whole_is_refused(
    sandbox: Sandbox, tmp_path: Path, inside: str
) -> None:
    """A repository's .git (or a bare repository), ~/.ssh, ~/.config: the read-only list
    inside the lent directory names none of what is run there (hooks/pre-commit, config,
    authorized_keys); lent, the code wrote .git/hooks/pre-commit. Refused before the run."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "init", "-q", "--bare", str(tmp_path / "bare.git")], check=True)
    workspace = tmp_path / inside
    workspace.mkdir(parents=True, exist_ok=True)
    before = sorted(p.name for p in workspace.iterdir())
    with pytest.raises(ConfigError, match="the host would run what the code writes") as raised:
        sandbox.run("open('pre-commit', 'w').write('evil')", workspace=workspace)
    assert "workspace" in raised.value.hint
    assert sorted(p.name for p in workspace.iterdir()) == before


@pytest.mark.parametrize("place", ["/etc/cron.d", "/usr/local/bin", "/var/spool/cron"])
def test_a_system_directory_or_one_on_path_is_refused(place: str) -> None:
    """Checked without lending them (a regression must not hand /etc to a sandbox)."""
    with pytest.raises(ConfigError, match=r"system directory|on PATH"):
        lending.check(place, ())


def test_a_directory_on_this_processs_path_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}/usr/bin")
    with pytest.raises(ConfigError, match="on PATH"):
        lending.check(tmp_path / "bin", ())


@pytest.mark.skipif(os.geteuid() != 0, reason="a bind mount needs root")
def test_a_place_of_codecage_reached_through_a_bind_mount_is_refused(tmp_path: Path) -> None:
    """The state directory bound elsewhere: its path is not codecage's, its inode is."""
    state = tmp_path / "state"
    (state / "ids").mkdir(parents=True)
    alias = tmp_path / "alias"
    alias.mkdir()
    places = (lending.Place(state, "codecage's state directory"),)
    subprocess.run(["mount", "--bind", str(state), str(alias)], check=True)
    try:
        for workspace in (alias, alias / "ids"):
            with pytest.raises(ConfigError, match="by another path, codecage's state"):
                lending.check(workspace, places)
    finally:
        subprocess.run(["umount", str(alias)], check=True)


def test_the_cli_refuses_codecages_own_virtualenv_in_its_own_terms(tmp_path: Path) -> None:
    run = run_cli(
        "run", "--workspace", sys.prefix, "--code", "1", cwd=tmp_path, timeout=300, command=CODECAGE
    )
    assert run.returncode == 2, run.stderr
    assert "codecage's virtualenv" in run.stderr
    assert "--workspace" in run.stderr  # the hint, worded for the CLI


def test_the_current_directory_is_refused_when_python_imports_from_it(tmp_path: Path) -> None:
    """`python -m` puts the current directory first on sys.path: a run lent it could plant
    a `codecage/` package that the next `python -m codecage` there imports, as root."""
    run = run_cli(
        "run", "--workspace", ".", "--code", "1", cwd=tmp_path, timeout=300, command=CODECAGE
    )
    assert run.returncode == 2, run.stderr
    assert "imports from (sys.path)" in run.stderr


def test_a_link_at_a_protected_name_is_refused_and_nothing_is_changed(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    (tmp_path / "notes").write_text("x")
    (tmp_path / ".bashrc").symlink_to("notes")
    (tmp_path / "tool").write_text("x")
    (tmp_path / "tool").chmod(0o2755)  # the operator's own setgid bit
    before = {p.name: os.lstat(p).st_ctime_ns for p in tmp_path.iterdir()}
    with pytest.raises(ConfigError, match="symbolic link"):
        sandbox.run("1", workspace=tmp_path)
    assert {p.name: os.lstat(p).st_ctime_ns for p in tmp_path.iterdir()} == before
    assert (tmp_path / "tool").stat().st_mode & 0o7777 == 0o2755


def test_a_hard_linked_protected_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.pth").write_text("x")
    os.link(tmp_path / "data" / "x.pth", tmp_path / "other")
    with pytest.raises(ConfigError, match="hard links"):
        lending.scan(tmp_path)


# --- the scan -------------------------------------------------------------------------------


def test_the_scan_protects_every_name_at_the_top_found_or_not(tmp_path: Path) -> None:
    (tmp_path / ".git").mkdir()
    found = scanned(tmp_path)
    assert set(lending.PROTECTED) <= set(found)
    assert found[".git"] == "dir"
    assert found[".bashrc"] == "missing"


def test_the_scan_finds_nested_repositories_venvs_and_pth_files(tmp_path: Path) -> None:
    config = (
        "[core]\n\tfsmonitor = scripts/fsmon\n\thooksPath = hooks-here\n"
        '[remote "origin"]\n\turl = https://example.invalid/x.git\n'
        '[alias]\n\tco = "!./bin/co.sh --x"\n'
    )
    lay_out(
        tmp_path,
        {"a/b/.git/config": config, "a/b/scripts/fsmon": "x", "e1/pyvenv.cfg": "", "x.pth": ""},
    )
    found = scanned(tmp_path)
    expected = {
        "a/b/.git": "dir",
        "a/b/scripts/fsmon": "file",
        "a/b/hooks-here": "missing",
        "a/b/bin": "missing",  # the first missing step of ./bin/co.sh
        "e1": "dir",
        "x.pth": "file",
    }
    assert {path: found.get(path) for path in expected} == expected
    assert not any(p.startswith(("a/b/https", "https")) for p in found)  # a URL is no path


def test_every_path_a_git_command_names_is_protected_not_only_its_first_word(
    tmp_path: Path,
) -> None:
    """git hands a filter, driver, alias or pager to the shell: ``sh scripts/clean.sh``
    runs scripts/clean.sh, which the scan once left writable (it looked at the first word,
    found on PATH). Also the keys it did not know (diff.external, merge drivers, pagers)."""
    config = (
        '[filter "x"]\n\tclean = sh scripts/clean.sh %f\n'
        '[alias]\n\tst = "!python3 st.py && true"\n'
        "[diff]\n\texternal = tools/diff.sh\n"
        '[merge "m"]\n\tdriver = tools/merge.sh %O %A %B\n'
        "[pager]\n\tlog = tools/pager.sh\n"
        "[core]\n\tgitProxy = proxy/run\n"
    )
    lay_out(tmp_path, {".git/config": config, "scripts/clean.sh": "cat\n", "st.py": "print(1)\n"})
    found = scanned(tmp_path)
    expected = {
        "scripts/clean.sh": "file",
        "st.py": "file",
        "tools": "missing",  # diff.sh, merge.sh, pager.sh: its first missing step
        "proxy": "missing",
    }
    assert {path: found.get(path) for path in expected} == expected
    assert "%f" not in found and "true" not in found  # arguments that name no file


def test_what_an_included_git_config_names_is_protected_too(tmp_path: Path) -> None:
    """A project's shared settings: ``include.path = ../.gitconfig`` in .git/config, and
    that file (protected) names ``core.hooksPath = tools/hooks``: the hooks directory was
    writable, and git ran the hooks the code put there."""
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("[include]\n\tpath = ../.gitconfig\n")
    (tmp_path / ".gitconfig").write_text("[include]\n\tpath = conf/more.inc\n")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "more.inc").write_text(
        "[core]\n\thooksPath = tools/hooks\n[include]\n\tpath = ../.gitconfig\n"
    )
    (tmp_path / "tools" / "hooks").mkdir(parents=True)
    assert scanned(tmp_path).items() >= {"conf/more.inc": "file", "tools/hooks": "dir"}.items()


def test_a_git_config_outside_the_lent_directory_protects_what_it_names_inside(
    tmp_path: Path,
) -> None:
    """Lending a subdirectory of a repository whose core.hooksPath (or filter) lies in it:
    git, run anywhere in the repository, runs the hooks the code wrote there."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(
        ["git", "-C", str(tmp_path), "config", "core.hooksPath", "sub/hooks"], check=True
    )
    subprocess.run(
        ["git", "-C", str(tmp_path), "config", "filter.x.clean", "sh sub/tools/c.sh"], check=True
    )
    (tmp_path / "sub" / "tools").mkdir(parents=True)
    (tmp_path / "sub" / "tools" / "c.sh").write_text("cat\n")
    found = {e.path: e.kind for e in lending.scan(tmp_path / "sub").entries}
    assert found["hooks"] == "missing"
    assert found["tools/c.sh"] == "file"
    subprocess.run(["git", "-C", str(tmp_path), "config", "core.hooksPath", "sub"], check=True)
    with pytest.raises(ConfigError, match="names as hooksPath"):
        lending.scan(tmp_path / "sub")


def test_a_git_file_protects_the_git_directory_it_points_to(tmp_path: Path) -> None:
    (tmp_path / "wt").mkdir()
    (tmp_path / "wt" / ".git").write_text("gitdir: ../store/wt\n")
    (tmp_path / "store" / "wt").mkdir(parents=True)
    (tmp_path / "store" / "wt" / "config").write_text("[core]\n\thooksPath = ../../h\n")
    assert scanned(tmp_path).items() >= {"wt/.git": "file", "store/wt": "dir"}.items()


def test_a_bare_repository_and_a_linked_worktrees_common_directory_are_protected(
    tmp_path: Path,
) -> None:
    """The bare repository + linked worktrees layout: the hooks and config git runs at a
    worktree's commit are in the bare repository (the worktree's `commondir`), which no
    name gives away; lent, the code wrote store.git/hooks/pre-commit. The common directory
    is found through the worktree's .git file even past the scan's depth."""
    source = tmp_path / "source"
    subprocess.run(["git", "init", "-q", str(source)], check=True)
    author = ("-c", "user.name=t", "-c", "user.email=t@t")
    subprocess.run(
        ["git", "-C", str(source), *author, "commit", "-q", "--allow-empty", "-m", "x"], check=True
    )
    lent = tmp_path / "lent"
    deep = "a/b/c/d/e/store.git"
    for store in ("store.git", deep):
        subprocess.run(["git", "clone", "-q", "--bare", str(source), str(lent / store)], check=True)
    subprocess.run(
        ["git", "-C", str(lent / "store.git"), "worktree", "add", "-q", "../wt"], check=True
    )
    subprocess.run(
        ["git", "-C", str(lent / deep), "worktree", "add", "-q", str(lent / "wt2")], check=True
    )
    found = {e.path: e.kind for e in lending.scan(lent).entries}
    assert found["store.git"] == "dir"
    assert found[deep] == "dir"
    assert found["wt2/.git"] == "file"


def test_the_scan_is_bounded_in_depth(tmp_path: Path) -> None:
    deep = tmp_path.joinpath(*["d"] * (lending.MAX_SCAN_DEPTH + 1))
    (deep / ".git").mkdir(parents=True)
    shallow = tmp_path.joinpath(*["d"] * (lending.MAX_SCAN_DEPTH - 1))
    found = {e.path for e in lending.scan(tmp_path).entries}
    assert f"{'/'.join(['d'] * (lending.MAX_SCAN_DEPTH + 1))}/.git" not in found
    (shallow / ".vscode").mkdir()
    found = {e.path for e in lending.scan(tmp_path).entries}
    assert f"{'/'.join(['d'] * (lending.MAX_SCAN_DEPTH - 1))}/.vscode" in found


# --- the plan -------------------------------------------------------------------------------


def test_the_plan_pins_the_way_and_covers_each_entry_read_only_shallow_first() -> None:
    found = lending.Found(
        entries=(
            lending.Entry(".bashrc", "missing", ""),
            lending.Entry("a/b/.git", "dir", ""),
            lending.Entry("x.pth", "file", ""),
        )
    )
    assert lending.plan(found, source="/src", dest="/workspace", empty_dir="/run/e") == (
        Mount("ro-bind", "/workspace/.bashrc", "/run/e"),
        Mount("bind", "/workspace/a", "/src/a"),
        Mount("ro-bind", "/workspace/x.pth", "/src/x.pth"),
        Mount("bind", "/workspace/a/b", "/src/a/b"),
        Mount("ro-bind", "/workspace/a/b/.git", "/src/a/b/.git"),
    )


# --- placeholders and the hold ------------------------------------------------------------


def test_placeholders_are_made_and_only_they_are_removed(tmp_path: Path) -> None:
    found = lending.Found(
        entries=(lending.Entry(".envrc", "missing", ""), lending.Entry(".venv", "missing", ""))
    )
    made = lending.make_placeholders(tmp_path, found)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".envrc", ".venv"]
    (tmp_path / ".venv").chmod(0o755)
    os.rmdir(tmp_path / ".venv")
    (tmp_path / ".venv").mkdir()  # someone else's now (maybe the same inode): not emptied
    (tmp_path / ".venv" / "theirs").write_text("x")
    lending.remove_placeholders(tmp_path, made)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".venv"]
    assert (tmp_path / ".venv" / "theirs").read_text() == "x"


def test_a_directory_is_lent_to_one_run_at_a_time(tmp_path: Path) -> None:
    first = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    second = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        lending.hold(first, tmp_path)
        with pytest.raises(ConfigError, match="lent to another run"):
            lending.hold(second, tmp_path)
        os.close(first)
        first = -1
        lending.hold(second, tmp_path)
    finally:
        for fd in (first, second):
            if fd >= 0:
                os.close(fd)


def test_a_lent_run_leaves_no_placeholder_and_lists_none(sandbox: Sandbox, tmp_path: Path) -> None:
    result = sandbox.run(
        "import os; open('out.txt', 'w').write('x'); sorted(os.listdir('.'))",
        workspace=tmp_path,
    )
    assert result.status == "ok", result.stderr
    assert ".bashrc" in result.return_value  # the code saw the read-only cover
    assert [f.path for f in result.files] == ["out.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]
