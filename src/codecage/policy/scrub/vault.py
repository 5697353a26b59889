"""Tokenization: stable tokens for the personal data in upstream tool results, and the
values back in the arguments of tool calls, for one run (or one session)."""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Mapping
from typing import Final

from codecage.policy.scrub.detectors import PLACEHOLDERS, Category
from codecage.policy.scrub.scrubber import Scrubber
from codecage.policy.scrub.values import collect_strings, rebuild

_TOKEN_LABELS: Final[Mapping[Category, str]] = {
    "email": "EMAIL",
    "phone": "PHONE",
    "ssn": "SSN",
    "credit_card": "CREDIT_CARD",
    "iban": "IBAN",
    "ip": "IP_ADDRESS",
}
_LITERAL_LABEL: Final = "TOKEN"
_TOKEN: Final = re.compile(
    r"\[(?:" + "|".join([*_TOKEN_LABELS.values(), _LITERAL_LABEL]) + r")_[1-9][0-9]{0,8}\]"
)


class Vault:
    """Stable tokens for the personal data in upstream tool results, held in host memory
    for one execution (or one session) and dropped with it (`clear`).

    `tokenize` replaces each email, phone number, SSN, card number, IBAN and IP address
    in a result with a token (``[EMAIL_1]``; the same value always gets the same token in
    this vault, another value the next number of its category) before the sandbox sees
    it. `detokenize` puts the values back into the arguments of a tool call, also where a
    token sits inside a longer string ("write to [EMAIL_1] today").

    Secrets are never tokenized: they become ``[SECRET]`` and cannot be passed on, so a
    credential in one server's result cannot travel into another server's arguments.

    Guessing: the sandbox may send a token it invented (``[EMAIL_7]``). If the vault has
    no such token the text stays as it is. If it has, the value reaches only a tool
    argument, never the sandbox's own view, and it is a value this vault already gave
    the sandbox as that token; tool results are tokenized again on the way back. What a
    tool does with an argument is the tool's: one that echoes it transformed (reversed,
    its length) can reveal it, which is what the broker's allow-list is for.

    Upstream text that already contains something shaped like a token ("[EMAIL_1]"
    quoted in an email body) is tokenized itself, as a ``[TOKEN_n]`` whose value is that
    literal text, so it can neither be confused with a real token in the sandbox's view
    nor be turned into someone's address by `detokenize`.
    """

    def __init__(self, scrubber: Scrubber) -> None:
        self._scrubber = scrubber
        self._lock = threading.Lock()
        self._token_of: dict[tuple[str, str], str] = {}
        self._value_of: dict[str, str] = {}
        self._issued: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._value_of)

    def tokenize(self, value: object) -> object:
        """A copy of a JSON-like tool result with personal data replaced by tokens
        (secrets by ``[SECRET]``); keys too, non-JSON objects are left as they are.

        Raises:
            Nothing.
        """
        texts: list[str] = []
        collect_strings(value, texts, convert_other=False)
        escaped = [_TOKEN.sub(self._escape_literal, t) if "[" in t else t for t in texts]
        replaced, _ = self._scrubber.replace_many(escaped, self._replacement)
        return rebuild(value, iter(replaced), convert_other=False)

    def detokenize(self, value: object) -> object:
        """A copy of JSON-like tool arguments with this vault's tokens replaced by their
        values; text that merely looks like a token is left as it is.

        Raises:
            Nothing.
        """
        texts: list[str] = []
        collect_strings(value, texts, convert_other=False)
        with self._lock:
            values = dict(self._value_of)

        def restore(text: str) -> str:
            if "[" not in text:
                return text
            return _TOKEN.sub(lambda m: values.get(m.group(), m.group()), text)

        return rebuild(value, iter(map(restore, texts)), convert_other=False)

    def clear(self) -> None:
        """Forget every value: call when the execution (or session) ends.

        Raises:
            Nothing.
        """
        with self._lock:
            self._token_of.clear()
            self._value_of.clear()
            self._issued.clear()

    def _token(self, label: str, value: str) -> str:
        with self._lock:
            token = self._token_of.get((label, value))
            if token is None:
                self._issued[label] += 1
                token = f"[{label}_{self._issued[label]}]"
                self._token_of[(label, value)] = token
                self._value_of[token] = value
            return token

    def _replacement(self, category: Category, value: str) -> str:
        if category == "secret":
            return PLACEHOLDERS["secret"]
        return self._token(_TOKEN_LABELS[category], value)

    def _escape_literal(self, match: re.Match[str]) -> str:
        return self._token(_LITERAL_LABEL, match.group())
