"""Untrusted text as Python source: string literals and docstrings.

Text an upstream server wrote (descriptions, titles, names, enum values, defaults) only ever
reaches the generated code through here: as a string literal (`py_str`, every non-ASCII or
non-printable character escaped) or as docstring text (`doc_text` drops control characters
and bounds the length, `docstring` doubles backslashes and breaks runs of quotes).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

MAX_DESCRIPTION: Final = 4000
_MAX_SUMMARY: Final = 120
_LINE_BREAKS: Final = re.compile("\r\n|[\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def py_str(text: str) -> str:
    """A Python string literal for `text`, safe for any input, in `ruff format` style.

    Every character that is not printable ASCII is escaped (so the source is ASCII, shows no
    bidi or homoglyph tricks, and its width is its length); the quote is ruff's choice:
    double, unless the text holds more double quotes than single ones.
    """
    quote = "'" if text.count('"') > text.count("'") else '"'
    out: list[str] = []
    for ch in text:
        code = ord(ch)
        if ch in ("\\", quote):
            out.append("\\" + ch)
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif code < 0x100:
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return quote + "".join(out) + quote


def doc_text(value: object, limit: int) -> str:
    """Untrusted text made fit for a docstring: printable, dedented, bounded. Not escaped."""
    if not isinstance(value, str):
        return ""
    text = _LINE_BREAKS.sub("\n", value[: limit * 2])
    text = "".join(ch if ch == "\n" or ch.isprintable() else " " for ch in text.expandtabs(4))
    lines = [line.rstrip() for line in text.split("\n")]
    indents = [len(line) - len(line.lstrip(" ")) for line in lines if line]
    cut = min(indents, default=0)
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line[cut:])
    text = "\n".join(out).strip("\n")
    if len(text) > limit:
        text = text[: limit - 4].rstrip() + " ..."
    return text


def doc_line(value: object, limit: int) -> str:
    """Untrusted text as one docstring line."""
    return " ".join(doc_text(value, limit * 2).split())[:limit]


def summary_line(description: object, fallback: str) -> str:
    for line in doc_text(description, MAX_DESCRIPTION).split("\n"):
        text = " ".join(line.split())
        if text:
            if len(text) > _MAX_SUMMARY:
                text = text[: _MAX_SUMMARY - 4].rsplit(" ", 1)[0] + " ..."
            return text
    return fallback


def _escape_doc(text: str) -> str:
    """Docstring body text (from `doc_text`) as the inside of a triple-quoted string.

    Backslashes are doubled; a quote is escaped where it would make a run of three, and at
    the start and the end, so no run can close the string.
    """
    out: list[str] = []
    run = 0
    for i, ch in enumerate(text):
        if ch == "\\":
            out.append("\\\\")
            run = 0
        elif ch == '"':
            if run == 2 or i == 0 or i == len(text) - 1:
                out.append('\\"')
                run = 0
            else:
                out.append(ch)
                run += 1
        else:
            out.append(ch)
            run = 0
    return "".join(out)


def docstring(lines: Sequence[str], indent: str) -> str:
    """A docstring from already-sanitized lines (the first is the summary)."""
    body = [_escape_doc(line) for line in lines]
    while len(body) > 1 and not body[-1]:
        body.pop()
    if len(body) == 1:
        return f'{indent}"""{body[0]}"""'
    rest = [f"{indent}{line}" if line else "" for line in body[1:]]
    return "\n".join([f'{indent}"""{body[0]}', *rest, f'{indent}"""'])
