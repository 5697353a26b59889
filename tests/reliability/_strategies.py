"""Hypothesis strategies for hostile input on the server's faces: MCP tool arguments, JSON-RPC
lines over stdio, and raw HTTP requests.

Everything here is what a client can put on the wire (JSON text, bytes); the tests decide
where it goes. Sizes are kept small enough that a few hundred examples stay within seconds,
and the few huge values (megabytes, deep nesting) are drawn as sampled constants, not grown.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st


def scaled(examples: int) -> int:
    """`examples`, times `FUZZ_SCALE` from the environment (default 1): the test command runs
    the short variant; a run by hand (or a soak) sets FUZZ_SCALE=20 for a long one, with
    pytest --timeout 0 (the test command allows 120 s per test)."""
    return max(1, round(examples * float(os.environ.get("FUZZ_SCALE", "1"))))


# --- values -------------------------------------------------------------------------------

MiB = 1024 * 1024

# Text a model (or an attacker) may send: control characters, NUL, escapes, bidi marks,
# newlines that forge lines, astral characters. Lone surrogates are in `nasty_text` too:
# the in-memory client carries them in values (the wire cannot: JSON parsers refuse them).
_NASTY_CHARS = st.sampled_from(
    [
        *("\x00", "\x1b", "\x1b]52;c;aGk=\x07", "\x1b[2J", "\n", "\r", "\t", "\u202e"),
        *("\u2028", "\x85", "\ufeff", "\U0001f600", "..", "/", "*", "%", "'", '"', "\\", " "),
    ]
)
nasty_text = st.lists(
    st.one_of(_NASTY_CHARS, st.text(max_size=8), st.sampled_from(["\ud800", "\udcff"])),
    max_size=12,
).map("".join)
wire_text = st.lists(st.one_of(_NASTY_CHARS, st.text(max_size=8)), max_size=12).map(
    lambda parts: "".join(parts).encode("utf-8", "ignore").decode("utf-8")
)
huge_text = st.sampled_from([1000, 70_000, 1 * MiB]).flatmap(
    lambda n: st.sampled_from(["a" * n, "\x00" * n, "é" * n, "\n" * n])
)

absurd_numbers = st.one_of(
    st.sampled_from([0, -1, -0.0, 1e308, -1e308, 1e-300, 2**63, 2**64 + 1, -(2**63) - 1]),
    st.sampled_from([10**30, 10**400, math.nan, math.inf, -math.inf, 5e-324]),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
)


def deep(depth: int, leaf: Any = 0) -> Any:
    """`leaf` nested `depth` lists deep (built without recursion)."""
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


# Deeper than ~200 never reaches a tool: the SDK client refuses to serialize it and both
# transports' JSON parser refuses to read it (the framing tests send such bytes raw).
deeply_nested = st.sampled_from([20, 120, 190]).map(deep)
json_scalars = st.one_of(st.none(), st.booleans(), absurd_numbers, wire_text)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(wire_text, inner, max_size=4)
    ),
    max_leaves=12,
)
hostile_values = st.one_of(json_values, nasty_text, huge_text, deeply_nested, absurd_numbers)

# --- MCP tool arguments --------------------------------------------------------------------

# Each tool's arguments, a valid value for each (cheap to run: nothing is slow), and which
# are required. Code is "1": a valid call costs one sandbox run, a few ms with the pool.
TOOL_ARGUMENTS: dict[str, dict[str, Any]] = {
    "execute_code": {
        "code": "1",
        "timeout": 5.0,
        "profile": "standard",
        "allowed_imports": ["json"],
        "memory_limit_mb": 256,
        "files": {"a.txt": "x"},
        "return_files": ["a.txt"],
        "backend": None,
        "session_id": None,
        "allow_hosts": None,
    },
    "validate_code": {"code": "import os\n1", "profile": "basic"},
    "get_sandbox_info": {"detail": False},
    "open_session": {
        "profile": None,
        "allowed_imports": None,
        "memory_limit_mb": None,
        "idle_ttl_seconds": 30.0,
        "allow_hosts": None,
    },
    "close_session": {"session_id": "ses_doesnotexist"},
    "list_sessions": {},
}
REQUIRED = {"execute_code": {"code"}, "validate_code": {"code"}, "close_session": {"session_id"}}

# Values aimed at one argument's checks (what its type and bounds would let through).
_AIMED: dict[str, st.SearchStrategy[Any]] = {
    "code": st.one_of(nasty_text, st.sampled_from(["1\x00", "'\ud800'", "x" * 70_000, "(" * 5000])),
    "files": st.one_of(
        st.dictionaries(nasty_text, nasty_text, max_size=3),
        st.dictionaries(
            st.sampled_from(["../x", "/etc/passwd", "a/../../b", "", ".", "a" * 300]),
            st.sampled_from(["x", "base64:!!!", "base64:" + "A" * 9]),
            max_size=2,
        ),
        st.just({f"f{i}": "" for i in range(101)}),
    ),
    "return_files": st.lists(
        st.one_of(nasty_text, st.sampled_from(["../../etc/passwd", "/proc/self/environ"])),
        max_size=25,
    ),
    "allow_hosts": st.lists(
        st.one_of(nasty_text, st.sampled_from(["*", "*.*", "0.0.0.0:0", "[::1]:99999"])),
        max_size=70,
    ),
    "allowed_imports": st.lists(
        st.one_of(nasty_text, st.sampled_from(["os", "ctypes", "a..b", "*"])), max_size=5
    ),
    "profile": st.one_of(
        nasty_text, st.sampled_from(["basic,,", "standard," * 50, "data_science"])
    ),
    "session_id": st.one_of(nasty_text, st.just("s" * 65)),
    "backend": st.one_of(nasty_text, st.sampled_from(["gvisor", "fallback", "b" * 33])),
}


@st.composite
def tool_calls(draw: st.DrawFn, tools: list[str] | None = None) -> tuple[str, dict[str, Any]]:
    """A tool name and arguments: the valid ones mutated (a wrong type, a missing required
    one, an extra one, an absurd value, a value aimed at the argument's own checks)."""
    tool = draw(st.sampled_from(tools or sorted(TOOL_ARGUMENTS)))
    base = {k: v for k, v in TOOL_ARGUMENTS[tool].items() if v is not None}
    args = dict(draw(st.sampled_from([base, {}, {k: base[k] for k in sorted(base)[:1]}])))
    args.update({k: base[k] for k in REQUIRED.get(tool, ()) if draw(st.booleans())})
    names = sorted(TOOL_ARGUMENTS[tool])
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        kind = draw(st.sampled_from(["hostile", "aimed", "extra", "drop", "absurd"]))
        name = draw(st.sampled_from(names)) if names else "x"
        if kind == "hostile" and names:
            args[name] = draw(hostile_values)
        elif kind == "aimed" and name in _AIMED:
            args[name] = draw(_AIMED[name])
        elif kind == "absurd" and names:
            args[name] = draw(absurd_numbers)
        elif kind == "extra":
            args[draw(st.one_of(wire_text, st.sampled_from(["timout", "__proto__"])))] = draw(
                json_scalars
            )
        elif kind == "drop" and args:
            args.pop(draw(st.sampled_from(sorted(args))))
    return tool, args


def wire_safe(value: Any) -> bool:
    """Whether `value` can travel as JSON (an MCP client refuses lone surrogates and NaN is
    not JSON): the real-transport tests draw only these."""
    try:
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except (ValueError, UnicodeEncodeError):
        return False
    return True


# --- JSON-RPC lines --------------------------------------------------------------------------

_IDS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    wire_text,
    st.lists(st.integers(), max_size=2),
    st.dictionaries(wire_text, st.integers(), max_size=2),
)
_METHODS = st.one_of(
    st.sampled_from(
        [
            *("ping", "tools/list", "tools/call", "initialize", "resources/list", "prompts/get"),
            *("notifications/cancelled", "notifications/initialized", "", "rpc.x"),
        ]
    ),
    wire_text,
)


