"""The docs are tested: every setting, status and event kind is documented, the Python
snippets of the README and of docs/library.md run and print what they show, the CLI reference
matches --help and its prose names only commands that exist, the README stays short with its
first examples on the first screen, the user docs carry no issue numbers, and the example
programs run."""

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
CLI_DOC = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
LIBRARY = (ROOT / "docs" / "library.md").read_text(encoding="utf-8")
# Every page a user reads: the README and docs/*.md.
USER_DOCS = {
    path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
}


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


SNIPPETS = [
    (page, index, code, shown)
    for page, text in (("README.md", README), ("docs/library.md", LIBRARY))
    for index, (code, shown) in enumerate(_python_blocks(text))
]


@pytest.mark.parametrize(
    ("page", "index", "code", "shown"), SNIPPETS, ids=[f"{s[0]}#{s[1]}" for s in SNIPPETS]
)
def test_python_snippets_run_and_print_what_the_page_shows(
    page: str, index: int, code: str, shown: str | None
) -> None:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, f"{page} snippet {index}", "exec"), {"__name__": "__readme__"})  # noqa: S102
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


def _console_block(command: str, page: str = README) -> list[str]:
    """The lines a console block of `page` shows after `$ command` (up to the next `$` line)."""
    block = page.split(f"$ {command}\n", 1)[1].split("```", 1)[0]
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


def test_the_cli_docs_json_result_has_the_fields_the_cli_prints() -> None:
    shown = "\n".join(
        _console_block("codecage run --file examples/analyse_sales.py --json", CLI_DOC)
    )
    ran = _cli("run", "--file", "examples/analyse_sales.py", "--json")
    assert ran.returncode == 0, ran.stderr
    printed = json.loads(ran.stdout)
    assert re.findall(r'^    "(\w+)":', shown, re.MULTILINE) == list(printed)
    usage = re.search(r'"usage": (\{.*?\})', shown)
    assert usage is not None and list(json.loads(usage.group(1))) == list(printed["usage"])


# --- the README: read in a minute, each face on the first screen -------------------------

FIRST_SCREEN = 60  # lines: what a terminal or a repository page shows before any scrolling


def _fenced(markdown: str, language: str) -> list[tuple[int, str]]:
    """Each ```language block: the line it starts on (1-based) and its text."""
    return [
        (markdown[: found.start()].count("\n") + 1, found.group(1))
        for found in re.finditer(rf"^```{language}\n(.*?)^```", markdown, re.DOTALL | re.MULTILINE)
    ]


def test_the_readme_is_at_most_300_lines() -> None:
    assert len(README.splitlines()) <= 300


def test_the_readme_first_screen_has_the_quick_start_and_a_first_example_of_each_face() -> None:
    screen = "\n".join(README.splitlines()[:FIRST_SCREEN])
    console = "\n".join(text for _, text in _fenced(screen, "console"))
    assert re.search(r"^\./scripts/demo\b", console, re.M), "the demo command"
    assert re.search(r"^\./scripts/test\b", console, re.M), "the test command"
    library = [text for _, text in _fenced(screen, "python")]
    assert any("from codecage import Sandbox" in text for text in library), "the library"
    assert re.search(r"^\$ codecage run ", console, re.M), "the command line"
    hosts = [json.loads(text) for _, text in _fenced(screen, "json")]
    assert {"command": "codecage", "args": ["serve"]} in [
        server for config in hosts for server in config["mcpServers"].values()
    ], "an MCP host's configuration"


# --- the user docs: no issue numbers, only commands that exist ---------------------------

_ISSUE_NUMBER = re.compile(r"\bissues?\s+(?:no\.?\s*)?#?\d+|(?<![\w&(/])#\d+\b", re.IGNORECASE)


@pytest.mark.parametrize("page", sorted(USER_DOCS))
def test_the_user_docs_name_no_issue_numbers(page: str) -> None:
    """A reader knows what a section is about from its name, not from a tracker they cannot
    see: "Egress through the proxy", not "(issue 22)"."""
    found = [m.group(0) for m in _ISSUE_NUMBER.finditer(USER_DOCS[page])]
    assert found == [], f"{page}: {found}"


