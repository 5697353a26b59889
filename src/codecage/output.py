"""What the guest prints, read with a hard cap and made safe to show.

Guest output is untrusted: it can hold terminal escape sequences (which can rewrite a
reviewer's screen or a log viewer's lines), bidi controls (which make text read differently
from what it is), invalid UTF-8 and any amount of it. `CappedBuffer` keeps a bounded prefix
and counts the rest; `neutralise` turns what was kept into text that shows every such
character as a visible escape instead of acting on it or dropping it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["CappedBuffer", "neutralise", "neutralise_line", "neutralise_text"]


def _escape_for(code_point: int) -> str:
    if code_point == 0x0D:
        # CR is the one control a reader expects spelled as in Python's repr.
        return "\\r"
    if 0xDC80 <= code_point <= 0xDCFF:
        # The surrogates that os.fsdecode / errors="surrogateescape" make from undecodable
        # bytes: show the byte they stand for, as neutralise() shows an invalid byte.
        return f"\\x{code_point - 0xDC00:02x}"
    if code_point <= 0xFF:
        return f"\\x{code_point:02x}"
    return f"\\u{code_point:04x}"


def _unsafe_code_points() -> list[int]:
    c0 = [c for c in range(0x00, 0x20) if c not in (0x09, 0x0A)]
    del_and_c1 = list(range(0x7F, 0xA0))
    bidi = [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
    # A lone surrogate cannot be encoded as UTF-8: left in, it would make the text
    # unwritable to a strict UTF-8 sink (JSON dumps, logs, MCP replies).
    surrogates = list(range(0xD800, 0xE000))
    return [*c0, *del_and_c1, *bidi, *surrogates]


_TABLE: dict[int, str] = {c: _escape_for(c) for c in _unsafe_code_points()}

# Runs of unsafe characters, so that a dense stretch (1 MiB of ESC) costs one callback.
_UNSAFE_RUN = re.compile(
    r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]+"
)


def _translate_run(match: re.Match[str]) -> str:
    return match.group().translate(_TABLE)


def neutralise_text(text: str) -> str:
    """Return `text` with every character that could act on a terminal, a log viewer or a
    reader's eye replaced by a visible backslash escape.

    Escaped (never dropped): C0 controls except newline and tab (ESC as ``\\x1b``, CR as
    ``\\r``), DEL, C1 controls (``\\x85``), the bidi controls U+061C, U+200E, U+200F,
    U+202A-U+202E and U+2066-U+2069 (``\\u202e``), and lone surrogates (``\\ud800``; those
    U+DC80-U+DCFF that ``surrogateescape`` makes from an undecodable byte show as that byte,
    ``\\x80``). The result always encodes as strict UTF-8. A backslash already in the text is
    left as it is, so an escape shown is not proof that the character was there.

    Raises:
        Nothing: every str is accepted.
    """
    if text.isascii():
        # ASCII input takes str.translate's ASCII fast path: ~2 ms per MiB of clean text.
        return text.translate(_TABLE)
    # Outside ASCII, translate looks each character up in a dict; a regex scan skips the
    # clean stretches in C and only the unsafe runs are translated.
    return _UNSAFE_RUN.sub(_translate_run, text)


# U+2028 and U+2029 end a line for some viewers and JSON-in-JS readers: a one-line field
# escapes them with newline and tab.
_LINE_TABLE: dict[int, str] = {
    **_TABLE,
    0x0A: "\\n",
    0x09: "\\t",
    0x2028: "\\u2028",
    0x2029: "\\u2029",
}

_UNSAFE_IN_LINE_RUN = re.compile(
    r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2028\u2029\u2066-\u2069\ud800-\udfff]+"
)


def _translate_line_run(match: re.Match[str]) -> str:
    return match.group().translate(_LINE_TABLE)


def neutralise_line(text: str) -> str:
    """`neutralise_text` for a one-line field (a name, a path, an event's detail): newline
    and tab are escaped too (``\\n``, ``\\t``; the line and paragraph separators as
    ``\\u2028``, ``\\u2029``), so the text cannot start a line of its own where it is
    shown (a forged ``status: ok``) or shift columns.

    Idempotent, like `neutralise_text`: its output holds no character it escapes, and a
    backslash is left as it is, so neutralising twice changes nothing.

    Raises:
        Nothing: every str is accepted.
    """
    if text.isascii():
        return text.translate(_LINE_TABLE)
    return _UNSAFE_IN_LINE_RUN.sub(_translate_line_run, text)


def neutralise(data: bytes) -> str:
    """Decode untrusted bytes as UTF-8 and return text safe to show (see `neutralise_text`).

    Invalid UTF-8, including a multi-byte sequence cut short at an output cap, shows as
    ``\\x80``-style escapes of the bytes concerned.

    Raises:
        Nothing: every byte string is accepted.
    """
    return neutralise_text(data.decode("utf-8", errors="backslashreplace"))


@dataclass(slots=True)
class CappedBuffer:
    """Keeps the first `cap_bytes` bytes appended, discards the rest and counts everything.

    The host reader appends each chunk it reads from a guest stream and keeps reading after
    the cap (so the child never blocks on a full pipe); only the count grows then.

    Raises:
        ValueError: `cap_bytes` is negative (a caller's bug: limits are validated earlier).
    """

    cap_bytes: int
    total_bytes: int = 0
    """Every byte appended, kept or not."""
    truncated: bool = False
    """True once any byte was discarded."""
    _kept: bytearray = field(default_factory=bytearray, repr=False)

    def __post_init__(self) -> None:
        if self.cap_bytes < 0:
            raise ValueError(f"cap_bytes must be >= 0, got {self.cap_bytes}")

    def append(self, chunk: bytes) -> None:
        """Keep as much of `chunk` as fits under the cap; count all of it.

        Raises:
            Nothing.
        """
        size = len(chunk)
        self.total_bytes += size
        room = self.cap_bytes - len(self._kept)
        if size <= room:
            self._kept += chunk
            return
        if room > 0:
            self._kept += chunk[:room]
        self.truncated = True

    @property
    def data(self) -> bytes:
        """The bytes kept (at most `cap_bytes`)."""
        return bytes(self._kept)
