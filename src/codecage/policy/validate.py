"""Static validation of agent code: say what would be refused, and what looks dangerous,
without ever running it.

`validate(code, allowed_modules=..., profile_name=...)` parses the code (it is never compiled to
bytecode, imported or executed), checks its imports against the profile's module set, runs
bandit's checks in-process, adds codecage's own AST rules for what bandit misses, and measures
the code. This is a policy and comfort layer: the OS sandbox, not this module, is the boundary.

Rules (`Finding.rule_id`; bandit's own ids, e.g. "B307", come with `source="bandit"`):

| id    | kind     | severity    | what it reports                                             |
|-------|----------|-------------|-------------------------------------------------------------|
| CC001 | syntax   | high        | the code does not parse (line and column of the error)      |
| CC002 | policy   | high        | an import outside the profile's modules (`import a.b`,      |
|       |          |             | `from a import b`, `__import__('a')`, `import_module('a')`) |
| CC003 | limit    | high        | the source is over MAX_SOURCE_BYTES: refused unread         |
| CC004 | limit    | high        | over the parse or walk budget: not analysed fully           |
| CC005 | limit    | high        | too deeply nested to analyse (the parser ran out of stack)  |
| CC101 | security | medium      | dynamic execution: eval/exec/compile of a non-literal, or   |
|       |          |             | one of them (or `__import__`) used as a value               |
| CC102 | security | medium      | `__import__`/`importlib.import_module` of a non-literal     |
| CC103 | security | medium/high | `getattr(builtins or __builtins__, ...)`: high for a        |
|       |          |             | computed name or a dangerous builtin (exec, eval, open, ...)|
| CC104 | security | medium/high | dunder walking: `__subclasses__`, `__globals__`,            |
|       |          |             | `__builtins__`, `__code__`, `__closure__` (high);           |
|       |          |             | `__mro__`, `__bases__`, `__base__`, `__dict__` of a class   |
|       |          |             | or function (medium); also through `getattr`,               |
|       |          |             | `__getattribute__` or a subscript with that name            |
| CC105 | security | high/medium | native memory: ctypes, _ctypes, cffi (high); mmap (medium)  |
| CC106 | security | medium      | an absolute path outside /workspace and /tmp passed to      |
|       |          |             | open(), io.open, os.*, pathlib.*, shutil.* or glob.*        |
| CC107 | security | high        | obfuscated dynamic execution: exec/eval/compile, a dynamic  |
|       |          |             | import or getattr fed by decoding (base64, codecs, zlib,    |
|       |          |             | bytes.fromhex, chr, `[::-1]`, ...) or string building (+, %,|
|       |          |             | f-string, join, format), directly or through variables; or  |
|       |          |             | any non-literal exec/eval/compile in code that also decodes |
| CC108 | security | low         | a string built from character codes (`''.join(map(chr, ..))`|

Told which tool directories the run has (`tool_packages`), an import of `servers.*` or
`skills.*` without its directory gets a recommendation, not a finding: the import policy
allows both, and the run fails on a missing module, not on a refusal.

`valid` is False on any syntax, policy or limit finding; security findings alone leave it True,
except that with `strict=True` a high-severity one makes it False.

Bounds (huge or pathological input must come back quickly and in bounded memory; measured
here on CPython 3.11: `ast.parse` costs about 3 us and 600 bytes per node):

- MAX_SOURCE_BYTES (10 MiB, UTF-8): larger sources are refused before anything else (CC003).
- MAX_PARSE_TOKENS (100,000, counted with one regex pass that stops at the budget): larger
  sources are not parsed (CC004). This caps the AST at roughly 150,000 nodes, about 1.5 s and
  under 200 MB (parse plus walk); a million-line file stops here.
- Parser RecursionError/MemoryError (deep nesting such as `-` * 100_000 + `x`) become CC005;
  the tokenizer's own nesting limit (200 brackets, 100 indents) comes back as a SyntaxError (CC001).
- The AST walk is iterative with a budget of MAX_WALK_NODES nodes (CC004 if reached).
- bandit (a recursive visitor, about 25 us per token) runs only up to BANDIT_MAX_TOKENS tokens
  and BANDIT_MAX_DEPTH levels of AST; `Analysis.skipped` says when it did not run.

Estimated complexity (`Analysis.complexity`) is McCabe's cyclomatic number of the whole module:
1 + one per `if`, conditional expression, `for`, `while`, `except` clause, `case`, comprehension
`for` and comprehension `if`, + (operands - 1) per `and`/`or`.
"""

