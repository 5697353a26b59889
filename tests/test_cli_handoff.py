"""`codecage run` handed to the user's local server (cli/handoff.py, cli/handoff_endpoint.py):
real `codecage` processes, a real local server started by `codecage session start-server`
in a fresh XDG_RUNTIME_DIR, real sandboxes. The same command runs handed off and in-process
(`CODECAGE_HANDOFF=0`); their stdout, stderr and exit code must be the same, but for what
differs between any two runs (the execution id, the times, the memory peak). Whether a run
was handed off is read from the server's log (one `handoff.run` line per run), not assumed.
"""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests._cli import CODECAGE, codecage

from codecage.cli import handoff
from codecage.cli.options import LimitFlags

_VARYING = [
    (re.compile(r"\d+ ms wall"), "N ms wall"),
    (re.compile(r"\d+ ms CPU"), "N ms CPU"),
    (re.compile(r"[\d.]+ MiB peak"), "N MiB peak"),
]


@dataclass(frozen=True)
class Home:
    """A user's environment whose local server runs: its runtime dir and env."""

    runtime: Path
    env: dict[str, str]

    @property
    def log(self) -> Path:
        return self.runtime / "codecage" / "server.log"

    def handed_off(self) -> int:
        """How many runs the server has taken so far."""
        return self.log.read_text(encoding="utf-8", errors="replace").count("handoff.run")

    def run(
        self, *args: str, handoff_env: str = "", **env: str
    ) -> subprocess.CompletedProcess[str]:
        merged = {**self.env, **env, **({"CODECAGE_HANDOFF": handoff_env} if handoff_env else {})}
        return codecage("run", *args, env=merged, cwd=self.runtime, timeout=300)

    def both(self, *args: str) -> tuple[subprocess.CompletedProcess[str], ...]:
        """The command handed off (checked in the server's log), then in-process."""
        before = self.handed_off()
        handed = self.run(*args)
        assert self.handed_off() == before + 1, handed.stderr
        local = self.run(*args, handoff_env="0")
        assert self.handed_off() == before + 1
        return handed, local


def _home(runtime: Path) -> Home:
    conf = runtime / "config.toml"
    conf.write_text("[sessions]\nlocal_idle_exit = 600\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODECAGE_")}
    env |= {
        "XDG_RUNTIME_DIR": str(runtime),
        # One audit store for the server and the in-process runs: the module's, not the user's.
        "CODECAGE_AUDIT": str(runtime / "audit.db"),
        "CODECAGE_CONFIG": str(conf),
    }
    return Home(runtime, env)


@pytest.fixture(scope="module")
def home() -> Iterator[Home]:
    # Short: a Unix socket's path holds at most 107 bytes (pytest's tmp_path can be longer).
    runtime = Path(tempfile.mkdtemp(prefix="cc-ho-", dir="/tmp"))
    served = _home(runtime)
    try:
        started = codecage("session", "start-server", env=served.env, timeout=300)
        assert started.returncode == 0, started.stderr
        yield served
    finally:
        codecage("session", "stop-server", env=served.env, timeout=300)
        shutil.rmtree(runtime, ignore_errors=True)


def _steady(text: str) -> str:
    """`text` without what differs between any two runs (times, the memory peak)."""
    for pattern, replacement in _VARYING:
        text = pattern.sub(replacement, text)
    return text


def _same(
    handed: subprocess.CompletedProcess[str], local: subprocess.CompletedProcess[str]
) -> None:
    assert handed.returncode == local.returncode, (handed.stderr, local.stderr)
    assert _steady(handed.stdout) == _steady(local.stdout)
    assert _steady(handed.stderr) == _steady(local.stderr)


def _same_json(
    handed: subprocess.CompletedProcess[str], local: subprocess.CompletedProcess[str]
) -> dict[str, object]:
    assert handed.returncode == local.returncode, (handed.stderr, local.stderr)
    assert handed.stderr == local.stderr == ""
    ours, theirs = json.loads(handed.stdout), json.loads(local.stdout)
    assert handed.stdout.count("\n") == local.stdout.count("\n") == 1
    for varying in ("execution_id", "usage"):
        assert set(ours[varying] if isinstance(ours[varying], dict) else {}) == set(
            theirs[varying] if isinstance(theirs[varying], dict) else {}
        )
        ours.pop(varying), theirs.pop(varying)
    assert ours == theirs
    return ours


def test_an_ok_run_prints_the_same_handed_off(home: Home) -> None:
    handed, local = home.both(
        "--code", 'print("hi")\nimport sys; print("e", file=sys.stderr)\n41 + 1'
    )
    _same(handed, local)
    assert handed.returncode == 0
    assert handed.stdout == "hi\n"
    assert "→ 42" in handed.stderr and "codecage: ok" in handed.stderr


def test_an_error_run_prints_the_same_handed_off(home: Home) -> None:
    handed, local = home.both("--code", "def f():\n    return 1 / 0\nf()")
    _same(handed, local)
    assert handed.returncode == 1
    assert "ZeroDivisionError" in handed.stderr and "codecage: error" in handed.stderr


