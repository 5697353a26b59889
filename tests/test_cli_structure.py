"""The CLI's shape, read from the real typer app: each flag group declared once and taken
whole by the commands that offer it, no command function over 60 lines, and no import
cycle between the files of cli/."""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.testing

from codecage.cli.app import _click_command, app
from codecage.cli.groups import FlagGroup, groups_of, takes_groups
from codecage.cli.options import (
    AuditFlags,
    CodeFlags,
    LimitFlags,
    NetworkFlags,
    OutputFlags,
    SandboxFlags,
    ServerFlags,
    TimeoutOpt,
    ToolFlags,
)
from codecage.models import Limits

CLI = Path(__file__).resolve().parent.parent / "src" / "codecage" / "cli"
MAX_LINES = 60


def _commands(
    group: typer.Typer, path: str = "codecage"
) -> Iterator[tuple[str, Callable[..., Any]]]:
    """Every command of `group` and its sub-groups: its path and the function typer calls."""
    for info in group.registered_commands:
        assert info.callback is not None
        yield f"{path} {info.name or info.callback.__name__}", info.callback
    for sub in group.registered_groups:
        assert sub.typer_instance is not None
        yield from _commands(sub.typer_instance, f"{path} {sub.name}")


COMMANDS = dict(_commands(app))
CLICK = _click_command()


def _click_params(path: str) -> dict[str, Any]:
    """The click parameters of the command at `path` ("codecage session run"), by name."""
    command = CLICK
    for name in path.split()[1:]:
        command = command.commands[name]
    return {param.name: param for param in command.params}


def _declaration(param: Any) -> tuple[Any, ...]:
    """What a user sees of a flag: its spellings, help, variable, default and shape."""
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    return (
        tuple(param.opts),
        getattr(param, "help", None),
        param.envvar,
        repr(param.default),
        param.multiple,
        param.metavar,
        repr(annotation),
    )


def test_the_walk_finds_every_command() -> None:
    """The checks below read COMMANDS: it must hold the commands, or they prove nothing."""
    expected = {
        "codecage run",
        "codecage run-batch",
        "codecage serve",
        "codecage gen",
        "codecage session open",
        "codecage session run",
        "codecage audit web",
        "codecage packages add",
    }
    assert expected <= set(COMMANDS)


@pytest.mark.parametrize("path", sorted(COMMANDS))
def test_no_command_function_is_over_60_lines(path: str) -> None:
    """Signature, help (its docstring) and body together: a longer command hides what it
    does among its flags; its steps belong in helpers named for them."""
    function = inspect.unwrap(COMMANDS[path])
    source = textwrap.dedent(inspect.getsource(function))
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef))
    lines = (node.end_lineno or 0) - node.lineno + 1
    assert lines <= MAX_LINES, f"{path} ({function.__name__}) is {lines} lines"


def test_the_limit_flags_are_the_fields_of_limits() -> None:
    """One flag per limit: a new `Limits` field without its flag (or a flag with no field)
    fails here, and its flag is then one line in `LimitFlags`."""
    fields = [param.name for param in LimitFlags.parameters()]
    assert fields == list(Limits.model_fields)


SHARED: dict[type[FlagGroup], list[str]] = {
    LimitFlags: ["codecage run", "codecage run-batch"],
    SandboxFlags: ["codecage run", "codecage run-batch"],
    ToolFlags: ["codecage run", "codecage serve"],
    NetworkFlags: ["codecage run", "codecage run-batch", "codecage serve"],
    AuditFlags: ["codecage run", "codecage run-batch", "codecage serve"],
    OutputFlags: ["codecage run", "codecage run-batch", "codecage serve"],
    CodeFlags: ["codecage run", "codecage session run"],
    ServerFlags: [
        "codecage session open",
        "codecage session run",
        "codecage session list",
        "codecage session close",
    ],
}


@pytest.mark.parametrize("group", list(SHARED), ids=lambda g: g.__name__)
def test_a_shared_group_is_one_declaration_in_every_command_that_takes_it(
    group: type[FlagGroup],
) -> None:
    """Each command takes the group itself (one parameter), not a copy of its flags, and
    what --help shows of each flag is then the same everywhere."""
    names = [param.name for param in group.parameters()]
    seen: dict[str, tuple[Any, ...]] = {}
    for path in SHARED[group]:
        assert group in groups_of(COMMANDS[path]).values(), f"{path} does not take {group}"
        params = _click_params(path)
        for name in names:
            declared = _declaration(params[name])
            assert seen.setdefault(name, declared) == declared, f"{path}: {name} differs"


