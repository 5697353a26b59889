"""The cap boundary: when the host cut a stream at its output cap, the text may end
inside a value that the full detectors cannot recognise any more. Each rule here says
what "could be the start" of a value of its category means, anchored at the end of the
text.

With ``truncated=True``, what is redacted to the end, per category: a configured
secret's first 4+ characters in any spelling; a known token prefix (``ghp_``, ``AKIA``,
``sk-``, ``eyJ…``, …) and what follows; a cut ``password=``/``token=``/Authorization
value (of any length: the rest is unknown); a user:password cut after the colon (not a
port); 16-39 mixed-case base64 characters; a PEM block with no END; an email local part
with its ``@``; card digits 9-18 starting with 2-6 (PCI DSS allows the first 8 to be
shown), one run of digits only next to a card word; an SSN's first 4+ digits; ``+`` and
5+ digits, ``(415) 555``/``415-555…``, a trunk number with 6+ digits; an IBAN with a
known country and 4+ account characters; three IPv4 octets and a dot, or with 6+ digits
(not ``3.11.7``, nor a prefix inside a private range: ``10.0.0.``); an IPv6 prefix with
3 colons, a ``::`` or a hex letter. Ordinary endings (numbers, dates, versions, words,
hashes) stay.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterator
from typing import Final

from codecage.policy.scrub.detectors import (
    B64_SET,
    DATE_START,
    NANP_REGIONS,
    VERSION_CONTEXT,
    Category,
    SecretForms,
    Span,
    View,
    card_context,
    char,
    iban_length,
    ipv4_not_global,
)

_MIN_TAIL_PREFIX: Final = 4  # a cut configured secret shows at least this much to be caught
_TAIL_WINDOW: Final = 1024  # the cap-boundary rules look at this many final characters

_TAIL_RULES: Final[tuple[tuple[Category, re.Pattern[str]], ...]] = (
    # A known token prefix and anything after it.
    (
        "secret",
        re.compile(
            r"(?<![A-Za-z0-9_\-])(?:(?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{0,15}|gh[pousr]_[A-Za-z0-9]*"
            r"|github_pat_[A-Za-z0-9_]*|gl(?:pat|dt|rt|cbt|ptt|ft|soat|imt|agent|oas|ffct)-"
            r"[A-Za-z0-9_\-]*|xox[abposre]-[A-Za-z0-9\-]*|(?:sk|rk)_(?:live|test)_[A-Za-z0-9]*"
            r"|whsec_[A-Za-z0-9+/]*|sk-[A-Za-z0-9_\-]{4,}|eyJ[A-Za-z0-9_\-]{4,}"
            r"(?:\.[A-Za-z0-9_\-]*){0,2}|AIza[0-9A-Za-z_\-]*|npm_[A-Za-z0-9]*"
            r"|pypi-[A-Za-z0-9_\-]*|https://hooks\.slack\.com/services/[A-Za-z0-9_/]*)\Z"
        ),
    ),
    # A user and the start of a password in a URL ("localhost:8080" is a port: digits).
    ("secret", re.compile(r"://[^\s:/@]{1,256}:([^\s/@]*[^\s/@0-9][^\s/@]*)\Z")),
    # A local part and an @: the domain was cut. Its last 64 characters at most, as the
    # whole-text detector takes them (a longer run keeps only what lies beyond).
    ("email", re.compile(r"[A-Za-z0-9._%+\-]{1,64}@[A-Za-z0-9.\-]*\Z")),
    # Card digits from the 9th on (PCI DSS lets the first 8 be shown), first digit 2-6.
    (
        "credit_card",
        re.compile(
            r"(?<![\w.,])(?:[2-6]\d{3}(?:[ -]\d{1,6}){1,4}|[2-6]\d{8,17}"
            r"|[2-6]\d{3}(?:[ -]\d{4}){0,3}[ -])\Z"
        ),
    ),
    # An area and group number: the first five digits are the sensitive part.
    ("ssn", re.compile(r"(?<![\w-])\d{3}-\d{1,2}(?:-\d{0,3})?\Z")),
    # "+" and 5 digits or more; a US area code and exchange; a national trunk number.
    ("phone", re.compile(r"(?<![\w+])\+[1-9](?:[ .\-()]{0,2}\d){4,13}[ .\-()]*\Z")),
    ("phone", re.compile(r"(?<![\w.\-])(?:\(\d{3}\) ?|\d{3}[- ])\d{3}(?:[- ]\d{0,3})?\Z")),
    # A country, check digits and four characters of the account.
    ("iban", re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}\d{2}(?: ?[A-Z0-9]{1,4}){1,8} ?\Z")),
    # Three octets and a dot, or three octets with 6 digits (192.168.1); not "3.11.7".
    ("ip", re.compile(r"(?<![\w.])\d{1,3}\.\d{1,3}\.\d{1,3}(?:\.\d{0,3})?\Z")),
    ("ip", re.compile(r"(?<![\w:.])[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7}\Z")),
)
_TAIL_ASSIGNMENT: Final = re.compile(
    r"(?:pass(?:word|wd|phrase)|secret(?:[_-]?key)?|token|api[_-]?key|access[_-]?key"
    r"|private[_-]?key|credentials?|authorization)(?![a-z0-9])"
    r"""["']?[ \t]*(?:=>|:=|=|:)[ \t]*["']?([^\s"',;&]+)\Z"""
)
_TAIL_BEARER: Final = re.compile(r"(?:bearer|basic)[ \t]+([a-z0-9\-._~+/]+=*)\Z")
_TAIL_B64: Final = re.compile(r"(?<![A-Za-z0-9+/])[A-Za-z0-9+/]{16,39}\Z")


_TAIL_TRUNK_PHONE: Final = re.compile(
    r"(?<![\w.+\-])(?:\(0\d{1,4}\) ?|0\d{1,4}[ \-])\d{1,8}(?:[ \-]\d{0,8}){0,3}\Z"
)


def _tail_ok(category: Category, tail: str) -> bool:
    """The category's extra condition on a tail that its pattern matched."""
    digits = sum(c.isdigit() for c in tail)
    if category == "credit_card":
        return 9 <= digits <= 18
    if category == "ssn":
        return digits >= 4
    if category == "phone":
        return digits >= 5 and not (tail[0].isdigit() and DATE_START.match(tail))
    if category == "iban":
        length = iban_length(tail[:2])
        return length is not None and 8 <= len(tail.replace(" ", "")) < length
    if category == "ip" and ":" in tail:
        shaped = tail.count(":") >= 3 or "::" in tail or re.search(r"[a-fA-F]|[0-9a-fA-F]{4}", tail)
        return bool(shaped) and any(c in string.hexdigits for c in tail)
    if category == "ip":
        octets = [o for o in tail.split(".") if o]
        if not all(int(o) <= 255 for o in octets) or not (tail.endswith(".") or digits >= 6):
            return False
        whole = tail.split(".")[:-1]  # the octets the cut left whole: a prefix of the address
        value = sum(int(o) << (24 - 8 * i) for i, o in enumerate(whole))
        return not ipv4_not_global(value, 8 * len(whole))  # "10.0.0." is private whatever follows
    return True


