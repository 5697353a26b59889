"""What counts as personal data or a secret: the categories, and for each its matchers
and the validators that confirm a candidate.

How it stays fast (< 50 ms per MB): a regex that starts with a character class makes
Python's `re` try a match at every position where the class matches, so a pattern that
starts with ``\\d`` costs ~25 ms/MB on ordinary program output on its own. Every detector
here instead starts with a literal (``@``, ``::``, ``://``, ``AKIA``, ``-----BEGIN``), which
`re` finds with a fast scan, or runs on a *shape* of the text (digits -> ``0``, letters ->
``A``/``a``, same length) where a card, an SSN or a US phone number starts with the literal
``000``. Candidates are then validated by the libraries that know the rules:
libphonenumber (`phonenumbers`) for phone numbers, `python-stdnum` for the Luhn check,
IBAN checksums and the SSN rules.

Decisions (each pinned by tests/test_scrub.py; the two corpora of
tests/issues/test_18_scrub.py check both directions). The aim: catch what leaks people's
data without changing the results of ordinary data work.

- A dotted quad is an IPv4 address (``1.2.3.4`` too: it is one) unless a version says so
  around it (``version``/``v``/``==`` before it, ``-beta``/``-2``/``+local`` after it, a
  fifth part). Only public addresses are redacted: private (10/8, 172.16/12,
  192.168/16), loopback, link-local, carrier-grade NAT, documentation, benchmarking,
  multicast and reserved ranges, 0.0.0.0/8 and netmasks name no person, and a log
  analysis of a network is made of them; nor do the public DNS resolvers (8.8.8.8,
  1.1.1.1, ...). IPv6 likewise (fc00::/7, fe80::/10,
  2001:db8::/32, ::1, multicast kept); IPv6 needs five hex digits in two groups
  (``a[1::2]`` is a slice).
- Cards: Luhn-valid, first digit 2-6 (no issuer uses 0, 1, 7, 8, 9; ms and ns
  timestamps start with 1), and one of: grouped as cards are printed (4-4-4-4, 4-6-5, by
  spaces or dashes, 13-19 digits); one run of 13-19 digits with an issuer's prefix and a
  card word (card, visa, cc, payment, ...) within 48 characters before or 24 after, no
  other number in between; or one run of digits that is a brand's number by issuer range
  *and* length (`card_brand`: Visa 4/13,16,19; Mastercard 51-55, 2221-2720/16; Amex 34,
  37/15; Discover, JCB, Diners, UnionPay, Mir, Maestro IINs/their lengths), as payment
  libraries decide, unless it stands as data: named as an id just before it or its row
  (``order``, ``id``, ``*_id``, ``invoice``, ``txn``, ``#``, ...), inside a longer alphanumeric run
  (a hash), after ``-``/``+``/``.``/``/`` (a signed number, a path), or in a row with
  other numbers not all of which are cards (a DataFrame or CSV row, a list of ids). One
  in ten random 16-digit numbers passes Luhn: these bounds keep ids, counts and
  Fibonacci numbers; a Luhn-valid id printed alone in a brand's range and length is
  redacted (it cannot be told from a card).
- Phones: ``+`` and a country code, US formats (``(415) 555-2671``, ``415-555-2671``,
  ``415.555.2671``, ``415 555 2671`` outside a row of numbers), and, for a non-NANP
  `phone_region`, national numbers with a trunk ``0``; libphonenumber must call each one
  valid. Unformatted national numbers (``4155552671``) only right after a word that names
  them (``phone:``, ``tel``, ``mobile no.``, ``fax``): ten bare digits are too common.
- SSNs: ``ddd-dd-dddd`` with stdnum's rules; right after ``SSN``/``social security number``
  also nine digits (``536904399``, ``536 90 4399``), and by the SSA's structural rules
  only (stdnum refuses numbers printed in advertising, but after the word they read as
  someone's SSN).
- Secrets by shape, by assignment (``password=``, ``"api_key": …``, ``token: …``; the key
  is kept, the value redacted, placeholders and code such as ``get_token()`` are not
  values), in Authorization headers and URLs (``user:pw@``, ``:pw@``), PEM/PuTTY private
  keys, and a 40-character mixed-case base64 word that does not decode to text, near a
  credential word or an access key id (an AWS secret key printed without its name). A
  password word (password, passwd, pwd, secret, credentials, private_key, or a name
  containing secret/pass) takes any value, and so does
  an environment variable's upper-case name (``GITHUB_TOKEN=…``: configuration); a token or
  key word (token, api_key, access_key, account_key, authorization) only a value that
  looks generated: 16+ characters, no space, two of lower, upper and digits (a seeded
  ``token: 1VjArnVgxwvq`` is data; real tokens are longer, and the known ones are found
  by shape). In prose (``my password is hunter2``) a value must look like a password (a
  letter and a digit or symbol, or 6+ digits) or, after a token word, generated; ``pass``
  and ``pw`` alone likewise (``bypass: true`` and ``pass: 12`` stay).
- Emails are redacted wherever they are, tables included: a table of customers' addresses
  is the leak this exists for. In a dict key, a finding becomes a numbered placeholder
  (``[EMAIL_1]``), so keys never collapse and a count per address stays one.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import ipaddress
import json
import math
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Final, Literal, get_args
from urllib.parse import quote, quote_plus

import phonenumbers
from stdnum import iban as stdnum_iban
from stdnum import luhn, numdb
from stdnum.us import ssn as stdnum_ssn

Category = Literal["email", "phone", "ssn", "credit_card", "iban", "ip", "secret"]
CATEGORIES: Final[tuple[Category, ...]] = get_args(Category)

PLACEHOLDERS: Final[Mapping[Category, str]] = {
    "email": "[EMAIL]",
    "phone": "[PHONE]",
    "ssn": "[SSN]",
    "credit_card": "[CREDIT_CARD]",
    "iban": "[IBAN]",
    "ip": "[IP_ADDRESS]",
    "secret": "[SECRET]",
}

MIN_SECRET_CHARS: Final = 6
"""A configured secret shorter than this is refused: it would redact ordinary words."""

# Library checks (libphonenumber, stdnum, ipaddress) per scan. Past it, a candidate that
# has the shape is redacted unchecked: output made of 60,000 phone-shaped numbers would
# otherwise cost the host seconds of CPU (~40 us per libphonenumber check).
_VALIDATION_BUDGET: Final = 4000

NANP_REGIONS: Final = frozenset(
    phonenumbers.region_codes_for_country_code(1)  # US, CA and the Caribbean: no trunk 0
)

Span = tuple[int, int, Category]


# --- the text and its projections ----------------------------------------------------

_SHAPE_TABLE: Final = str.maketrans(
    string.digits + string.ascii_uppercase + string.ascii_lowercase,
    "0" * 10 + "A" * 26 + "a" * 26,
)
_LOWER_TABLE: Final = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)
_B64_CHARS: Final = string.ascii_letters + string.digits + "+/"
_B64_TABLE: Final = str.maketrans(_B64_CHARS, "x" * len(_B64_CHARS))


class View:
    """The text being scrubbed and same-length projections of it, made once and only
    when a detector asks: positions in a projection are positions in the text."""

    __slots__ = ("_b64", "_lower", "_shape", "checks_left", "text", "truncated")

    def __init__(self, text: str, truncated: bool) -> None:
        self.text = text
        self.truncated = truncated
        self.checks_left = _VALIDATION_BUDGET
        self._shape: str | None = None
        self._lower: str | None = None
        self._b64: str | None = None

    def valid(self, check: Callable[[], bool]) -> bool:
        """`check()` while the scan's validation budget lasts; after it, True: a
        candidate with the shape of a value is redacted rather than let through."""
        if self.checks_left <= 0:
            return True
        self.checks_left -= 1
        return check()

    @property
    def shape(self) -> str:
        """Digits as ``0``, ASCII letters as ``A``/``a``, everything else as it is."""
        if self._shape is None:
            self._shape = self.text.translate(_SHAPE_TABLE)
        return self._shape

    @property
    def lower(self) -> str:
        """ASCII-lowercased (`str.lower` can change the length of non-ASCII text)."""
        if self._lower is None:
            self._lower = self.text.translate(_LOWER_TABLE)
        return self._lower

    @property
    def b64(self) -> str:
        """Every base64 character as ``x``, so that long runs are found by a literal."""
        if self._b64 is None:
            self._b64 = self.text.translate(_B64_TABLE)
        return self._b64


def _extend_left(text: str, end: int, reversed_pattern: re.Pattern[str], limit: int) -> int:
    """Where a run that ends at `end` starts: `re` cannot look behind by a variable
    length, so the pattern is matched forwards on the reversed window."""
    window = text[max(0, end - limit) : end][::-1]
    match = reversed_pattern.match(window)
    return end - (match.end() if match else 0)


def _is_word(char: str) -> bool:
    return char.isalnum() or char == "_"


def char(text: str, index: int) -> str:
    """The character at `index`; outside the text, a line break: a boundary like any other
    (an empty string would be `in` every string of characters it is tested against)."""
    return text[index] if 0 <= index < len(text) else "\n"


def _split_groups(candidate: str) -> list[int]:
    """End offsets of the digit groups of `candidate`, longest first, so a validator
    can retry without a trailing group that the greedy pattern took by mistake."""
    ends = [m.end() for m in re.finditer(r"\d+", candidate)]
    return ends[::-1]


# --- email -----------------------------------------------------------------------------

_EMAIL_DOMAIN: Final = re.compile(
    r"@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+([A-Za-z]{2,24})(?![A-Za-z0-9-])"
)
_EMAIL_LOCAL_REVERSED: Final = re.compile(r"[A-Za-z0-9._%+\-]{1,64}")
# `icon@2x.png` is a file name, not an address: these are extensions, not TLDs.
_FILE_EXTENSIONS: Final = frozenset(
    [
        "png",
        "jpg",
        "jpeg",
        "gif",
        "svg",
        "webp",
        "ico",
        "bmp",
        "tif",
        "tiff",
        "css",
        "js",
        "mjs",
        "json",
        "txt",
        "pdf",
        "html",
        "htm",
        "xml",
        "csv",
        "log",
        "yaml",
        "yml",
        "toml",
        "lock",
        "map",
        "wasm",
        "whl",
        "gz",
        "zip",
        "tar",
    ]
)


def _find_emails(view: View) -> Iterator[Span]:
    text = view.text
    for match in _EMAIL_DOMAIN.finditer(text):
        end: int | None = match.end()
        if match.group(1).lower() in _FILE_EXTENSIONS:
            end = _address_before_extension(text, match)
        if end is None:
            continue
        at = match.start()
        start = _extend_left(text, at, _EMAIL_LOCAL_REVERSED, 64)
        while start < at and text[start] == ".":
            start += 1
        if start < at and not _in_url_userinfo(text, start):
            yield (start, end, "email")


def _address_before_extension(text: str, match: re.Match[str]) -> int | None:
    """Where the address ends in a file name made of one (``alice@example.com.csv``), or
    None when the extension is the only TLD-like part (``icon@2x.png``)."""
    domain_end = match.start(1) - 1  # the dot before the extension
    domain = text[match.start() + 1 : domain_end]
    head, dot, tld = domain.rpartition(".")
    if dot and head and 2 <= len(tld) <= 24 and tld.isalpha():
        return domain_end
    return None


def _in_url_userinfo(text: str, start: int) -> bool:
    """`scheme://user:password@host`: the password is a secret (found by the URL rule),
    and the host is no mailbox."""
    if char(text, start - 1) != ":":
        return False
    word = text[max(0, start - 300) : start].rsplit(None, 1)[-1]
    return "://" in word


# --- digit shapes: SSN, cards, US phone numbers (searched in the shape) ----------------

# The lookbehind sits after the literal, so `re` still scans for "000" quickly; it
# rejects a start inside a longer number, a word, or the decimals of a float.
_DIGIT_SHAPES: Final = re.compile(
    r"000(?<![0Aa_]000)(?<!0\.000)(?<!0,000)"
    r"(?:(?P<ssn>-00-0000)"
    r"|(?P<us_phone>[-. ]000[-. ]0000)"
    r"|(?P<card>0[ -]0000[ -]0000|0[ -]000000[ -]0000|0000000000)"
    r"|(?P<named>(?<=[ :=#\"'\t(]000)(?:000000(?:0{1,3})?(?![0Aa_])| 00 0000(?![0Aa_]))))"
)
_PAREN_PHONE: Final = re.compile(r"\(000\)(?<![0Aa_]\(000\)) ?000[-. ]0000(?![0Aa_])")
_IBAN_HEAD: Final = re.compile(r"[A-Z]{2}\d{2} ?\Z")
_CARD_AT: Final = re.compile(
    r"\d{4}[ -]\d{4}[ -]\d{4}(?:[ -]\d{1,4}){0,2}|\d{4}[ -]\d{6}[ -]\d{4,5}|\d{13,19}(?!\d)"
)
_SSN_AT: Final = re.compile(r"\d{3}-\d{2}-\d{4}")


def _digits_end_ok(text: str, end: int) -> bool:
    """A number ends here: no letter or digit follows, nor more of a longer number (the
    decimals of a float, the rest of a date: ``.5``, ``,5``, ``-01``, ``/27``)."""
    after = char(text, end)
    if _is_word(after):
        return False
    return not (after in ".,-/" and char(text, end + 1).isdigit())


# Words that make a run of digits a card number: a card's name, its network's, a payment.
_CARD_WORDS: Final = re.compile(
    r"(?<![a-z])(?:credit|debit|(?:credit|debit)?cards?|cardholder|card_?(?:number|no|num)"
    r"|visa|master ?card|amex|american express|discover|jcb|diners|maestro|unionpay"
    r"|cc|ccn|cc_?(?:number|no|num)|pan|payments?|cvv2?|cvc2?|exp(?:iry|iration|ires)?)(?![a-z])"
)
_CARD_CONTEXT_BEFORE: Final = 48  # characters before a contiguous run searched for a card word
_CARD_CONTEXT_AFTER: Final = 24


def _issuer_prefix(digits: str) -> bool:
    """The number starts with a prefix that a card network issues (ISO/IEC 7812 IIN
    ranges of Visa, Mastercard, Amex, Discover, JCB, Diners, UnionPay, Maestro, Mir)."""
    two, four = int(digits[:2]), int(digits[:4])
    return (
        digits[0] in "46"
        or 50 <= two <= 58
        or two in (34, 36, 37, 38, 39)
        or 300 <= int(digits[:3]) <= 305
        or 3528 <= four <= 3589
        or 2200 <= four <= 2204
        or 2221 <= four <= 2720
    )


_OTHER_NUMBER: Final = re.compile(r"\d{4}")


def card_context(view: View, start: int, end: int) -> bool:
    """A card word just before or after the digits, with no other number in between
    ("card 4111… for order 4539…": the order id is not the card). Any line: in a JSON
    value the key is the string before."""
    lower = view.lower
    words = list(_CARD_WORDS.finditer(lower, max(0, start - _CARD_CONTEXT_BEFORE), start))
    before = words[-1] if words else None  # the card word nearest to the digits
    if before is not None and not _OTHER_NUMBER.search(lower, before.end(), start):
        return True
    after = _CARD_WORDS.search(lower, end, end + _CARD_CONTEXT_AFTER)
    if after is not None and not _OTHER_NUMBER.search(lower, end, after.start()):
        return True
    return _expiry_after(view.text, end)


# A card's expiry date, MM/YY or MM/YYYY, as the next token of a row ("4111… 12/27 123",
# a CSV line of card, expiry and CVV): the date names the digits before it as a card as
# surely as the word "exp" does. Dates in data are written year first; this one is not.
_EXPIRY: Final = re.compile(r"(?:0[1-9]|1[0-2])/(?:\d{2}|20\d{2})")


# An expiry right after a comma ("4111…,12/27,123"): the comma is a CSV's, not a decimal's.
_EXPIRY_NEXT: Final = re.compile(r",(?:0[1-9]|1[0-2])/(?:\d{2}|20\d{2})(?![\w/.-])")


def _expiry_after(text: str, end: int) -> bool:
    _before, after = _neighbours(text, end, end)
    return bool(after) and _EXPIRY.fullmatch(after) is not None


# Each brand's issuer ranges (IIN prefixes, as numbers of that many digits) and the lengths
# its cards have: the tables payment libraries check (ISO/IEC 7812 as the networks publish
# them). A run of digits with no separator and no card word is a card only when it is one
# brand's number by both range and length (and Luhn-valid).
_BRANDS: Final[tuple[tuple[str, tuple[tuple[int, int], ...], frozenset[int]], ...]] = (
    ("visa", ((4, 4),), frozenset({13, 16, 19})),
    ("mastercard", ((51, 55), (2221, 2720)), frozenset({16})),
    ("amex", ((34, 34), (37, 37)), frozenset({15})),
    (
        "discover",
        ((6011, 6011), (644, 649), (65, 65), (622126, 622925)),
        frozenset(range(16, 20)),
    ),
    ("jcb", ((3528, 3589),), frozenset(range(16, 20))),
    ("diners", ((300, 305), (3095, 3095), (36, 36), (38, 39)), frozenset(range(14, 20))),
    ("unionpay", ((62, 62),), frozenset(range(16, 20))),
    ("mir", ((2200, 2204),), frozenset(range(16, 20))),
    (
        "maestro",
        (
            (5018, 5018),
            (5020, 5020),
            (5038, 5038),
            (5893, 5893),
            (6304, 6304),
            (6759, 6759),
            (6761, 6763),
        ),
        frozenset(range(13, 20)),
    ),
)


# (brand, prefix length, low, high, lengths), the ranges of `_BRANDS` made ready to compare.
_BRAND_RANGES: Final = tuple(
    (brand, len(str(low)), low, high, lengths)
    for brand, ranges, lengths in _BRANDS
    for low, high in ranges
)


def card_brand(digits: str) -> str | None:
    """The brand whose issuer range and length `digits` (a run of digits) has, or None."""
    size = len(digits)
    for brand, width, low, high, lengths in _BRAND_RANGES:
        if size in lengths and low <= int(digits[:width]) <= high:
            return brand
    return None


_LUHN_DOUBLED: Final = (0, 2, 4, 6, 8, 1, 3, 5, 7, 9)


def luhn_ok(digits: str) -> bool:
    """The Luhn check of a run of ASCII digits (stdnum's, without its input cleaning: a
    bare run is checked for every brand-shaped number of the text, never budgeted)."""
    total = 0
    for i, char_ in enumerate(reversed(digits)):
        digit = ord(char_) - 48
        total += _LUHN_DOUBLED[digit] if i & 1 else digit
    return total % 10 == 0


# A bare run named as an id just before it ("order 4539…", "id: …", `{"order_id": …}`,
# "#5105…"): an id that happens to be Luhn-valid in a brand's range, not a card.
_ID_BEFORE: Final = re.compile(
    r"(?:(?<![a-z0-9])(?:[a-z0-9]+[_-])?(?:ids?|orders?|invoices?|tickets?|txn|tx|ref"
    r"|reference|transactions?|seq|sequence|rows?|records?|snowflake|uuid)|#)[\s\0\"':=#\[({,]*\Z"
)
_ID_WINDOW: Final = 48
# What stands between the numbers of a row: a table's, a list's, a CSV line's, a value's.
_ROW_GAP: Final = frozenset(" \t\r\n\0,;|[](){}\"'")
_ROW_NUMBER: Final = re.compile(r"[-+]?\d(?:[\d.,/:-]*\d)?")
_ROW_LOOK: Final = 64  # characters a neighbour is looked for in, each side
_ROW_HEAD: Final = 8  # numbers of a row walked back over to find the word that names it


def _neighbours(text: str, start: int, end: int) -> tuple[str, str]:
    """The tokens just before and after `text[start:end]`, over the gaps of a row."""
    i = start
    while i > 0 and start - i < _ROW_LOOK and text[i - 1] in _ROW_GAP:
        i -= 1
    j = i
    while j > 0 and i - j < _ROW_LOOK and text[j - 1] not in _ROW_GAP:
        j -= 1
    k = end
    while k < len(text) and k - end < _ROW_LOOK and text[k] in _ROW_GAP:
        k += 1
    m = k
    while m < len(text) and m - k < _ROW_LOOK and text[m] not in _ROW_GAP:
        m += 1
    return text[j:i], text[k:m]


def _row_start(text: str, start: int) -> int:
    """Where the row of numbers `start` is in begins (`start` itself when the token before
    is not a number): a header or key before the row names all of it ("ids: [a, b]", an
    ``order_id`` column printed without an index)."""
    for _ in range(_ROW_HEAD):
        before, _after = _neighbours(text, start, start)
        if not before or not _ROW_NUMBER.fullmatch(before):
            return start
        start = text.rindex(before, 0, start)
    return start


def _in_a_row_of_data(view: View, start: int, end: int) -> bool:
    """The run sits among other numbers (a DataFrame row, a CSV line, a list of ids, a
    list value) and not every one of them is a card: it is a column of data. A row made
    only of card numbers (two test cards printed together) is a row of cards."""
    numbers = [t for t in _neighbours(view.text, start, end) if t and _ROW_NUMBER.fullmatch(t)]
    return any(not (t.isdigit() and card_brand(t) is not None and luhn_ok(t)) for t in numbers)


def _bare_card(view: View, start: int, end: int, digits: str) -> bool:
    """One run of digits: a card with a card word nearby (any issuer prefix, 13-19
    digits), or without one when it is a brand's number by range and length, not named
    as an id, not in a row of other data, and not a path or signed number."""
    if card_context(view, start, end):
        return _issuer_prefix(digits) and view.valid(partial(luhn.is_valid, digits))
    if card_brand(digits) is None or char(view.text, start - 1) in "-+./\\":
        return False
    if not luhn_ok(digits) or _in_a_row_of_data(view, start, end):
        return False
    first = _row_start(view.text, start)
    return not _ID_BEFORE.search(view.lower, max(0, first - _ID_WINDOW), first)


def _card_span(view: View, start: int) -> Span | None:
    """A card number: Luhn-valid 13-19 digits, grouped the way cards are printed (4-4-4-4,
    4-6-5), or as one run of digits (`_bare_card`). A run of digits is an id, a count or
    a Fibonacci number as often as a card (one in ten random 16-digit numbers passes
    Luhn): bare, it needs a card word, or a brand's range and length and no sign of data."""
    text = view.text
    if text[start] not in "23456":
        return None  # no issuer starts with 0, 1, 7, 8, 9: ms/ns timestamps start with 1
    if _IBAN_HEAD.search(text, max(0, start - 5), start):
        return None  # the account digits of an IBAN (valid or not) are not a card
    match = _CARD_AT.match(text, start)
    if match is None:
        return None
    candidate = match.group()
    for end in _split_groups(candidate):
        digits = re.sub(r"\D", "", candidate[:end])
        if len(digits) < 13:
            break
        at = start + end
        if not (len(digits) <= 19 and (_digits_end_ok(text, at) or _EXPIRY_NEXT.match(text, at))):
            continue
        grouped = len(digits) != end  # the separators are the context
        if (
            view.valid(partial(luhn.is_valid, digits))
            if grouped
            else _bare_card(view, start, start + end, digits)
        ):
            return (start, start + end, "credit_card")
    return None