# A spelling two commands declare differently, on purpose: what it means there differs.
DIFFERENT_ON_PURPOSE = {
    "--json": "run-batch prints only its summary as JSON, on stderr",
    "--out": "run's directory, run-batch's result file, gen's tree",
    "--memory-mb": "session open: the whole session's, the server's default and bounds",
    "--timeout": "session run: within the server's maximum, which is its default",
    "--profile": "session open: the session's, the server's default",
    "--allow-host": "session open: within the server's [network] ceiling",
    "--token": "serve requires it, session sends it, audit web checks its own",
    "--host": "serve's and audit web's addresses, with their own defaults",
    "--port": "serve's and audit web's ports",
    "--server": "gen: servers to generate; session: the server to call",
    "--mcp-config": "gen: its default is the config file's servers",
    "--strict": "validate: a finding makes the code invalid; run: refuses to run it",
    "--code": "validate checks the code, run runs it",
    "--file": "validate checks the file, run runs it",
    "--all": "audit erase's and gen's",
    "--store": "each audit command's",
    "--in": "run: the fresh workspace, within --workspace-mb; session: kept for later runs",
    "--insecure-no-token": "serve's and audit web's: what an open port gives away differs",
    "--client": "audit erase erases that caller's records; list and export filter by it",
    "--since": "audit stats' window has a default; list and export filter",
    "--limit": "audit list shows 50 by default; export all",
}


def test_no_flag_is_declared_twice_by_accident() -> None:
    """Any other flag two commands take is declared once (same help, variable, default):
    a copy that drifts from the original shows here."""
    seen: dict[str, tuple[str, tuple[Any, ...]]] = {}
    for path in COMMANDS:
        for param in _click_params(path).values():
            for spelling in param.opts:
                if not spelling.startswith("--") or spelling in DIFFERENT_ON_PURPOSE:
                    continue
                first, declared = seen.setdefault(spelling, (path, _declaration(param)))
                assert declared == _declaration(param), f"{spelling}: {first} and {path}"


def _imports(tree: ast.Module, package: str) -> Iterator[tuple[str, list[str]]]:
    """Each module an import statement names, with the names it takes from it; imports
    for type checking aside, those inside functions included (they hide a cycle from
    import time, not from a reader)."""
    skipped = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for child in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            yield from ((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if not node.level else f"{package}.{node.module}"
            yield base, [alias.name for alias in node.names]


def _cli_graph() -> dict[str, set[str]]:
    """The cli/ files and which of them each names: `from codecage.cli import x` names the
    package (its __init__, which imports app) and the submodule x."""
    modules = {
        "codecage.cli" if p.stem == "__init__" else f"codecage.cli.{p.stem}": p
        for p in CLI.glob("*.py")
    }
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for module, names in _imports(ast.parse(path.read_text()), "codecage.cli"):
            named = {module, *(f"{module}.{n}" for n in names)}
            graph[name] |= {m for m in named if m in modules and m != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle in `graph`, if it has one (depth-first, with the path so far)."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for target in sorted(graph[node]):
            found = visit(target, [*path, node])
            if found:
                return found
        done.add(node)
        return None

    for start in sorted(graph):
        found = visit(start, [])
        if found:
            return found
    return None


def test_the_cli_files_import_each_other_without_a_cycle() -> None:
    graph = _cli_graph()
    # The walk reads the files: the package names the app and `run`'s hand-off.
    assert graph["codecage.cli"] == {"codecage.cli.app", "codecage.cli.handoff"}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_a_flag_taken_twice_is_refused_when_the_command_is_made() -> None:
    """Two groups (or a group and a parameter) with one flag name would leave typer one
    of them silently: refused at import instead."""

    def command(*, limits: LimitFlags, timeout: TimeoutOpt = None) -> None:
        pass

    with pytest.raises(TypeError, match="timeout"):
        takes_groups(command)


def test_a_command_gets_its_groups_built_from_the_flags_given() -> None:
    """What typer parses reaches the command as the group, the unset flags None."""
    got: list[LimitFlags] = []

    @takes_groups
    def command(*, limits: LimitFlags) -> None:
        got.append(limits)

    runner = typer.testing.CliRunner()
    single = typer.Typer()
    single.command()(command)
    result = runner.invoke(single, ["--timeout", "2.5", "--memory-mb", "300"])
    assert result.exit_code == 0, result.output
    assert got == [LimitFlags(timeout=2.5, memory_mb=300)]
    assert got[0].overrides() == {"timeout": 2.5, "memory_mb": 300}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["session", "open", "--memory-mb", "1"], "--memory-mb must be at least 32 (got 1)"),
        (["session", "run", "ID", "--code", "1", "--timeout", "0"], "--timeout must be more"),
    ],
)
def test_a_group_flag_s_own_check_runs_when_it_is_parsed(args: list[str], message: str) -> None:
    """A group's field can carry a callback (a bounds check): it must find its module's
    functions when typer calls it, and refuse as a usage error (2) before any server."""
    result = typer.testing.CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
