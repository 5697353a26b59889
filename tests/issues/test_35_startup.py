"""Issue 35, item 6: a CLI that starts like a command.

- `import codecage` loads none of the library (each public name on first use), and
  `codecage run` imports its own command's modules only, none of the other commands'.
- `codecage serve` over stdio answers `initialize` before it has built its host: while the
  backend's self-test is held at a gate (a `bwrap` first on PATH that waits for a file), the
  answer (the SDK's own, kept from the start before) is already there. A run asked for at
  once waits until the self-test has passed, and on a host whose self-test fails it is
  refused, as before.

No timing is asserted here: benchmarks/bench_cli_startup.py measures the times.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from test_server import CODECAGE, INITIALIZE, send_lines, server_env

ROOT = Path(__file__).resolve().parents[2]

# What a plain `codecage run` must not import: the other commands and what only they need.
OTHER_COMMANDS = (
    "codecage.cli.audit",
    "codecage.cli.batch",
    "codecage.cli.gen",
    "codecage.cli.info",
    "codecage.cli.packages",
    "codecage.cli.serve",
    "codecage.cli.session",
    "codecage.audit.views",
)
# What `import codecage` (and the CLI's entry, and the serve front) must not import.
LIBRARY = ("pydantic", "codecage.models", "codecage.sandbox", "codecage.host", "codecage.engine")

_LOADED = r"""
import json, sys
exec(sys.argv[1])
print(json.dumps(sorted(sys.modules)))
"""


def loaded_after(statements: str) -> set[str]:
    """The modules a fresh interpreter holds after `statements` (this checkout's code)."""
    proc = subprocess.run(
        [sys.executable, "-c", _LOADED, statements],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_importing_codecage_loads_none_of_the_library_until_a_name_is_used() -> None:
    assert loaded_after("import codecage").isdisjoint(LIBRARY)
    used = loaded_after(
        "import codecage\n"
        "from codecage import Sandbox, ExecutionResult, ConfigError\n"
        "assert Sandbox.__module__ == 'codecage.sandbox'\n"
        "assert codecage.ExecutionResult is ExecutionResult\n"
        "assert set(codecage.__all__) <= set(dir(codecage))\n"
        "assert all(getattr(codecage, n) is not None for n in codecage.__all__)\n"
    )
    assert {"codecage.sandbox", "codecage.models", "pydantic"} <= used


def test_the_entry_point_and_the_serve_front_load_none_of_the_library() -> None:
    loaded = loaded_after("import codecage.cli, codecage.mcp.early")
    assert loaded.isdisjoint({*LIBRARY, "typer", "rich", "mcp", "mcp_types", "anyio"})


def test_codecage_run_imports_none_of_the_other_commands() -> None:
    run = loaded_after(
        "from codecage.cli import main\n"
        "try:\n    main(['run', '--code', '1', '--json'])\n"
        "except SystemExit as exc:\n    assert exc.code == 0, exc.code\n"
    )
    assert "codecage.cli.run" in run
    assert run.isdisjoint(OTHER_COMMANDS), sorted(run & set(OTHER_COMMANDS))


def test_the_import_check_sees_another_command_when_one_is_run() -> None:
    # The check above could pass by looking at nothing: `codecage info` loads its module.
    info = loaded_after(
        "from codecage.cli import main\n"
        "try:\n    main(['info', '--json'])\n"
        "except SystemExit:\n    pass\n"
    )
    assert "codecage.cli.info" in info


# --- serve: `initialize` first, the self-test before any run -------------------------------

# A `bwrap` first on PATH: the availability check (`... true`) and `--version` pass
# through; every sandbox start logs the time it began (ns), then waits until GATE/open
# exists. With GATE/fail, the sandbox shares the host's IPC namespace: the self-test's
# namespaces probe fails (a host that cannot prove its isolation). Paths are written in:
# bwrap runs with no environment, as the sandbox's ids.
_GATED_BWRAP = """#!/bin/sh
case "$1" in --version) exec {real} "$@";; esac
for last; do :; done
[ "$last" = true ] && exec {real} "$@"
{date} +%s%N >> {log}
while [ ! -e {gate}/open ]; do {sleep} 0.05; done
if [ -e {gate}/fail ]; then
    for arg; do shift; [ "$arg" = --unshare-ipc ] || set -- "$@" "$arg"; done
fi
exec {real} "$@"
"""


def _user_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "codecage"


def _first_answer(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the server closed stdout without answering"
    answer: dict[str, Any] = json.loads(line)
    return answer


@dataclass(frozen=True)
class Seeded:
    """A cache directory (a copy of the user's: library lists and a self-test verdict, so
    its start is quick) in which a server started with `argv` answered `initialize` itself
    (`answer`) and kept that answer for the next start with the same arguments."""

    cache: Path
    answer: dict[str, Any]
    argv: list[str]


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Seeded:
    base = tmp_path_factory.mktemp("seeded")
    cache = base / "cache" / "codecage"
    if _user_cache().is_dir():
        shutil.copytree(_user_cache(), cache, ignore=shutil.ignore_patterns("serve-init*"))
    config = base / "codecage.toml"  # bwrap only: a failing self-test has no fallback
    config.write_text('[sandbox]\nbackends = ["bwrap"]\n')
    argv = [CODECAGE, "serve", "--config", str(config)]
    env = server_env(XDG_CACHE_HOME=str(cache.parent))
    with subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=base
    ) as proc:
        send_lines(proc, [INITIALIZE])
        answer = _first_answer(proc)
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=120)
    assert list(cache.glob("serve-initialize-*.json")), "the SDK's answer was not kept"
    return Seeded(cache, answer, argv)


@dataclass(frozen=True)
class Gated:
    """A stdio server whose sandboxes wait at `gate` (see _GATED_BWRAP)."""

    proc: subprocess.Popen[bytes]
    cache: Path
    gate: Path
    log: Path


@pytest.fixture
def gated(tmp_path: Path, seeded: Seeded) -> Iterator[Gated]:
    """A server started as the seeded one was, with a copy of its cache without the
    self-test verdict (it proves the host again) and a gated bwrap first on PATH. All of it
    in a directory every user can read: bwrap runs as the sandbox's own ids."""
    open_dir = Path(tempfile.mkdtemp(prefix="codecage-test35-"))
    open_dir.chmod(0o755)
    try:
        yield from _gated(open_dir, seeded, tmp_path)
    finally:
        shutil.rmtree(open_dir, ignore_errors=True)


def _gated(open_dir: Path, seeded: Seeded, tmp_path: Path) -> Iterator[Gated]:
    cache = open_dir / "cache" / "codecage"
    shutil.copytree(seeded.cache, cache, ignore=shutil.ignore_patterns("selftest-*"))
    real = shutil.which("bwrap")
    assert real is not None
    gate, log = open_dir / "gate", open_dir / "bwrap.log"
    gate.mkdir(mode=0o755)
    log.touch(mode=0o666)
    log.chmod(0o666)
    (open_dir / "bin").mkdir(mode=0o755)
    wrapper = open_dir / "bin" / "bwrap"
    tools = {"date": shutil.which("date"), "sleep": shutil.which("sleep")}
    wrapper.write_text(_GATED_BWRAP.format(real=real, gate=gate, log=log, **tools))
    wrapper.chmod(0o755)
    env = server_env(
        XDG_CACHE_HOME=str(cache.parent), PATH=f"{open_dir / 'bin'}:{os.environ['PATH']}"
    )
    with subprocess.Popen(
        seeded.argv,  # the same arguments: the kept answer is theirs
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
    ) as proc:
        yield Gated(proc, cache, gate, log)
        (gate / "open").touch()  # never leave the server waiting
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=120)