def test_a_timeout_prints_the_same_handed_off(home: Home) -> None:
    handed, local = home.both("--code", "import time\ntime.sleep(30)", "--timeout", "1")
    _same(handed, local)
    assert handed.returncode == 1
    assert "timeout" in handed.stderr


def test_json_prints_the_same_object_handed_off(home: Home) -> None:
    ok = _same_json(*home.both("--code", "print('x' * 3)\n[1, 2]", "--json"))
    assert ok["status"] == "ok" and ok["return_value"] == [1, 2]
    failed = _same_json(*home.both("--json", "--code", "raise ValueError('no')"))
    assert failed["status"] == "error"


def _on_a_terminal(home: Home, *args: str, handoff_env: str = "") -> tuple[int, str]:
    """`codecage run ARGS` with its stdout and stderr on one pseudo-terminal: its exit code
    and what the terminal received (CI=true: no spinner, which only a terminal shows while
    a sandbox starts in-process, and which erases itself)."""
    env = {**home.env, "CI": "true", **({"CODECAGE_HANDOFF": handoff_env} if handoff_env else {})}
    env.pop("NO_COLOR", None)
    env.pop("FORCE_COLOR", None)
    master, slave = pty.openpty()
    process = subprocess.Popen(
        [CODECAGE, "run", *args],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env=env,
        cwd=home.runtime,
    )
    os.close(slave)
    received = bytearray()
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: every writer has closed the terminal
            break
        if not data:
            break
        received += data
    os.close(master)
    return process.wait(timeout=300), received.decode("utf-8", "replace")


def test_a_terminal_sees_the_same_colours_handed_off(home: Home) -> None:
    for code in ("print('hi')\n7 * 6", "raise KeyError('k')"):
        before = home.handed_off()
        handed = _on_a_terminal(home, "--code", code)
        assert home.handed_off() == before + 1
        local = _on_a_terminal(home, "--code", code, handoff_env="0")
        assert handed[0] == local[0]
        steady = [_steady(text) for _, text in (handed, local)]
        assert steady[0] == steady[1]
        assert "\x1b[" in steady[0]  # rich coloured the status: it saw a terminal


def test_output_cut_at_its_cap_prints_the_same_head_and_tail(home: Home) -> None:
    code = "import sys\nfor i in range(400):\n    print(i)\n    print(-i, file=sys.stderr)"
    handed, local = home.both("--max-output-bytes", "1024", "--code", code)
    _same(handed, local)
    assert "cut here" in handed.stdout and handed.stdout.rstrip().endswith("399")
    _same(*home.both("--max-output-bytes", "1024", "--code", code, "--raw"))


def test_control_characters_and_raw_output_print_the_same(home: Home) -> None:
    code = "import sys\nprint('\\x1b[31mred\\x07')\nsys.stdout.buffer.write(b'\\xff\\n')"
    _same(*home.both("--code", code))
    _same(*home.both("--code", code, "--raw"))


def test_a_file_profile_and_limits_are_handed_off(home: Home) -> None:
    program = home.runtime / "job.py"
    program.write_text("import json\nprint(json.dumps({'a': 1}))\nraise SystemExit(3)\n")
    args = ("--file", str(program), "--profile", "basic", "--memory-mb", "256", "--json")
    result = _same_json(*home.both(*args))
    assert result["exit_code"] == 3
    assert result["limits"]["memory_mb"] == 256  # type: ignore[index]
    blocked = _same_json(*home.both("--code", "import subprocess", "--profile", "basic", "--json"))
    assert blocked["status"] == "error"
    strict = ("--strict", "--json", "--profile", "basic", "--code", "import subprocess")
    assert _same_json(*home.both(*strict))["status"] == "blocked"


def test_a_handed_off_run_is_on_record_as_the_clis(home: Home) -> None:
    before = home.handed_off()
    handed = home.run("--code", "print('on record')", "--json")
    assert handed.returncode == 0, handed.stderr
    assert home.handed_off() == before + 1
    execution_id = json.loads(handed.stdout)["execution_id"]
    listed = codecage("audit", "list", "--json", env=home.env, timeout=120)
    assert listed.returncode == 0, listed.stderr
    (record,) = [
        r for r in json.loads(listed.stdout)["executions"] if r["execution_id"] == execution_id
    ]
    assert record["face"] == "cli"
    assert record["caller"].startswith("cli:")


def test_another_configuration_runs_in_process(home: Home) -> None:
    before = home.handed_off()
    done = home.run("--code", "print(1)", handoff_env="debug", CODECAGE_SCRUB="0")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "1\n"
    assert "run in-process: the local server declined: another configuration" in done.stderr
    assert home.handed_off() == before


