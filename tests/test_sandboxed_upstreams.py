"""Upstream MCP servers started with `"sandbox": true` (bridge/sandboxed.py), driven
through the real broker over their real stdio transport.

Containment: a probe server (tests/fixtures/probe_server.py) tries to read a host file,
its environment and a TCP listener on the host's loopback; the same server unsandboxed
succeeds at each, so each test shows that the sandbox is what stops it. Then the reference
servers nobody here wrote (npm's memory, filesystem and everything; PyPI's time and git)
work sandboxed, with the memory persisting in the state directory across brokers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests._web import QuietHandler, serving_http_on_loopback
from tests.conftest import HostCanary, NetCanary

from codecage import toolsetup
from codecage.bridge import upstreams
from codecage.bridge.broker import Broker
from codecage.bridge.channel import CallFailed
from codecage.config import load as load_config
from codecage.errors import ConfigError
from codecage.isolation import cgroups, rootfs
from codecage.isolation import identity as identities
from codecage.models import NetworkSettings

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "tests" / "fixtures" / "probe_server.py"
NPM = ROOT / "tools" / "node_modules" / "@modelcontextprotocol"
VENV_BIN = Path(sys.executable).parent
SANDBOX_ID = identities.plan().identity

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")


def call(broker: Broker, server: str, tool: str, **arguments: Any) -> Any:
    """The tool's structured result (unwrapped from MCPServer's {"result": ...}), else its
    text."""
    answer = broker.call(server, tool, arguments).result(timeout=120)
    value = answer.structured if answer.structured is not None else answer.text
    return value["result"] if isinstance(value, dict) and set(value) == {"result"} else value


def broker_for(servers: dict[str, Any]) -> Broker:
    return Broker(upstreams.parse({"mcpServers": servers}, source="test", environ={}))


@pytest.fixture
def given_dir() -> Iterator[Path]:
    """A directory the sandbox's host id can reach and write (/tmp/pytest-of-root is 0700
    and belongs to root), as an operator would prepare one; removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="codecage-test-given-"))
    path.chmod(0o755)
    os.chown(path, SANDBOX_ID.uid, SANDBOX_ID.gid)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def probe(sandbox: bool, state: Path, **extra: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"command": str(VENV_BIN / "python"), "args": [str(PROBE)]}
    if sandbox:
        entry |= {"sandbox": True, "state_dir": str(state)}
    return entry | extra


@pytest.fixture
def probes(given_dir: Path) -> Iterator[Broker]:
    """The probe server twice: `caged` sandboxed, `open` on the host as before."""
    servers = {"caged": probe(True, given_dir), "open": probe(False, given_dir)}
    with broker_for(servers) as broker:
        yield broker


# --- containment: what the sandbox stops, shown against the same server without it ------


def test_a_sandboxed_server_cannot_read_host_files(probes: Broker, host_canary: HostCanary) -> None:
    for path in host_canary.paths:
        assert host_canary.token in call(probes, "open", "read_file", path=str(path))
        refused = call(probes, "caged", "read_file", path=str(path))
        assert refused.startswith("error: FileNotFoundError")  # the path is named, not read
    if os.geteuid() == 0:
        assert "root:" in call(probes, "open", "read_file", path="/etc/shadow")
    assert "error" in call(probes, "caged", "read_file", path="/etc/shadow")
    passwd = call(probes, "caged", "read_file", path="/etc/passwd")
    assert "root:" not in passwd and "/state" in passwd