from __future__ import annotations

import ast
import io
import itertools
import logging
import posixpath
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from codecage.guest import contract, imports
from codecage.models import (
    MAX_CODE_BYTES,
    Analysis,
    Finding,
    Severity,
    ValidationReport,
)

log = logging.getLogger(__name__)

MAX_SOURCE_BYTES: Final = MAX_CODE_BYTES
MAX_PARSE_TOKENS: Final = 100_000
MAX_WALK_NODES: Final = 500_000
MAX_FINDINGS: Final = 200  # listed in a report; models.ValidationReport says so
BANDIT_MAX_TOKENS: Final = 20_000
BANDIT_MAX_DEPTH: Final = 150

_SEVERITY_RANK: Final[dict[str, int]] = {"low": 0, "medium": 1, "high": 2}
_TOKEN_RE: Final = re.compile(r"\w+|[^\w\s]")
_BANDIT_FILENAME: Final = "./agent_code.py"  # a bare relative name: bandit stats nothing
# B108 (hard-coded /tmp path): /tmp in the sandbox is a private tmpfs, the place to use.
_BANDIT_EXCLUDED: Final = ("B108",)

_EXEC_NAMES: Final = frozenset({"exec", "eval", "compile"})
_IMPORT_NAMES: Final = frozenset({"__import__", "import_module"})
_BUILTINS_NAMES: Final = frozenset({"builtins", "__builtins__"})
_DANGEROUS_BUILTINS: Final = frozenset(
    {"exec", "eval", "compile", "__import__", "open", "breakpoint", "globals", "vars", "getattr"}
)
_HIGH_DUNDERS: Final = frozenset(
    {"__subclasses__", "__globals__", "__builtins__", "__code__", "__closure__"}
)
_MEDIUM_DUNDERS: Final = frozenset({"__mro__", "__bases__", "__base__"})
_NATIVE_MODULES: Final[dict[str, Severity]] = {
    "ctypes": "high",
    "_ctypes": "high",
    "cffi": "high",
    "mmap": "medium",
}
_DECODERS: Final = frozenset(
    {
        "b64decode",
        "b32decode",
        "b16decode",
        "b85decode",
        "a85decode",
        "urlsafe_b64decode",
        "standard_b64decode",
        "decodebytes",
        "unhexlify",
        "a2b_base64",
        "a2b_hex",
        "fromhex",
        "decompress",
        "decode",
        "loads",
        "chr",
        "bytes",
        "bytearray",
    }
)
_BUILDERS: Final = frozenset({"join", "format", "replace", "format_map"})
_PATH_FUNCS: Final = frozenset({"open", "Path", "PurePath", "PosixPath", "PurePosixPath"})
_PATH_MODULES: Final = frozenset({"os", "pathlib", "shutil", "glob", "io"})
_ALLOWED_ROOTS: Final = (contract.WORKSPACE_DIR, "/tmp")  # noqa: S108 - the sandbox's own /tmp
_NETWORK_MODULES: Final = frozenset({"socket", "urllib", "http", "requests", "httpx", "ssl"})
_BLOCK_NODES: Final = (
    ast.If,
    ast.For,
    ast.AsyncFor,
    ast.While,
    ast.With,
    ast.AsyncWith,
    ast.Try,
    ast.TryStar,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Match,
)