@st.composite
def jsonrpc_messages(draw: st.DrawFn) -> Any:
    """A JSON-RPC-shaped value: right or wrong version, ids of every type, odd methods,
    params of any shape (tool calls with hostile arguments among them)."""
    message: dict[str, Any] = {}
    if draw(st.integers(min_value=0, max_value=9)):
        message["jsonrpc"] = draw(st.sampled_from(["2.0", "2.0", "1.0", 2, None]))
    if draw(st.booleans()):
        message["id"] = draw(_IDS)
    message["method"] = draw(_METHODS)
    if message["method"] == "tools/call":
        name, args = draw(tool_calls())
        message["params"] = {"name": name, "arguments": args}
    elif draw(st.booleans()):
        message["params"] = draw(json_values)
    if draw(st.integers(min_value=0, max_value=9)) == 0:
        message.update({"result": draw(json_values), "error": draw(json_values)})
    return message


@st.composite
def stdio_lines(draw: st.DrawFn) -> bytes:
    """One line (or a few) for a stdio server: garbage bytes, invalid UTF-8, valid JSON that
    is not JSON-RPC, JSON-RPC with bad fields, batches, lone-surrogate escapes."""
    kind = draw(st.integers(min_value=0, max_value=6))
    if kind == 0:
        return draw(st.binary(max_size=200)).replace(b"\n", b" ") + b"\n"
    if kind == 1:
        return json.dumps(draw(json_values)).encode() + b"\n"
    if kind == 2:
        batch = draw(st.lists(jsonrpc_messages(), min_size=0, max_size=3))
        return json.dumps(batch).encode() + b"\n"
    if kind == 3:  # JSON with a lone surrogate escape, invalid UTF-8 inside a string, NaN
        text = json.dumps(draw(jsonrpc_messages()))
        bad = draw(st.sampled_from([b'"\\ud800"', b'"\xff\xfe"', b"NaN", b"1e999", b'"\x00"']))
        return text.encode().replace(b'"2.0"', bad, 1) + b"\n"
    return json.dumps(draw(jsonrpc_messages())).encode() + b"\n"  # NaN as Python writes it


