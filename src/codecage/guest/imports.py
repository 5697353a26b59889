"""The import rule: which dotted names an import statement asks for, and whether a profile's
module set allows them.

One rule, three users: the guest's import hook (inside the sandbox, where this package is
`codecage` and this module `codecage.imports`), `validate` (on the host, as
`codecage.guest.imports`) and the profiles. So `validate` and `run` cannot disagree. Standard
library only, and nothing of the host: the guest imports it.

A module set names modules by dotted prefix: "xml.etree" allows `xml.etree.ElementTree` and
the parent package `xml` as a stepping stone, not `xml.dom`. An import statement asks for
every module it could bind: `import a.b` asks for a.b; `from a import b, c` for a.b and a.c
(b may be a submodule, and `from a import b` would bind it), or for a alone when a itself is
allowed whole; `from a import *` for a. Relative imports (`from . import x`) resolve inside a
package, whose own imports are never the user's: they ask for nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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
    """The dotted names `__import__(name, fromlist=fromlist, level=level)` asks for.

    `from a import b` asks for a.b whatever a allows, since b may be the submodule a.b: a
    set that allows a whole allows a.b too, and one that allows only a.x must not let
    `from a import b` bind a.b.
    """
    if level > 0 or not name:
        return []
    items = [item for item in fromlist or () if item != "*"]
    return [f"{name}.{item}" for item in items] or [name]


def refused(
    name: str, fromlist: Sequence[str] | None, level: int, modules: Iterable[str]
) -> str | None:
    """The first dotted name of this import that `modules` does not allow, or None."""
    return next((d for d in requested(name, fromlist, level) if not allowed(d, modules)), None)
