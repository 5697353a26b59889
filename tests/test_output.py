"""Capped reading and neutralising of what the guest prints (codecage.output)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from codecage.output import CappedBuffer, neutralise, neutralise_text

BIDI_CONTROLS = [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
FORBIDDEN = frozenset(
    [chr(c) for c in range(0x20) if c not in (0x09, 0x0A)]
    + [chr(c) for c in range(0x7F, 0xA0)]
    + [chr(c) for c in BIDI_CONTROLS]
    + [chr(c) for c in range(0xD800, 0xE000)]
)

# Characters every generated text should meet often, not only by luck.
dangerous_chars = st.sampled_from(
    ["\x1b", "\r", "\x07", "\x00", "\x7f", "\x85", "\x9b", "\u202e", "\u2066", "\ud800", "\udc80"]
)
any_chars = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=())
any_text = st.text(st.one_of(any_chars, dangerous_chars, st.sampled_from(["\n", "\t", "\\"])))


def reference_neutralise_text(text: str) -> str:
    """A slow, obvious per-character model of neutralise_text, to compare against."""
    out = []
    for ch in text:
        c = ord(ch)
        if ch not in FORBIDDEN:
            out.append(ch)
        elif ch == "\r":
            out.append("\\r")
        elif 0xDC80 <= c <= 0xDCFF:
            out.append(f"\\x{c - 0xDC00:02x}")
        elif c <= 0xFF:
            out.append(f"\\x{c:02x}")
        else:
            out.append(f"\\u{c:04x}")
    return "".join(out)


def assert_safe(text: str) -> None:
    text.encode("utf-8", errors="strict")
    assert not FORBIDDEN.intersection(text)


# --- neutralise ---------------------------------------------------------------------------


@given(st.binary(max_size=4096))
def test_neutralised_bytes_encode_as_strict_utf8_and_hold_no_control_or_bidi_characters(
    data: bytes,
) -> None:
    assert_safe(neutralise(data))


@given(any_text)
def test_neutralised_text_encodes_as_strict_utf8_and_holds_no_control_or_bidi_characters(
    text: str,
) -> None:
    assert_safe(neutralise_text(text))


@given(any_text)
def test_neutralise_text_escapes_exactly_what_a_per_character_model_escapes(text: str) -> None:
    assert neutralise_text(text) == reference_neutralise_text(text)


@given(st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E) | st.sampled_from("\n\t")))
def test_printable_ascii_with_newlines_and_tabs_is_left_unchanged(text: str) -> None:
    assert neutralise(text.encode("ascii")) == text
    assert neutralise_text(text) == text


@given(st.text(st.characters(exclude_categories=("Cc", "Cs", "Cf"))))
def test_text_without_control_or_format_characters_is_left_unchanged(text: str) -> None:
    assert neutralise(text.encode("utf-8")) == text


@pytest.mark.parametrize(
    ("data", "shown"),
    [
        (b"\x1b[2J", "\\x1b[2J"),
        (b"a\rb", "a\\rb"),
        (b"\x07", "\\x07"),
        (b"\x00", "\\x00"),
        (b"\x7f", "\\x7f"),
        (b"\x0b\x0c", "\\x0b\\x0c"),
        ("\u0085".encode(), "\\x85"),
        ("\u009b".encode(), "\\x9b"),
        ("\u202e".encode(), "\\u202e"),
        ("\u2066\u2069".encode(), "\\u2066\\u2069"),
        ("\u200e\u200f\u061c".encode(), "\\u200e\\u200f\\u061c"),
        (b"line\n\tindented", "line\n\tindented"),
    ],
)
def test_control_and_bidi_characters_are_shown_as_escapes_not_dropped(
    data: bytes, shown: str
) -> None:
    assert neutralise(data) == shown


def test_invalid_utf8_bytes_are_shown_as_hex_escapes() -> None:
    assert neutralise(b"ok \x80\xff\xc3(") == "ok \\x80\\xff\\xc3("


def test_utf8_encoded_surrogates_are_invalid_and_shown_as_bytes() -> None:
    assert neutralise("\ud800".encode("utf-8", "surrogatepass")) == "\\xed\\xa0\\x80"


def test_lone_surrogates_in_text_do_not_survive() -> None:
    assert neutralise_text("a\ud800b\udfff") == "a\\ud800b\\udfff"


def test_a_file_name_with_an_undecodable_byte_shows_that_byte() -> None:
    name = os.fsdecode(b"report\xff.csv")
    assert neutralise_text(name) == "report\\xff.csv" == neutralise(b"report\xff.csv")


def test_a_megabyte_of_plain_ascii_is_returned_unchanged() -> None:
    text = "the quick brown fox jumps over the lazy dog\n" * 24_000
    assert neutralise(text.encode("ascii")) == text


def test_a_megabyte_of_escape_characters_is_escaped_whole() -> None:
    assert neutralise(b"\x1b" * 2**20) == "\\x1b" * 2**20


# --- CappedBuffer -------------------------------------------------------------------------


@given(st.integers(min_value=0, max_value=64), st.lists(st.binary(max_size=40), max_size=20))
def test_capped_buffer_keeps_a_prefix_within_the_cap_and_counts_every_byte(
    cap: int, chunks: list[bytes]
) -> None:
    buf = CappedBuffer(cap)
    for chunk in chunks:
        buf.append(chunk)
    everything = b"".join(chunks)
    assert len(buf.data) <= cap
    assert buf.data == everything[:cap]
    assert buf.total_bytes == sum(len(chunk) for chunk in chunks)
    assert buf.truncated == (len(everything) > cap)


def test_capped_buffer_exactly_full_is_not_truncated() -> None:
    buf = CappedBuffer(4)
    buf.append(b"ab")
    buf.append(b"cd")
    buf.append(b"")
    assert (buf.data, buf.truncated, buf.total_bytes) == (b"abcd", False, 4)
    buf.append(b"e")
    assert (buf.data, buf.truncated, buf.total_bytes) == (b"abcd", True, 5)


def test_a_utf8_sequence_cut_at_the_cap_becomes_an_escaped_byte() -> None:
    buf = CappedBuffer(5)
    buf.append("abc€".encode())  # € is three bytes: e2 82 ac
    assert buf.truncated
    assert neutralise(buf.data) == "abc\\xe2\\x82"


def test_capped_buffer_refuses_a_negative_cap() -> None:
    with pytest.raises(ValueError, match="cap_bytes"):
        CappedBuffer(-1)
    with pytest.raises(ValueError, match="tail_bytes"):
        CappedBuffer(10, tail_bytes=11)


# With a tail (what the host reader uses for stdout and stderr): head and tail, a marker.

lines_st = st.lists(
    st.text(st.sampled_from("ab \u00e9"), max_size=30).map(lambda t: (t + "\n").encode()),
    max_size=200,
)


@given(
    st.integers(min_value=0, max_value=2000),
    st.integers(min_value=0, max_value=1000),
    lines_st,
    st.integers(min_value=1, max_value=50),
)
def test_with_a_tail_the_buffer_shows_a_prefix_and_a_suffix_within_the_cap(
    cap: int, tail: int, lines: list[bytes], chunk: int
) -> None:
    tail = min(tail, cap)
    buf = CappedBuffer(cap, tail_bytes=tail)
    everything = b"".join(lines)
    for start in range(0, len(everything), chunk):
        buf.append(everything[start : start + chunk])
    data = buf.data
    assert len(data) <= cap
    assert buf.total_bytes == len(everything)
    assert buf.truncated == (len(everything) > cap)
    if not buf.truncated:
        assert data == everything
        return
    if b"cut here" not in data:
        assert data == everything[:cap]  # one long line, or no room for a marker
        return
    head, _, rest = data.partition(b"[... ")
    marker, _, shown_tail = rest.partition(b"\n")
    assert everything.startswith(head) and everything.endswith(shown_tail)
    assert head.endswith(b"\n") and (not shown_tail or everything.endswith(b"\n"))
    cut = everything[len(head) : len(everything) - len(shown_tail)]
    newlines = cut.count(b"\n")
    assert f"[... {newlines:,} line".encode() in b"[... " + marker, (marker, cut)


@pytest.mark.parametrize(("rows", "row"), [(1000, "{:04}"), (10_000, "row {}")])
def test_the_tail_holds_the_end_of_a_long_output_and_says_how_much_was_cut(
    rows: int, row: str
) -> None:
    buf = CappedBuffer(1000, tail_bytes=500)
    lines = [f"{row.format(i)}\n" for i in range(rows)]
    for line in lines:
        buf.append(line.encode())
    text = buf.data.decode()
    assert text.startswith(lines[0]) and text.endswith(lines[-1])
    assert buf.total_bytes == len("".join(lines)) and buf.truncated
    marker = next(line for line in text.splitlines() if line.startswith("[... "))
    assert "cut here" in marker and "write the output to a file" in marker
    shown = [line for line in text.splitlines() if not line.startswith("[... ")]
    assert f"{rows - len(shown):,} lines" in marker, (marker, shown)


def test_a_tail_never_starts_inside_a_private_key_block() -> None:
    key_body = b"".join(b"QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo0MTIz\n" for _ in range(40))
    stream = b"a\n" * 500 + b"-----BEGIN RSA PRIVATE KEY-----\n" + key_body
    stream += b"-----END RSA PRIVATE KEY-----\nafter\n" + b"z\n" * 30
    buf = CappedBuffer(1200, tail_bytes=600)
    buf.append(stream)
    assert b"QUJD" not in buf.data.partition(b"cut here")[2]