def validate(
    code: str,
    *,
    allowed_modules: frozenset[str] | None = None,
    profile_name: str = "basic",
    strict: bool = False,
    tool_packages: Iterable[str] | None = None,
) -> ValidationReport:
    """Analyse `code` statically; it is never executed, compiled to bytecode or imported.

    Args:
        code: Python source.
        allowed_modules: the dotted module names the profile allows (checked by the guest's
            own rule, codecage.guest.imports); None skips the import check.
        profile_name: named in messages about disallowed imports.
        strict: when True, a high-severity security finding makes the code invalid.
        tool_packages: which of `servers` and `skills` the run has (it is given their
            directories); importing another gets a recommendation. None skips that check.

    Raises:
        Nothing for any input text: problems with the code are findings in the report.
    """
    lines = code.count("\n") + (1 if code and not code.endswith("\n") else 0)
    base = _Counts(lines=lines, characters=len(code))
    skipped: list[str] = []
    if allowed_modules is None:
        skipped.append("import policy: no module set given")

    size = len(code.encode("utf-8", "surrogatepass"))
    if size > MAX_SOURCE_BYTES:
        finding = _limit(
            "CC003",
            f"source is {size} bytes, over the limit of {MAX_SOURCE_BYTES} bytes "
            f"({MAX_SOURCE_BYTES // 2**20} MiB); move data into /workspace files",
        )
        return _report([finding], base, skipped, profile_name, strict, bandit_ran=False)

    tokens = sum(1 for _ in itertools.islice(_TOKEN_RE.finditer(code), MAX_PARSE_TOKENS + 1))
    if tokens > MAX_PARSE_TOKENS:
        finding = _limit(
            "CC004",
            f"too large to analyse: over {MAX_PARSE_TOKENS} tokens; split the program or move "
            "data into /workspace files",
        )
        return _report([finding], base, skipped, profile_name, strict, bandit_ran=False)

    tree, parse_finding = _parse(code)
    if tree is None:
        assert parse_finding is not None  # noqa: S101 - _parse returns one or the other
        return _report([parse_finding], base, skipped, profile_name, strict, bandit_ran=False)

    scan = _Scan.of(tree, base)
    findings = scan.findings(allowed_modules, profile_name)
    if scan.truncated:
        findings.append(
            _limit(
                "CC004",
                f"too large to analyse fully: over {MAX_WALK_NODES} AST nodes; split the program",
            )
        )
    bandit_ran = False
    if tokens > BANDIT_MAX_TOKENS:
        skipped.append(f"bandit: {tokens} tokens, over its budget of {BANDIT_MAX_TOKENS}")
    elif scan.max_ast_depth > BANDIT_MAX_DEPTH:
        skipped.append(
            f"bandit: AST {scan.max_ast_depth} levels deep, over its budget of {BANDIT_MAX_DEPTH}"
        )
    else:
        bandit_findings, error = _bandit(code)
        bandit_ran = error is None
        if error is not None:
            skipped.append(f"bandit: {error}")
        findings.extend(bandit_findings)
    counts = scan.counts
    counts.recommendations = _recommend(scan, findings)
    if tool_packages is not None:
        counts.recommendations.extend(scan.missing_tools(frozenset(tool_packages)))
    return _report(findings, counts, skipped, profile_name, strict, bandit_ran=bandit_ran)


# --- parsing --------------------------------------------------------------------------


def _parse(code: str) -> tuple[ast.Module | None, Finding | None]:
    # The caller's warning filters must not change the verdict: under `-W error` an invalid
    # escape sequence would otherwise turn into a SyntaxError.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.parse(code, filename="<agent code>"), None
    except SyntaxError as exc:
        where = f"line {exc.lineno}, column {exc.offset}" if exc.lineno else "unknown position"
        return None, Finding(
            rule_id="CC001",
            kind="syntax",
            severity="high",
            line=max(exc.lineno or 0, 0),
            col=max(exc.offset or 0, 0),
            message=f"syntax error at {where}: {exc.msg}",
            source="codecage",
        )
    except (RecursionError, MemoryError):
        return None, _limit(
            "CC005", "too deeply nested to analyse: flatten nested expressions or blocks"
        )
    except ValueError as exc:  # null bytes, unencodable text
        return None, Finding(
            rule_id="CC001",
            kind="syntax",
            severity="high",
            line=0,
            col=0,
            message=f"source cannot be parsed: {exc}",
            source="codecage",
        )


