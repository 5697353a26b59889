"""The docs are tested: every setting, status and event kind is documented, the README's
Python snippets run, the CLI reference matches --help, and the example programs run."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from codecage import Sandbox
from codecage.models import EVENT_KINDS, STATUSES, Limits

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
SECURITY = (ROOT / "docs" / "security-model.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", sorted(Limits.model_fields))
def test_every_limit_is_documented_with_flag_and_env_var(name: str) -> None:
    assert f"`{name}`" in CONFIGURATION
    assert "--" + name.replace("_", "-") in CONFIGURATION or name == "timeout"
    assert f"CODECAGE_{name.upper()}" in CONFIGURATION


def test_every_default_in_the_docs_is_the_models_default() -> None:
    for name, field in Limits.model_fields.items():
        row = next(line for line in CONFIGURATION.splitlines() if line.startswith(f"| `{name}` |"))
        assert f" {field.default} |" in row or f" {field.default:,} |" in row, (name, row)


@pytest.mark.parametrize("status", STATUSES)
def test_every_status_is_documented(status: str) -> None:
    assert f"`{status}`" in CONFIGURATION


@pytest.mark.parametrize("kind", EVENT_KINDS)
def test_every_event_kind_is_documented(kind: str) -> None:
    assert f"`{kind}`" in CONFIGURATION


def test_the_security_model_names_what_is_not_isolated() -> None:
    assert re.search(r"what is \*?\*?not\*?\*? isolated", SECURITY, re.IGNORECASE)
    for test_file in sorted((ROOT / "tests" / "containment").glob("test_*.py")):
        assert test_file.name in SECURITY, f"{test_file.name} is not cited"


def _python_blocks(markdown: str) -> list[tuple[str, str | None]]:
    """Each ```python block, and the ```text block of its "Real output" when the prose right
    after it (before any other block) says "Real output"."""
    blocks = []
    for found in re.finditer(r"```python\n(.*?)```\n", markdown, re.DOTALL):
        rest = markdown[found.end() :]
        between, _, after = rest.partition("```")
        shown = None
        if "Real output" in between and after.startswith("text\n"):
            shown = after[len("text\n") :].partition("```")[0]
        blocks.append((found.group(1), shown))
    return blocks


def _shape(text: str) -> list[str]:
    """Lines with every number as N: timings and counts vary from run to run, the words and
    the fields that are printed must not."""
    return [re.sub(r"\d+(?:\.\d+)?", "N", line.rstrip()) for line in text.strip().splitlines()]


@pytest.mark.parametrize("index", range(len(_python_blocks(README))))
def test_readme_python_snippets_run_and_print_what_the_readme_shows(index: int) -> None:
    code, shown = _python_blocks(README)[index]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, f"README.md snippet {index}", "exec"), {"__name__": "__readme__"})  # noqa: S102
    if shown is not None:
        assert _shape(printed.getvalue()) == _shape(shown)


# Programs that call MCP tools need upstream servers: test_runtime_in_sandbox runs those.
PLAIN_EXAMPLES = sorted(
    p for p in (ROOT / "examples").glob("*.py") if "from servers" not in p.read_text("utf-8")
)


@pytest.mark.parametrize("example", PLAIN_EXAMPLES, ids=str)
def test_example_programs_run_in_the_sandbox(sandbox: Sandbox, example: Path) -> None:
    r = sandbox.run(example.read_text(encoding="utf-8"), filename=example.name)
    assert r.status == "ok", (r.error, r.stderr)


def test_the_cli_reference_is_generated_from_the_real_help() -> None:
    check = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen-cli-docs"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stderr


def _console_block(command: str) -> list[str]:
    """The lines a README console block shows after `$ command` (up to the next `$` line)."""
    block = README.split(f"$ {command}\n", 1)[1].split("```", 1)[0]
    return block.split("\n$ ", 1)[0].rstrip("\n").splitlines()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from codecage.cli import main; main()", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


def test_the_readme_cli_run_shows_what_the_cli_prints() -> None:
    shown = _console_block("codecage run --file examples/analyse_sales.py")
    ran = _cli("run", "--file", "examples/analyse_sales.py")
    assert ran.returncode == 0, ran.stderr
    on_stderr = [line for line in shown if line.startswith(("→", "codecage:"))]
    on_stdout = [line for line in shown if line not in on_stderr]
    assert _shape(ran.stdout) == [_shape(line)[0] for line in on_stdout]
    assert _shape(ran.stderr) == [_shape(line)[0] for line in on_stderr]


def test_the_readme_json_result_has_the_fields_the_cli_prints() -> None:
    shown = "\n".join(_console_block("codecage run --file examples/analyse_sales.py --json"))
    ran = _cli("run", "--file", "examples/analyse_sales.py", "--json")
    assert ran.returncode == 0, ran.stderr
    printed = json.loads(ran.stdout)
    assert re.findall(r'^    "(\w+)":', shown, re.MULTILINE) == list(printed)
    usage = re.search(r'"usage": (\{.*?\})', shown)
    assert usage is not None and list(json.loads(usage.group(1))) == list(printed["usage"])


def _modules() -> list[str]:
    package = ROOT / "src" / "codecage"
    found = []
    for path in sorted(package.rglob("*.py")):
        if "__pycache__" in path.parts or path.stem in {"__init__", "__main__"}:
            continue
        found.append(str(path.relative_to(package).with_suffix("")))
    return found


@pytest.mark.parametrize("module", _modules())
def test_every_module_is_in_the_architecture_doc(module: str) -> None:
    """docs/architecture.md shows the layout as built: a new module is named there, on the
    lines of its folder (or of the folder above, which may describe a subpackage), or this
    fails."""
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    tree = doc.split("```")[1] + "\n  end"
    folder, _, stem = module.rpartition("/")
    if not folder:
        assert re.search(rf"^  {re.escape(stem)}\.py ", tree, re.M), module
        return
    blocks = [
        block.group(1)
        for name in (folder, folder.split("/")[0])
        if (block := re.search(rf"^  {re.escape(name)}/ (.*?)(?=^  \S)", tree, re.M | re.S))
    ]
    assert any(stem in re.findall(r"[a-z_]+", block) for block in blocks), (module, blocks)