def test_a_sandboxed_server_sees_only_its_configured_environment(
    given_dir: Path, env_canary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The SDK gives an unsandboxed server the host's HOME, LOGNAME, PATH, SHELL, TERM, USER.
    monkeypatch.setenv("LOGNAME", env_canary)
    servers = {
        "caged": probe(True, given_dir, env={"GIVEN": "yes"}),
        "open": probe(False, given_dir, env={"GIVEN": "yes"}),
    }
    with broker_for(servers) as broker:
        opened = call(broker, "open", "environment")
        caged = call(broker, "caged", "environment")
    assert opened["LOGNAME"] == env_canary
    assert env_canary not in str(caged)
    assert set(caged) == {"GIVEN", "PATH", "HOME", "LANG", "PWD"}  # PWD: bwrap's --chdir
    assert caged["HOME"] == "/state"


def test_a_sandboxed_server_cannot_connect_to_the_hosts_loopback(
    probes: Broker, net_canary: NetCanary
) -> None:
    assert call(probes, "open", "connect", port=net_canary.port) == net_canary.token
    answer = call(probes, "caged", "connect", port=net_canary.port)
    assert answer.startswith("error") and net_canary.token not in answer
    assert len(net_canary.connections) == 1  # the open one's only


def test_a_sandboxed_server_runs_as_neither_root_nor_with_a_writable_root(
    probes: Broker, given_dir: Path
) -> None:
    status = call(probes, "caged", "read_file", path="/proc/self/status")
    uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
    assert uid_line.split()[1:] == ["1000"] * 4
    assert "NoNewPrivs:\t1" in status and "Seccomp:\t2" in status
    assert call(probes, "caged", "write_file", path="/usr/x", text="x").startswith("error")
    assert call(probes, "caged", "write_file", path="/state/x", text="kept") == "ok"
    assert (given_dir / "x").read_text(encoding="utf-8") == "kept"


# --- the same layers as a run's: launched through the Backend ------------------------------


def test_a_sandboxed_server_sees_the_masked_proc_entries_masked(probes: Broker) -> None:
    """Before, a sandboxed server built its own bwrap command and had none of a run's /proc
    masks: /proc/key-users listed every host user's keys there. Now it is launched through
    the Backend with a run's mount plan for /proc."""
    host_side = call(probes, "open", "read_file", path="/proc/key-users")
    assert host_side and not host_side.startswith("error")  # there is something to hide
    masked_files = [p for p in rootfs.PROC_MASKED if Path(p).is_file()]
    assert "/proc/key-users" in masked_files
    for path in masked_files:
        assert call(probes, "caged", "read_file", path=path) == "", path


@pytest.mark.skipif(cgroups.detect() is None, reason="needs cgroups (root, or delegation)")
def test_a_sandboxed_server_runs_in_a_cgroup_with_its_limits_as_the_sandboxs_host_id(
    given_dir: Path,
) -> None:
    """Seen from the host while the server runs: a cgroup of its own holds every process of
    its sandbox, with the entry's memory_mb and max_processes, and each of those processes
    is the sandbox's (non-root) host id. Before: no cgroup at all."""
    entry = probe(True, given_dir, memory_mb=300, max_processes=40)
    with broker_for({"p": entry}) as broker:
        assert call(broker, "p", "environment")["HOME"] == "/state"
        found = upstream_cgroups()
        assert len(found) == 1, found
        (limits,) = found.values()
    assert limits["memory"] == 300 * 1024 * 1024
    assert limits["pids"] == 40 + 1  # the sandbox's init counts too
    assert limits["procs"], "no process in the server's cgroup"
    for pid, uids in limits["procs"].items():
        assert uids == [SANDBOX_ID.uid] * 4, (pid, uids)
    assert SANDBOX_ID.uid != 0
    assert upstream_cgroups() == {}  # removed with the session


def upstream_cgroups() -> dict[str, dict[str, Any]]:
    """This process's sandboxed servers' cgroups: their memory and pids limits (v1 or v2)
    and the host uids of the processes in them."""
    support = cgroups.detect()
    assert support is not None
    found: dict[str, dict[str, Any]] = {}
    for controller, parent in support.parents.items():
        for group in parent.glob(f"{os.getpid()}-upstream-*"):
            seen = found.setdefault(group.name, {"procs": {}})
            if controller in ("memory", "unified"):
                name = "memory.max" if controller == "unified" else "memory.limit_in_bytes"
                seen["memory"] = int((group / name).read_text())
            if controller in ("pids", "unified"):
                seen["pids"] = int((group / "pids.max").read_text())
            for pid in (group / "cgroup.procs").read_text().split():
                seen["procs"][int(pid)] = host_uids(int(pid))
    return found


def host_uids(pid: int) -> list[int]:
    status = Path(f"/proc/{pid}/status").read_text(encoding="ascii", errors="replace")
    line = next(line for line in status.splitlines() if line.startswith("Uid:"))
    return [int(v) for v in line.split()[1:]]


# --- refusals that say what to do ------------------------------------------------------------


def test_bad_allow_hosts_are_refused_when_the_config_is_loaded(given_dir: Path) -> None:
    with pytest.raises(ConfigError, match="no URL"):
        upstreams.parse(
            {"mcpServers": {"p": probe(True, given_dir, allow_hosts=["http://x/"])}},
            source="test",
            environ={},
        )
    with pytest.raises(ConfigError, match="only with `sandbox`"):
        upstreams.parse(
            {"mcpServers": {"p": probe(False, given_dir, allow_hosts=["x.com"])}},
            source="test",
            environ={},
        )


class _Hello(QuietHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.reply(f"hello {self.path}".encode())


@pytest.fixture
def web() -> Iterator[int]:
    with serving_http_on_loopback(_Hello) as httpd:
        yield httpd.server_address[1]


def _caged_web_broker(given_dir: Path, web: int, network: NetworkSettings) -> Broker:
    """A broker of one sandboxed server, "caged", whose allow_hosts name `web` (as
    web.test and by its address), under the operator's `network`."""
    allowed = [f"web.test:{web}", f"127.0.0.1:{web}"]
    servers = upstreams.parse(
        {"mcpServers": {"caged": probe(True, given_dir, allow_hosts=allowed)}},
        source="test",
        environ={},
    )
    return Broker(servers, network=network)


def test_a_sandboxed_server_reaches_its_allowed_hosts_through_the_proxy_only(
    given_dir: Path, web: int
) -> None:
    network = NetworkSettings(resolve={"web.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]})
    with _caged_web_broker(given_dir, web, network) as broker:
        assert call(broker, "caged", "fetch", url=f"http://web.test:{web}/x") == "hello /x"
        refused = call(broker, "caged", "fetch", url=f"http://other.test:{web}/y")
        assert refused.startswith("error: HTTP 403"), refused
        direct = call(broker, "caged", "connect", port=web)  # around the proxy: nothing
        assert direct.startswith("error"), direct
        env = call(broker, "caged", "environment")
        assert env["HTTP_PROXY"].startswith("http://127.0.0.1:")
    records = broker.network_records("caged")
    assert [(r.host, r.allowed) for r in records] == [("web.test", True), ("other.test", False)]


def test_the_operator_s_deny_wins_over_a_server_s_allow_hosts(given_dir: Path, web: int) -> None:
    network = NetworkSettings(resolve={"web.test": ["127.0.0.1"]}, deny=[f"web.test:{web}"])
    with _caged_web_broker(given_dir, web, network) as broker:
        refused = call(broker, "caged", "fetch", url=f"http://web.test:{web}/x")
    assert refused.startswith("error: HTTP 403") and "denied" in refused, refused


def test_the_config_s_network_settings_reach_the_broker(
    given_dir: Path, web: int, tmp_path: Path
) -> None:
    """`prepare` (what the faces call) hands `[network]` to the broker: its resolve table
    is what lets the sandboxed server reach web.test here."""
    allowed = f'["web.test:{web}", "127.0.0.1:{web}"]'
    config = tmp_path / "config.toml"  # the operator's (the given dir is the sandbox id's)
    config.write_text(
        '[network.resolve]\n"web.test" = ["127.0.0.1"]\n'
        "[mcpServers.caged]\n"
        f'command = "{VENV_BIN / "python"}"\n'
        f'args = ["{PROBE}"]\n'
        "sandbox = true\n"
        f'state_dir = "{given_dir}"\n'
        f"allow_hosts = {allowed}\n"
    )
    config.chmod(0o600)
    (tmp_path / "tree").mkdir()  # an existing tree: no listing of the tools first
    setup = toolsetup.prepare(None, settings=load_config(config), servers_dir=tmp_path / "tree")
    assert setup.broker is not None
    with setup.broker as broker:
        assert call(broker, "caged", "fetch", url=f"http://web.test:{web}/c") == "hello /c"


def test_without_allow_hosts_a_sandboxed_server_has_no_proxy(given_dir: Path, web: int) -> None:
    with broker_for({"caged": probe(True, given_dir)}) as broker:
        assert "HTTP_PROXY" not in call(broker, "caged", "environment")
        answer = call(broker, "caged", "fetch", url=f"http://127.0.0.1:{web}/z")
    assert answer.startswith("error"), answer


def test_a_missing_command_says_so_and_what_to_do(given_dir: Path) -> None:
    entry = {"command": "no-such-server-xyz", "sandbox": True, "state_dir": str(given_dir)}
    with broker_for({"gone": entry}) as broker, pytest.raises(CallFailed) as failed:
        broker.list_tools("gone")
    assert "'no-such-server-xyz' is not found" in failed.value.message
    assert "absolute path" in failed.value.message


def test_a_directory_argument_not_given_to_the_sandbox_is_refused(
    given_dir: Path, tmp_path: Path
) -> None:
    entry = probe(True, given_dir)
    entry["args"] = [*entry["args"], str(tmp_path)]
    with broker_for({"p": entry}) as broker, pytest.raises(CallFailed) as failed:
        broker.list_tools("p")
    assert f"names the directory {tmp_path}" in failed.value.message
    assert "`roots`" in failed.value.message


def test_codecages_own_virtualenv_is_refused_as_a_root(given_dir: Path) -> None:
    """A root is lent read-write: never one of codecage's own places (isolation.lending)."""
    entry = probe(True, given_dir) | {"roots": [sys.prefix]}
    with broker_for({"p": entry}) as broker, pytest.raises(CallFailed) as failed:
        broker.list_tools("p")
    assert "codecage's virtualenv" in failed.value.message
    assert "`roots`" in failed.value.message


def test_nothing_of_a_sandboxed_server_is_left_after_the_broker_closes(given_dir: Path) -> None:
    with broker_for({"p": probe(True, given_dir)}) as broker:
        call(broker, "p", "environment")
        running = processes_naming(str(given_dir))
        assert running  # the launcher (bwrap) and the server under it
    assert not processes_naming(str(given_dir))
    assert not list(Path(tempfile.gettempdir()).glob(f"codecage-upstream-{os.getpid()}-*"))


def processes_naming(text: str) -> list[int]:
    """Host processes whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(int(entry.name))
    return found


# --- the reference servers, sandboxed --------------------------------------------------------


needs_npm = pytest.mark.skipif(not NPM.is_dir(), reason="scripts/setup installs the npm servers")
needs_pypi = pytest.mark.skipif(
    not (VENV_BIN / "mcp-server-git").exists(), reason="scripts/setup installs the PyPI servers"
)


@needs_npm
def test_the_memory_server_keeps_its_graph_in_the_state_dir_across_brokers(
    given_dir: Path,
) -> None:
    entry = {
        "command": "node",
        "args": [str(NPM / "server-memory" / "dist" / "index.js")],
        "env": {"MEMORY_FILE_PATH": "/state/memory.jsonl"},
        "sandbox": True,
        "state_dir": str(given_dir),
    }
    entity = {"name": "Ana", "entityType": "person", "observations": ["likes tea"]}
    with broker_for({"memory": entry}) as broker:
        call(broker, "memory", "create_entities", entities=[entity])
    assert "likes tea" in (given_dir / "memory.jsonl").read_text(encoding="utf-8")
    with broker_for({"memory": entry}) as broker:  # a new server process: a host restart
        graph = call(broker, "memory", "read_graph")
    assert [e["name"] for e in graph["entities"]] == ["Ana"]


@needs_npm
def test_the_filesystem_server_works_on_the_directory_given_to_it(given_dir: Path) -> None:
    work = given_dir / "files"
    work.mkdir()
    os.chown(work, SANDBOX_ID.uid, SANDBOX_ID.gid)
    (work / "in.txt").write_text("hello from the host", encoding="utf-8")
    entry = {
        "command": "node",
        "args": [str(NPM / "server-filesystem" / "dist" / "index.js"), str(work)],
        "roots": [str(work)],
        "sandbox": True,
        "state_dir": str(given_dir),
    }
    with broker_for({"fs": entry}) as broker:
        text = call(broker, "fs", "read_text_file", path=str(work / "in.txt"))
        call(broker, "fs", "write_file", path=str(work / "out.txt"), content="from the server")
        with pytest.raises(CallFailed, match="outside allowed directories"):
            call(broker, "fs", "read_text_file", path="/etc/hostname")
    assert "hello from the host" in str(text)
    assert (work / "out.txt").read_text(encoding="utf-8") == "from the server"


@needs_npm
def test_the_everything_server_works_sandboxed(given_dir: Path) -> None:
    entry = {
        "command": "node",
        "args": [str(NPM / "server-everything" / "dist" / "index.js"), "stdio"],
        "sandbox": True,
        "state_dir": str(given_dir),
    }
    with broker_for({"everything": entry}) as broker:
        names = {tool.name for tool in broker.list_tools("everything")}
        echoed = call(broker, "everything", "echo", message="hi there")
    assert "echo" in names
    assert "hi there" in str(echoed)


@needs_pypi
def test_the_time_server_works_sandboxed(given_dir: Path) -> None:
    entry = {
        "command": str(VENV_BIN / "mcp-server-time"),
        "args": ["--local-timezone", "UTC"],
        "sandbox": True,
        "state_dir": str(given_dir),
    }
    with broker_for({"time": entry}) as broker:
        tokyo = call(
            broker,
            "time",
            "convert_time",
            source_timezone="UTC",
            time="12:00",
            target_timezone="Asia/Tokyo",
        )
    assert tokyo["target"]["datetime"][11:16] == "21:00"


@needs_pypi
def test_the_git_server_works_on_the_repository_given_to_it(given_dir: Path) -> None:
    repo = given_dir / "repo"
    repo.mkdir()
    git = ["git", "-c", "safe.directory=*", "-c", "user.name=Ana", "-c", "user.email=a@b.c"]
    subprocess.run([*git, "init", "-q", "-b", "main"], cwd=repo, check=True)
    (repo / "a.txt").write_text("a", encoding="utf-8")
    subprocess.run([*git, "add", "a.txt"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "Add a"], cwd=repo, check=True)
    subprocess.run(["chown", "-R", f"{SANDBOX_ID.uid}:{SANDBOX_ID.gid}", str(repo)], check=True)
    state = given_dir / "state"
    state.mkdir()
    entry = {
        "command": str(VENV_BIN / "mcp-server-git"),
        "args": ["--repository", str(repo)],
        "roots": [str(repo)],
        "sandbox": True,
        "state_dir": str(state),
    }
    with broker_for({"git": entry}) as broker:
        log = call(broker, "git", "git_log", repo_path=str(repo))
        (repo / "b.txt").write_text("b", encoding="utf-8")
        call(broker, "git", "git_add", repo_path=str(repo), files=["b.txt"])
        staged = call(broker, "git", "git_diff_staged", repo_path=str(repo))
    assert "Add a" in str(log)
    assert "b.txt" in str(staged)