def _limit(rule_id: str, message: str) -> Finding:
    return Finding(
        rule_id=rule_id,
        kind="limit",
        severity="high",
        line=0,
        col=0,
        message=message,
        source="codecage",
    )


# --- the walk -------------------------------------------------------------------------


@dataclass(slots=True)
class _Counts:
    lines: int
    characters: int
    functions: int = 0
    classes: int = 0
    loops: int = 0
    max_nesting_depth: int = 0
    complexity: int = 0
    imports: set[str] = field(default_factory=set)
    recommendations: list[str] = field(default_factory=list)
    nodes: int = 0


@dataclass(slots=True)
class _Imported:
    """One import as `__import__` sees it, so the guest's rule judges it as at run time."""

    node: ast.AST
    name: str  # `import a.b`, `from a.b import c`: a.b; `from . import c`: ""
    fromlist: tuple[str, ...] = ()  # `from a.b import c, d`: (c, d)
    level: int = 0  # `from .. import c`: 2

    @property
    def module(self) -> str:
        """The top-level name ("" for a relative import)."""
        return self.name.split(".")[0] if self.level == 0 else ""


@dataclass(slots=True)
class _Scan:
    """One bounded, iterative walk of the tree; the rules then read what it collected."""

    counts: _Counts
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)
    calls: list[ast.Call] = field(default_factory=list)
    attributes: list[ast.Attribute] = field(default_factory=list)
    names: list[ast.Name] = field(default_factory=list)
    subscripts: list[ast.Subscript] = field(default_factory=list)
    assigns: list[tuple[list[str], ast.expr]] = field(default_factory=list)
    imported: list[_Imported] = field(default_factory=list)
    defined: set[str] = field(default_factory=set)
    decoded: list[ast.AST] = field(default_factory=list)
    built: list[ast.AST] = field(default_factory=list)
    call_funcs: set[ast.AST] = field(default_factory=set)
    print_in_loop: int = 0
    prints: int = 0
    while_true: int = 0
    max_ast_depth: int = 0
    truncated: bool = False

    @classmethod
    def of(cls, tree: ast.Module, counts: _Counts) -> _Scan:
        scan = cls(counts)
        counts.complexity = 1
        # (node, AST depth, block depth, inside a loop)
        stack: list[tuple[ast.AST, int, int, bool]] = [(tree, 0, 0, False)]
        while stack:
            if counts.nodes >= MAX_WALK_NODES:
                scan.truncated = True
                break
            node, depth, block, in_loop = stack.pop()
            counts.nodes += 1
            scan.max_ast_depth = max(scan.max_ast_depth, depth)
            scan._visit(node, in_loop)
            if isinstance(node, _BLOCK_NODES):
                block += 1
                counts.max_nesting_depth = max(counts.max_nesting_depth, block)
            loop = in_loop or isinstance(node, ast.For | ast.AsyncFor | ast.While)
            for child in ast.iter_child_nodes(node):
                scan.parents[child] = node
                stack.append((child, depth + 1, block, loop))
        return scan

    def _visit(self, node: ast.AST, in_loop: bool) -> None:
        c = self.counts
        match node:
            case ast.FunctionDef() | ast.AsyncFunctionDef() | ast.ClassDef():
                self.defined.add(node.name)
                if isinstance(node, ast.ClassDef):
                    c.classes += 1
                else:
                    c.functions += 1
            case ast.Lambda():
                c.functions += 1
            case ast.For() | ast.AsyncFor():
                c.loops += 1
                c.complexity += 1
            case ast.While():
                c.loops += 1
                c.complexity += 1
                if isinstance(node.test, ast.Constant) and node.test.value is True:
                    self.while_true += 1
            case ast.comprehension():
                c.loops += 1
                c.complexity += 1 + len(node.ifs)
            case ast.If() | ast.IfExp() | ast.ExceptHandler() | ast.match_case():
                c.complexity += 1
            case ast.BoolOp():
                c.complexity += len(node.values) - 1
            case ast.Import():
                for alias in node.names:
                    self.imported.append(_Imported(node, alias.name))
            case ast.ImportFrom():
                items = tuple(a.name for a in node.names)
                self.imported.append(_Imported(node, node.module or "", items, node.level))
            case ast.Call():
                self.calls.append(node)
                self.call_funcs.add(node.func)
                name = _call_name(node)
                if name == "print":
                    self.prints += 1
                    self.print_in_loop += in_loop
                if name in _DECODERS:
                    self.decoded.append(node)
                elif name in _BUILDERS:
                    self.built.append(node)
                module = _literal_import(node)
                if module is not None:
                    self.imported.append(_Imported(node, module))
            case ast.Attribute():
                self.attributes.append(node)
            case ast.Name():
                self.names.append(node)
            case ast.Subscript():
                self.subscripts.append(node)
                if _is_reversing_slice(node.slice):
                    self.decoded.append(node)
            case ast.BinOp() if isinstance(node.op, ast.Add | ast.Mod):
                self.built.append(node)
            case ast.JoinedStr():
                self.built.append(node)
            case ast.Assign() | ast.AnnAssign() | ast.AugAssign() | ast.NamedExpr():
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                if names and node.value is not None:
                    self.assigns.append((names, node.value))
            case _:
                pass

    # --- rules ---------------------------------------------------------------------------

    def findings(self, allowed: frozenset[str] | None, profile: str) -> list[Finding]:
        out: list[Finding] = []
        self.counts.imports = {i.module for i in self.imported if i.module}
        for imp in self.imported:
            refused = _refused_import(imp, allowed) if allowed is not None else None
            if refused is not None:
                top = refused.split(".")[0]
                out.append(
                    _at(
                        imp.node,
                        "CC002",
                        "high",
                        f"import of '{refused}' is not allowed by profile '{profile}': allow "
                        f"it (allowed_imports=['{top}'], or --allow-import {top}) or choose a "
                        "profile that has it",
                        kind="policy",
                    )
                )
            native = _NATIVE_MODULES.get(imp.module)
            if native is not None:
                out.append(
                    _at(
                        imp.node,
                        "CC105",
                        native,
                        f"'{imp.module}' gives raw memory access and bypasses Python-level checks",
                    )
                )
        tainted = self._taint()
        out.extend(self._dynamic(tainted))
        out.extend(self._dunders())
        out.extend(self._paths())
        out.extend(self._char_codes())
        out.sort(key=lambda f: (f.line, f.col, f.rule_id))
        return out

    def missing_tools(self, given: frozenset[str]) -> list[str]:
        """What to give a run whose code imports `servers.*`/`skills.*` without that tree
        (the import would fail: no such module), once per package."""
        missing = sorted(({i.module for i in self.imported} & set(imports.TOOL_PACKAGES)) - given)
        flags = {"servers": "--mcp-config or --servers-dir", "skills": "--skills-dir"}
        return [
            f"give the run a {name} directory ({flags[name]}; {name}_dir= in the library): "
            f"without one, `import {name}.…` fails with ModuleNotFoundError"
            for name in missing
        ]

    def _taint(self) -> set[ast.AST]:
        """Nodes whose value may come from decoding or string building, through variables."""
        marked: set[ast.AST] = set()
        for node in itertools.chain(self.decoded, self.built):
            self._mark(node, marked)
        loads: dict[str, list[ast.Name]] = {}
        for name in self.names:
            if isinstance(name.ctx, ast.Load):
                loads.setdefault(name.id, []).append(name)
        tainted: set[str] = set()
        changed = True
        while changed:  # ends: each round taints at least one new name, or stops
            changed = False
            for targets, value in self.assigns:
                if value in marked:
                    for target in targets:
                        if target not in tainted:
                            tainted.add(target)
                            changed = True
                            for load in loads.get(target, []):
                                self._mark(load, marked)
        return marked

    def _mark(self, node: ast.AST, marked: set[ast.AST]) -> None:
        current: ast.AST | None = node
        while current is not None and current not in marked:
            marked.add(current)
            current = self.parents.get(current)

    def _dynamic(self, marked: set[ast.AST]) -> Iterable[Finding]:
        decodes = bool(self.decoded)
        aliases = {
            t for targets, value in self.assigns if _name_of(value) in _EXEC_NAMES for t in targets
        }
        for call in self.calls:
            name = _call_name(call)
            func = call.func
            is_exec = name in _EXEC_NAMES and (
                isinstance(func, ast.Name) or _name_of(_value_of(func)) in _BUILTINS_NAMES
            )
            is_exec = is_exec or (isinstance(func, ast.Name) and func.id in aliases)
            if is_exec and call.args and not _is_literal(call.args[0]):
                if any(a in marked for a in call.args):
                    yield _at(
                        call,
                        "CC107",
                        "high",
                        f"{name}() runs a string built or decoded at runtime: obfuscated "
                        "dynamic execution",
                    )
                elif decodes:
                    yield _at(
                        call,
                        "CC107",
                        "high",
                        f"{name}() of a non-literal in code that also decodes strings: cannot "
                        "show the executed code is not obfuscated",
                    )
                else:
                    yield _at(
                        call,
                        "CC101",
                        "medium",
                        f"{name}() of a non-literal: dynamic execution cannot be validated; "
                        "call the code directly",
                    )
            elif name in _IMPORT_NAMES and call.args and not _is_literal(call.args[0]):
                if call.args[0] in marked:
                    yield _at(
                        call,
                        "CC107",
                        "high",
                        f"{name}() of a module name built or decoded at runtime",
                    )
                else:
                    yield _at(
                        call,
                        "CC102",
                        "medium",
                        f"{name}() of a non-literal name: the import cannot be checked "
                        "against the profile",
                    )
            elif name == "getattr" and len(call.args) >= 2:
                yield from self._getattr(call, marked)
        for node in self.names:
            if (
                isinstance(node.ctx, ast.Load)
                and node.id in _EXEC_NAMES | _IMPORT_NAMES
                and node not in self.call_funcs
            ):
                severity: Severity = "high" if decodes else "medium"
                yield _at(
                    node,
                    "CC101",
                    severity,
                    f"{node.id} is used as a value: dynamic execution through an alias",
                )

    def _getattr(self, call: ast.Call, marked: set[ast.AST]) -> Iterable[Finding]:
        target, attr = call.args[0], call.args[1]
        literal = attr.value if isinstance(attr, ast.Constant) else None
        on_builtins = _name_of(target) in _BUILTINS_NAMES
        if not isinstance(literal, str) and attr in marked:
            yield _at(
                call,
                "CC107",
                "high",
                "getattr() with an attribute name built or decoded at runtime: obfuscated access",
            )
        elif on_builtins:
            dangerous = not isinstance(literal, str) or literal in _DANGEROUS_BUILTINS
            what = f"'{literal}'" if isinstance(literal, str) else "a computed name"
            yield _at(
                call,
                "CC103",
                "high" if dangerous else "medium",
                f"getattr() on builtins for {what}: reaches builtins indirectly",
            )
        elif isinstance(literal, str):
            severity = _dunder_severity(literal)
            if severity is not None:
                yield _at(call, "CC104", severity, f"getattr() for '{literal}': dunder walking")

    def _dunders(self) -> Iterable[Finding]:
        for node in self.attributes:
            severity = _dunder_severity(node.attr)
            if node.attr == "__dict__" and self._is_class_or_function(node.value):
                severity = "medium"
            if severity is not None:
                yield _at(node, "CC104", severity, f"'.{node.attr}': dunder walking")
        for call in self.calls:
            if _call_name(call) == "__getattribute__" and call.args:
                arg = call.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    severity = _dunder_severity(arg.value)
                    if severity is not None:
                        yield _at(call, "CC104", severity, f"__getattribute__('{arg.value}')")
        for sub in self.subscripts:
            key = sub.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                severity = _dunder_severity(key.value)
                if severity is not None:
                    yield _at(sub, "CC104", severity, f"['{key.value}']: dunder walking")
        for name in self.names:
            if name.id == "__builtins__":
                yield _at(name, "CC104", "high", "'__builtins__' reaches every builtin")

    def _is_class_or_function(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.defined or node.id in {"object", "type"}
        if isinstance(node, ast.Attribute):
            return node.attr == "__class__"
        return isinstance(node, ast.Call) and _call_name(node) == "type"

    def _paths(self) -> Iterable[Finding]:
        for call in self.calls:
            dotted = _dotted(call.func)
            if not dotted:
                continue
            root = dotted.split(".")[0]
            if dotted not in _PATH_FUNCS and root not in _PATH_MODULES:
                continue
            for arg in call.args:
                path = _path_prefix(arg)
                if path is not None and _outside_sandbox(path):
                    yield _at(
                        arg,
                        "CC106",
                        "medium",
                        f"{dotted}() of '{path[:80]}': only /workspace and /tmp exist in the "
                        "sandbox",
                    )

    def _char_codes(self) -> Iterable[Finding]:
        for call in self.calls:
            if _call_name(call) != "join" or not call.args:
                continue
            arg = call.args[0]
            stack: list[ast.AST] = [arg]
            seen = 0
            while stack and seen < 1000:  # bounded: only the join's own argument
                node = stack.pop()
                seen += 1
                if isinstance(node, ast.Name) and node.id == "chr":
                    yield _at(
                        call, "CC108", "low", "string built from character codes: obfuscation"
                    )
                    break
                stack.extend(ast.iter_child_nodes(node))


# --- helpers --------------------------------------------------------------------------


def _at(node: ast.AST, rule_id: str, severity: Severity, message: str, **kw: str) -> Finding:
    return Finding(
        rule_id=rule_id,
        kind=kw.get("kind", "security"),
        severity=severity,
        line=getattr(node, "lineno", 0),
        col=getattr(node, "col_offset", -1) + 1,
        message=message,
        source="codecage",
    )


def _name_of(node: ast.AST | None) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


def _value_of(node: ast.AST) -> ast.AST | None:
    return node.value if isinstance(node, ast.Attribute) else None


def _call_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def _dotted(node: ast.AST) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute) and len(parts) < 10:
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _is_literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str | bytes)