_IN_A_ROW_BEFORE: Final = re.compile(r"[\d/.:-] \Z")
_IN_A_ROW_AFTER: Final = re.compile(r" \d")


def _us_phone_span(view: View, start: int, end: int) -> Span | None:
    text = view.text
    candidate = text[start:end]
    if candidate[3] != candidate[7] or not _digits_end_ok(text, end):
        return None
    if candidate[3] == " " and (
        _IN_A_ROW_BEFORE.search(text, max(0, start - 2), start) or _IN_A_ROW_AFTER.match(text, end)
    ):
        return None  # "12 283 200 2000 7": a row of numbers, not a phone number
    # "1-800-555-0199": the trunk 1 belongs to the number.
    if char(text, start - 1) in "-. " and char(text, start - 2) == "1":
        if not _is_word(char(text, start - 3)) and char(text, start - 3) != ".":
            start -= 2
    elif char(text, start - 1) in "-.+/:":
        return None
    return (start, end, "phone") if view.valid(partial(_valid_phone, candidate, "US")) else None


def _ssn_span(view: View, start: int) -> Span | None:
    text = view.text
    match = _SSN_AT.match(text, start)
    if match is None or not _digits_end_ok(text, match.end()) or char(text, start - 1) == "-":
        return None
    digits = match.group().replace("-", "")
    valid = view.valid(partial(stdnum_ssn.is_valid, match.group())) or (
        _ssn_structure_ok(digits) and _named_before(view, start) == "ssn"
    )
    return (start, match.end(), "ssn") if valid else None


