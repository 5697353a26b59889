"""Issue 18, item 1: the defaults under which ordinary agent code runs.

The corpus (tests/agent_corpus/NN_name.py) holds programs of the kind models write: scripting
with os/sys/pathlib/subprocess/sqlite3/threading/logging/argparse, data analysis with pandas,
numpy and matplotlib, algorithmic answers, file work in the working directory,
`if __name__ == "__main__": sys.exit(main())`. Each file says what a correct run shows in
its header:

    # expect: ok                  or   # expect: error exit=1
    # stdout: TEXT                TEXT appears in stdout (repeatable)
    # stderr: TEXT                TEXT appears in stderr (repeatable)
    # file: NAME                  the run wrote NAME in the workspace (repeatable)

Every program runs with no flags at all through each face: the library (`Sandbox()`), the
CLI (`codecage run --file X --json`) and MCP (`execute_code` of `codecage serve`, driven by
the SDK's stdio client); at least 95% of them must run correctly on each.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp_types import CallToolResult, TextContent
from tests._cli import codecage as run_cli

from codecage import Options, Sandbox, config
from codecage.isolation import rootfs
from codecage.mcp import reply as reply_text
from codecage.mcp.server import build_server
from codecage.policy import profiles

CORPUS = Path(__file__).resolve().parent.parent / "agent_corpus"
CLI = [sys.executable, "-m", "codecage.cli"]
CODECAGE = str(Path(sys.executable).with_name("codecage"))
REQUIRED = 0.95
WORKERS = 3  # a bounded pool: the machine is shared, and each run is its own sandbox
RUN_TIMEOUT_S = 60


@dataclass(frozen=True)
class Program:
    name: str
    path: Path
    source: str
    status: str = "ok"
    exit_code: int = 0
    stdout: tuple[str, ...] = ()
    stderr: tuple[str, ...] = ()
    files: tuple[str, ...] = ()


@dataclass
class Seen:
    """What one face reported of one run, in the same shape for every face."""

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    files: list[str] = field(default_factory=list)
    detail: str = ""


def load_corpus() -> list[Program]:
    programs = []
    for path in sorted(CORPUS.glob("[0-9][0-9]_*.py")):
        source = path.read_text(encoding="utf-8")
        header: dict[str, list[str]] = {}
        for line in source.splitlines():
            if not line.startswith("# "):
                break
            key, _, value = line[2:].partition(":")
            header.setdefault(key.strip(), []).append(value.strip())
        expect = (header.get("expect") or ["ok"])[0].split()
        exit_code = int(expect[1].removeprefix("exit=")) if len(expect) > 1 else 0
        programs.append(
            Program(
                name=path.stem,
                path=path,
                source=source,
                status=expect[0],
                exit_code=exit_code,
                stdout=tuple(header.get("stdout", ())),
                stderr=tuple(header.get("stderr", ())),
                files=tuple(header.get("file", ())),
            )
        )
    return programs


PROGRAMS = load_corpus()


def problems(program: Program, seen: Seen) -> list[str]:
    """What is wrong with `seen` as an outcome of `program` (empty: it ran correctly)."""
    found = []
    if seen.status != program.status or seen.exit_code != program.exit_code:
        found.append(
            f"status {seen.status} exit {seen.exit_code}, expected {program.status} exit "
            f"{program.exit_code}: {seen.detail or seen.stderr[-300:]}"
        )
    found += [f"stdout lacks {text!r}" for text in program.stdout if text not in seen.stdout]
    found += [f"stderr lacks {text!r}" for text in program.stderr if text not in seen.stderr]
    found += [f"no file {name}" for name in program.files if name not in seen.files]
    return found


def score(face: str, seen: dict[str, Seen]) -> None:
    failures = {p.name: problems(p, seen[p.name]) for p in PROGRAMS if problems(p, seen[p.name])}
    passed = len(PROGRAMS) - len(failures)
    listing = "\n".join(f"  {name}: {'; '.join(why)}" for name, why in failures.items())
    print(f"{face}: {passed}/{len(PROGRAMS)} ran correctly\n{listing}")
    assert passed >= REQUIRED * len(PROGRAMS), (
        f"{face}: only {passed} of {len(PROGRAMS)} agent programs ran correctly with no "
        f"flags (need {REQUIRED:.0%}):\n{listing}"
    )


def from_result(result: dict[str, Any]) -> Seen:
    error = result.get("error") or {}
    return Seen(
        status=result["status"],
        exit_code=result.get("exit_code"),
        stdout=result.get("stdout") or "",
        stderr=result.get("stderr") or "",
        files=[f["path"] for f in result.get("files") or []],
        detail=f"{error.get('type')}: {error.get('message')}" if error else "",
    )


def run_all(run_one: Callable[[Program], Seen]) -> dict[str, Seen]:
    with ThreadPoolExecutor(WORKERS) as pool:
        return dict(zip([p.name for p in PROGRAMS], pool.map(run_one, PROGRAMS), strict=True))


def test_the_corpus_is_big_and_says_what_each_program_must_show() -> None:
    assert len(PROGRAMS) >= 60
    for program in PROGRAMS:
        assert program.status in ("ok", "error"), program.name
        assert program.stdout or program.stderr or program.files, program.name


@pytest.mark.timeout(150)
def test_agent_programs_run_with_no_flags_through_the_library(
    clean_env: dict[str, str],
) -> None:
    with Sandbox() as sandbox:

        def run_one(program: Program) -> Seen:
            result = sandbox.run(program.source, filename=program.path.name)
            return from_result(result.model_dump(mode="json"))

        seen = run_all(run_one)
    score("library", seen)


@pytest.mark.timeout(150)
def test_agent_programs_run_with_no_flags_through_the_cli(
    clean_env: dict[str, str], tmp_path: Path
) -> None:
    def run_one(program: Program) -> Seen:
        proc = run_cli(
            *("run", "--file", str(program.path), "--json"),
            cwd=tmp_path,
            env=clean_env,
            timeout=RUN_TIMEOUT_S,
            command=CLI,
        )
        try:
            return from_result(json.loads(proc.stdout))
        except (json.JSONDecodeError, KeyError):
            return Seen("no result", proc.returncode, proc.stdout, proc.stderr)

    score("cli", run_all(run_one))


def _reply_text(reply: CallToolResult) -> str:
    return "\n".join(block.text for block in reply.content if isinstance(block, TextContent))


def from_reply(reply: CallToolResult) -> Seen:
    """The reply's structured result; where it leaves out what its text already holds
    (stdout, stderr), the text stands in for it."""
    text = _reply_text(reply)
    data = reply.structured_content or {}
    if "status" not in data:
        return Seen("refused" if reply.is_error else "no result", None, text, text)
    seen = from_result(data)
    seen.stdout = text if seen.stdout in ("", reply_text.IN_TEXT) else seen.stdout
    seen.stderr = text if seen.stderr in ("", reply_text.IN_TEXT) else seen.stderr
    return seen


@pytest.mark.timeout(150)
def test_agent_programs_run_with_no_flags_through_mcp(
    clean_env: dict[str, str], tmp_path: Path
) -> None:
    """`codecage serve` as an MCP host starts it (warm pool and all), over stdio."""
    # The SDK passes only a few variables on: the ones that make it run this checkout's
    # code with no configuration of the user's go explicitly.
    env = {k: clean_env[k] for k in ("PYTHONPATH", "XDG_CONFIG_HOME") if k in clean_env}
    params = StdioServerParameters(command=CODECAGE, args=["serve"], cwd=str(tmp_path), env=env)

    async def main() -> dict[str, Seen]:
        seen: dict[str, Seen] = {}
        slots = anyio.Semaphore(WORKERS)
        with (tmp_path / "stderr.log").open("w", encoding="utf-8") as errlog:
            transport = stdio_client(params, errlog=errlog)
            async with Client(transport, read_timeout_seconds=RUN_TIMEOUT_S) as client:

                async def run_one(program: Program) -> None:
                    async with slots:
                        reply = await client.call_tool("execute_code", {"code": program.source})
                    seen[program.name] = from_reply(reply)

                async with anyio.create_task_group() as group:
                    for program in PROGRAMS:
                        group.start_soon(run_one, program)
        return seen

    score("mcp", anyio.run(main))


# --- the default profile, and what it binds -------------------------------------------------


def test_the_default_profile_is_standard_for_the_library_the_config_and_info(
    clean_env: dict[str, str],
) -> None:
    assert profiles.DEFAULT_PROFILE == "standard"
    assert config.load().profile == "standard"
    assert profiles.resolve([]).profile == "standard"
    sandbox = Sandbox()
    assert sandbox.policy is not None and sandbox.policy.allows_every_module
    info = sandbox.info()
    assert info.import_policy == "standard"
    assert [p.name for p in info.profiles if p.default] == ["standard"]
    # The curated profiles stay, for operators who want intent made explicit.
    assert {"basic", "data_science", "filesystem", "network"} <= {p.name for p in info.profiles}


def test_the_cli_and_the_server_run_under_the_standard_profile_by_default(
    clean_env: dict[str, str],
) -> None:
    p = subprocess.run(
        [*CLI, "info", "--json"], capture_output=True, text=True, env=clean_env, timeout=60
    )
    assert json.loads(p.stdout)["import_policy"] == "standard", p.stderr

    async def main() -> dict[str, Any]:
        async with Client(
            build_server(Sandbox(pool=False).host), read_timeout_seconds=60
        ) as client:
            reply = await client.call_tool("get_sandbox_info", {})
        return reply.structured_content or {}

    assert anyio.run(main)["default_profile"] == "standard"


@pytest.mark.parametrize("import_policy", [True, False], ids=["default", "no-import-policy"])
def test_every_installed_data_package_imports_under_the_default_and_with_no_policy(
    clean_env: dict[str, str], import_policy: bool
) -> None:
    installed = [top for top in profiles.DATA_PACKAGES if profiles.installed(top)]
    assert {"numpy", "pandas", "matplotlib"} <= set(installed)  # the test venv has them
    code = "import importlib\n" + "".join(
        f"importlib.import_module({top!r})\n" for top in installed
    )
    code += "import pandas as pd\nint(pd.DataFrame({'a': [1, 2, 3]})['a'].sum())"
    r = Sandbox(options=Options(import_policy=import_policy)).run(code, limits={"timeout": 120})
    assert (r.status, r.return_value) == ("ok", 6), (r.error, r.stderr[-2000:])


def test_the_cli_without_an_import_policy_imports_pandas(clean_env: dict[str, str]) -> None:
    p = subprocess.run(
        [*CLI, "run", "--no-import-policy", "--json", "--code", "import pandas\n1"],
        capture_output=True,
        text=True,
        env=clean_env,
        timeout=120,
    )
    result = json.loads(p.stdout)
    assert (result["status"], result["return_value"]) == ("ok", 1), result["error"]


def test_only_curated_data_science_preloads_the_heavy_packages() -> None:
    """A warm sandbox of the default profile preloads nothing: benchmarks/bench_preload.py
    measured ~0.8 s of CPU and ~63 MB per refill for numpy+pandas+matplotlib, paid by
    every run of the pool, against ~0.3 s of CPU once in the runs that import pandas."""
    assert profiles.preload_for(profiles.resolve(["standard"])) == ()
    assert profiles.preload_for(None) == ()
    assert profiles.preload_for(profiles.resolve(["data_science"])) == profiles.PRELOAD


# --- exit codes and the working directory --------------------------------------------------


@pytest.mark.parametrize(
    ("code", "status", "exit_code"),
    [
        ("import sys\nsys.exit(0)", "ok", 0),
        ("import sys\nsys.exit()", "ok", 0),
        ("raise SystemExit", "ok", 0),
        ("raise SystemExit(0)", "ok", 0),
        ("import sys\nsys.exit(1)", "error", 1),
        ("import sys\nsys.exit(3)", "error", 3),
        ("import sys\nsys.exit('bad input')", "error", 1),
    ],
)
def test_sys_exit_zero_is_success_and_nonzero_is_an_error_with_its_code(
    clean_env: dict[str, str], code: str, status: str, exit_code: int
) -> None:
    r = Sandbox().run("print('before')\n" + code)
    assert (r.status, r.exit_code, r.stdout) == (status, exit_code, "before\n")
    if "bad input" in code:
        assert "bad input" in r.stderr


def test_the_working_directory_is_the_workspace(clean_env: dict[str, str]) -> None:
    code = "import os\nopen('x.txt', 'w').write('1')\n(os.getcwd(), sorted(os.listdir('.')))"
    r = Sandbox().run(code)
    assert r.return_value == ["/workspace", ["x.txt"]]
    assert [f.path for f in r.files] == ["x.txt"]


# --- refusals under curated profiles: in the face's own terms, never a missing module --------


def test_a_refusal_over_the_cli_names_the_flags(clean_env: dict[str, str]) -> None:
    p = subprocess.run(
        [*CLI, "run", "--profile", "basic", "--json", "--code", "import os"],
        capture_output=True,
        text=True,
        env=clean_env,
        timeout=60,
    )
    message = json.loads(p.stdout)["error"]["message"]
    assert "pass --allow-import os or --profile standard" in message
    assert "allowed_imports" not in message


def test_a_refusal_over_mcp_names_the_tools_arguments(clean_env: dict[str, str]) -> None:
    async def main() -> dict[str, Any]:
        async with Client(
            build_server(Sandbox(pool=False).host), read_timeout_seconds=60
        ) as client:
            reply = await client.call_tool(
                "execute_code", {"code": "import os", "profile": "basic"}
            )
        return reply.structured_content or {}

    message = anyio.run(main)["error"]["message"]
    assert "pass allowed_imports=['os'] or profile='standard' to execute_code" in message
    assert "--allow-import" not in message and "codecage info" not in message
    assert "Sandbox(" not in message


def test_a_refusal_never_suggests_allowing_a_module_that_is_not_installed(
    clean_env: dict[str, str],
) -> None:
    missing = [top for top in ("seaborn", "requests", "sklearn") if not profiles.installed(top)]
    sandbox = Sandbox(profile="basic")
    for top in [*missing, "no_such_module_anywhere"]:
        r = sandbox.run(f"import {top}")
        assert r.error is not None and r.error.type == "ModuleNotFoundError", top
        assert "not installed" in r.error.message and "allowed_imports" not in r.error.message
    installed = sandbox.run("import pandas")  # installed, so allowing it helps
    assert installed.error is not None and "allowed_imports=['pandas']" in installed.error.message


def test_a_refusal_suggests_the_standard_profile_only_where_the_operator_enabled_it(
    clean_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CODECAGE_ENABLED_PROFILES", "basic,data_science")
    r = Sandbox(profile="basic").run("import os")
    assert r.error is not None and "allowed_imports=['os']" in r.error.message
    assert "standard" not in r.error.message


# --- validate agrees with run ------------------------------------------------------------


def test_validate_finds_nothing_to_refuse_in_what_the_default_runs(
    clean_env: dict[str, str],
) -> None:
    sandbox = Sandbox()
    for program in PROGRAMS:
        refused = [f for f in sandbox.validate(program.source).findings if f.kind == "policy"]
        assert refused == [], program.name


@pytest.mark.parametrize(
    "code",
    [
        "from urllib.parse import urlparse",
        "import urllib.parse",
        "import xml.etree.ElementTree as ET",
        "from xml.etree import ElementTree",
        "from servers.memory import read_graph",
        "import skills.summarise",
        "from __future__ import annotations",
    ],
)
def test_validate_under_basic_allows_what_a_basic_run_allows(code: str) -> None:
    sandbox = Sandbox(profile="basic")
    assert sandbox.validate(code).valid, sandbox.validate(code).findings
    r = sandbox.run(code)
    assert not any(e.kind == "import_blocked" for e in r.events), r.error


def test_cli_validate_of_a_dotted_stdlib_import_under_basic_is_valid(
    clean_env: dict[str, str],
) -> None:
    code = "from urllib.parse import urlparse\nurlparse('https://example.org').netloc"
    p = subprocess.run(
        [*CLI, "validate", "--profile", "basic", "--json", "--code", code],
        capture_output=True,
        text=True,
        env=clean_env,
        timeout=60,
    )
    assert p.returncode == 0 and json.loads(p.stdout)["valid"], p.stdout


def test_the_package_listing_is_cached_and_a_cached_path_outside_site_packages_is_not_believed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Binding the default's data packages must not cost every `codecage run` the ~0.6 s of
    reading every distribution's RECORD; the cache cannot widen what is bound either."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    names = ("numpy",)
    entries, _ = rootfs._package_files(names)
    [cache_file] = (tmp_path / "codecage").glob("packages-*.json")
    assert {Path(p) for p in json.loads(cache_file.read_text())["entries"]} == entries
    planted = json.loads(cache_file.read_text())
    planted["entries"].append("/etc")
    cache_file.write_text(json.dumps(planted))
    again, _ = rootfs._package_files(names)
    assert again == entries and Path("/etc") not in again