def _refused_import(imp: _Imported, allowed: frozenset[str]) -> str | None:
    """The dotted name the run-time import hook refuses for `imp`, or None: the same rule,
    the same function (`import a.b` checks a.b, `from a import b` checks a.b)."""
    return imports.refused(imp.name, imp.fromlist, imp.level, allowed | imports.ALWAYS_ALLOWED)


def _literal_import(call: ast.Call) -> str | None:
    if _call_name(call) not in _IMPORT_NAMES or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value:
        if arg.value.startswith("."):
            return None
        return arg.value
    return None


def _is_reversing_slice(node: ast.AST) -> bool:
    if not isinstance(node, ast.Slice) or node.step is None:
        return False
    step = node.step
    return isinstance(step, ast.UnaryOp) and isinstance(step.op, ast.USub)


def _dunder_severity(name: str) -> Severity | None:
    if name in _HIGH_DUNDERS:
        return "high"
    if name in _MEDIUM_DUNDERS:
        return "medium"
    return None


def _path_prefix(node: ast.AST) -> str | None:
    value: object = None
    if isinstance(node, ast.Constant):
        value = node.value
    elif isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        value = first.value if isinstance(first, ast.Constant) else None
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value if isinstance(value, str) and value.startswith("/") else None


def _outside_sandbox(path: str) -> bool:
    norm = posixpath.normpath(path)
    return not any(norm == root or norm.startswith(root + "/") for root in _ALLOWED_ROOTS)


