"""The command line as a user runs it: a real process, real sandboxes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests._cli import codecage

CODECAGE = [sys.executable, "-m", "codecage.cli"]


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODECAGE_")}
    return codecage(*args, stdin=stdin if stdin is not None else "", env=env, command=CODECAGE)


def test_run_json_prints_exactly_one_result_object_and_exits_0() -> None:
    p = cli("run", "--code", "print('hi')\n40 + 2", "--json")
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout)  # exactly one object: json.loads refuses trailing data
    assert result["status"] == "ok"
    assert result["stdout"] == "hi\n"
    assert result["return_value"] == 42
    for key in ("execution_id", "exit_code", "signal", "stdout_truncated", "stderr_truncated",
                "error", "files", "usage", "limits", "events"):  # fmt: skip
        assert key in result


def test_run_json_exits_1_when_the_code_fails() -> None:
    p = cli("run", "--code", "raise ValueError('nope')", "--json")
    assert p.returncode == 1
    result = json.loads(p.stdout)
    assert result["status"] == "error"
    assert result["error"]["type"] == "ValueError"


def test_human_mode_prints_program_output_then_a_summary_on_stderr() -> None:
    code = "print('out'); import sys; print('err', file=sys.stderr)"
    p = cli("run", "--code", code, "--allow-import", "sys")
    assert p.returncode == 0
    assert p.stdout == "out\n"
    assert "err" in p.stderr
    assert "codecage: ok" in p.stderr and "ms wall" in p.stderr


def test_code_can_come_from_stdin_and_from_a_file(tmp_path: Path) -> None:
    assert cli("run", "-", "--json", stdin="print(7)").stdout.count('"7\\n"') == 1
    script = tmp_path / "job.py"
    script.write_text("raise KeyError('k')\n")
    p = cli("run", "--file", str(script), "--json")
    assert json.loads(p.stdout)["error"]["traceback"].count('File "job.py", line 1') == 1


@pytest.mark.parametrize(
    "args",
    [
        ["run", "--code", "1", "--timeout", "-5"],
        ["run", "--code", "1", "--memory-mb", "5"],
        ["run", "--code", "1", "--memory-mb", "many"],
        ["run"],
        ["run", "--code", "1", "--file", "x.py"],
        ["run", "--no-such-flag"],
        ["run", "--code", "1", "--max-tool-calls", "0"],
        ["serve", "--max-tool-calls", "1000000"],
    ],
)
def test_usage_errors_exit_2_with_a_hint(args: list[str]) -> None:
    p = cli(*args)
    assert p.returncode == 2, p.stderr
    assert p.stdout == ""


def test_refusals_in_json_mode_are_one_json_error_object() -> None:
    p = cli("run", "--code", "1", "--memory-mb", "5", "--json")
    assert p.returncode == 2
    error = json.loads(p.stdout)["error"]
    assert error["type"] == "ConfigError" and "memory_mb" in error["message"] and error["hint"]
    assert "Hint:" in p.stderr


def test_a_binary_file_is_refused_clearly(tmp_path: Path) -> None:
    blob = tmp_path / "blob.py"
    blob.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    p = cli("run", "--file", str(blob))
    assert p.returncode == 2
    assert "not UTF-8" in p.stderr


def test_terminal_escapes_are_neutralised_unless_raw() -> None:
    code = "print('\\x1b[2J\\x1b]0;pwned\\x07 \\u202e')"
    p = cli("run", "--code", code)
    assert "\x1b" not in p.stdout and "\u202e" not in p.stdout
    assert "\\x1b[2J" in p.stdout and "\\u202e" in p.stdout
    raw = cli("run", "--code", code, "--raw")
    assert "\x1b[2J" in raw.stdout


def test_info_json_reports_layers_and_defaults() -> None:
    p = cli("info", "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["backend"] == "bwrap"
    layers = {layer["name"]: layer for layer in report["layers"]}
    assert {"namespaces", "network", "seccomp", "memory", "processes", "cpu"} <= set(layers)
    assert layers["host identity"]["active"] is True
    states = {state["name"]: state for state in report["backend_states"]}
    assert states["bwrap"]["in_force"] and states["bwrap"]["available"]
    assert states["landlock"]["degraded"] and not states["landlock"]["in_force"]
    assert report["default_limits"]["memory_mb"] == 512
    assert report["default_limits"]["timeout"] == 30


def test_doctor_passes_every_layer_on_this_host() -> None:
    p = cli("doctor", "--json")
    report = json.loads(p.stdout)
    assert p.returncode == 0, report
    assert report["passed"] is True
    assert {probe["layer"] for probe in report["probes"]} == {
        "namespaces", "privileges", "host identity", "filesystem", "environment", "network",
        "seccomp", "memory", "processes",
    }  # fmt: skip
    assert not any(probe["weak"] for probe in report["probes"])
    identity = next(p for p in report["probes"] if p["layer"] == "host identity")
    assert "not root" in identity["detail"]


def test_every_command_has_help_with_an_example() -> None:
    for command in ("run", "validate", "info", "doctor"):
        p = cli(command, "--help")
        assert p.returncode == 0
        assert "codecage " + command in p.stdout  # the example


def test_profile_flags_gate_imports_with_exit_1_and_an_event() -> None:
    refused = cli("run", "--code", "import os", "--profile", "basic", "--json")
    assert refused.returncode == 1
    result = json.loads(refused.stdout)
    assert result["error"]["type"] == "ImportError"
    assert [e["kind"] for e in result["events"]] == ["import_blocked"]
    assert cli("run", "--code", "import os").returncode == 0  # the default refuses nothing
    allowed = cli("run", "--code", "import os", "--profile", "basic", "--allow-import", "os,sys")
    assert allowed.returncode == 0
    assert cli("run", "--code", "import pathlib", "--profile", "filesystem").returncode == 0
    assert cli("run", "--code", "import os", "--no-import-policy").returncode == 0
    assert cli("run", "--code", "1", "--profile", "nope").returncode == 2


def test_validate_reports_findings_without_running_and_exits_by_verdict(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    code = f"import base64\nexec(base64.b64decode('eA=='))\nopen({str(marker)!r}, 'w')"
    p = cli("validate", "--code", code, "--json")
    assert p.returncode == 0, p.stderr  # valid: security findings alone do not refuse
    report = json.loads(p.stdout)
    assert "CC107" in {f["rule_id"] for f in report["findings"]}
    assert not marker.exists()  # never executed
    assert cli("validate", "--code", code, "--strict").returncode == 1
    assert cli("validate", "--code", "import os").returncode == 0  # as the default's run
    assert cli("validate", "--code", "import os", "--profile", "basic").returncode == 1
    basic_os = cli("validate", "--code", "import os", "--profile", "basic", "--allow-import", "os")
    assert basic_os.returncode == 0
    syntax = json.loads(cli("validate", "--code", "x = (", "--json").stdout)
    assert syntax["valid"] is False and syntax["findings"][0]["line"] == 1
    assert "ERROR" not in cli("validate", "--code", "1").stderr


def test_run_strict_exits_1_with_a_blocked_result() -> None:
    p = cli("run", "--strict", "--json", "--code", "exec(''.join(map(chr, [112, 40, 41])))")
    assert p.returncode == 1
    assert json.loads(p.stdout)["status"] == "blocked"


def test_run_without_upstream_servers_does_not_load_the_mcp_sdk(tmp_path: Path) -> None:
    """The SDK takes ~0.5 s to import: a plain `codecage run` must not pay for it."""
    probe = (
        "import sys\n"
        "from codecage import toolsetup\n"
        "toolsetup.prepare(None, settings=None)\n"
        "print(sorted(m for m in sys.modules if m == 'mcp' or m.startswith('mcp.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_info_shows_text_with_brackets_whole_not_read_as_markup(tmp_path: Path) -> None:
    """The network profile's description names "the config's [network]", and a limit's
    source names its file, whose path may hold brackets: rich read them as markup tags and
    dropped them ("the config's );") until info printed them as plain text."""
    config_file = tmp_path / "cfg[limits]" / "codecage.toml"
    config_file.parent.mkdir()
    config_file.write_text("[limits]\ntimeout = 7\n", encoding="utf-8")
    p = cli("info", "--config", str(config_file))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    line = next(ln for ln in lines if ln.strip().lstrip("* ").startswith("network"))
    assert "the config's [network]); without any" in line, line
    timeout = next(ln for ln in lines if ln.split()[:1] == ["timeout"])
    assert "cfg[limits]" in timeout, timeout