def _ssn_structure_ok(digits: str) -> bool:
    """The SSA's structural rules (area not 000, 666 or 9xx, group not 00, serial not
    0000), without stdnum's list of numbers known to be printed in advertising: after the
    word SSN, 078-05-1120 is someone's number as far as a reader can tell."""
    area, group, serial = digits[:3], digits[3:5], digits[5:]
    return area not in ("000", "666") and area[0] != "9" and group != "00" and serial != "0000"


def _find_digit_shapes(view: View, wanted: frozenset[Category], region: str) -> Iterator[Span]:
    text, shape = view.text, view.shape
    named_wanted = bool(wanted & {"ssn", "phone"})
    for match in _DIGIT_SHAPES.finditer(shape):
        kind, start = match.lastgroup, match.start()
        span: Span | None = None
        if kind == "card" and "credit_card" in wanted:
            span = _card_span(view, start)
        elif kind == "ssn" and "ssn" in wanted:
            span = _ssn_span(view, start)
        elif kind == "us_phone" and "phone" in wanted:
            span = _us_phone_span(view, start, match.end())
        elif kind == "named" and named_wanted:
            span = _named_number_span(view, start, match.end(), wanted, region)
        if span is not None:
            yield span
    if "phone" in wanted:
        for match in _PAREN_PHONE.finditer(shape):
            number = text[match.start() : match.end()]
            if view.valid(partial(_valid_phone, number, "US")):
                yield (match.start(), match.end(), "phone")