# --- HTTP requests, as bytes on a socket -------------------------------------------------------

_HEADER_NAMES = st.one_of(
    st.sampled_from(
        [
            *(b"X-A", b"Cookie", b"Accept", b"Content-Type", b"Mcp-Session-Id", b"Origin"),
            *(b"Mcp-Protocol-Version", b"Expect", b"Connection", b"Upgrade", b"Range", b"Host"),
        ]
    ),
    st.binary(min_size=1, max_size=12).filter(lambda b: b":" not in b and b"\n" not in b),
)
_HEADER_VALUES = st.one_of(
    st.sampled_from(
        [
            *(b"", b"\xff\xfe\x80", b"\x00", b"a\rb", b"100-continue", b"h2c", b"websocket"),
            *(b"bytes=0-99999999999", b"application/json; charset=latin-1", b"close"),
        ]
    ),
    st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
    st.sampled_from([20_000, 70_000]).map(lambda n: b"v" * n),
)


@dataclass(frozen=True)
class HttpRequest:
    """A request as sent: its bytes, and what the test must know of it."""

    data: bytes
    authorized: bool
    path: str
    whole: bool
    """Whether the body is all there as framed (if not, the client half-closes after it)."""

    def __repr__(self) -> str:
        return f"HttpRequest({self.data[:400]!r}..., {len(self.data)} bytes)"


def _chunked(body: bytes, broken: str) -> bytes:
    if broken == "bad-size":
        return b"zz\r\n" + body + b"\r\n0\r\n\r\n"
    if broken == "short":
        return b"%x\r\n" % (len(body) + 5) + body + b"\r\n0\r\n\r\n"
    if broken == "huge-size":
        return b"ffffffffffffffffffff\r\n" + body
    if broken == "no-crlf":
        return b"%x" % len(body) + body + b"0\r\n\r\n"
    if broken == "negative":
        return b"-5\r\nabc\r\n0\r\n\r\n"
    return b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n" if body else b"0\r\n\r\n"


