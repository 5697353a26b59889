"""Issue 19: one import rule, used by the guest's import hook, by `validate` and by the
profiles, so `validate` and `run` cannot disagree (the dotted cases, `from P import x`,
relative imports, `servers.*`/`skills.*` with their directories)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from tests._cli import codecage

from codecage import Options, Sandbox
from codecage.guest import bootstrap, imports
from codecage.policy import profiles
from codecage.policy import validate as validation

ROOT = Path(__file__).resolve().parents[2]

# (code, allowed under `basic`): the cases of the issue and their neighbours
BASIC_CASES = [
    ("from urllib.parse import urlparse", True),
    ("import urllib.parse", True),
    ("import xml.etree.ElementTree", True),
    ("from xml.etree import ElementTree", True),
    ("from xml import etree", True),
    ("from __future__ import annotations", True),
    ("from collections import OrderedDict", True),
    ("import urllib.request", False),
    ("from urllib import request", False),
    ("from xml import dom", False),
    ("import xml.dom.minidom", False),
    ("from os import path", False),
]

FILESYSTEM_CASES = [
    ("from os import path", True),
    ("from os import getcwd, listdir", True),  # attributes of os, as `import os; os.getcwd`
    ("import os; os.getcwd()", True),
    ("from email import mime", False),  # a submodule: checked as email.mime
]


@pytest.fixture(scope="module")
def basic() -> Sandbox:
    return Sandbox(profile="basic", pool=False)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODECAGE_")}
    return codecage(*args, env=env, cwd=ROOT)


@pytest.mark.parametrize(("code", "allowed"), BASIC_CASES)
def test_run_and_validate_agree_under_basic(basic: Sandbox, code: str, allowed: bool) -> None:
    result = basic.run(code)
    blocked = [e.detail for e in result.events if e.kind == "import_blocked"]
    assert (result.status == "ok") is allowed, (result.status, result.error)
    assert (not blocked) is allowed, blocked
    report = basic.validate(code)
    assert report.valid is allowed, report.message
    if not allowed:  # both name the same module
        assert blocked[0].split(" ")[0] in report.message


@pytest.mark.parametrize(("code", "allowed"), FILESYSTEM_CASES)
def test_an_attribute_is_imported_as_its_module_is(code: str, allowed: bool) -> None:
    """`from os import getcwd` under a profile that has os.path (so `import os` works) is
    allowed: getcwd is os's attribute, not a submodule to check."""
    box = Sandbox(profile="filesystem", pool=False)
    result = box.run(code)
    blocked = [e.detail for e in result.events if e.kind == "import_blocked"]
    assert (result.status == "ok") is allowed, (result.status, result.error)
    assert (not blocked) is allowed, blocked
    assert box.validate(code).valid is allowed


@pytest.mark.parametrize(
    ("code", "refused"),
    [
        ("from urllib.parse import urlparse", None),
        ("import xml.etree.ElementTree", None),
        ("from urllib import request", "urllib.request"),
        ("from xml import dom", "xml.dom"),
    ],
)
def test_the_cli_validate_says_what_run_does(code: str, refused: str | None) -> None:
    out = _cli("validate", "--profile", "basic", "--json", "--code", code)
    report = json.loads(out.stdout)
    assert report["valid"] is (refused is None), report["message"]
    assert out.returncode == (0 if refused is None else 1)
    if refused is not None:
        assert f"import of '{refused}'" in report["message"]
    ran = _cli("run", "--profile", "basic", "--json", "--code", code)
    result = json.loads(ran.stdout)
    blocked = [e["detail"] for e in result["events"] if e["kind"] == "import_blocked"]
    assert blocked == ([] if refused is None else [f"{refused} (profile basic)"])


# --- one function -------------------------------------------------------------------------