# --- an SSN or a phone number written without separators, named by a word -------------

# Nine bare digits are too common to be SSNs and ten too common to be phone numbers, unless
# a word just before says what they are ("SSN 536904399", "phone: 4155552671"). The digits
# are found in the shape (by `_DIGIT_SHAPES`, a fast literal scan); the word is then looked
# for in the few characters before them.
# Matched on the reversed text before the digits (one attempt, not one per position):
# "SSN: ", "social security number ", "phone no. ", "Mobile #", "tel ", reversed.
_NAMED_BY_REVERSED: Final = re.compile(
    r"[^a-z0-9\n]{0,6}(?:(?:si|saw) [^a-z0-9\n]{0,3})?(?:(?:rebmun|\.?on|#) ?)?"
    r"(?:(?P<ssn>nss|ytiruces laicos|#ss)|(?P<phone>enohp|enohpelet|let|elibom|llec|xaf|sms"
    r"|ppastahw))(?![a-z])"
)
_NAMED_WINDOW: Final = 32
# The last character of every naming word and of its suffix ("number", "no.", "#"): a run
# of digits after anything else ("epoch=", "id": ) is dismissed without a regex.
_NAMING_LAST: Final = frozenset("nyelxspro#.")
_NAMING_GAP: Final = 6


def _named_before(view: View, start: int) -> Literal["ssn", "phone"] | None:
    """Whether the text just before `start` names an SSN or a phone number."""
    window = view.lower[max(0, start - _NAMED_WINDOW) : start][::-1]
    word = _NAMED_BY_REVERSED.match(window)
    if word is None:
        return None
    return "ssn" if word.group("ssn") is not None else "phone"


def _named_number_span(
    view: View, start: int, end: int, wanted: frozenset[Category], region: str
) -> Span | None:
    lower = view.lower
    last = start - 1
    while last > max(0, start - _NAMING_GAP) and lower[last] in " :=#\t\"'(":
        last -= 1
    if last < 0 or lower[last] not in _NAMING_LAST:
        return None
    text = view.text
    if not _digits_end_ok(text, end) or char(text, start - 1) in "+-.":
        return None
    named = _named_before(view, start)
    if named is None:
        return None
    number = text[start:end]
    digits = number.replace(" ", "")
    if named == "ssn":
        if "ssn" in wanted and len(digits) == 9 and _ssn_structure_ok(digits):
            return (start, end, "ssn")
    elif (
        "phone" in wanted
        and " " not in number
        and view.valid(partial(_valid_phone, number, region))
    ):
        return (start, end, "phone")
    return None


# --- phone numbers with + or a national trunk prefix -----------------------------------

_INTL_PHONE: Final = re.compile(r"\+(?<![\w+]\+)[1-9](?:[ .\-()]{0,2}\d){6,14}")
_TRUNK_PHONE: Final = re.compile(
    r"0(?<![\w.+\-]0)\d{1,4}(?:[ \-]\d{2,8}){1,4}|\(0\d{1,4}\) ?\d{2,8}(?:[ \-]\d{2,8}){0,3}"
)
DATE_START: Final = re.compile(r"\(?\d{1,4}([-./])\d{1,2}\1\d{1,4}(?!\d)")


def _valid_phone(candidate: str, region: str | None) -> bool:
    try:
        number = phonenumbers.parse(candidate, region)
    except phonenumbers.NumberParseException:
        return False
    return phonenumbers.is_valid_number(number)


