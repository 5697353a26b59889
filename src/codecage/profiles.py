"""Capability profiles: which modules the agent's code may import.

This is a *policy* layer on top of the sandbox, never the boundary: the import hook runs
inside the sandbox, in the same interpreter as the code it polices, and determined code can
get around it (`random._os` is the `os` module). What the code can *do* is bounded by the
OS layers (namespaces, seccomp, limits) whatever it imports. The policy's job is to make
intent explicit, and to give an agent a clear, early "not allowed here, and how to ask".

A profile names modules by dotted prefix: "xml.etree" allows `xml.etree.ElementTree` and the
parent package `xml` as a stepping stone, not `xml.dom`. Profiles combine by union.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass

from codecage.errors import ConfigError
from codecage.models import ProfileInfo

RUNTIME_MODULES = frozenset({"codecage", "codecage.runtime"})
"""The guest's own helpers, importable under every profile."""

_BASIC = frozenset(
    {
        # numbers and data structures
        "math", "cmath", "random", "statistics", "decimal", "fractions", "numbers",
        "collections", "itertools", "functools", "operator", "heapq", "bisect", "array",
        "copy", "pprint", "reprlib", "enum", "dataclasses", "typing", "types", "abc",
        "contextlib", "graphlib", "weakref",
        # text
        "string", "textwrap", "re", "difflib", "unicodedata", "json", "csv", "html",
        "html.parser", "xml.etree", "urllib.parse",
        # encodings and hashes
        "base64", "binascii", "hashlib", "hmac", "secrets", "struct", "codecs", "zlib",
        # time
        "datetime", "zoneinfo", "calendar", "time",
        # identifiers, async (for tool calls), diagnostics of the code's own errors
        "uuid", "asyncio", "traceback", "warnings", "io",
    }
)  # fmt: skip

_FILESYSTEM = frozenset(
    {
        "pathlib", "os.path", "tempfile", "shutil", "glob", "fnmatch", "zipfile", "tarfile",
        "gzip", "bz2", "lzma", "filecmp", "stat",
    }
)  # fmt: skip

_NETWORK = frozenset(
    {"urllib.request", "urllib.error", "http.client", "http.cookiejar", "ssl", "socket",
     "email", "mimetypes", "httpx", "requests"}
)  # fmt: skip

_DATA_SCIENCE = frozenset(
    {"numpy", "pandas", "scipy", "matplotlib", "sklearn", "pyarrow", "sympy", "statsmodels"}
)

BUILTIN_PROFILES: dict[str, frozenset[str]] = {
    "basic": _BASIC,
    "data_science": _BASIC | _DATA_SCIENCE,
    "filesystem": _BASIC | _FILESYSTEM,
    "network": _BASIC | _NETWORK,
}

PROFILE_DESCRIPTIONS: dict[str, str] = {
    "basic": "a curated safe stdlib set: maths, text, data formats, dates, hashing, asyncio",
    "data_science": "basic + numpy, pandas, scipy, matplotlib (Agg backend) and friends, "
    "where installed (the `data` extra)",
    "filesystem": "basic + pathlib, os.path, shutil, glob, archives (still confined to "
    "/workspace and /tmp by the OS)",
    "network": "basic + urllib.request, http.client, socket, httpx/requests; only useful "
    "with a network policy, which codecage does not have yet: the sandbox has no network",
}


PRELOAD: tuple[str, ...] = ("numpy", "pandas", "matplotlib", "matplotlib.pyplot")
"""Heavy modules a warm sandbox imports before its request, when its profile allows them
and they are installed: the ~1 s a cold `import pandas` costs is then paid ahead of time."""


@dataclass(frozen=True, slots=True)
class ImportPolicy:
    """The modules one run may import, and how to explain a refusal."""

    profile: str  # e.g. "basic" or "data_science,filesystem"
    modules: frozenset[str]

    def allows(self, dotted: str) -> bool:
        """Whether `import dotted` is allowed (pure; mirrors the guest's check)."""
        return module_allowed(dotted, self.modules)


def preload_for(policy: ImportPolicy | None) -> tuple[str, ...]:
    """The modules a warm sandbox of `policy` imports ahead of its request."""
    if policy is None:
        return ()
    wanted = [m for m in PRELOAD if policy.allows(m)]
    installed = importable(wanted)
    return tuple(m for m in wanted if installed.get(m.split(".")[0], False))


def module_allowed(dotted: str, modules: Iterable[str]) -> bool:
    """`dotted` is allowed when it is an entry, lies under one, or is a parent of one."""
    for entry in modules:
        if dotted == entry or dotted.startswith(entry + ".") or entry.startswith(dotted + "."):
            return True
    return False


def resolve(
    profiles: Iterable[str],
    *,
    allowed_imports: Iterable[str] = (),
    replace: bool = False,
    custom: dict[str, frozenset[str]] | None = None,
) -> ImportPolicy:
    """The import policy of `profiles` combined, extended (or replaced) by `allowed_imports`.

    Raises:
        ConfigError: a profile is unknown or a module name is not a dotted identifier.
    """
    known = {**BUILTIN_PROFILES, **(custom or {})}
    names = [p.strip() for p in profiles if p.strip()] or ["basic"]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(
            f"unknown profile {', '.join(map(repr, unknown))}",
            hint=f"pass {{profile}} as one of: {', '.join(sorted(known))} (combine with commas)",
        )
    extra = frozenset(_checked_module(m) for m in allowed_imports)
    modules: frozenset[str] = frozenset()
    if not replace:
        for name in names:
            modules |= known[name]
    return ImportPolicy(profile=",".join(names), modules=modules | extra | RUNTIME_MODULES)


def _checked_module(name: str) -> str:
    name = name.strip()
    if not name or not all(part.isidentifier() for part in name.split(".")):
        raise ConfigError(
            f"{name!r} is not a module name",
            hint="give dotted module names in {allowed_imports}, e.g. xml.dom.minidom",
        )
    return name


def importable(modules: Iterable[str]) -> dict[str, bool]:
    """Which third-party packages of a profile are installed, and so bound into the sandbox
    when a run's profile allows them (`pip install codecage[data]` for data_science)."""
    tops = {m.split(".")[0] for m in modules} & {m.split(".")[0] for m in _DATA_SCIENCE}
    return {top: importlib.util.find_spec(top) is not None for top in sorted(tops)}


def describe(
    default: str = "basic",
    custom: dict[str, frozenset[str]] | None = None,
    enabled: Iterable[str] | None = None,
) -> list[ProfileInfo]:
    """Every profile callers may choose (built-in and operator-defined), for `info`."""
    every = {**BUILTIN_PROFILES, **(custom or {})}
    allowed = set(enabled) if enabled is not None else set(every)
    defaults = {p.strip() for p in default.split(",")}
    return [
        ProfileInfo(
            name=name,
            description=PROFILE_DESCRIPTIONS.get(name, "defined in the config file"),
            modules=sorted(modules),
            packages_importable=importable(modules),
            default=name in defaults,
        )
        for name, modules in every.items()
        if name in allowed
    ]