def find_tail(
    view: View, wanted: frozenset[Category], forms: SecretForms, region: str
) -> Iterator[Span]:
    """Spans that run to the end of a text cut at the output cap (see the rules above)."""
    text = view.text
    offset = max(0, len(text) - _TAIL_WINDOW)
    window = text[offset:]
    yield from _configured_tail(text, forms)
    rules = list(_TAIL_RULES)
    if region not in NANP_REGIONS:
        rules.append(("phone", _TAIL_TRUNK_PHONE))
    for category, pattern in rules:
        match = pattern.search(window) if category in wanted else None
        if match is None:
            continue
        start = match.start(1) if pattern.groups else match.start()
        if not _tail_ok(category, window[start:]):
            continue
        if (
            category == "credit_card"
            and window[start:].isdigit()
            and not card_context(view, offset + start, len(text))
        ):
            continue  # one cut run of digits is a card only next to a card word
        if category == "ip" and VERSION_CONTEXT.search(
            view.lower, max(0, offset + start - 12), offset + start
        ):
            continue
        yield (offset + start, len(text), category)
    if "secret" in wanted:
        yield from _secret_tail(view, offset)


def _secret_tail(view: View, offset: int) -> Iterator[Span]:
    """An assignment or an Authorization header cut in its value; a cut random key."""
    text = view.text
    lower_window = view.lower[offset:]
    for pattern in (_TAIL_ASSIGNMENT, _TAIL_BEARER):
        match = pattern.search(lower_window)
        if match is not None:
            yield (offset + match.start(1), len(text), "secret")
    match = _TAIL_B64.search(text, offset)
    if match is not None and _looks_random_prefix(match.group()):
        yield (match.start(), len(text), "secret")


def _looks_random_prefix(token: str) -> bool:
    return (
        any(c.isupper() for c in token)
        and any(c.islower() for c in token)
        and any(c.isdigit() for c in token)
    )


def _configured_tail(text: str, forms: SecretForms) -> Iterator[Span]:
    """A text that ends with the first characters of a configured secret (in any of its
    spellings) ends in the middle of it."""
    tail = text[-_TAIL_WINDOW:]
    for form in (*forms.literals, *forms.fragments):
        for size in range(min(len(form) - 1, len(tail)), _MIN_TAIL_PREFIX - 1, -1):
            if tail.endswith(form[:size]):
                start = len(text) - size
                if form in forms.fragments:
                    start -= char(text, start - 1) in B64_SET
                yield (start, len(text), "secret")
                break
