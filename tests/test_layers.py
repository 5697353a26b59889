"""The layers hold: every import inside `src/codecage` points down the layer order, and no
two files import each other, directly or around a loop.

`LAYERS` below is the single source of the order (docs/architecture.md shows it; a test
here keeps the two equal). The imports are read from the source with `ast`, not by
importing anything: an import under `if TYPE_CHECKING:` is exempt (it never runs), an
import inside a function counts (it runs when the function does, and one put there to
dodge a cycle is still that cycle).

A layer may import from its own layer and any layer below it. Besides the order:
- a concrete backend (`backends/bwrap.py`, ...) is imported by no module outside
  `backends/`: the rest of the package reaches backends through the protocol and the
  name table in `backends/base.py`;
- the faces (the library's `sandbox`/`session`/`batch`, `mcp/`, `cli/`) do not import the
  engine: they hold a `Host` and send it requests.

`KNOWN` lists what is still against these rules in code that other work restructures (the
host and the CLI): each entry must still be true (a fixed one is removed from the list, as
a strict xfail would be), and nothing else may be.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "src"
PACKAGE = "codecage"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("guest", ("guest",)),
    ("foundations", ("_version", "errors", "output", "forks", "fdio", "kept", "runtime")),
    ("models", ("models",)),
    ("plans", ("policy", "isolation", "offline", "displays")),
    ("options", ("config", "configsearch", "options", "packages")),
    ("backends", ("backends",)),
    ("trail, egress", ("audit", "egress")),
    ("bridge", ("bridge",)),
    ("engine", ("engine",)),
    ("host", ("host", "toolsetup")),
    ("library", ("", "sandbox", "session", "batch")),
    ("faces", ("mcp", "cli", "ray")),
)
"""Bottom first: (the layer's name, the modules and packages in it, relative to
`codecage`; "" is the package's own `__init__`, the public API)."""

CONCRETE_BACKENDS = ("backends.bwrap", "backends.gvisor", "backends.landlock")
FACES = ("", "sandbox", "session", "batch", "mcp", "cli", "ray")

KNOWN: frozenset[str] = frozenset()
"""Violations left to other work, as the checks word them."""


@dataclass(frozen=True, slots=True)
class Import:
    """One import of a module of the package by another: where, and of what."""

    source: str  # dotted, relative to `codecage` ("" for the package itself)
    target: str
    line: int


def _modules() -> dict[str, Path]:
    """Every module of the package, dotted relative to `codecage` ("" is its __init__)."""
    found: dict[str, Path] = {}
    for path in (SOURCE / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(SOURCE / PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _relative(dotted: str) -> str | None:
    """`codecage.a.b` -> `a.b` (`codecage` -> ""); None for anything outside the package."""
    if dotted == PACKAGE:
        return ""
    if dotted.startswith(PACKAGE + "."):
        return dotted[len(PACKAGE) + 1 :]
    return None


def _module_of(name: str) -> str:
    """The module a dotted name is in: itself when it is one, else its nearest parent."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The package's modules an import statement of `module` loads: for `from P import x`,
    the submodule P.x when there is one, else P."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = _relative(alias.name)
            if name is not None:
                yield _module_of(name)
        return
    base = node.module or ""
    if node.level:
        package = module.split(".")
        if MODULES[module].stem != "__init__":
            package = package[:-1]
        package = package[: len(package) - (node.level - 1)]
        absolute = ".".join([PACKAGE, *filter(None, package), *([base] if base else [])])
    else:
        absolute = base
    name = _relative(absolute)
    if name is None:
        return
    for alias in node.names:
        sub = f"{name}.{alias.name}".lstrip(".")
        yield sub if sub in MODULES else _module_of(name)


def _imports(module: str, tree: ast.Module | None = None) -> Iterator[Import]:
    """Every import of the package's modules by `module` (its source, or `tree`) that can
    run: at the top, in functions and classes, in try and if blocks; not under
    `if TYPE_CHECKING:`."""
    if tree is None:
        tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                pending.extend(child.orelse)
            elif isinstance(child, ast.Import | ast.ImportFrom):
                for target in _targets(module, child):
                    if target != module:
                        yield Import(module, target, child.lineno)
            else:
                pending.append(child)


IMPORTS = sorted(
    {found for module in MODULES for found in _imports(module)},
    key=lambda i: (i.source, i.line, i.target),
)


def layer_of(module: str) -> int:
    """The index in `LAYERS` of `module`: its most specific entry."""
    best: tuple[int, int] | None = None
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            inside = module == member or (member and module.startswith(member + "."))
            if inside and (best is None or len(member) > best[1]):
                best = (index, len(member))
    if best is None:
        raise AssertionError(f"codecage.{module} is in no layer: add it to LAYERS")
    return best[0]


def _inside(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or (p and module.startswith(p + ".")) for p in prefixes)


def describe(found: Import) -> str:
    source = f"codecage.{found.source}".rstrip(".")
    target = f"codecage.{found.target}".rstrip(".")
    return f"{source} -> {target}"


def violations() -> set[str]:
    """Every import against the order or against the two rules above."""
    bad: set[str] = set()
    for found in IMPORTS:
        source, target = layer_of(found.source), layer_of(found.target)
        if target > source:
            bad.add(f"{describe(found)} (up from {LAYERS[source][0]} to {LAYERS[target][0]})")
        if _inside(found.target, CONCRETE_BACKENDS) and not _inside(found.source, ("backends",)):
            bad.add(f"{describe(found)} (a concrete backend outside backends/)")
        if _inside(found.source, FACES) and _inside(found.target, ("engine",)):
            bad.add(f"{describe(found)} (a face reaching past the host into the engine)")
    return bad


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen: set[str] = set()
    pending = list(graph[start])
    while pending:
        module = pending.pop()
        if module not in seen:
            seen.add(module)
            pending.extend(graph[module])
    return seen


def cycles() -> list[list[str]]:
    """Each set of modules that import each other around a loop (two or more), sorted: the
    graph is small, so by reachability from each module rather than by Tarjan's."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for found in IMPORTS:
        graph[found.source].add(found.target)
    reach = {module: _reachable(graph, module) for module in graph}
    loops = {
        frozenset({module} | {other for other in reach[module] if module in reach[other]})
        for module in graph
        if module in reach[module]
    }
    return sorted(sorted(f"codecage.{m}".rstrip(".") for m in loop) for loop in loops)


def test_every_module_is_in_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def test_no_import_goes_against_the_layer_order() -> None:
    found = violations()
    cycle_entries = {e for e in KNOWN if e.startswith("cycle ")}
    new = found - (KNOWN - cycle_entries)
    gone = (KNOWN - cycle_entries) - found
    assert not new, "imports against the layers:\n" + "\n".join(sorted(new))
    assert not gone, "fixed, remove from KNOWN:\n" + "\n".join(sorted(gone))


def test_no_import_cycle_between_files() -> None:
    found = {"cycle " + " <-> ".join(component) for component in cycles()}
    cycle_entries = {e for e in KNOWN if e.startswith("cycle ")}
    assert not found - cycle_entries, "import cycles:\n" + "\n".join(sorted(found - cycle_entries))
    assert not cycle_entries - found, "fixed, remove from KNOWN:\n" + "\n".join(
        sorted(cycle_entries - found)
    )


def test_the_reader_counts_function_level_imports_and_skips_type_checking_ones() -> None:
    """The reader itself, on a module of the models layer written to break the order twice:
    the import in a function is seen (and goes up), the one for the type checker is not."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from codecage.host import Host\n"
        "def f() -> None:\n    from codecage.engine import run\n"
    )
    seen = [found.target for found in _imports("models.result", tree)]
    assert seen == ["engine.run"]
    assert layer_of("engine.run") > layer_of("models.result")


def render() -> str:
    """The layer table as docs/architecture.md shows it, bottom first."""
    lines = []
    for name, members in LAYERS:
        shown = ", ".join(
            "codecage (the package: __init__)"
            if not m
            else (f"{m}/" if (SOURCE / PACKAGE / m.replace(".", "/")).is_dir() else m)
            for m in members
        )
        lines.append(f"{name:<15}{shown}")
    return "\n".join(lines)


def test_the_architecture_doc_shows_the_layers() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"## Layers.*?```text\n(.*?)```", doc, re.S)
    assert block is not None, "docs/architecture.md has no ## Layers section with a text block"
    assert block.group(1).rstrip("\n") == render(), "the doc's layer table is not LAYERS:\n" + (
        render()
    )


@pytest.mark.parametrize("member", [m for _, ms in LAYERS for m in ms if m])
def test_every_layer_member_exists(member: str) -> None:
    assert member in MODULES, f"LAYERS names codecage.{member}, which does not exist"