def _cli_commands() -> dict[str, set[str]]:
    """Each top-level command of the real CLI and its sub-commands (hidden ones left out)."""
    import typer

    from codecage.cli import app

    group = typer.main.get_command(app)
    return {
        name: {sub for sub, c in getattr(command, "commands", {}).items() if not c.hidden}
        for name, command in getattr(group, "commands", {}).items()
        if not command.hidden
    }


def _sentences(markdown: str) -> list[str]:
    """The prose of a page, sentence by sentence: code blocks dropped, lines joined."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.DOTALL | re.MULTILINE)
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", prose)]
    return [s for p in paragraphs for s in re.split(r"(?<=[.!?])\s+(?=[A-Z*`(\[])", p) if s]


def _named_commands(markdown: str) -> list[list[str]]:
    """Every `codecage WORD [WORD]` of a page: in inline code, or a line of a console block."""
    named = []
    for sentence in _sentences(markdown):
        named += re.findall(r"`codecage ((?:[a-z][a-z-]*)(?: [a-z][a-z-]*)?)", sentence)
    for _, block in _fenced(markdown, "console"):
        named += re.findall(r"^(?:\$ )?codecage ([a-z][a-z-]*(?: [a-z][a-z-]*)?)", block, re.M)
    return [words.split() for words in named]


def _exists(words: list[str], commands: dict[str, set[str]]) -> bool:
    """`codecage run`, `codecage audit list`; a second word after a command with no
    sub-commands is an argument (`codecage run script`), not a command."""
    if words[0] not in commands:
        return False
    return len(words) == 1 or not commands[words[0]] or words[1] in commands[words[0]]


@pytest.mark.parametrize("page", sorted(USER_DOCS))
def test_the_user_docs_name_only_commands_that_exist(page: str) -> None:
    """docs/cli.md's prose once called `gen` and `audit` planned long after they shipped; a
    command a page names (outside a sentence that says it is planned or not built) exists."""
    commands = _cli_commands()
    planned = {
        word
        for sentence in _sentences(USER_DOCS[page])
        if re.search(r"\bplanned\b|\bnot built\b", sentence, re.IGNORECASE)
        for word in re.findall(r"`codecage ([a-z][a-z-]*)", sentence)
    }
    wrong = [
        " ".join(words)
        for words in _named_commands(USER_DOCS[page])
        if not _exists(words, commands) and words[0] not in planned
    ]
    assert wrong == [], f"{page} names commands the CLI does not have: {wrong}"


TOML_BLOCKS = [
    (page, line, text)
    for page, markdown in sorted(USER_DOCS.items())
    for line, text in _fenced(markdown, "toml")
]


@pytest.mark.parametrize(
    ("page", "line", "text"), TOML_BLOCKS, ids=[f"{p}:{n}" for p, n, _ in TOML_BLOCKS]
)
def test_every_config_example_in_the_docs_is_a_config_file_codecage_accepts(
    tmp_path: Path, page: str, line: int, text: str
) -> None:
    """A key renamed or dropped in the code leaves no example behind that would be refused."""
    from codecage import config

    tmp_path.chmod(0o755)  # a config file must be trusted: no pytest 0700 above it
    example = tmp_path / "config.toml"
    example.write_text(text, encoding="utf-8")
    config.load(example, environ={})


@pytest.mark.parametrize("page", sorted(USER_DOCS))
def test_no_command_that_exists_is_called_planned(page: str) -> None:
    commands = _cli_commands()
    wrong = [
        sentence
        for sentence in _sentences(USER_DOCS[page])
        if re.search(r"\bplanned\b", sentence, re.IGNORECASE)
        and {*re.findall(r"`(?:codecage )?([a-z][a-z-]*)`", sentence)} & commands.keys()
    ]
    assert wrong == [], f"{page} calls an existing command planned: {wrong}"


def test_the_cli_docs_list_every_command_in_their_intro() -> None:
    """The table at the top of docs/cli.md is generated (gen-cli-docs --check keeps it fresh);
    this fails if the table itself is dropped from the page."""
    intro = CLI_DOC.split("\n## ", 1)[0]
    for name in _cli_commands():
        assert f"[`codecage {name}`](#codecage-{name})" in intro, name


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