def _phone_within(view: View, start: int, end: int, region: str | None) -> Span | None:
    """The longest valid phone number that `text[start:end]` starts with, if any: the
    candidate pattern is greedy and may have taken a following number too."""
    text = view.text
    candidate = text[start:end]
    for group_end in _split_groups(candidate):
        digits = sum(c.isdigit() for c in candidate[:group_end])
        if digits < 7:
            break
        number = candidate[:group_end]
        if _digits_end_ok(text, start + group_end) and view.valid(
            partial(_valid_phone, number, region)
        ):
            return (start, start + group_end, "phone")
    return None


def _find_prefixed_phones(view: View, region: str) -> Iterator[Span]:
    text = view.text
    for match in _INTL_PHONE.finditer(text):
        span = _phone_within(view, match.start(), match.end(), None)
        if span is not None:
            yield span
    if region in NANP_REGIONS:
        return  # NANP numbers have no trunk 0; the US shapes cover their national format
    for match in _TRUNK_PHONE.finditer(text):
        candidate = match.group()
        if DATE_START.match(candidate) or not 9 <= sum(c.isdigit() for c in candidate) <= 13:
            continue
        span = _phone_within(view, match.start(), match.end(), region)
        if span is not None:
            yield span


# --- IBAN ------------------------------------------------------------------------------

_IBAN_SHAPE: Final = re.compile(r"AA00(?<![0Aa_]AA00)")
_IBAN_AT: Final = re.compile(r"[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?")
_IBAN_DB: Final = numdb.get("iban")


def iban_length(country: str) -> int | None:
    """The length of a full IBAN of `country`, from stdnum's registry, or None."""
    props = _IBAN_DB.info(country)[0][1]
    bban = props.get("bban")
    if not bban:
        return None
    return 4 + sum(int(n) for n in re.findall(r"(\d+)!?[nac]", bban))


def _find_ibans(view: View) -> Iterator[Span]:
    text = view.text
    for pivot in _IBAN_SHAPE.finditer(view.shape):
        match = _IBAN_AT.match(text, pivot.start())
        if match is None:
            continue
        candidate = match.group()
        for end in _split_alnum_groups(candidate):
            number = candidate[:end]
            if not _is_word(char(text, pivot.start() + end)) and view.valid(
                partial(stdnum_iban.is_valid, number)
            ):
                yield (pivot.start(), pivot.start() + end, "iban")
                break


def _split_alnum_groups(candidate: str) -> list[int]:
    ends = [m.end() for m in re.finditer(r"[A-Z0-9]+", candidate)]
    return ends[::-1]


# --- IP addresses ------------------------------------------------------------------------

_IPV4_SHAPE: Final = re.compile(r"0\.0{1,3}\.0{1,3}\.0{1,3}(?![0Aa_])(?!\.0)")
VERSION_CONTEXT: Final = re.compile(
    r"(?:(?<![a-z])(?:version|ver|release|v)|==|>=|<=|~=|!=|@)[ :=\"']*\Z"
)
_IPV6_FULL: Final = re.compile(r":[0-9A-Fa-f]{1,4}(?::[0-9A-Fa-f]{1,4}){6}(?![0-9A-Za-z_:])")
_IPV6_COMPRESSED: Final = re.compile(
    r"::(?:[0-9A-Fa-f]{1,4}(?::[0-9A-Fa-f]{1,4}){0,6}(?:\.\d{1,3}){0,3})?(?:%[0-9A-Za-z_.]+)?"
)
_HEX_GROUP: Final = re.compile(r"[0-9A-Fa-f]{1,4}")
_HEX_GROUPS_REVERSED: Final = re.compile(r"[0-9A-Fa-f]{1,4}(?::[0-9A-Fa-f]{1,4}){0,6}")


# IPv4 networks that are not on the public internet (RFC 6890's special-purpose registry,
# multicast and the reserved 240/4): an address in one names a machine on someone's own
# network, a documentation example or a mask, never a person on the internet.
_IPV4_NOT_GLOBAL: Final = tuple(
    (int(net.network_address), int(net.netmask))
    for net in map(
        ipaddress.IPv4Network,
        (
            "0.0.0.0/8",
            "10.0.0.0/8",
            "100.64.0.0/10",
            "127.0.0.0/8",
            "169.254.0.0/16",
            "172.16.0.0/12",
            "192.0.0.0/24",
            "192.0.2.0/24",
            "192.168.0.0/16",
            "198.18.0.0/15",
            "198.51.100.0/24",
            "203.0.113.0/24",
            "224.0.0.0/3",  # multicast and reserved, 255.255.255.255 included
        ),
    )
)


# Public DNS resolvers: a service everyone queries (``dig @8.8.8.8``), not a person.
_PUBLIC_RESOLVERS: Final = frozenset(
    int(ipaddress.ip_address(a))
    for a in (
        "8.8.8.8",
        "8.8.4.4",
        "1.1.1.1",
        "1.0.0.1",
        "9.9.9.9",
        "149.112.112.112",
        "208.67.222.222",
        "208.67.220.220",
        "2001:4860:4860::8888",
        "2001:4860:4860::8844",
        "2606:4700:4700::1111",
        "2606:4700:4700::1001",
        "2620:fe::fe",
    )
)


def ipv4_not_global(value: int, prefix_bits: int = 32) -> bool:
    """Whether every address that starts with the first `prefix_bits` of `value` is in a
    network that is not public (with fewer than 32 bits: a prefix cut at the output cap)."""
    prefix_mask = (0xFFFFFFFF << (32 - prefix_bits)) & 0xFFFFFFFF
    return any(
        mask & prefix_mask == mask and value & mask == network for network, mask in _IPV4_NOT_GLOBAL
    )


def _keep_address(address: ipaddress.IPv6Address) -> bool:
    """Only public (global unicast) addresses can point at a person: loopback, unspecified,
    link-local, unique local (fc00::/7), documentation (2001:db8::/32) and multicast
    addresses, and IPv4-mapped ones of a private IPv4 address, say nothing about anyone."""
    mapped = address.ipv4_mapped
    if mapped is not None:
        return ipv4_not_global(int(mapped))
    return not address.is_global or address.is_multicast or int(address) in _PUBLIC_RESOLVERS


def _ipv4_span(view: View, pivot: int, end: int) -> Span | None:
    text, shape = view.text, view.shape
    start = pivot
    while start > pivot - 2 and char(shape, start - 1) == "0":
        start -= 1
    before = char(shape, start - 1)
    if before in ("0", "A", "a", "_", ".", "+"):
        return None
    if before == "-" and char(shape, start - 2) != "0":
        return None  # "-" is a boundary only in a range: 10.0.0.1-10.0.0.9
    if _followed_by_version_suffix(text, end):
        return None
    if VERSION_CONTEXT.search(view.lower, max(0, start - 12), start):
        return None
    octets = text[start:end].split(".")
    if any(len(o) > 1 and o[0] == "0" for o in octets) or any(int(o) > 255 for o in octets):
        return None  # not an address (ipaddress refuses leading zeros too)
    value = int.from_bytes(bytes(int(o) for o in octets), "big")
    if ipv4_not_global(value) or _is_netmask(value) or value in _PUBLIC_RESOLVERS:
        return None  # private, loopback, link-local, documentation, masks: identify nobody
    return (start, end, "ip")


_IPV4_NEXT: Final = re.compile(r"-\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}")


def _followed_by_version_suffix(text: str, end: int) -> bool:
    """1.2.3.4-beta, 1.2.5.1-2 (a Debian revision), 1.2.3.4+local: versions. A range
    10.0.0.1-10.0.0.9 is two addresses."""
    if char(text, end) not in "-+~" or not char(text, end + 1).isalnum():
        return False
    return _IPV4_NEXT.match(text, end) is None