_CALL = {
    "jsonrpc": "2.0",
    "id": 2,
    "method": "tools/call",
    "params": {"name": "execute_code", "arguments": {"code": "6 * 7"}},
}
_INITIALIZED = {"jsonrpc": "2.0", "method": "notifications/initialized"}


def test_initialize_is_answered_before_the_self_test_and_a_run_waits_for_it(
    gated: Gated, seeded: Seeded
) -> None:
    proc = gated.proc
    send_lines(proc, [INITIALIZE])
    answer = _first_answer(proc)
    # Every sandbox start waits at the gate: the self-test cannot have run yet.
    assert not list(gated.cache.glob("selftest-*.json"))
    assert answer == seeded.answer  # the SDK's own answer, word for word

    send_lines(proc, [_INITIALIZED, _CALL])  # a run asked for before the host is proven
    (gated.gate / "open").touch()
    reply = _first_answer(proc)
    assert reply["id"] == 2 and not reply["result"].get("isError"), reply
    assert reply["result"]["structuredContent"]["status"] == "ok", reply
    verdicts = list(gated.cache.glob("selftest-*.json"))
    assert verdicts, "the self-test verdict was not kept"
    proven_at = verdicts[0].stat().st_mtime_ns
    starts = [int(line) for line in gated.log.read_text().split()]
    # The first sandbox is the self-test's; every one after it (the pool's, the run's)
    # started once the verdict was in.
    assert len(starts) >= 2 and starts[0] < proven_at, (starts, proven_at)
    assert all(start >= proven_at for start in starts[1:]), (starts, proven_at)


def test_a_host_that_fails_its_self_test_answers_initialize_and_refuses_the_run(
    gated: Gated,
) -> None:
    proc = gated.proc
    (gated.gate / "fail").touch()
    send_lines(proc, [INITIALIZE])
    assert "result" in _first_answer(proc)
    send_lines(proc, [_INITIALIZED, _CALL])
    (gated.gate / "open").touch()
    reply = _first_answer(proc)
    text = json.dumps(reply)
    assert reply["id"] == 2 and "isolation layers missing" in text, reply
    assert "namespaces" in text, reply
    assert not list(gated.cache.glob("selftest-*.json"))  # a failure is not cached


# --- the transport's side of the early answer -----------------------------------------------


async def _written(writer: Any, texts: list[str], read_fd: int) -> bytes:
    for text in texts:
        await writer.write(text)
        await writer.flush()
    return os.read(read_fd, 1 << 16) if texts else b""


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_sdks_answer_is_dropped_when_sent_early_and_kept_when_it_changed(
    tmp_path: Path, anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    from codecage.mcp import early, stdio

    cache = tmp_path / "serve-initialize-x.json"
    sent_early = {"protocolVersion": "2025-06-18", "serverInfo": {"name": "old"}}
    front = early.Front(request_id=1, cache=cache, answered=sent_early)
    sdk = {"protocolVersion": "2025-06-18", "serverInfo": {"name": "new"}}
    notification = json.dumps({"jsonrpc": "2.0", "method": "notifications/message"}) + "\n"
    answer = json.dumps({"jsonrpc": "2.0", "id": 1, "result": sdk}) + "\n"
    later = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"tools": []}}) + "\n"
    read_fd, write_fd = os.pipe()
    try:
        writer = stdio._Writer(write_fd, front)
        # A notification goes out; the SDK's answer does not (the client has one); a later
        # message with the same id (another request's) goes out.
        out = await _written(writer, [notification, answer, later], read_fd)
    finally:
        os.close(read_fd)
        os.close(write_fd)
    assert out == (notification + later).encode()
    assert json.loads(cache.read_text()) == sdk  # the next start sends the SDK's new one
    assert "server.initialize_changed" in caplog.text
