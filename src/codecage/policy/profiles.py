"""Capability profiles: which modules the agent's code may import.

The default profile, `standard`, refuses nothing: the whole standard library and every
installed data package (numpy, pandas, matplotlib, ...) are importable. The curated profiles
(`basic`, `data_science`, `filesystem`, `network`) are for operators who want the code's
intent made explicit, at the price of a refusal (and an agent's round trip) for anything
outside them.

This is a *policy* layer on top of the sandbox, never the boundary: the import hook runs
inside the sandbox, in the same interpreter as the code it polices, and determined code can
get around it (`random._os` is the `os` module). What the code can *do* is bounded by the
OS layers (namespaces, seccomp, limits) whatever it imports. The policy's job is to make
intent explicit, and to give an agent a clear, early "not allowed here, and how to ask".

A profile names modules by dotted prefix: "xml.etree" allows `xml.etree.ElementTree` and the
parent package `xml` as a stepping stone, not `xml.dom` (nor `from xml import dom`). Profiles
combine by union. The rule itself is codecage.guest.imports, which the guest runs too.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from codecage.errors import ConfigError
from codecage.guest.imports import ALWAYS_ALLOWED, EVERY_MODULE, allowed
from codecage.models import ProfileInfo

DEFAULT_PROFILE = "standard"
"""What runs use when neither the call nor the configuration names a profile."""

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

DATA_PACKAGES: tuple[str, ...] = (
    *sorted(_DATA_SCIENCE),
    # what analysis code reaches for next: plots, spreadsheets, graphs, parsing, tables
    "seaborn", "plotly", "openpyxl", "xlrd", "xlsxwriter", "polars", "PIL", "networkx",
    "bs4", "lxml", "yaml", "dateutil", "pytz", "tabulate", "tqdm",
)  # fmt: skip
"""Third-party packages (top-level import names) bound read-only into the sandbox of the
default profile, and of runs without an import policy, when the host has them installed
(with the packages they require)."""

BUILTIN_PROFILES: dict[str, frozenset[str]] = {
    "standard": frozenset({EVERY_MODULE}),
    "basic": _BASIC,
    "data_science": _BASIC | _DATA_SCIENCE,
    "filesystem": _BASIC | _FILESYSTEM,
    "network": _BASIC | _NETWORK,
}

PROFILE_DESCRIPTIONS: dict[str, str] = {
    "standard": "the whole standard library and every installed data package (numpy, "
    "pandas, scipy, matplotlib, ...): no import is refused; the OS layers are the boundary",
    "basic": "a curated safe stdlib set: maths, text, data formats, dates, hashing, asyncio",
    "data_science": "basic + numpy, pandas, scipy, matplotlib (Agg backend) and friends, "
    "where installed (the `data` extra)",
    "filesystem": "basic + pathlib, os.path, shutil, glob, archives (still confined to "
    "/workspace and /tmp by the OS)",
    "network": "basic + urllib.request, http.client, socket, ssl, httpx/requests: for runs "
    "allowed hosts (--allow-host, allow_hosts, the config's [network]); without any, the "
    "sandbox still has no network",
}


PRELOAD: tuple[str, ...] = ("numpy", "pandas", "matplotlib", "matplotlib.pyplot")
"""Heavy modules a warm sandbox imports before its request, when its profile allows them
and they are installed: the ~1 s a cold `import pandas` costs is then paid ahead of time."""


@dataclass(frozen=True, slots=True)
class ImportPolicy:
    """The modules one run may import, and how to explain a refusal."""

    profile: str  # e.g. "standard" or "data_science,filesystem"
    modules: frozenset[str]

    def allows(self, dotted: str) -> bool:
        """Whether `import dotted` is allowed (the guest's rule, codecage.guest.imports)."""
        return allowed(dotted, self.modules)

    @property
    def allows_every_module(self) -> bool:
        """Nothing is refused (the `standard` profile): the guest installs no import hook."""
        return EVERY_MODULE in self.modules


NETWORK_MODULES: frozenset[str] = _NETWORK
"""What a run with egress may import whatever its profile: an ordinary program that fetches
a URL just runs once its host is allowed."""


def with_network(policy: ImportPolicy | None) -> ImportPolicy | None:
    """`policy` with the network modules allowed too (a run that was allowed hosts); a
    policy that allows every module, or none, is returned as it is."""
    if policy is None or policy.allows_every_module or policy.modules >= NETWORK_MODULES:
        return policy
    return ImportPolicy(profile=policy.profile, modules=policy.modules | NETWORK_MODULES)


def preload_for(policy: ImportPolicy | None) -> tuple[str, ...]:
    """The modules a warm sandbox of `policy` imports ahead of its request."""
    if policy is None or policy.allows_every_module:
        return ()
    return tuple(m for m in PRELOAD if policy.allows(m) and installed(m.split(".")[0]))


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
    names = [p.strip() for p in profiles if p.strip()] or [DEFAULT_PROFILE]
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
    return ImportPolicy(profile=",".join(names), modules=modules | extra | ALWAYS_ALLOWED)


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
    when a run's profile allows them (`pip install codecage[data]` for the data packages)."""
    return {top: installed(top) for top in sorted(_third_party(frozenset(modules)))}


def packages_to_bind(policy: ImportPolicy | None) -> frozenset[str]:
    """The third-party packages (top-level names) a sandbox of `policy` gets bound, when
    installed: those the profile names, or every data package where nothing is refused
    (the `standard` profile, or no import policy at all)."""
    return _third_party(policy.modules if policy is not None else frozenset({EVERY_MODULE}))


def installed(top: str) -> bool:
    """Whether the host has the package `top` (and so can bind it into a sandbox)."""
    return _installed(top)


def installed_packages() -> tuple[str, ...]:
    """The third-party packages any profile names that this host has: an import refusal
    suggests allowing one of these, never a package that would then be missing."""
    every: frozenset[str] = frozenset(DATA_PACKAGES)
    for modules in BUILTIN_PROFILES.values():
        every |= _third_party(modules)
    return tuple(sorted(top for top in every if installed(top)))


def _third_party(modules: frozenset[str]) -> frozenset[str]:
    tops = {m.split(".")[0] for m in modules}
    if EVERY_MODULE in tops:
        tops |= set(DATA_PACKAGES)
    return frozenset(tops - sys.stdlib_module_names - _NOT_PACKAGES)


_NOT_PACKAGES = frozenset({EVERY_MODULE, "codecage", "servers", "skills"})


@functools.cache
def _installed(top: str) -> bool:
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):  # a broken package counts as missing
        return False


def describe(
    default: str = DEFAULT_PROFILE,
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