def _is_netmask(value: int) -> bool:
    """255.255.255.0 and the like: ones, then zeros."""
    return value >> 24 == 255 and (value | (value - 1)) & 0xFFFFFFFF == 0xFFFFFFFF


def _ipv6_span(view: View, start: int, end: int) -> Span | None:
    text = view.text
    if char(text, start - 1) in (":", ".") or _is_word(char(text, start - 1)):
        return None
    if _is_word(char(text, end)) or char(text, end) == ":":
        return None
    candidate = text[start:end]
    groups = [g for g in candidate.split("%")[0].split(":") if g]
    # "1::2" in a slice and "a::b" in code are valid addresses too short to be ones.
    if len(groups) < 2 or sum(map(len, groups)) < 5:
        return None
    return (start, end, "ip") if view.valid(partial(_is_ipv6, candidate)) else None


def _is_ipv6(candidate: str) -> bool:
    try:
        address = ipaddress.IPv6Address(candidate)
    except ValueError:
        return False
    return not _keep_address(address)


def _find_ips(view: View) -> Iterator[Span]:
    text = view.text
    if "." in text:
        for match in _IPV4_SHAPE.finditer(view.shape):
            span = _ipv4_span(view, match.start(), match.end())
            if span is not None:
                yield span
    if ":" not in text:
        return
    for match in _IPV6_FULL.finditer(text):
        start = _extend_left(text, match.start(), _HEX_GROUP, 4)
        if start < match.start():
            span = _ipv6_span(view, start, match.end())
            if span is not None:
                yield span
    for match in _IPV6_COMPRESSED.finditer(text):
        start = _extend_left(text, match.start(), _HEX_GROUPS_REVERSED, 40)
        span = _ipv6_span(view, start, match.end())
        if span is not None:
            yield span


# --- secrets by shape ------------------------------------------------------------------


def _jwt_header_ok(token: str) -> bool:
    """A JWT's first part decodes to a JSON object naming its algorithm."""
    head = token.split(".", 1)[0]
    try:
        decoded = json.loads(base64.urlsafe_b64decode(head + "=" * (-len(head) % 4)))
    except (ValueError, binascii.Error):
        return False
    return isinstance(decoded, dict) and ("alg" in decoded or "typ" in decoded)


def _has_letter_and_digit(token: str) -> bool:
    return any(c.isdigit() for c in token) and any(c.isalpha() for c in token)


# Documented token formats (each provider's docs; gitleaks and detect-secrets list the
# same prefixes). Each starts with a literal so that `re` scans for it quickly.
# Each pattern starts with a literal, so that `re` scans for it quickly; alternatives
# that share a first letter share a pattern (one scan), and a named group says which
# matched when its shape needs a further check.
_TOKEN_SHAPES: Final = (
    re.compile(
        r"A(?:(?:KIA|SIA|BIA|CCA|3T[A-Z0-9])[A-Z0-9]{16}(?![A-Za-z0-9])"  # AWS access key id
        r"|Iza[0-9A-Za-z_\-]{35}(?![0-9A-Za-z_\-]))"  # Google API key
    ),
    re.compile(
        r"g(?:h[pousr]_[A-Za-z0-9]{36,255}(?![A-Za-z0-9_])"  # GitHub
        r"|ithub_pat_[A-Za-z0-9_]{22,255}"  # GitHub fine-grained
        r"|l(?:pat|dt|rt|cbt|ptt|ft|soat|imt|agent|oas|ffct)-[A-Za-z0-9_\-]{20,255})"  # GitLab
    ),
    re.compile(r"GR1348941[A-Za-z0-9_\-]{20,255}"),  # GitLab runner registration
    re.compile(r"x(?:(?P<slack>ox[abposre]-[A-Za-z0-9\-]{10,255})|app-\d-[A-Za-z0-9\-]{10,255})"),
    re.compile(r"https://hooks\.slack\.com/services/[A-Za-z0-9_/]{8,}"),
    re.compile(
        r"sk(?:_(?:live|test)_[A-Za-z0-9]{10,255}"  # Stripe
        r"|(?P<openai>-[A-Za-z0-9_\-]{20,255}))"  # OpenAI, Anthropic
    ),
    re.compile(r"rk_(?:live|test)_[A-Za-z0-9]{10,255}"),  # Stripe restricted
    re.compile(r"whsec_[A-Za-z0-9+/]{20,255}"),  # Stripe webhook
    re.compile(r"(?P<jwt>eyJ[A-Za-z0-9_\-]{4,}\.eyJ[A-Za-z0-9_\-]{4,}\.[A-Za-z0-9_\-]*)"),
    re.compile(r"npm_[A-Za-z0-9]{36}(?![A-Za-z0-9])"),
    re.compile(r"SG\.[A-Za-z0-9_\-]{22}\.[A-Za-z0-9_\-]{43}(?![A-Za-z0-9_\-])"),  # SendGrid
    re.compile(r"hf_[A-Za-z0-9]{34}(?![A-Za-z0-9])"),  # Hugging Face
    re.compile(r"shp(?:at|ss|ca|pa)_[a-fA-F0-9]{32}(?![A-Za-z0-9])"),  # Shopify
    re.compile(r"do[por]_v1_[a-f0-9]{64}(?![A-Za-z0-9])"),  # DigitalOcean
    re.compile(r"pypi-AgE[A-Za-z0-9_\-]{50,}"),
)
_TOKEN_JUDGES: Final[Mapping[str, Callable[[str], bool]]] = {
    "slack": _has_letter_and_digit,
    "openai": _has_letter_and_digit,
    "jwt": _jwt_header_ok,
}
_TOKEN_CHARS: Final = frozenset(string.ascii_letters + string.digits + "_-")

_PEM_BEGIN: Final = re.compile(r"-----BEGIN[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----")
_PEM_END: Final = re.compile(r"-----END[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----")
# Base64 lines (a line must be base64 to its end) and the RFC 1421 headers.
_PEM_BODY: Final = re.compile(
    r"(?:\r?\n(?:[A-Za-z0-9+/=]*(?=\r?\n|\Z)|(?:Proc-Type|DEK-Info|Comment): [^\n]*))*"
)
_PUTTY_PRIVATE: Final = re.compile(r"Private-Lines: *\d+(?:\r?\n[A-Za-z0-9+/=]*)*")

