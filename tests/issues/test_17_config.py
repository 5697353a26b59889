"""Issue 17, item 1: configuration comes only from places the operator controls.

A `codecage.toml` in the current directory used to be loaded silently: its [mcpServers]
command ran on the host before any code, and code run with `--workspace .` could write it
for the next run. Each test here plants such a command (one that touches a marker file)
where an attacker could, and checks that nothing starts it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests._cli import codecage

from codecage import ConfigError, Sandbox
from codecage.config import candidate_paths, load

# -P: as the installed `codecage` script runs, without the current directory on sys.path
# (with it there, `--workspace .` is refused: code could plant modules that the next
# `python -m` imports; tests/test_lending.py).
CODECAGE = [sys.executable, "-P", "-m", "codecage.cli"]


def evil_config(marker: Path) -> str:
    """A config whose upstream "server" is a host command that touches `marker`."""
    return f"""
[limits]
timeout = 7

[scrub]
enabled = false

[mcpServers.evil]
command = "/bin/sh"
args = ["-c", "touch {marker}"]
"""


def cli(
    *args: str, cwd: Path, env: dict[str, str], stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    return codecage(*args, stdin=stdin, cwd=cwd, env=env, command=CODECAGE)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """An untrusted project directory (the working directory of the commands)."""
    directory = tmp_path / "project"
    directory.mkdir()
    return directory


def test_run_and_serve_do_not_load_a_codecage_toml_in_the_current_directory(
    project: Path, tmp_path: Path, clean_env: dict[str, str]
) -> None:
    marker = tmp_path / "host-command-ran"
    (project / "codecage.toml").write_text(evil_config(marker), encoding="utf-8")
    run = cli("run", "--json", "--code", "print(1)", cwd=project, env=clean_env)
    assert not marker.exists(), "run started the [mcpServers] command of ./codecage.toml"
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["limits"]["timeout"] != 7
    # serve (stdio; stdin at EOF, so it stops after start-up) logs the config in force.
    serve = cli("serve", "--no-pool", cwd=project, env=clean_env)
    assert not marker.exists(), "serve started the [mcpServers] command of ./codecage.toml"
    start = [line for line in serve.stderr.splitlines() if "server.start" in line]
    assert len(start) == 1, serve.stderr
    assert 'config_file=null config_origin="none"' in start[0]


def test_a_sandbox_does_not_load_a_codecage_toml_in_the_current_directory(
    project: Path, tmp_path: Path, clean_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (project / "codecage.toml").write_text(evil_config(tmp_path / "m"), encoding="utf-8")
    monkeypatch.chdir(project)
    with Sandbox(pool=False) as sandbox:
        assert sandbox.host.settings.config_file is None
        assert sandbox.host.settings.mcp_servers == {}
        assert sandbox.host.scrub_settings.enabled
        assert sandbox.run("1").limits.timeout != 7
    assert load().config_file is None


def test_code_that_writes_codecage_toml_into_its_workspace_does_not_configure_the_next_run(
    project: Path, tmp_path: Path, clean_env: dict[str, str]
) -> None:
    marker = tmp_path / "host-command-ran"
    plant = f"open('/workspace/codecage.toml', 'w').write({evil_config(marker)!r})"
    first = cli("run", "--json", "--workspace", ".", "--code", plant, cwd=project, env=clean_env)
    assert first.returncode == 0, first.stderr
    assert (project / "codecage.toml").is_file()  # the code did write it
    for args in (["--code", "print(1)"], ["--workspace", ".", "--code", "print(1)"]):
        again = cli("run", "--json", *args, cwd=project, env=clean_env)
        assert not marker.exists(), "a file the code wrote ran a command on the host"
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["limits"]["timeout"] != 7


@pytest.mark.parametrize(
    ("mode", "owner", "reason"),
    [
        (0o664, None, "writable by group"),
        (0o646, None, "writable by others"),
        (0o644, 65534, "owned by uid 65534"),
    ],
    ids=["group-writable", "world-writable", "owned-by-another-user"],
)
def test_a_config_file_that_someone_else_can_change_is_refused(
    tmp_path: Path, clean_env: dict[str, str], mode: int, owner: int | None, reason: str
) -> None:
    if owner is not None and os.geteuid() != 0:
        pytest.skip("making a file another user's needs root")
    path = tmp_path / "xdg" / "codecage" / "config.toml"
    path.parent.mkdir()
    path.write_text("[limits]\ntimeout = 7\n", encoding="utf-8")
    path.chmod(mode)
    if owner is not None:
        os.chown(path, owner, -1)
    # Given explicitly, through CODECAGE_CONFIG, or found in the user's directory: the same.
    for explicit, environ in ((path, {}), (None, {"CODECAGE_CONFIG": str(path)}), (None, None)):
        with pytest.raises(ConfigError) as info:
            load(explicit, environ=environ)
        assert str(path) in str(info.value) and reason in str(info.value)
        assert "chmod go-w" in info.value.hint
    with pytest.raises(ConfigError, match=reason):
        Sandbox(config=path)


def test_a_config_file_in_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    path = shared / "config.toml"
    path.write_text("[limits]\ntimeout = 7\n", encoding="utf-8")
    shared.chmod(0o775)  # anyone in the group could replace the file
    with pytest.raises(ConfigError, match=f"the directory {shared} is writable by group"):
        load(path, environ={})
    shared.chmod(0o1777)  # sticky, as /tmp: others cannot replace a file they do not own
    assert load(path, environ={}).limits.timeout == 7
    link = shared / "link.toml"
    link.symlink_to(path)
    if os.geteuid() == 0:  # a link another user planted in a sticky directory
        os.chown(link, 65534, -1, follow_symlinks=False)
        with pytest.raises(ConfigError, match="link owned by uid 65534"):
            load(link, environ={})


def test_a_symbolic_link_to_a_trusted_file_is_followed(tmp_path: Path) -> None:
    target = tmp_path / "real" / "config.toml"
    target.parent.mkdir()
    target.write_text("[limits]\ntimeout = 7\n", encoding="utf-8")
    (tmp_path / "user").mkdir()
    link = tmp_path / "user" / "config.toml"
    link.symlink_to("../real/config.toml")
    settings = load(link, environ={})
    assert settings.limits.timeout == 7
    assert target in settings.config_lookups and settings.config_file == link


def test_a_config_file_inside_the_workspace_is_refused_before_anything_starts(
    project: Path, tmp_path: Path, clean_env: dict[str, str]
) -> None:
    marker = tmp_path / "host-command-ran"
    config = project / "conf" / "config.toml"
    config.parent.mkdir()
    config.write_text(evil_config(marker), encoding="utf-8")
    env = {**clean_env, "CODECAGE_CONFIG": str(config)}
    run = cli("run", "--workspace", str(project), "--code", "print(1)", cwd=tmp_path, env=env)
    assert run.returncode == 2, run.stderr
    assert f"the workspace {project} contains the config file in use" in run.stderr
    assert not marker.exists()
    with pytest.raises(ConfigError, match="contains the config file in use"):
        Sandbox(config=config, pool=False).run("1", workspace=project)
    # A link in the workspace that points to a file outside it: the code could re-point it.
    outside = tmp_path / "outside.toml"
    outside.write_text("", encoding="utf-8")
    (project / "link.toml").symlink_to(outside)
    with pytest.raises(ConfigError, match="contains the config file in use"):
        Sandbox(config=project / "link.toml", pool=False).run("1", workspace=project)


def test_a_workspace_that_holds_a_place_config_is_searched_is_refused(
    tmp_path: Path, clean_env: dict[str, str]
) -> None:
    # No config file exists yet: a run with its workspace around XDG_CONFIG_HOME could
    # write the user's config for every later run.
    with Sandbox(pool=False) as sandbox, pytest.raises(ConfigError) as info:
        sandbox.run("1", workspace=tmp_path)
    assert str(tmp_path / "xdg" / "codecage" / "config.toml") in str(info.value)
    elsewhere = tmp_path / "xdg" / "ws"
    elsewhere.mkdir()
    mcp_inside = elsewhere / "mcp.json"
    mcp_inside.write_text('{"mcpServers": {}}', encoding="utf-8")
    run = cli(
        "run", "--workspace", str(elsewhere), "--mcp-config", str(mcp_inside),
        "--code", "1", cwd=tmp_path, env=clean_env,
    )  # fmt: skip
    assert run.returncode == 2 and "contains the --mcp-config file" in run.stderr, run.stderr


def test_info_and_verbose_logging_show_the_config_file_and_where_it_came_from(
    tmp_path: Path, clean_env: dict[str, str]
) -> None:
    user = tmp_path / "xdg" / "codecage" / "config.toml"
    user.parent.mkdir()
    user.write_text("[limits]\ntimeout = 7\n", encoding="utf-8")
    explicit = tmp_path / "explicit.toml"
    explicit.write_text("", encoding="utf-8")
    cases = [([], clean_env, user, "user"),
             (["--config", str(explicit)], clean_env, explicit, "argument"),
             ([], {**clean_env, "CODECAGE_CONFIG": str(explicit)}, explicit, "env")]  # fmt: skip
    for args, env, path, origin in cases:
        report = json.loads(cli("info", "--json", *args, cwd=tmp_path, env=env).stdout)
        assert (report["config_file"], report["config_origin"]) == (str(path), origin)
    human = cli("info", cwd=tmp_path, env=clean_env)
    assert f"config file: {user} (from the user's config directory)" in human.stdout
    verbose = cli("validate", "-v", "--code", "1", cwd=tmp_path, env=clean_env)
    assert f'INFO codecage.cli config.file path="{user}" origin="user"' in verbose.stderr


def test_a_relative_xdg_config_home_does_not_bring_the_current_directory_back(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (project / "codecage").mkdir()
    (project / "codecage" / "config.toml").write_text("[limits]\ntimeout = 7\n")
    monkeypatch.chdir(project)
    # The XDG spec: a relative value is invalid and ignored (the default ~/.config is used).
    searched = [path for _, path in candidate_paths({"XDG_CONFIG_HOME": "."})]
    assert all(path.is_absolute() for path in searched)
    assert project / "codecage" / "config.toml" not in [p.resolve() for p in searched]
