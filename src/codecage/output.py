"""What the guest prints, read with a hard cap and made safe to show.

Guest output is untrusted: it can hold terminal escape sequences (which can rewrite a
reviewer's screen or a log viewer's lines), bidi controls (which make text read differently
from what it is), invalid UTF-8 and any amount of it. `CappedBuffer` keeps a bounded head
and tail and counts what falls between; `neutralise` turns what was kept into text that
shows every such character as a visible escape instead of acting on it or dropping it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = [
    "CappedBuffer",
    "cut_marker",
    "neutralise",
    "neutralise_line",
    "neutralise_text",
    "size_text",
]


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


def size_text(n: int) -> str:
    """A byte count for people: "812 B", "12.3 KB", "1.2 MB" (decimal units)."""
    if n < 1000:
        return f"{n} B"
    if n < 1_000_000:
        return f"{n / 1000:.1f} KB"
    return f"{n / 1_000_000:.1f} MB"


def cut_marker(lines: int, cut_bytes: int, why: str) -> str:
    """The one line that stands where output was cut: how much, and what to do instead."""
    plural = "" if lines == 1 else "s"
    return f"[... {lines:,} line{plural} / {size_text(cut_bytes)} cut here{why} ...]"


def _tail_start(tail: bytes) -> int:
    """Where a shown tail may start: after its first line break, and after the END line of
    a PEM block (a private key) that the cut fell inside, so that no key's body is shown
    without the BEGIN line the scrubber knows it by. 0: nowhere (no line break)."""
    start = tail.find(b"\n") + 1
    end = tail.find(b"-----END ", start)
    if start > 0 and end >= 0 and tail.find(b"-----BEGIN ", start, end) < 0:
        start = tail.find(b"\n", end) + 1
    return start


_HOST_CUT_WHY = (
    " (the host keeps the head and the tail of each stream, max_output_bytes in all); "
    "to get all of it, write the output to a file in the workspace, or print less"
)


@dataclass(slots=True)
class CappedBuffer:
    """Keeps the first `cap_bytes` bytes appended and, with `tail_bytes`, the last ones too:
    what `data` shows is at most `cap_bytes`, the last `tail_bytes` of them from the end of
    the stream. What falls between is discarded and counted (bytes and lines), and `data`
    puts a marker line where it was.

    The tail matters because the end of a program's output is where its result and its
    errors usually are. The host reader appends each chunk it reads from a guest stream and
    keeps reading after the cap (so the child never blocks on a full pipe); the tail keeps
    moving then, and the memory held stays under three times the cap.

    Raises:
        ValueError: `cap_bytes` is negative, or `tail_bytes` is not within 0..`cap_bytes`
            (a caller's bug: limits are validated earlier).
    """

    cap_bytes: int
    tail_bytes: int = 0
    """Of `cap_bytes`, how many `data` shows from the end (0: only the first bytes)."""
    total_bytes: int = 0
    """Every byte appended, kept or not."""
    truncated: bool = False
    """True once more than `cap_bytes` were appended (some were discarded)."""
    _head: bytearray = field(default_factory=bytearray, repr=False)
    _tail: bytearray = field(default_factory=bytearray, repr=False)
    _dropped_bytes: int = 0
    _dropped_lines: int = 0

    def __post_init__(self) -> None:
        if self.cap_bytes < 0:
            raise ValueError(f"cap_bytes must be >= 0, got {self.cap_bytes}")
        if not 0 <= self.tail_bytes <= self.cap_bytes:
            raise ValueError(f"tail_bytes must be in 0..{self.cap_bytes}, got {self.tail_bytes}")

    def append(self, chunk: bytes) -> None:
        """Keep what belongs to the first `cap_bytes` or to the tail; count all of it.

        Raises:
            Nothing.
        """
        position = self.total_bytes
        self.total_bytes += len(chunk)
        room = self.cap_bytes - len(self._head)
        if room > 0:
            self._head += chunk[:room]
        if self.total_bytes > self.cap_bytes:
            self.truncated = True
        if self.tail_bytes == 0:
            return
        # The tail is everything after the head's share (cap_bytes - tail_bytes), of which
        # the last tail_bytes are kept; trimmed in batches, when it holds twice its share,
        # so that a stream of small chunks costs linear time, not quadratic.
        start = max(self.cap_bytes - self.tail_bytes - position, 0)
        if start < len(chunk):
            self._tail += chunk[start:]
            if len(self._tail) >= 2 * self.tail_bytes:
                self._settle()

    def _settle(self) -> None:
        excess = len(self._tail) - self.tail_bytes
        if excess > 0:
            self._dropped_lines += self._tail.count(b"\n", 0, excess)
            del self._tail[:excess]
            self._dropped_bytes += excess

    @property
    def data(self) -> bytes:
        """What was kept, at most `cap_bytes`. Without a tail, or when nothing was cut:
        the first bytes. With a tail, once bytes were cut: the head, a marker line saying
        how much was cut and what to do, then the tail.

        Both cuts fall on line breaks: the head's unfinished last line and the tail's
        unfinished first line are cut too (and counted), so no line, and no value on it
        (an address, a card number, a key), is shown in part; the marker is a line of its
        own. When the head or the tail holds no line break (output of one endless line),
        or the cap leaves no room for the marker, only the first `cap_bytes` are kept, cut
        where the cap fell, as without a tail (the scrubber then knows the text's end was
        cut).
        """
        if self.tail_bytes == 0 or not self.truncated:
            return bytes(self._head)
        self._settle()
        head = bytes(self._head[: self.cap_bytes - self.tail_bytes])
        tail = bytes(self._tail)
        head_end, tail_start = head.rfind(b"\n") + 1, _tail_start(tail)
        while head_end > 0 and tail_start > 0:
            cut = head[head_end:] + tail[:tail_start]
            lines = self._dropped_lines + cut.count(b"\n")
            marker = cut_marker(lines, self._dropped_bytes + len(cut), _HOST_CUT_WHY).encode()
            kept = head[:head_end] + marker + b"\n" + tail[tail_start:]
            if len(kept) <= self.cap_bytes:
                return kept
            # Make room for the marker: a line less of the head, else of the tail.
            if head_end > 1 and (shorter := head.rfind(b"\n", 0, head_end - 1) + 1) > 0:
                head_end = shorter
            else:
                tail_start = tail.find(b"\n", tail_start) + 1
        return bytes(self._head)
