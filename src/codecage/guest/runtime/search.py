"""Finding tools: `search_tools`, `ToolRef` and `list_servers`, over the tool tree that
`codecage gen` wrote (mounted read-only at /servers), read with `ast` and never imported."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from typing import Any, Literal

from ..contract import SERVERS_DIR

_MAX_TOOL_FILE_BYTES = 1024 * 1024  # search_tools skips larger files


class ToolRef:
    """A tool found by `search_tools`: its names, its module and what it does.

    Immutable, compared and hashed by value (like a frozen dataclass, without importing
    `dataclasses` in the sandbox). `load()` imports the module; `await ref.load().call(...)`
    calls the tool.

    Attributes:
        server: the server's name, as the host knows it (for `call_tool`).
        tool: the tool's name, as the server knows it (for `call_tool`).
        module: the module to import, e.g. "servers.memory.create_entities".
        summary: the first line of the tool's description ("" for detail="name").
        description: the module's whole docstring: description, parameters, result
            (None unless detail="full").
    """

    __slots__ = ("description", "module", "server", "summary", "tool")
    __match_args__ = ("server", "tool", "module", "summary", "description")

    server: str
    tool: str
    module: str
    summary: str
    description: str | None

    def __init__(
        self, server: str, tool: str, module: str, summary: str = "", description: str | None = None
    ) -> None:
        object.__setattr__(self, "server", server)
        object.__setattr__(self, "tool", tool)
        object.__setattr__(self, "module", module)
        object.__setattr__(self, "summary", summary)
        object.__setattr__(self, "description", description)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"ToolRef is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"ToolRef is immutable: cannot delete {name!r}")

    def _fields(self) -> tuple[str, str, str, str, str | None]:
        return (self.server, self.tool, self.module, self.summary, self.description)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ToolRef):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{n}={v!r}" for n, v in zip(self.__match_args__, self._fields(), strict=True)
        )
        return f"ToolRef({fields})"

    def __str__(self) -> str:
        return f"{self.module}: {self.summary}" if self.summary else self.module

    def __reduce__(self) -> tuple[type[ToolRef], tuple[str, str, str, str, str | None]]:
        return (ToolRef, self._fields())

    def load(self) -> Any:
        """Import and return the tool's module (`call`, `call_sync`, `Params`, ...).

        Raises:
            ImportError: the module cannot be imported (e.g. /servers is not importable
                here: inside codecage it always is).
        """
        import importlib

        return importlib.import_module(self.module)


def list_servers(root: str | os.PathLike[str] | None = None) -> list[str]:
    """The servers whose tools are in the tool tree, as module names, sorted.

    `from servers.<name> import <tool>` imports one; `search_tools` finds tools across
    them. `root` is the tree (default /servers, where codecage mounts it).
    """
    base = os.fspath(root) if root is not None else SERVERS_DIR
    return [name for name, _ in _server_dirs(base)]


def _server_dirs(base: str) -> list[tuple[str, str]]:
    try:
        entries = list(os.scandir(base))
    except OSError:
        return []
    found = []
    for entry in entries:
        if (
            entry.name.isidentifier()
            and entry.is_dir(follow_symlinks=False)
            and os.path.isfile(os.path.join(entry.path, "__init__.py"))
        ):
            found.append((entry.name, entry.path))
    return sorted(found)


def search_tools(
    query: str,
    detail: Literal["name", "basic", "full"] = "basic",
    limit: int | None = 10,
    *,
    root: str | os.PathLike[str] | None = None,
) -> list[ToolRef]:
    """Tools in the tool tree that match `query`, best first, read without importing them.

    Words of the query are matched (case, plural and -ing/-ed aside, prefixes counting
    half) against each tool's name, which weighs most, then its server's name, then the
    summary, then the rest of its description. Ties go by module name; an empty query
    lists every tool. `detail`: "name" gives server, tool and module; "basic" adds the
    one-line summary; "full" adds the whole docstring (description, parameters, result).
    `limit` is the most returned (None: all). `root` is the tree (default /servers).

    Raises:
        ValueError: `detail` is not one of the three, or `limit` is below 1.
        TypeError: `query` is not a string.
    """
    if not isinstance(query, str):
        raise TypeError(f"query must be a string, not {type(query).__name__}")
    if detail not in ("name", "basic", "full"):
        raise ValueError(f"detail must be 'name', 'basic' or 'full', not {detail!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be 1 or more (or None for all), not {limit!r}")
    words = _query_words(query)
    base = os.fspath(root) if root is not None else SERVERS_DIR
    scored: list[tuple[float, str, ToolRef]] = []
    for server_module, server_path in _server_dirs(base):
        for info in _tools_of(server_module, server_path):
            score = _score(words, info) if words else 0.0
            if words and score <= 0:
                continue
            scored.append((-score, info.ref.module, info.ref))
    scored.sort(key=lambda item: (item[0], item[1]))
    chosen = scored if limit is None else scored[:limit]
    return [_with_detail(ref, detail) for _, _, ref in chosen]


class _ToolInfo:
    """A parsed tool module: its full ToolRef and its words for scoring (`more`: other
    text of the module that counts as description)."""

    __slots__ = ("description", "name", "ref", "server", "summary")

    def __init__(self, ref: ToolRef, server_module: str, tool_module: str, more: str) -> None:
        self.ref = ref
        self.name = frozenset(_words(f"{ref.tool} {tool_module}"))
        self.server = frozenset(_words(f"{ref.server} {server_module}"))
        self.summary = frozenset(_words(ref.summary))
        text = _description_body(ref.description or "") + "\n" + more
        self.description = frozenset(_words(text))


# (path, size, mtime_ns, inode) -> parsed tool: /servers is read-only, searches are many.
_parsed: dict[tuple[str, int, int, int], _ToolInfo | None] = {}


def _tools_of(server_module: str, server_path: str) -> Iterator[_ToolInfo]:
    try:
        entries = sorted(os.scandir(server_path), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        stem, dot, ext = entry.name.rpartition(".")
        if ext != "py" or not dot or stem == "__init__" or not stem.isidentifier():
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_TOOL_FILE_BYTES:
            continue
        key = (entry.path, st.st_size, st.st_mtime_ns, st.st_ino)
        if key not in _parsed:
            _parsed[key] = _parse_tool(entry.path, server_module, stem)
        info = _parsed[key]
        if info is not None:
            yield info


def _parse_tool(path: str, server_module: str, tool_module: str) -> _ToolInfo | None:
    """Read a tool module's docstring and SERVER/TOOL constants with `ast`, not import."""
    import ast

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            source = f.read(_MAX_TOOL_FILE_BYTES + 1)
        if len(source) > _MAX_TOOL_FILE_BYTES:
            return None
        tree = ast.parse(source, filename=path)
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    constants: dict[str, str] = {}
    for node in tree.body:
        target: ast.expr | None = None
        value: ast.expr | None = None
        if isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        if (
            isinstance(target, ast.Name)
            and target.id in ("SERVER", "TOOL")
            and isinstance(value, ast.Constant)
            and isinstance(value.value, str)
        ):
            constants[target.id] = value.value
    doc = ast.get_docstring(tree) or ""
    summary = next((line.strip() for line in doc.splitlines() if line.strip()), "")
    ref = ToolRef(
        server=constants.get("SERVER", server_module),
        tool=constants.get("TOOL", tool_module),
        module=f"servers.{server_module}.{tool_module}",
        summary=summary,
        description=doc,
    )
    # The docstrings of its types describe the fields of nested arguments and results.
    types = [ast.get_docstring(n) or "" for n in tree.body if isinstance(n, ast.ClassDef)]
    return _ToolInfo(ref, server_module, tool_module, "\n".join(types))


