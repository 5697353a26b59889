"""Reading codecage's own source: what a module imports, for the tests that pin layering."""

from __future__ import annotations

import ast
from pathlib import Path


def imports_of(path: Path) -> set[str]:
    """The dotted names of the absolute imports in `path`: `import a.b` and
    `from a.b import c` both give a.b (relative imports: see `relative_imports`)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def top_level_imports(path: Path) -> set[str]:
    """The top-level packages `path` imports (absolute imports only)."""
    return {name.split(".")[0] for name in imports_of(path)}


def relative_imports(path: Path) -> int:
    """How many `from . import x` style imports `path` has."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return sum(1 for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level)