RULE_TABLE = [
    # (name, fromlist, level, modules, refused)
    ("urllib.parse", ("urlparse",), 0, {"urllib.parse"}, None),
    ("urllib", ("request",), 0, {"urllib.parse"}, "urllib.request"),
    ("urllib", ("parse", "request"), 0, {"urllib.parse"}, "urllib.request"),
    ("urllib", ("*",), 0, {"urllib.parse"}, None),  # a parent package is a stepping stone
    ("xml", ("etree",), 0, {"xml.etree"}, None),
    ("xml.dom", (), 0, {"xml.etree"}, "xml.dom"),
    ("os", ("getcwd",), 0, {"os.path"}, None),  # an attribute of a stepping stone: as `import os`
    ("os", ("path",), 0, {"os.path"}, None),
    ("email", ("utils", "mime"), 0, {"email.utils"}, "email.mime"),
    ("xml", ("dom",), 0, {"xml.etree"}, "xml.dom"),
    ("os", ("getcwd",), 0, {"os"}, None),
    ("anything", ("x",), 0, {"*"}, None),
    ("", ("sibling",), 1, set(), None),  # relative: inside a package, never the user's
    ("helpers", ("f",), 2, set(), None),
    ("servers.memory", ("read_graph",), 0, set(), None),
    ("skills.report", (), 0, set(), None),
    ("codecage.runtime", ("workspace",), 0, set(), None),
    ("__future__", ("annotations",), 0, set(), None),
]


@pytest.mark.parametrize(("name", "fromlist", "level", "modules", "refused"), RULE_TABLE)
def test_one_rule_for_host_and_guest(
    name: str, fromlist: tuple[str, ...], level: int, modules: set[str], refused: str | None
) -> None:
    every = frozenset(modules) | imports.ALWAYS_ALLOWED
    assert imports.refused(name, fromlist, level, every) == refused
    policy = profiles.ImportPolicy(profile="t", modules=every)
    for dotted in imports.requested(name, fromlist, level):
        if dotted == name or imports.is_module(dotted):  # an attribute asks for its module
            assert policy.allows(dotted) is (dotted != refused)
    statement = (
        f"from {'.' * level}{name} import {', '.join(fromlist)}" if fromlist else f"import {name}"
    )
    report = validation.validate(statement, allowed_modules=every, profile_name="t")
    assert report.valid is (refused is None), report.message
    if refused is not None:
        assert f"import of '{refused}'" in report.message


def test_the_host_and_the_guest_import_the_same_module() -> None:
    """profiles and validate call codecage.guest.imports, and the guest hook imports that
    same file (as codecage.imports, the guest package being mounted as `codecage`)."""
    assert profiles.allowed is imports.allowed
    assert validation.imports is imports
    hook = Path(bootstrap.__file__).read_text(encoding="utf-8")
    assert 'rule = _guest_module("imports")' in hook
    assert Path(imports.__file__).parent == Path(bootstrap.__file__).parent
    assert bootstrap.EVERY_MODULE == imports.EVERY_MODULE
    assert profiles.resolve(["basic"]).modules >= imports.ALWAYS_ALLOWED


# --- the tool packages --------------------------------------------------------------------


@pytest.fixture
def tool_dirs(tmp_path: Path) -> tuple[Path, Path]:
    servers = tmp_path / "servers"
    (servers / "memory").mkdir(parents=True)
    (servers / "memory" / "__init__.py").write_text(
        "from .read_graph import read_graph\n", encoding="utf-8"
    )
    (servers / "memory" / "read_graph.py").write_text(
        "import json\n\ndef read_graph():\n    return json.dumps({'nodes': 1})\n",
        encoding="utf-8",
    )
    skills = tmp_path / "skills"
    skills.mkdir()
    (skills / "report.py").write_text(
        "import os\n\ndef title(s):\n    return s.title() + os.sep\n", encoding="utf-8"
    )
    return servers, skills


TOOL_CODE = (
    "from servers.memory import read_graph\nfrom skills.report import title\n"
    "(read_graph(), title('a'))"
)