def test_a_config_file_changed_since_the_server_started_runs_in_process() -> None:
    runtime = Path(tempfile.mkdtemp(prefix="cc-ho-", dir="/tmp"))
    served = _home(runtime)
    try:
        started = codecage("session", "start-server", env=served.env, timeout=300)
        assert started.returncode == 0, started.stderr
        done = served.run("--code", "print(5)", handoff_env="debug")
        assert "handed off to the local server" in done.stderr, done.stderr
        with open(runtime / "config.toml", "a", encoding="utf-8") as conf:
            conf.write("# edited: the server read the file before this\n")
        done = served.run("--code", "print(6)", handoff_env="debug")
        assert done.returncode == 0, done.stderr
        assert done.stdout == "6\n"
        assert "declined: another configuration" in done.stderr
        assert served.handed_off() == 1
    finally:
        codecage("session", "stop-server", env=served.env, timeout=300)
        shutil.rmtree(runtime, ignore_errors=True)


def test_an_unknown_flag_or_a_lent_directory_runs_in_process(home: Home) -> None:
    before = home.handed_off()
    for extra in (("--verbose",), ("--out", str(home.runtime / "out"))):
        done = home.run("--code", "print(2)", *extra, handoff_env="debug")
        assert done.returncode == 0, done.stderr
        assert done.stdout == "2\n"
        assert "run in-process: the option or argument" in done.stderr
    assert home.handed_off() == before


def test_a_refused_run_is_refused_in_process_in_its_own_words(home: Home) -> None:
    before = home.handed_off()
    handed = home.run("--code", "1", "--profile", "no-such-profile")
    local = home.run("--code", "1", "--profile", "no-such-profile", handoff_env="0")
    assert handed.returncode == local.returncode == 2
    assert handed.stderr == local.stderr and "no-such-profile" in handed.stderr
    assert home.handed_off() == before


def test_a_stale_or_foreign_socket_or_an_open_directory_runs_in_process() -> None:
    runtime = Path(tempfile.mkdtemp(prefix="cc-ho-", dir="/tmp"))
    try:
        served = _home(runtime)
        directory = runtime / "codecage"
        directory.mkdir(mode=0o700)
        (directory / "token").write_text("t0ken")
        (directory / "token").chmod(0o600)
        with socket.socket(socket.AF_UNIX) as stale:  # bound, never listening, left behind
            stale.bind(str(directory / "server.sock"))
        done = served.run("--code", "print(3)", handoff_env="debug")
        assert done.returncode == 0, done.stderr
        assert done.stdout == "3\n"
        assert "run in-process: the local server does not answer" in done.stderr
        if os.geteuid() == 0:  # only root can give the socket to another user
            os.chown(directory / "server.sock", 65534, 65534)
            done = served.run("--code", "print(7)", handoff_env="debug")
            assert done.stdout == "7\n"
            assert "is not a socket of yours" in done.stderr
        directory.chmod(0o755)
        done = served.run("--code", "print(4)", handoff_env="debug")
        assert done.stdout == "4\n"
        assert "is not a directory of yours with mode 0700" in done.stderr
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def test_the_handed_off_run_imports_no_pydantic_typer_or_rich(home: Home) -> None:
    probe = (
        "import sys\n"
        "sys.argv = ['codecage', 'run', '--code', '1']\n"
        "from codecage.cli import main\n"
        "try:\n"
        "    main()\n"
        "finally:\n"
        "    heavy = {m.split('.')[0] for m in sys.modules} & {'pydantic', 'typer', 'rich',"
        " 'click', 'codecage.models'}\n"
        "    heavy |= {m for m in sys.modules if m.startswith(('codecage.mod', 'codecage.ho'))}\n"
        "    sys.stderr.write(f'HEAVY={sorted(heavy)}\\n')\n"
    )
    before = home.handed_off()
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env=home.env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert home.handed_off() == before + 1
    assert "HEAVY=[]" in done.stderr, done.stderr
    # The probe can fail: in-process, the same command imports them all.
    local = subprocess.run(
        [sys.executable, "-c", probe],
        env={**home.env, "CODECAGE_HANDOFF": "0"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert "'pydantic'" in local.stderr and "'typer'" in local.stderr, local.stderr


def test_a_limit_spelled_otherwise_than_plainly_runs_in_process() -> None:
    assert handoff.parse(["--timeout", "2.5", "--memory-mb", "256", "-c", "1"]).limits == {
        "timeout": 2.5,
        "memory_mb": 256,
    }
    for flag, value in (
        ("--memory-mb", "\uff12\uff15\uff16"),
        ("--memory-mb", "1_0"),
        ("--timeout", "inf"),
    ):
        with pytest.raises(handoff.Declined):
            handoff.parse([flag, value, "--code", "1"])


def test_the_flags_handed_off_are_runs_own() -> None:
    assert {name for name, _ in handoff.LIMIT_FLAGS.values()} == set(
        LimitFlags.__dataclass_fields__
    )
    from codecage.cli.app import _build, _click_command

    command = _click_command(_build(["run"])).commands["run"]
    names = {opt for param in command.params for opt in param.opts}
    understood = {*handoff.VALUE_FLAGS, *handoff.BOOL_FLAGS, *handoff.LIMIT_FLAGS}
    assert understood <= names
    for param in command.params:
        for opt in param.opts:
            if opt in handoff.LIMIT_FLAGS:
                assert handoff.LIMIT_FLAGS[opt][1] is param.type_descriptor.annotation
