"""The scrubber: runs the detectors over a text or a JSON-like value, merges overlapping
findings and replaces them by placeholders; with its configuration (`ScrubConfig`) and
results.

`Scrubber.scrub` takes the whole captured text of a stream (so a value written in two
pieces is whole again) and, when the host cut the stream at its output cap, also redacts a
tail that could be the start of a sensitive value (`codecage.policy.scrub.tail`).
`Scrubber.scrub_value` does the same for JSON-like values (return value, events).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

import phonenumbers

from codecage.errors import ConfigError
from codecage.policy.scrub.detectors import (
    CATEGORIES,
    MIN_SECRET_CHARS,
    PLACEHOLDERS,
    Category,
    Span,
    View,
    plan,
    secret_forms,
)
from codecage.policy.scrub.tail import find_tail
from codecage.policy.scrub.values import collect_strings, rebuild

# In a dict key, a finding becomes a numbered placeholder ([EMAIL_1]) so that keys stay apart.
_NUMBERED_LABELS: Final[Mapping[Category, str]] = {c: p[1:-1] for c, p in PLACEHOLDERS.items()}

# When two findings overlap, their union is redacted under the first of these: a password
# that looks like an email address is still a secret.
_PRIORITY: Final[tuple[Category, ...]] = (
    "secret",
    "ssn",
    "credit_card",
    "iban",
    "email",
    "phone",
    "ip",
)
_RANK: Final[Mapping[Category, int]] = {c: i for i, c in enumerate(_PRIORITY)}

# --- configuration and results -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ScrubConfig:
    """What the scrubber looks for.

    `categories` empty means the detectors are off; `secrets` are still redacted then,
    because an operator listed them one by one (pass none to turn scrubbing off
    entirely). `phone_region` is the ISO 3166 region whose national format (a number
    without ``+``) is recognised; US formats are always recognised.

    Raises:
        ConfigError: an unknown category or region, or a secret shorter than
            `MIN_SECRET_CHARS` (it would redact ordinary text).
    """

    categories: frozenset[Category] = frozenset(CATEGORIES)
    secrets: tuple[str, ...] = ()
    phone_region: str = "US"

    def __post_init__(self) -> None:
        categories = frozenset(self.categories)
        unknown = sorted(str(c) for c in categories - set(CATEGORIES))
        if unknown:
            raise ConfigError(
                f"unknown scrub categories: {', '.join(unknown)}",
                hint=f"choose from: {', '.join(CATEGORIES)}",
            )
        region = self.phone_region.upper()
        if region not in phonenumbers.SUPPORTED_REGIONS:
            raise ConfigError(
                f"phone_region={self.phone_region!r} is not a region libphonenumber knows",
                hint="use a two-letter ISO 3166 code such as US, GB, DE or FR",
            )
        for secret in self.secrets:
            if len(secret.strip()) < MIN_SECRET_CHARS:
                raise ConfigError(
                    f"a configured secret of {len(secret.strip())} characters is too short"
                    f" to scrub (the minimum is {MIN_SECRET_CHARS})",
                    hint="configure the whole credential; a short value would be found in"
                    " ordinary text and redact it",
                )
        object.__setattr__(self, "categories", categories)
        object.__setattr__(self, "secrets", tuple(dict.fromkeys(self.secrets)))
        object.__setattr__(self, "phone_region", region)


@dataclass(frozen=True, slots=True)
class Scrubbed:
    """A scrubbed text and how many values of each category were redacted in it."""

    text: str
    counts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ScrubbedValue:
    """A scrubbed copy of a JSON-like value and how many values were redacted in it."""

    value: object
    counts: dict[str, int] = field(default_factory=dict)


def merge_counts(*counts: Mapping[str, int]) -> dict[str, int]:
    """Add up the redaction counts of several fields into the one a result reports.

    Raises:
        Nothing.
    """
    total: Counter[str] = Counter()
    for one in counts:
        total.update(one)
    return {c: total[c] for c in CATEGORIES if total[c]}


# --- putting findings together -----------------------------------------------------------


def _merge(spans: Iterable[Span]) -> list[Span]:
    """Overlapping findings become one, redacted whole under the highest-priority
    category: redacting only part of either would leave the rest of it readable."""
    merged: list[Span] = []
    for start, end, category in sorted(spans, key=lambda s: (s[0], -s[1])):
        if start >= end:
            continue
        if merged and start < merged[-1][1]:
            last_start, last_end, last_category = merged[-1]
            best = min(last_category, category, key=_RANK.__getitem__)
            merged[-1] = (last_start, max(last_end, end), best)
        else:
            merged.append((start, end, category))
    return merged


def _splice(text: str, spans: list[Span], replace: Callable[[Category, str], str]) -> str:
    parts: list[str] = []
    position = 0
    for start, end, category in spans:
        parts.append(text[position:start])
        parts.append(replace(category, text[start:end]))
        position = end
    parts.append(text[position:])
    return "".join(parts)


def _count(spans: list[Span]) -> dict[str, int]:
    counts = Counter(category for _, _, category in spans)
    return {c: counts[c] for c in CATEGORIES if counts[c]}


# --- the scrubber ------------------------------------------------------------------------


class Scrubber:
    """Finds and replaces personal data and secrets in text and JSON-like values.

    One per configuration, reused across executions: it compiles what it looks for once.
    Thread-safe: it keeps no state between calls.
    """

    def __init__(self, config: ScrubConfig | None = None) -> None:
        self.config = config if config is not None else ScrubConfig()
        self._wanted = self.config.categories
        self._region = self.config.phone_region
        self._forms = secret_forms(self.config.secrets)
        self._detectors = plan(self._wanted, self._region, self._forms)
        self._detectors_only: Scrubber | None = None

    def without_secrets(self) -> Scrubber:
        """This scrubber without its configured secrets: its detectors only.

        What code in the sandbox may run on its own text (`codecage.runtime.scrub`). With
        the configured secrets, that would be an oracle: the code sends guesses (all one
        million 6-digit numbers in one text) and sees which one comes back as
        ``[SECRET]``, so it learns a credential it was never given. The configured secrets
        still leave every result: the host scrubs them from what the run returns.

        Raises:
            Nothing.
        """
        if not self.config.secrets:
            return self
        if self._detectors_only is None:
            config = ScrubConfig(categories=self._wanted, phone_region=self._region)
            self._detectors_only = Scrubber(config)
        return self._detectors_only

    @property
    def active(self) -> bool:
        """Whether this scrubber can change anything at all."""
        return bool(self._detectors)

    def find(self, text: str, *, truncated: bool = False) -> list[Span]:
        """The (start, end, category) spans to redact in `text`, sorted, not overlapping.

        Raises:
            Nothing.
        """
        if not text or not self._detectors:
            return []
        view = View(text, truncated)
        spans: list[Span] = []
        for detect in self._detectors:
            spans.extend(detect(view))
        if truncated:
            tails = list(find_tail(view, self._wanted, self._forms, self._region))
            if tails:  # the longest reading of the tail names it: "(415) 555-26" is a phone
                spans.append(min(tails, key=lambda s: (s[0], _RANK[s[2]])))
        return _merge(spans)

    def scrub(self, text: str, *, truncated: bool = False) -> Scrubbed:
        """Replace every finding in `text` by its placeholder (``[EMAIL]``).

        Pass the whole captured stream, not chunks: a value written in two pieces is
        only whole again in the complete text. Pass `truncated=True` when the host cut
        the stream at its cap: a tail that could be the start of a value is redacted
        too (see `codecage.policy.scrub.tail`).

        Raises:
            Nothing.
        """
        spans = self.find(text, truncated=truncated)
        if not spans:
            return Scrubbed(text, {})
        return Scrubbed(_splice(text, spans, _placeholder), _count(spans))

    def scrub_name(self, name: str) -> Scrubbed:
        """A file name scrubbed with each of its parts read apart.

        In a file name, ``/``, ``\\``, ``_``, ``.``, ``-`` and ``+`` only separate words:
        ``out/4111111111111111.txt`` and ``card_5555555555554444.csv`` name a card as
        surely as the bare number does, though in running text a digit after ``/`` or
        ``.`` is part of a path or a decimal and a word joined by ``_`` is one token. The
        findings are looked for in `name` as it is (an address keeps its dots) and with
        those characters read as spaces (same length, so the spans fall where they are in
        `name`), and both are replaced in `name` itself.

        Raises:
            Nothing.
        """
        spans = _merge([*self.find(name), *self.find(name.translate(_NAME_SEPARATORS))])
        if not spans:
            return Scrubbed(name, {})
        return Scrubbed(_splice(name, spans, _placeholder), _count(spans))

    def scrub_value(self, value: object) -> ScrubbedValue:
        """A scrubbed copy of a JSON-like value and what was redacted in it.

        Strings are scrubbed wherever they are, dict keys included: an address used as a
        key leaks as much as one used as a value. A finding in a key becomes a numbered
        placeholder (``[EMAIL_1]``, ``[EMAIL_2]``; the same value the same number
        throughout the value), so the dict keeps every key apart and its shape: a count
        per address is still a count per address. An int whose digits are a finding
        becomes the placeholder string. Tuples become lists; other objects are scrubbed
        as their `str`. Nesting deeper than 200 levels is replaced by ``[TOO_DEEP]``. A
        value is not scanned across its strings: an address split over two list items
        survives.

        Raises:
            Nothing.
        """
        texts: list[str] = []
        keys: list[int] = []
        collect_strings(value, texts, convert_other=True, keys=keys)
        scrubbed, spans = self.replace_many(
            texts, _placeholder, keys=frozenset(keys), replace_key=_Numbering()
        )
        mapped = iter(scrubbed)
        return ScrubbedValue(rebuild(value, mapped, convert_other=True), _count(spans))

    def replace_many(
        self,
        texts: list[str],
        replace: Callable[[Category, str], str],
        *,
        keys: frozenset[int] = frozenset(),
        replace_key: Callable[[Category, str], str] | None = None,
    ) -> tuple[list[str], list[Span]]:
        """Each text with its findings replaced by `replace(category, value)` (by
        `replace_key` in the texts whose indices are in `keys`), and the findings
        (positions in the joined text, for counting).

        The texts are scanned as one, joined by a separator that no detector's pattern
        can cross, because one scan of a long text costs far less than one per short
        text (~17 us each). If a finding does reach a separator anyway (a PEM block whose
        END is in another string) or a text holds a NUL, each text is scanned on its own
        instead.

        Raises:
            Nothing.
        """
        if not texts or not self._detectors:
            return texts, []
        by_text = _by_text(replace, keys, replace_key)
        if len(texts) == 1:
            return self._replace_each(texts, by_text)
        joined = _JOIN.join(texts)
        if joined.count("\0") != len(texts) - 1:  # a text holds a NUL of its own
            return self._replace_each(texts, by_text)
        spans = self.find(joined)
        if not spans:
            return texts, []
        if keys and replace_key is not None:
            # The text a finding is in: how many separators (their NULs) come before it,
            # counted forwards from finding to finding (the spans are sorted).
            replacements = []
            index = position = 0
            for start, end, category in spans:
                index += joined.count("\0", position, start)
                position = start
                replacements.append(by_text(index)(category, joined[start:end]))
            taken = iter(replacements)
            parts = _splice(joined, spans, lambda _category, _value: next(taken))
        else:
            parts = _splice(joined, spans, replace)
        split = parts.split(_JOIN)
        if len(split) != len(texts):  # a finding ate into a separator
            return self._replace_each(texts, by_text)
        return split, spans

    def _replace_each(
        self, texts: list[str], by_text: Callable[[int], Callable[[Category, str], str]]
    ) -> tuple[list[str], list[Span]]:
        out: list[str] = []
        every: list[Span] = []
        for index, text in enumerate(texts):
            spans = self.find(text)
            out.append(_splice(text, spans, by_text(index)) if spans else text)
            every.extend(spans)
        return out, every


# What separates the words of a file name (`Scrubber.scrub_name`), read as a space.
_NAME_SEPARATORS: Final = str.maketrans(dict.fromkeys("/\\_.-+", " "))


def _by_text(
    replace: Callable[[Category, str], str],
    keys: frozenset[int],
    replace_key: Callable[[Category, str], str] | None,
) -> Callable[[int], Callable[[Category, str], str]]:
    """The replacement for the findings of the text at an index: `replace_key` in a key."""
    if replace_key is None or not keys:
        return lambda _index: replace
    return lambda index: replace_key if index in keys else replace


class _Numbering:
    """Numbered placeholders (``[EMAIL_1]``): the same value gets the same one, another
    value the next number of its category. One per scrubbed value."""

    def __init__(self) -> None:
        self._labels: dict[tuple[Category, str], str] = {}
        self._issued: Counter[Category] = Counter()

    def __call__(self, category: Category, value: str) -> str:
        label = self._labels.get((category, value))
        if label is None:
            self._issued[category] += 1
            label = f"[{_NUMBERED_LABELS[category]}_{self._issued[category]}]"
            self._labels[(category, value)] = label
        return label


# A newline stops every pattern but the PEM one, which `replace_many` checks for; the NUL
# makes the separator impossible to mistake for text (texts with a NUL are not joined).
_JOIN: Final = "\n\0\n"


def _placeholder(category: Category, _value: str) -> str:
    return PLACEHOLDERS[category]