def test_servers_and_skills_import_under_basic_with_their_dirs(
    tool_dirs: tuple[Path, Path],
) -> None:
    """The packages' own imports (json, os: outside `basic`, and a relative one) are not
    the user's, at run time and in validate alike."""
    servers, skills = tool_dirs
    sandbox = Sandbox(
        profile="basic", pool=False, options=Options(servers_dir=servers, skills_dir=skills)
    )
    result = sandbox.run(TOOL_CODE)
    assert result.status == "ok", result.error
    assert result.return_value == ['{"nodes": 1}', "A/"]
    assert sandbox.validate(TOOL_CODE, strict=True).valid


def test_validate_without_the_dirs_says_how_to_give_them() -> None:
    """Valid (the policy allows both trees, as at run time, where the import then fails on
    a missing module), with a recommendation naming the flags for each missing tree."""
    sandbox = Sandbox(profile="basic", pool=False)
    result = sandbox.run(TOOL_CODE)
    assert result.error is not None and result.error.type == "ModuleNotFoundError"
    assert not [e for e in result.events if e.kind == "import_blocked"]
    report = sandbox.validate(TOOL_CODE)
    assert report.valid, report.message
    tips = [t for t in report.analysis.recommendations if t.startswith("give the run")]
    assert len(tips) == 2
    assert "--mcp-config or --servers-dir" in tips[0] and "--skills-dir" in tips[1]


def test_the_cli_validate_takes_the_tool_dirs(tool_dirs: tuple[Path, Path]) -> None:
    servers, skills = tool_dirs
    code = ["--profile", "basic", "--json", "--code", TOOL_CODE]

    def tips(*flags: str) -> list[str]:
        out = _cli("validate", *flags, *code)
        assert out.returncode == 0, out.stdout
        report = json.loads(out.stdout)
        return [t for t in report["analysis"]["recommendations"] if t.startswith("give the run")]

    assert len(tips()) == 2
    assert tips("--skills-dir", str(skills)) == [
        "give the run a servers directory (--mcp-config or --servers-dir; servers_dir= in "
        "the library): without one, `import servers.…` fails with ModuleNotFoundError"
    ]
    # --servers-dir needs upstream servers, as for `run`
    refused = _cli("validate", "--servers-dir", str(servers), *code)
    assert refused.returncode == 2
    assert "need upstream servers" in json.loads(refused.stdout)["error"]["message"]


def test_the_flagship_program_passes_strict_checks_with_the_readme_flags(tmp_path: Path) -> None:
    """`validate --strict` and `run --strict` of examples/memory_agent.py with an
    --mcp-config: `from servers.memory import ...` is fine, the run is not `blocked`."""
    server = ROOT / "tools" / "node_modules" / ".bin" / "mcp-server-memory"
    if not server.exists():
        pytest.skip("scripts/setup --test installs the memory server")
    config = tmp_path / "mcp.json"
    memory = {"command": str(server), "env": {"MEMORY_FILE_PATH": str(tmp_path / "m.jsonl")}}
    config.write_text(json.dumps({"mcpServers": {"memory": memory}}), encoding="utf-8")
    flags = [
        "--strict",
        "--json",
        "--mcp-config",
        str(config),
        "--file",
        "examples/memory_agent.py",
    ]
    checked = _cli("validate", *flags)
    report = json.loads(checked.stdout)
    assert report["valid"], report["message"]
    assert checked.returncode == 0
    ran = json.loads(_cli("run", *flags).stdout)
    assert ran["status"] == "ok", ran


def test_validate_honours_enabled_profiles_like_the_library(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[policy]\nenabled_profiles = ["basic"]\n', encoding="utf-8")
    config.chmod(0o600)
    out = _cli("validate", "--config", str(config), "--profile", "network", "--code", "1")
    assert out.returncode == 2, out.stderr
    assert "not enabled" in out.stderr