# --- bandit ---------------------------------------------------------------------------


def _bandit(code: str) -> tuple[list[Finding], str | None]:
    """Run bandit's checks in-process on the source text, with `# nosec` ignored.

    BanditManager's public entry points read files or stdin only; `_parse_file` is the step
    they share, and it takes any binary file-like, so no temp file is written.
    """
    # Imported here: importing bandit emits a stevedore DeprecationWarning and loads its
    # plugins, which only validation needs.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from bandit.core import config as b_config  # type: ignore[import-untyped]
        from bandit.core import manager as b_manager

        # Agent code must not be able to silence findings with `# nosec`.
        manager = b_manager.BanditManager(
            b_config.BanditConfig(),
            "file",
            quiet=True,
            ignore_nosec=True,
            profile={"exclude": _BANDIT_EXCLUDED},
        )
        data = io.BytesIO(code.encode("utf-8", "surrogatepass"))
        manager._parse_file(_BANDIT_FILENAME, data, [_BANDIT_FILENAME])
    if manager.skipped:
        return [], str(manager.skipped[0][1])
    findings = []
    for issue in manager.get_issue_list():
        severity = str(issue.severity).lower()
        findings.append(
            Finding(
                rule_id=str(issue.test_id),
                kind="security",
                severity=severity if severity in _SEVERITY_RANK else "low",
                line=int(issue.lineno),
                col=int(issue.col_offset) + 1,
                message=str(issue.text),
                source="bandit",
            )
        )
    return findings, None