# `password=…`, `"api_key": "…"`, `token: …`, `{'secret': '…'}`: the key ends in one
# of these words (so `max_tokens` and `token_count` do not), the value is redacted.
# A password is short and plain by nature, so a password word takes any value; a token
# or key word takes a value only when it looks generated (`_credential_like`): a seeded
# `token: 1VjArnVgxwvq` is data, `token: Zx81kPq9LmN2vB7cR4tY` a credential.
_KEYWORDS: Final = tuple(
    (re.compile(p + r"(?![a-z0-9])"), any_value)
    for p, any_value in (
        (r"p(?:ass(?:word|wd|phrase)|wd|rivate[_-]?key)", True),
        # "pass" and "pw" alone are parts of other words (bypass, compass): a whole word,
        # and a value that looks like a password (`_password_like`).
        (r"p(?:ass|w)(?<![a-z]pass)(?<![a-z]pw)", False),
        (r"secret(?:[_-]?key)?", True),
        (r"credentials?", True),
        (r"token", False),
        (r"a(?:pi[_-]?key|pikey|ccess[_-]?key|uthorization)", False),
        # `key` alone is too common a word: only these names of it (checked in
        # `_find_assignments`; the pattern starts with a literal to stay fast).
        (r"key", False),
    )
)
MIN_CONTEXT_SECRET_CHARS: Final = 16
"""The shortest value a token or key word (``token:``, ``api_key=``) makes a secret."""
_ASSIGNED_VALUE: Final = re.compile(
    r"""["']?[ \t]*(?:=>|:=|=|:)[ \t]*"""
    r"""(?:"((?:[^"\\\n]|\\.){1,1024})"|'((?:[^'\\\n]|\\.){1,1024})'|([^\s"'`,;&<>(){}\[\]]{1,1024}))"""
)
_NOT_A_VALUE: Final = frozenset(
    [
        "null",
        "none",
        "nil",
        "true",
        "false",
        "undefined",
        "redacted",
        "masked",
        "hidden",
        "str",
        "bytes",
        "string",
        "int",
        "any",
        "optional",
        "secretstr",
    ]
)
# Documentation and templates, not values: [SECRET], [EMAIL_1], ****, xxxx, ${VAR},
# {{ var }}, %s, <token>, TOKEN, YOUR_API_KEY.
_PLACEHOLDER_LIKE: Final = re.compile(
    r"\[[A-Z_]+\]|\[[A-Z_]+_\d+\]|\*+|x+|X+|•+|\$\{[^}]*\}|\{\{.*\}\}|%s|<[^>]*>|[A-Z][A-Z_]*"
)
_SCHEME: Final = re.compile(r"(?:bearer|basic|token|digest)[ \t]+", re.IGNORECASE)
_SCHEME_VALUE: Final = re.compile(r"[^\s\"'`,;&<>(){}\[\]]{1,1024}")
_AUTH_SCHEME: Final = re.compile(r"b(?:(?P<bearer>earer)|asic)[ \t]+")
_BEARER_VALUE: Final = re.compile(r"[A-Za-z0-9\-._~+/]{8,4096}=*")
_BASIC_VALUE: Final = re.compile(r"[A-Za-z0-9+/]{8,}={0,2}(?![A-Za-z0-9+/=])")
_URL_CREDENTIALS: Final = re.compile(r"://[^\s:/@]{0,256}:([^\s/@]{1,256})@")
_LONG_B64: Final = re.compile("x" * 40 + "x*")


def _boundary_before(text: str, start: int) -> bool:
    return char(text, start - 1) not in _TOKEN_CHARS


def _find_token_shapes(view: View) -> Iterator[Span]:
    text = view.text
    for pattern in _TOKEN_SHAPES:
        for match in pattern.finditer(text):
            judge = _TOKEN_JUDGES.get(match.lastgroup or "")
            if _boundary_before(text, match.start()) and (judge is None or judge(match.group())):
                yield (match.start(), match.end(), "secret")


def _find_pem(view: View) -> Iterator[Span]:
    """A private key block from BEGIN to its END line; with no END, to the end of its
    body (or of the text, when it was cut). END lines are found once and looked up, so
    a text of many BEGIN lines costs one pass, not one per line."""
    text = view.text
    if "-----BEGIN" in text:
        ends = [m.end() for m in _PEM_END.finditer(text)]
        covered = -1
        for begin in _PEM_BEGIN.finditer(text):
            if begin.start() < covered:
                continue
            index = bisect.bisect_left(ends, begin.end())
            if index < len(ends):
                covered = ends[index]
            elif view.truncated:
                covered = len(text)
            else:
                body = _PEM_BODY.match(text, begin.end())
                covered = body.end() if body else begin.end()
            yield (begin.start(), covered, "secret")
    if "Private-Lines:" in text:
        for match in _PUTTY_PRIVATE.finditer(text):
            yield (match.start(), match.end(), "secret")


def _is_real_value(value: str, quoted: bool) -> bool:
    stripped = value.strip()
    if not stripped or stripped.lower() in _NOT_A_VALUE or _PLACEHOLDER_LIKE.fullmatch(stripped):
        return False
    return quoted or not (stripped.isdigit() and len(stripped) < 6)


def _credential_like(value: str) -> bool:
    """A value that looks generated: 16+ characters, no space, and two of lower case,
    upper case and digits (``Zx81kPq9LmN2vB7cR4tY``, a 32-digit hex key)."""
    if len(value) < MIN_CONTEXT_SECRET_CHARS or any(c.isspace() for c in value):
        return False
    classes = (
        any(c.islower() for c in value)
        + any(c.isupper() for c in value)
        + any(c.isdigit() for c in value)
    )
    return classes >= 2


# "my password is hunter2", "the API token is Zx81…": in prose, a value must look like a
# credential (the password is "incorrect", the token "expired").
_PROSE_VALUE: Final = re.compile(
    r" (?:is|was) +([^\s\"'`,;&<>(){}\[\]]{1,256}?)[.!]?(?=\s|\Z|[\"',;)])"
)
_PASSWORD_SYMBOLS: Final = frozenset("!@#$%^&*+=?~")


def _password_like(value: str) -> bool:
    """A letter and a digit or symbol (``hunter2``, ``P@ss``), or six digits and more (a
    PIN, a one-time password): not a plain word (``incorrect``, ``test_foo``)."""
    if value.isdigit():
        return len(value) >= 6
    has_letter = any(c.isalpha() for c in value)
    return has_letter and any(c.isdigit() or c in _PASSWORD_SYMBOLS for c in value)


def _prose_value_span(text: str, key_end: int, any_value: bool) -> tuple[int, int] | None:
    match = _PROSE_VALUE.match(text, key_end)
    if match is None:
        return None
    value = match.group(1)
    if _PLACEHOLDER_LIKE.fullmatch(value) or value.lower() in _NOT_A_VALUE:
        return None
    ok = _password_like(value) if any_value else _credential_like(value)
    return match.span(1) if ok else None


def _assigned_value_span(
    text: str, key_end: int, any_value: bool, password_like: bool = False
) -> tuple[int, int] | None:
    match = _ASSIGNED_VALUE.match(text, key_end)
    if match is None:
        return _prose_value_span(text, key_end, any_value or password_like)
    group = next(i for i in (1, 2, 3) if match.group(i) is not None)
    start, end = match.span(group)
    if group == 3 and char(text, end) in "([{":
        return None  # `token = get_token()` in a traceback is code, not a value
    scheme = _SCHEME.match(text, start)
    if scheme is not None:  # "Authorization: Bearer abc…": the value follows the scheme
        value = _SCHEME_VALUE.match(text, scheme.end())
        if value is None:
            return None
        start, end = value.start(), max(value.end(), end if group != 3 else value.end())
        any_value = True  # a scheme says that what follows is a credential
    if not _is_real_value(text[start:end], quoted=group != 3):
        return None
    if password_like and not any_value and _password_like(text[start:end].strip()):
        return start, end
    if not any_value and not _credential_like(text[start:end]):
        return None
    return start, end


_KEY_NAMES: Final = re.compile(
    r"(?<![a-z])(?:account|session|signing|encryption|master|consumer|subscription)[_-]?\Z"
)
_KEY_NAME_REVERSED: Final = re.compile(r"[a-z0-9_.\-]{1,64}")


def _names_a_password(text: str, lower: str, keyword_start: int, keyword_end: int) -> bool:
    """A token or key word inside a name that says secret or password
    (``aws_secret_access_key``), or an environment variable's name (``GITHUB_TOKEN=``,
    ``export API_KEY=``: configuration, where credentials live): any value is a secret."""
    start = _extend_left(lower, keyword_start, _KEY_NAME_REVERSED, 64)
    name = lower[start:keyword_start]
    if "secret" in name or "pass" in name:
        return True
    return char(text, keyword_end) == "=" and text[start:keyword_end].isupper()


