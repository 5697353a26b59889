"""The import rule: which dotted names an import statement asks for, and whether a profile's
module set allows them.

One rule, three users: the guest's import hook (inside the sandbox, where this package is
`codecage` and this module `codecage.imports`), `validate` (on the host, as
`codecage.guest.imports`) and the profiles. So `validate` and `run` cannot disagree. Standard
library only, and nothing of the host: the guest imports it.

A module set names modules by dotted prefix: "xml.etree" allows `xml.etree.ElementTree` and
the parent package `xml` as a stepping stone, not `xml.dom`. An import statement asks for
every module it would bind: `import a.b` asks for a.b; `from a import b` for the submodule
a.b when b is one (found without running anything), else for a, whose attribute b is (so
`from os import getcwd` is allowed wherever `import os` is); `from a import *` for a.
Relative imports (`from . import x`) resolve inside a package, whose own imports are never
the user's: they ask for nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

EVERY_MODULE = "*"
"""A module-set entry that allows every module (the `standard` profile)."""

ALWAYS_ALLOWED = frozenset({"codecage", "codecage.runtime", "servers", "skills", "__future__"})
"""Importable under every profile: the guest's own helpers, the generated tool modules and
the skills (there only when a directory is given), and compiler directives."""

TOOL_PACKAGES = ("servers", "skills")
"""Packages that exist in the sandbox only when the run is given their directory."""


def allowed(dotted: str, modules: Iterable[str]) -> bool:
    """`dotted` is allowed when it is an entry, lies under one, or is a parent of one (or
    when `*`, every module, is an entry). ALWAYS_ALLOWED is not implied: pass it in."""
    for entry in modules:
        if (
            entry == EVERY_MODULE
            or dotted == entry
            or dotted.startswith(entry + ".")
            or entry.startswith(dotted + ".")
        ):
            return True
    return False


def requested(name: str, fromlist: Sequence[str] | None = (), level: int = 0) -> list[str]:
    """The dotted names `__import__(name, fromlist=fromlist, level=level)` may bind: `name`,
    and `name.item` for each item of the fromlist (the submodules among them are checked as
    such by `refused`)."""
    if level > 0 or not name:
        return []
    items = [item for item in fromlist or () if item != "*"]
    return [f"{name}.{item}" for item in items] or [name]


def refused(
    name: str, fromlist: Sequence[str] | None, level: int, modules: Iterable[str]
) -> str | None:
    """The first dotted name of this import that `modules` does not allow, or None.

    `from a import b` binds the submodule a.b when there is one: then a.b must be allowed
    (a set that allows only a.x must not let it bind a.b); when b is a's attribute, a must
    be (as for `import a`).
    """
    modules = frozenset(modules)
    if level > 0 or not name:
        return None
    if not allowed(name, modules):
        return name
    for dotted in requested(name, fromlist, level):
        if dotted != name and not allowed(dotted, modules) and is_module(dotted):
            return dotted
    return None


def is_module(dotted: str) -> bool:
    """Whether `dotted` names a module that an import would find: one already imported, or
    one the import system's finders locate, package by package, without running any of
    them (a spec is looked up, nothing is loaded)."""
    if dotted in sys.modules:
        return True
    path: Any = None
    parts = dotted.split(".")
    for depth in range(1, len(parts) + 1):
        spec = _find_spec(".".join(parts[:depth]), path)
        if spec is None:
            return False
        path = spec.submodule_search_locations
        if path is None and depth < len(parts):
            return False  # a plain module has no submodules
    return True


def _find_spec(fullname: str, path: Any) -> Any:
    module = sys.modules.get(fullname)
    if module is not None:
        return getattr(module, "__spec__", None)
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec(fullname, path)
        except (ImportError, ValueError, AttributeError):
            continue
        if spec is not None:
            return spec
    return None