# --- verdict --------------------------------------------------------------------------


def _recommend(scan: _Scan, findings: list[Finding]) -> list[str]:
    c = scan.counts
    rules = {f.rule_id for f in findings}
    out: list[str] = []
    if rules & {"CC101", "CC102", "CC107", "B102", "B307"}:
        out.append("call code directly instead of eval/exec: dynamic code cannot be validated")
    if "CC002" in rules:
        out.append("import only the profile's modules, or ask for more with --allow-import")
    if "CC106" in rules:
        out.append("read and write files under /workspace; other host paths are not visible")
    if scan.print_in_loop or scan.prints > 20:
        out.append("write large results to /workspace files instead of printing: output is capped")
    if c.imports & _NETWORK_MODULES:
        out.append("the sandbox has no network unless the profile and network policy allow it")
    if scan.while_true:
        out.append("make sure `while True` loops end: the run is killed at its wall timeout")
    if c.max_nesting_depth > 4:
        out.append(f"move deeply nested blocks (depth {c.max_nesting_depth}) into functions")
    if c.complexity > 30:
        out.append(f"split the program into smaller functions (complexity {c.complexity})")
    return out


def _report(
    findings: list[Finding],
    counts: _Counts,
    skipped: list[str],
    profile: str,
    strict: bool,
    *,
    bandit_ran: bool,
) -> ValidationReport:
    if not bandit_ran and not any(s.startswith("bandit") for s in skipped):
        skipped.append("bandit: the code was not parsed")
    analysis = Analysis(
        lines=counts.lines,
        characters=counts.characters,
        functions=counts.functions,
        classes=counts.classes,
        loops=counts.loops,
        max_nesting_depth=counts.max_nesting_depth,
        complexity=counts.complexity,
        imports=sorted(counts.imports),
        recommendations=counts.recommendations,
        nodes_analysed=counts.nodes,
        bandit_ran=bandit_ran,
        skipped=skipped,
    )
    valid, message = _verdict(findings, profile, strict)  # from all of them
    return ValidationReport(
        valid=valid,
        message=message,
        profile=profile,
        strict=strict,
        findings=findings[:MAX_FINDINGS],
        omitted_findings=max(0, len(findings) - MAX_FINDINGS),
        analysis=analysis,
    )


def _verdict(findings: list[Finding], profile: str, strict: bool) -> tuple[bool, str]:
    for f in findings:
        if f.kind in ("syntax", "limit"):
            return False, f.message
    refused = [f for f in findings if f.kind == "policy"]
    if refused:
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        return False, refused[0].message + more
    security = [f for f in findings if f.kind == "security"]
    high = [f for f in security if f.severity == "high"]
    if strict and high:
        first = high[0]
        return False, (
            f"refused in strict mode: {len(high)} high-severity finding(s), first {first.rule_id} "
            f"at line {first.line}"
        )
    if not security:
        return True, f"valid under profile '{profile}': no findings"
    worst = max(security, key=lambda f: _SEVERITY_RANK[f.severity]).severity
    return True, (
        f"valid under profile '{profile}': {len(security)} security finding(s), highest {worst}"
    )