def _description_body(doc: str) -> str:
    """The docstring without codegen's closing paragraph, which every tool has alike."""
    cut = doc.find("\nCall it with `await call(")
    return doc if cut < 0 else doc[:cut]


# Dropped from a query (unless it has nothing else): they match everything.
_STOP_WORDS = frozenset(
    {"a", "an", "and", "are", "as", "at", "be", "by", "do", "for", "from", "i", "in"}
    | {"into", "is", "it", "me", "my", "of", "on", "or", "that", "the", "to", "which", "with"}
)


def _split_words(text: str) -> list[str]:
    """Lowercase words of `text`, camelCase and snake_case split: readGraph -> read, graph."""
    words: list[str] = []
    current: list[str] = []
    previous = ""
    for ch in text:
        if ch.isalnum() and ch.isascii():
            if ch.isupper() and current and (previous.islower() or previous.isdigit()):
                words.append("".join(current))
                current = []
            current.append(ch)
        elif current:
            words.append("".join(current))
            current = []
        previous = ch
    if current:
        words.append("".join(current))
    return [w.lower() for w in words]


def _stem(word: str) -> str:
    """A crude English stem, the same on both sides: entities/entity, creating/create."""
    if len(word) > 4 and word.endswith("ies"):
        word = word[:-3] + "y"
    elif len(word) > 4 and word.endswith(("sses", "ches", "shes", "xes", "zes")):
        word = word[:-2]
    elif len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        word = word[:-1]
    if len(word) > 5 and word.endswith("ing"):
        word = word[:-3]
    elif len(word) > 4 and word.endswith("ed"):
        word = word[:-2]
    if len(word) > 3 and word.endswith("e"):
        word = word[:-1]
    return word


def _words(text: str) -> list[str]:
    return [_stem(w) for w in _split_words(text)]


def _query_words(query: str) -> list[str]:
    raw = _split_words(query)
    kept = [w for w in raw if w not in _STOP_WORDS] or raw
    return list(dict.fromkeys(_stem(w) for w in kept))


# Per query word: a match in the tool's name outweighs matches everywhere else together.
_WEIGHTS = (("name", 8.0), ("server", 4.0), ("summary", 2.0), ("description", 1.0))


def _score(words: list[str], info: _ToolInfo) -> float:
    score = 0.0
    for word in words:
        for field, weight in _WEIGHTS:
            tokens: frozenset[str] = getattr(info, field)
            if word in tokens:
                score += weight
            elif len(word) >= 3 and any(t.startswith(word) for t in tokens):
                score += weight / 2
    return score


def _with_detail(ref: ToolRef, detail: str) -> ToolRef:
    if detail == "full":
        return ref
    return ToolRef(ref.server, ref.tool, ref.module, ref.summary if detail == "basic" else "")


# Public as the package's (codecage.runtime): tracebacks and pickles name it so.
ToolRef.__module__ = __package__ or ToolRef.__module__