def _find_assignments(view: View) -> Iterator[Span]:
    text, lower = view.text, view.lower
    for keyword, any_value in _KEYWORDS:
        covered = -1
        for match in keyword.finditer(lower):
            if match.start() < covered:
                continue  # inside the value just found ("password=password=…")
            if keyword.pattern.startswith("key") and not _KEY_NAMES.search(
                lower, max(0, match.start() - 13), match.start()
            ):
                continue
            strong = any_value or _names_a_password(text, lower, match.start(), match.end())
            short_word = keyword.pattern.startswith("p(?:ass|w)")
            span = _assigned_value_span(text, match.end(), strong, password_like=short_word)
            if span is not None:
                covered = span[1]
                yield (span[0], span[1], "secret")


def _find_auth_headers(view: View) -> Iterator[Span]:
    text, lower = view.text, view.lower
    for match in _AUTH_SCHEME.finditer(lower):
        if match.group("bearer"):
            value = _BEARER_VALUE.match(text, match.end())
            ok = value is not None and _has_letter_and_digit(value.group())
        else:
            value = _BASIC_VALUE.match(text, match.end())
            ok = value is not None and _decodes_to_userpass(value.group())
        if ok and value is not None:
            yield (value.start(), value.end(), "secret")
    if "://" in text:
        for match in _URL_CREDENTIALS.finditer(text):
            if not _PLACEHOLDER_LIKE.fullmatch(match.group(1)):
                yield (match.start(1), match.end(1), "secret")


def _decodes_to_userpass(value: str) -> bool:
    try:
        return b":" in base64.b64decode(value, validate=True)
    except (ValueError, binascii.Error):
        return False


def _looks_random(token: str) -> bool:
    """A 40-character base64 word with mixed classes and high entropy: an AWS secret
    access key printed on its own. Hex digests (one case) and paths (low entropy) are not."""
    if token.islower() or token.isupper() or token.isalpha():
        return False  # one case only (hex digests), or no digit at all
    if not any(c.isdigit() for c in token):
        return False
    counts = Counter(token)
    entropy = -sum(n / len(token) * math.log2(n / len(token)) for n in counts.values())
    return entropy >= 4.2


# A 40-character random word is an AWS secret key only near a word that says so (or near
# its access key id): 30 random bytes in base64 are 40 characters too.
_AWS_CONTEXT: Final = re.compile(
    r"(?<![a-z])(?:aws|secret|key|token|credentials?|password|akia|asia)"
)


def _decodes_to_text(token: str) -> bool:
    """Base64 of readable text (``aGVsbG8gd29y…``) is data someone encoded, not a key: an
    AWS secret key decodes to random bytes."""
    try:
        decoded = base64.b64decode(token, validate=True).decode("utf-8")
    except (ValueError, binascii.Error):
        return False
    return decoded.isprintable()


def _find_aws_secret_keys(view: View) -> Iterator[Span]:
    text = view.text
    for match in _LONG_B64.finditer(view.b64):
        start, end = match.span()
        if end - start != 40 or char(text, end) == "=" or char(text, start - 1) in "=-_":
            continue
        token = text[start:end]
        if (
            _looks_random(token)
            and not _decodes_to_text(token)
            and _AWS_CONTEXT.search(view.lower, max(0, start - 80), min(len(text), end + 80))
        ):
            yield (start, end, "secret")


# --- configured secrets ----------------------------------------------------------------

_URLSAFE: Final = str.maketrans("+/", "-_")
B64_SET: Final = frozenset(_B64_CHARS + "-_")


@dataclass(frozen=True, slots=True)
class SecretForms:
    """Every spelling of the configured secrets that the scrubber looks for."""

    literals: tuple[str, ...]
    fragments: tuple[str, ...]  # base64 text fully determined by the secret's bytes


def _literal_forms(secret: str) -> set[str]:
    raw = secret.encode()
    forms = {
        secret,
        quote(secret, safe=""),
        quote(secret),
        quote_plus(secret),
        json.dumps(secret)[1:-1],
        repr(secret)[1:-1],
        raw.hex(),
        raw.hex().upper(),
    }
    # Percent-escapes may be spelled in lower case (%2f) by other encoders.
    forms |= {re.sub(r"%[0-9A-F]{2}", lambda m: m.group().lower(), f) for f in forms if "%" in f}
    return forms


def _base64_fragments(secret: str) -> set[str]:
    """The base64 characters that encode only the secret, at each of the three byte
    alignments it can have inside longer base64 text, in both alphabets."""
    raw = secret.encode()
    fragments: set[str] = set()
    for offset in range(3):
        encoded = base64.b64encode(b"\0" * offset + raw).decode()
        first = -(-8 * offset // 6)  # the first character with no bit of the padding
        last = 8 * (offset + len(raw)) // 6  # past the last character with only secret bits
        fragment = encoded[first:last]
        fragments |= {fragment, fragment.translate(_URLSAFE)}
    return fragments


def secret_forms(secrets: Iterable[str]) -> SecretForms:
    literals: set[str] = set()
    fragments: set[str] = set()
    for secret in secrets:
        literals |= _literal_forms(secret)
        fragments |= _base64_fragments(secret)
    fragments -= literals
    return SecretForms(
        tuple(sorted(literals, key=len, reverse=True)), tuple(sorted(fragments, key=len))
    )


def _occurrences(text: str, needle: str) -> Iterator[tuple[int, int]]:
    """Where `needle` is in `text`; overlapping occurrences make one span."""
    start = text.find(needle)
    while start >= 0:
        end = start + len(needle)
        following = text.find(needle, start + 1)
        while 0 <= following < end:
            end = following + len(needle)
            following = text.find(needle, following + 1)
        yield start, end
        start = following


def _find_configured(view: View, forms: SecretForms) -> Iterator[Span]:
    text = view.text
    for literal in forms.literals:
        for start, end in _occurrences(text, literal):
            yield (start, end, "secret")
    for fragment in forms.fragments:
        for start, end in _occurrences(text, fragment):
            # The characters either side hold a few bits of the secret too.
            start -= char(text, start - 1) in B64_SET
            end += char(text, end) in B64_SET
            end += text.startswith("==", end) + (char(text, end) == "=")  # its padding
            yield (start, end, "secret")


Detector = Callable[[View], Iterable[Span]]


def plan(wanted: frozenset[Category], region: str, forms: SecretForms) -> list[Detector]:
    """The detectors in force for these categories, phone region and configured secrets,
    in the order they run (the order does not change the result: overlaps are merged
    afterwards)."""
    detectors: list[Detector] = []
    if forms.literals:
        detectors.append(lambda v: _find_configured(v, forms))
    if "secret" in wanted:
        detectors += [
            _find_pem,
            _find_token_shapes,
            _find_assignments,
            _find_auth_headers,
            _find_aws_secret_keys,
        ]
    if "email" in wanted:
        detectors.append(_find_emails)
    if wanted & {"ssn", "credit_card", "phone"}:
        detectors.append(lambda v: _find_digit_shapes(v, wanted, region))
    if "phone" in wanted:
        detectors.append(lambda v: _find_prefixed_phones(v, region))
    if "iban" in wanted:
        detectors.append(_find_ibans)
    if "ip" in wanted:
        detectors.append(_find_ips)
    return detectors