@st.composite
def http_requests(draw: st.DrawFn, port: int, token: str, bodies: st.SearchStrategy[bytes]) -> Any:
    """A raw HTTP/1.1 request to `codecage serve --http`: odd methods and paths, the token
    right, wrong, missing or repeated, headers huge, many, duplicated or not latin-1, a body
    framed by a right or wrong Content-Length or by (broken) chunks, or neither."""
    method = draw(st.sampled_from([b"POST", b"POST", b"GET", b"DELETE", b"PUT", b"OPTIONS"]))
    path = draw(
        st.sampled_from(
            [
                *("/mcp", "/mcp", "/run_code", "/run_code", "/healthz", "/metrics", "/"),
                *("/mcp/", "/%00", "/run_code?x=1", "/" + "a" * 9000, "*", "/mcp#x"),
            ]
        )
    )
    if draw(st.integers(min_value=0, max_value=15)) == 0:
        method = draw(st.binary(min_size=1, max_size=8).filter(lambda b: b" " not in b))
    lines = [method + b" " + path.encode() + b" HTTP/1.1"]
    host = draw(st.sampled_from([f"127.0.0.1:{port}", f"127.0.0.1:{port}", "evil.example", ""]))
    if draw(st.integers(min_value=0, max_value=9)):
        lines.append(b"Host: " + host.encode())
    auth = draw(st.sampled_from(["right", "right", "right", "none", "wrong", "twice", "odd"]))
    if auth in ("right", "twice"):
        lines.append(f"Authorization: Bearer {token}".encode())
    if auth == "twice":
        lines.insert(1, b"Authorization: Bearer not-it")
    if auth == "wrong":
        lines.append(b"Authorization: Bearer " + token.encode()[:-1] + b"\xff")
    if auth == "odd":
        lines.append(draw(st.sampled_from([b"Authorization: ", b"Authorization: Basic Og=="])))
    if draw(st.booleans()):
        lines.append(b"Content-Type: application/json")
        lines.append(b"Accept: application/json, text/event-stream")
    for _ in range(draw(st.sampled_from([0, 0, 1, 3, 300]))):
        lines.append(draw(_HEADER_NAMES) + b": " + draw(_HEADER_VALUES))
    body = draw(bodies)
    framing = draw(st.sampled_from(["length", "length", "none", "chunked", "lie", "two", "bad"]))
    whole = framing in ("length", "none")
    if framing in ("length", "two"):
        lines.append(b"Content-Length: %d" % len(body))
    if framing == "two":
        lines.append(b"Content-Length: %d" % (len(body) + 1))
    if framing == "lie":
        lines.append(b"Content-Length: %d" % draw(st.sampled_from([0, len(body) + 10, 2**40])))
    if framing == "bad":
        lines.append(b"Content-Length: " + draw(st.sampled_from([b"-1", b"1e3", b"0x10", b" 5"])))
    if framing == "chunked":
        lines.append(b"Transfer-Encoding: chunked")
        broken = draw(st.sampled_from(["ok", "ok", "bad-size", "short", "huge-size", "no-crlf"]))
        body = _chunked(body, broken)
        whole = broken == "ok"
    if framing == "none":
        body = b""
    data = b"\r\n".join(lines) + b"\r\n\r\n" + body
    return HttpRequest(data, authorized=auth == "right", path=path, whole=whole)


def _run_code_bodies() -> st.SearchStrategy[Any]:
    """SandboxFusion requests with absurd fields (mostly cheap to run: `1`)."""
    field_values: dict[str, st.SearchStrategy[Any]] = {
        "run_timeout": st.one_of(st.just(5), absurd_numbers),
        "compile_timeout": absurd_numbers,
        "memory_limit_MB": st.one_of(st.just(-1), absurd_numbers),
        "stdin": st.one_of(st.none(), wire_text, json_values),
        "files": st.one_of(
            st.dictionaries(wire_text, st.one_of(st.none(), wire_text), max_size=3),
            st.just({"../x": "YQ=="}),
            st.just({"a": "!!notbase64"}),
            json_values,
        ),
        "fetch_files": st.one_of(st.lists(wire_text, max_size=3), json_values),
    }
    return st.fixed_dictionaries(
        {
            "code": st.one_of(st.just("1"), wire_text, st.just("print(input())")),
            "language": st.one_of(st.just("python"), st.just("python"), wire_text),
        },
        optional=field_values,
    )


def run_code_bodies() -> st.SearchStrategy[bytes]:
    return _run_code_bodies().map(lambda body: json.dumps(body).encode())


http_bodies = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    jsonrpc_messages().map(lambda v: json.dumps(v).encode()),
    st.sampled_from([b'{"a":"\xff"}', b'{"a":"\\ud800"}', b"[" * 10_000, b"\x00" * 1000]),
    run_code_bodies(),
)
