"""Scrubbing and tokenization (src/codecage/policy/scrub/): each detector on realistic
positives and near-miss negatives, ordinary program output left alone, values split across
writes and cut at the output cap, configured secrets in every spelling, counts, switches,
JSON-like values and the broker's vault. No timing is asserted here: the figures come from
benchmarks/bench_scrub.py (smoke-run at the end of this file)."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from codecage.errors import ConfigError
from codecage.output import CappedBuffer
from codecage.policy.scrub import (
    CATEGORIES,
    MIN_SECRET_CHARS,
    PLACEHOLDERS,
    Category,
    Scrubber,
    ScrubConfig,
    Vault,
    merge_counts,
)
from codecage.policy.scrub.detectors import _CARD_WORDS as CARD_CONTEXT
from codecage.policy.scrub.detectors import card_brand, luhn_ok
from codecage.policy.scrub.values import collect_strings

ROOT = Path(__file__).resolve().parent.parent
SCRUB = Scrubber()
FAST = settings(max_examples=150, deadline=None)


def scrubbed(text: str, *, truncated: bool = False) -> str:
    return SCRUB.scrub(text, truncated=truncated).text


def only(category: Category) -> Scrubber:
    return Scrubber(ScrubConfig(categories=frozenset({category})))


# --- helpers to make test data (independent of the code under test) --------------------


def luhn_complete(body: str) -> str:
    """`body` with the check digit that makes it pass the Luhn check."""
    total = 0
    for i, char in enumerate(reversed(body)):
        digit = int(char) * (2 if i % 2 == 0 else 1)
        total += digit - 9 if digit > 9 else digit
    return body + str((10 - total % 10) % 10)


def grouped(number: str, sep: str) -> str:
    return sep.join(number[i : i + 4] for i in range(0, len(number), 4))


# --- email -----------------------------------------------------------------------------

EMAILS = [
    "john.doe@example.com",
    "j.doe+newsletter@mail.example.co.uk",
    "first_last@company.io",
    "ADMIN@EXAMPLE.ORG",
    "a@b.co",
    "user-42@sub-domain.example.museum",
]


@pytest.mark.parametrize("address", EMAILS)
def test_an_email_address_is_replaced_by_its_placeholder(address: str) -> None:
    for text, expected in (
        (f"contact {address} today", "contact [EMAIL] today"),
        (f'{{"email": "{address}"}}', '{"email": "[EMAIL]"}'),
        (f"Jane <{address}>", "Jane <[EMAIL]>"),
        (f"{address}.", "[EMAIL]."),
    ):
        assert scrubbed(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "icon@2x.png and logo@3x.webp",
        "@property\ndef name(self): ...",
        "user@localhost",
        "pip install pkg@1.2.3",
        "ssh git@host",
        "@@ -1,4 +1,5 @@",
        "price @ 3.50 each",
    ],
)
def test_strings_with_an_at_sign_that_are_not_addresses_survive(text: str) -> None:
    assert scrubbed(text) == text


_LABEL = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)
_LOCAL = st.from_regex(r"[A-Za-z0-9]([A-Za-z0-9._+-]{0,20}[A-Za-z0-9])?", fullmatch=True)
_TLD = st.from_regex(r"[a-z]{2,6}", fullmatch=True).filter(lambda t: t not in {"png", "json"})


@FAST
@given(local=_LOCAL, labels=st.lists(_LABEL, min_size=1, max_size=3), tld=_TLD)
def test_generated_email_addresses_are_redacted_whole(
    local: str, labels: list[str], tld: str
) -> None:
    address = f"{local}@{'.'.join(labels)}.{tld}"
    assert scrubbed(f"mail {address}, thanks") == "mail [EMAIL], thanks"


# --- phone numbers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "number",
    [
        "+1 415-555-2671",
        "+14155552671",
        "(415) 555-2671",
        "415-555-2671",
        "415.555.2671",
        "415 555 2671",
        "1-800-555-0199",
        "+44 20 7946 0958",
        "+49 30 12345678",
        "+33 1 23 45 67 89",
        "+81 3-1234-5678",
        "+91 98765 43210",
        "+61 2 9876 5432",
    ],
)
def test_international_and_us_phone_numbers_are_redacted(number: str) -> None:
    assert scrubbed(f"call {number} now") == "call [PHONE] now"


@pytest.mark.parametrize(
    ("region", "number"),
    [("GB", "020 7946 0958"), ("DE", "030 12345678"), ("FR", "01 23 45 67 89")],
)
def test_national_numbers_are_redacted_in_the_configured_region(region: str, number: str) -> None:
    scrubber = Scrubber(ScrubConfig(phone_region=region))
    assert scrubber.scrub(f"tel. {number}.").text == "tel. [PHONE]."
    assert scrubbed(f"tel. {number}.") == f"tel. {number}."  # not a US format


def test_a_number_followed_by_another_number_is_cut_where_the_phone_number_ends() -> None:
    assert scrubbed("+1 415 555 2671 42 items") == "[PHONE] 42 items"


@pytest.mark.parametrize(
    "text",
    [
        "2026-11-22 10:00:01",
        "22/11/2026 and 11.22.2026",
        "1,234,567 rows",
        "3.14159265358979",
        "123-456-7890",  # area code 123 does not exist
        "100 200 3000",
        "epoch 1763805601 ms 1763805601123",
        "id 4155552671",  # unformatted national numbers are not looked for
        "+1",
        "version 415.555.26",
    ],
)
def test_numbers_that_are_not_phone_numbers_survive(text: str) -> None:
    assert scrubbed(text) == text


def test_dates_are_not_national_phone_numbers_in_a_region_with_a_trunk_prefix() -> None:
    german = Scrubber(ScrubConfig(phone_region="DE"))
    for text in ("2026-11-22", "05-11-2026 10:00", "05.11.2026", "0.5 0.25 0.125"):
        assert german.scrub(text).text == text


# --- SSN -------------------------------------------------------------------------------


@pytest.mark.parametrize("ssn", ["123-45-6789", "078-05-1121", "536-90-4399"])
def test_a_us_social_security_number_is_redacted(ssn: str) -> None:
    assert scrubbed(f"SSN {ssn}, on file") == "SSN [SSN], on file"


@pytest.mark.parametrize(
    "text",
    [
        "000-12-3456",  # area 000 is never issued
        "666-12-3456",
        "912-34-5678",  # 9xx is not issued
        "123-00-4567",
        "123-45-0000",
        "078-05-1120",  # the wallet card number, famously invalid
        "2026-11-22",
        "123-45-67890",
        "a123-45-6789",
    ],
)
def test_ssn_shaped_numbers_that_cannot_be_one_survive(text: str) -> None:
    assert scrubbed(text) == text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("SSN 536904399.", "SSN [SSN]."),
        ("social security number: 536 90 4399", "social security number: [SSN]"),
        ("phone: 4155552671", "phone: [PHONE]"),
        ("Mobile no. 415.555.2671", "Mobile no. [PHONE]"),
        # the word names the number only when nothing else stands in between
        ("ssn_count: 536904399", "ssn_count: 536904399"),
        ("cell 12: 4155552671", "cell 12: 4155552671"),
        ("SSN 000904399", "SSN 000904399"),  # area 000 is never issued
        ("SSN 219-09-9999", "SSN [SSN]"),  # printed in advertising, but named an SSN here
        ("phone: 1234567890", "phone: 1234567890"),  # not a valid US number
    ],
)
def test_bare_digits_are_an_ssn_or_a_phone_number_only_when_a_word_names_them(
    text: str, expected: str
) -> None:
    assert scrubbed(text) == expected


# --- payment cards ---------------------------------------------------------------------

CARDS = [
    "4111 1111 1111 1111",
    "4111-1111-1111-1111",
    "4111111111111111",
    "5555555555554444",
    "378282246310005",
    "3782 822463 10005",
    "6011111111111117",
    "3530111333300000",
    "2221000000000009",
    "4222222222222",
]


@pytest.mark.parametrize("card", CARDS)
def test_a_card_number_that_passes_the_luhn_check_is_redacted(card: str) -> None:
    assert scrubbed(f"card: {card}, exp 12/27") == "card: [CREDIT_CARD], exp 12/27"


_CARD_BODY = st.tuples(
    st.sampled_from("23456"),
    st.integers(12, 18).flatmap(lambda n: st.text("0123456789", min_size=n, max_size=n)),
)


@FAST
@given(body=_CARD_BODY, sep=st.sampled_from([" ", "-"]))
def test_generated_luhn_valid_grouped_card_numbers_are_redacted(
    body: tuple[str, str], sep: str
) -> None:
    """Grouped the way a card is printed: the grouping is the card context."""
    number = luhn_complete(body[0] + body[1][:-1])
    assert scrubbed(f"paid with {grouped(number, sep)} today") == "paid with [CREDIT_CARD] today"


# Issuer prefixes (IIN ranges) of the networks: Visa, Mastercard (old and 2-series), Amex,
# Diners, JCB, Discover, UnionPay, Maestro, Mir.
ISSUERS = ("4", "51", "55", "2221", "2720", "34", "37", "36", "300", "3528", "6011", "62")
ISSUERS += ("50", "2200")
_ISSUED = st.tuples(
    st.sampled_from(ISSUERS),
    st.integers(13, 19),
    st.text("0123456789", min_size=18, max_size=18),
)
CARD_WORDS = ["card", "Visa", "credit card no.", "cc:", "Mastercard", "card_number", "payment"]


@FAST
@given(issued=_ISSUED, word=st.sampled_from(CARD_WORDS))
def test_generated_luhn_valid_numbers_next_to_a_card_word_are_redacted(
    issued: tuple[str, int, str], word: str
) -> None:
    prefix, length, rest = issued
    number = luhn_complete((prefix + rest)[: length - 1])
    assert scrubbed(f"{word} {number} today") == f"{word} [CREDIT_CARD] today"
    assert scrubbed(f"{number} ({word})") == f"[CREDIT_CARD] ({word})"


@FAST
@given(issued=_ISSUED, label=st.sampled_from(["order", "id=", "order_id:", '"id": ', "#"]))
def test_generated_luhn_valid_runs_named_as_ids_survive(
    issued: tuple[str, int, str], label: str
) -> None:
    """One in ten random 16-digit numbers passes Luhn: an id named as one stays."""
    prefix, length, rest = issued
    number = luhn_complete((prefix + rest)[: length - 1])
    text = f"{label} {number} shipped"
    assert scrubbed(text) == text


@FAST
@given(issued=_ISSUED, label=st.sampled_from(["row 3:", "", "fib(80) =", "printed:", "value"]))
def test_a_bare_luhn_valid_run_is_a_card_exactly_when_it_is_a_brands_number(
    issued: tuple[str, int, str], label: str
) -> None:
    """Issue 33, item 10: with no card word, no separators and no id named, a run of
    digits is a card when it has a brand's issuer range and length (and Luhn), as payment
    libraries decide; any other Luhn-valid run (a Visa prefix at 14 digits, Amex at 16)
    stays."""
    prefix, length, rest = issued
    number = luhn_complete((prefix + rest)[: length - 1])
    text = f"{label} {number} shipped"
    if card_brand(number) is None:
        assert scrubbed(text) == text
    else:
        assert scrubbed(text) == f"{label} [CREDIT_CARD] shipped"


@FAST
@given(body=_CARD_BODY, bump=st.integers(1, 9))
def test_luhn_invalid_order_ids_survive(body: tuple[str, str], bump: int) -> None:
    valid = luhn_complete(body[0] + body[1][:-1])
    order_id = valid[:-1] + str((int(valid[-1]) + bump) % 10)
    assert scrubbed(f"order {order_id} shipped") == f"order {order_id} shipped"
    if len(order_id) == 16:
        spaced = grouped(order_id, " ")
        assert scrubbed(f"ref {spaced}") == f"ref {spaced}"


@FAST
@given(first=st.sampled_from("01789"), rest=st.text("0123456789", min_size=12, max_size=17))
def test_luhn_valid_numbers_no_card_issuer_uses_survive(first: str, rest: str) -> None:
    number = luhn_complete(first + rest)  # timestamps in ms, us, ns start with 1
    assert scrubbed(f"ts={number}") == f"ts={number}"


def test_digits_inside_floats_hex_and_words_are_not_card_numbers() -> None:
    for text in (
        "0.4111111111111111",
        "1.4111111111111111e-05",
        "deadbeef4111111111111111cafe",
        "id_4111111111111111",
        "4111111111111111.5",
    ):
        assert scrubbed(text) == text


# --- IBAN ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "iban",
    [
        "DE89 3704 0044 0532 0130 00",
        "DE89370400440532013000",
        "GB82WEST12345698765432",
        "GB82 WEST 1234 5698 7654 32",
        "FR1420041010050500013M02606",
        "NL91ABNA0417164300",
    ],
)
def test_an_iban_with_a_valid_checksum_is_redacted(iban: str) -> None:
    assert scrubbed(f"pay to {iban} by Friday") == "pay to [IBAN] by Friday"


@pytest.mark.parametrize(
    "text",
    ["DE89 3704 0044 0532 0130 01", "ID12345678", "AB12CDEF3456GHIJ", "US12 3456 7890 1234"],
)
def test_iban_shaped_strings_with_a_bad_checksum_or_country_survive(text: str) -> None:
    assert scrubbed(text) == text


# --- IP addresses ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "81.2.69.160",
        "93.184.216.34",
        "172.32.0.1",  # just past 172.16/12
        "1.2.3.4",  # a bare dotted quad is an address: it is one
        "2a00:1450:4001:82b::200e",
        "2a03:2880:f12f:0083:face:b00c:0000:25de",
        "::ffff:81.2.69.160",
    ],
)
def test_public_ip_addresses_are_redacted(address: str) -> None:
    assert scrubbed(f"from {address} at noon") == "from [IP_ADDRESS] at noon"


@pytest.mark.parametrize(
    "address",
    [
        "10.0.0.1",
        "172.16.0.5",
        "172.31.255.254",
        "192.168.1.20",
        "169.254.169.254",
        "100.64.0.1",  # carrier-grade NAT
        "192.0.2.1",  # documentation (TEST-NET-1, -2, -3)
        "198.51.100.23",
        "203.0.113.9",
        "198.18.0.1",  # benchmarking
        "224.0.0.251",  # multicast
        "255.255.255.255",
        "2001:db8::8a2e:370:7334",
        "2001:0db8:85a3:0000:0000:8a2e:0370:7334",
        "fe80::1ff:fe23:4567:890a%eth0",
        "fd12:3456:789a:1::1",
        "ff02::fb",
        "::ffff:192.0.2.1",
        "::ffff:10.1.2.3",
        "8.8.8.8",  # public DNS resolvers: a service, not a person
        "1.1.1.1",
        "2606:4700:4700::1111",
    ],
)
def test_private_and_reserved_addresses_survive(address: str) -> None:
    """They name a machine on someone's own network, an example or a mask: no person."""
    assert scrubbed(f"from {address} at noon") == f"from {address} at noon"


def test_an_ip_address_keeps_its_port_and_brackets() -> None:
    assert scrubbed("http://81.2.69.160:8080/x") == "http://[IP_ADDRESS]:8080/x"
    assert scrubbed("[2a00:1450:4001:82b::200e]:443") == "[[IP_ADDRESS]]:443"
    assert scrubbed("81.2.69.1-81.2.69.9") == "[IP_ADDRESS]-[IP_ADDRESS]"


@pytest.mark.parametrize(
    "text",
    [
        "listening on 127.0.0.1:8000 and [::1]:8000",
        "bind 0.0.0.0 and ::",
        "netmask 255.255.255.0 hostmask 0.0.0.255",
        "version 1.2.3.4",
        "v1.2.3.4",
        "numpy==1.26.4.1",
        "1.2.3.4-beta",
        "libfoo 1.2.5.1-2 amd64",
        '"version": "4.4.4.4"',
        "1.2.3.4.5",
        "999.1.1.1",
        "1.2.3",
        "10:00:01",
        "00:1a:2b:3c:4d:5e",
        "std::vector<int>",
        "a[1::2]",
        "Foo::Bar::baz",
    ],
)
def test_addresses_that_identify_nobody_and_version_strings_survive(text: str) -> None:
    assert scrubbed(text) == text


def test_the_ip_category_can_be_turned_off_alone() -> None:
    no_ip = Scrubber(ScrubConfig(categories=frozenset(CATEGORIES) - {"ip"}))
    assert no_ip.scrub("from 81.2.69.160").text == "from 81.2.69.160"


# --- secrets by shape ------------------------------------------------------------------

JWT = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4ifQ"
    ".SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c"
)
PEM = (
    "-----BEGIN RSA PRIVATE KEY-----\n"
    "MIIEpAIBAAKCAQEA3Tz2mr7SZiAMfQyuvBjM9Oi..Z1BjP5C\n"
    "Proc-Type: 4,ENCRYPTED\n"
    "c2VjcmV0IGtleSBib2R5IGxpbmU=\n"
    "-----END RSA PRIVATE KEY-----"
)


AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"  # noqa: S105 - AWS's documented example


@pytest.mark.parametrize(
    "token",
    [
        "AKIAIOSFODNN7EXAMPLE",
        AWS_SECRET,  # an AWS secret key, on its own
        "ghp_" + "aB3dE6gH9jK2mN5pQ8sT1vW4yZ7bC0eF3hJ6",
        "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEF",
        "glpat-AbCdEf123456GhIjKlMn",
        "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx",
        "https://hooks.slack.com/services/T00000000/B00000000/XXXXXXXXXXXXXXXXXXXXXXXX",
        "sk_live_" + "4eC39HqLyjWDarjtT1zdp7dc",
        "rk_test_" + "4eC39HqLyjWDarjtT1zdp7dc",
        "sk-proj-AbC123dEf456GhI789jKl012MnO345pQr678",
        "sk-ant-api03-AbC123dEf456GhI789jKl012MnO345",
        "AIzaSyA1b2C3d4E5f6G7h8I9j0KlMnOpQrStUvW",
        "npm_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8",
        "SG." + "ngeVfQFYQlKU0ufo8x5d1A.TwL2iGABf9DHoTf-09kqeF8tAmbihYzrnopKc-1s5cr",
        "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYzAbCdEfGh",
        "shpat_" + "0123456789abcdef0123456789abcdef",
        "dop_v1_" + "0123456789abcdef" * 4,
        JWT,
        PEM,
    ],
)
def test_secrets_are_recognised_by_their_shape(token: str) -> None:
    assert scrubbed(f"key: {token}\nnext line") == "key: [SECRET]\nnext line"
    if token != AWS_SECRET:  # a random word needs a credential word nearby
        assert scrubbed(f"({token})") == "([SECRET])"


def test_a_random_40_character_word_is_an_aws_secret_key_only_near_a_credential_word() -> None:
    assert scrubbed(f"AKIAIOSFODNN7EXAMPLE {AWS_SECRET}") == "[SECRET] [SECRET]"
    assert scrubbed(f"aws: ({AWS_SECRET})") == "aws: ([SECRET])"
    random_bytes = "o7qQQwMAJzq8AtS2VTGJn++KbQyRB4IVvCyMYLcq"  # base64 of 30 random bytes
    assert scrubbed(f"sample: {random_bytes}") == f"sample: {random_bytes}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("password=hunter2", "password=[SECRET]"),
        ("DB_PASSWORD=s3cr3t!x", "DB_PASSWORD=[SECRET]"),
        (
            '{"api_key": "k1x9Qw7Zp3Lm8Rt2", "user": "bo"}',
            '{"api_key": "[SECRET]", "user": "bo"}',
        ),
        ("{'secret': 'xyz', 'n': 1}", "{'secret': '[SECRET]', 'n': 1}"),
        ("token: 9f8e7d6c5b4a39281706f5e4d3c2b1a0", "token: [SECRET]"),
        ("pwd=letmein", "pwd=[SECRET]"),
        ("client_secret => 'q1w2e3'", "client_secret => '[SECRET]'"),
        ("password='p@ss word'", "password='[SECRET]'"),
        ('"Password" : "a\\"b"', '"Password" : "[SECRET]"'),
        ("aws_secret_access_key = abcDEF123", "aws_secret_access_key = [SECRET]"),
        ("Authorization: Token abc", "Authorization: Token [SECRET]"),
        ("Authorization: Bearer abc.def.ghi123", "Authorization: Bearer [SECRET]"),
        ('{"Authorization": "Bearer t0k3n-value"}', '{"Authorization": "Bearer [SECRET]"}'),
        ("Authorization: Basic dXNlcjpwYXNzd29yZA==", "Authorization: Basic [SECRET]"),
        (
            "postgres://admin:Sup3rS3cret@db.internal:5432/app",
            "postgres://admin:[SECRET]@db.internal:5432/app",
        ),
        ("?api_key=Zx81kPq9LmN2vB7cR4tY&page=2", "?api_key=[SECRET]&page=2"),
        ("export GITHUB_TOKEN=abc123", "export GITHUB_TOKEN=[SECRET]"),  # configuration
        ("AccountKey=Zm9vYmFyYmF6cXV4MTIzNDU2;x=1", "AccountKey=[SECRET];x=1"),
        ("redis://:hunter2hunter2@cache:6379/0", "redis://:[SECRET]@cache:6379/0"),
        ("my password is hunter2.", "my password is [SECRET]."),  # prose: password-like only
        ("one-time password is 493817", "one-time password is [SECRET]"),
        ("the token was Zx81kPq9LmN2vB7cR4tY", "the token was [SECRET]"),
        ("pw=Tr0ub4dor", "pw=[SECRET]"),
    ],
)
def test_assigned_secrets_are_redacted_and_their_key_kept(text: str, expected: str) -> None:
    assert scrubbed(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "max_tokens=100 tokens: 1500 token_count: 5 token: 42",
        "password: None, token=null, secret: true",
        "Enter password:\n",
        "password=",
        '  File "app.py", line 3, in login\n    token = get_token()\n    password = cfg["pw"]',
        "def login(user: str, password: str) -> bool:",
        "password: ******** and password: [SECRET] and token: ${TOKEN}",
        "Authorization: Bearer TOKEN or Bearer <token>",
        "tokenizer=bpe passwords_checked=3 secretary=Ann",
        "http://localhost:8080/path and https://user@host/x",
        "sk-learn and task-runner-0123456789abcdefghij",
        "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        "commit 3f786850e387550fdab836ed7e6dc881de23001b",
        "3F786850E387550FDAB836ED7E6DC881DE23001B",
        "/usr/lib/python3.11/site-packages/pandas/core/frame.py",
        "-----BEGIN PUBLIC KEY-----\nMFkwEwYHKoZIzj0CAQYIKoZIzj0D\n-----END PUBLIC KEY-----",
        "eyJub3QiOiAiYSB0b2tlbiJ9",  # base64 JSON, not a JWT
        # a token or key word takes only a value that looks generated (16+ characters)
        "token: 1VjArnVgxwvq",
        '{"api_key": "abc123", "token": "NbrnTP3fAbnF"}',
        "?api_key=k3y&page=2 access_key: short-name",
        "token: this_is_a_readable_name",
        "the password is incorrect, password was reset, the token is expired",
        "bypass: true compass: N42 pass: 12 PASS: test_login",
        "U2Vuc29yIDcgcmVhZGluZyA0Mi41QyBhdCAwOTox",  # 40 base64 characters of text
    ],
)
def test_near_misses_of_secret_shapes_survive(text: str) -> None:
    assert scrubbed(text) == text


def test_a_private_key_without_its_end_line_is_redacted_to_the_end_of_its_body() -> None:
    text = "key:\n-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\nQUJD\ndone: yes"
    assert scrubbed(text) == "key:\n[SECRET]\ndone: yes"


# --- ordinary program output -------------------------------------------------------------

_ORDINARY = st.one_of(
    st.uuids().map(str),
    st.binary(min_size=1, max_size=64).map(lambda b: __import__("hashlib").sha256(b).hexdigest()),
    st.binary(min_size=1, max_size=64).map(lambda b: __import__("hashlib").sha1(b).hexdigest()),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.integers(-(10**12) + 1, 10**12 - 1).map(str),
    st.integers(10**9, 2 * 10**9).flatmap(
        lambda s: st.sampled_from([str(s), str(s * 1000), str(s * 10**9), f"{s}.{s % 997}"])
    ),
    st.datetimes().map(lambda d: d.isoformat()),
    st.dates().map(lambda d: d.strftime("%d/%m/%Y")),
    st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 99)).map(
        lambda v: "{}.{}.{}".format(*v)
    ),
    st.tuples(st.integers(0, 9), st.integers(0, 99), st.integers(0, 99), st.integers(0, 999)).map(
        lambda v: "version {}.{}.{}.{}".format(*v)
    ),
    st.integers(0, 10**6).map(lambda n: f"{n:,}"),
    st.floats(0, 100, allow_nan=False).map(lambda f: f"{f:.2f}%"),
    st.sampled_from(["INFO", "ERROR", "processed", "rows", "took", "ms", "->", "|", "=", ":"]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_ORDINARY, min_size=1, max_size=12))
def test_ordinary_output_survives_unchanged(parts: list[str]) -> None:
    line = " ".join(parts)
    assert scrubbed(line) == line


def _bench() -> object:
    spec = importlib.util.spec_from_file_location(
        "bench_scrub", ROOT / "benchmarks" / "bench_scrub.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_corpus_of_program_output_without_personal_data_has_no_finding() -> None:
    clean = _bench().make_corpus(200_000, sensitive_every=0)  # type: ignore[attr-defined]
    assert SCRUB.find(clean) == []


# --- split writes and the output cap -----------------------------------------------------

SPLIT_WRITES = r"""
import sys
pieces = ("contact john.doe@exa", "mple.com, card 4111 1111 ", "1111 1111, ssn 123-4", "5-6789\n")
for piece in pieces:
    sys.stdout.write(piece)
    sys.stdout.flush()
"""


def _read_in_chunks(code: str, size: int) -> list[bytes]:
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        chunks = []
        while chunk := os.read(proc.stdout.fileno(), size):
            chunks.append(chunk)
    return chunks


def test_values_split_across_writes_are_caught_in_the_whole_captured_text() -> None:
    chunks = _read_in_chunks(SPLIT_WRITES, 9)
    assert len(chunks) > 4
    whole = b"".join(chunks).decode()
    result = SCRUB.scrub(whole)
    assert result.text == "contact [EMAIL], card [CREDIT_CARD], ssn [SSN]\n"
    assert result.counts == {"email": 1, "ssn": 1, "credit_card": 1}
    # Why the host scrubs the whole text: chunk by chunk, the same values leak.
    piecewise = "".join(SCRUB.scrub(c.decode()).text for c in chunks)
    assert "john.doe" in piecewise or "4111" in piecewise


@pytest.mark.parametrize(
    ("tail", "category"),
    [
        ("contact john.doe@exa", "email"),
        ("contact john.doe@", "email"),
        ("card 4111 1111 1111", "credit_card"),
        ("card 4111 1111 1", "credit_card"),
        ("ssn 123-45", "ssn"),
        ("ssn 123-45-67", "ssn"),
        ("call +1 415 555", "phone"),
        ("call (415) 555-26", "phone"),
        ("call 415-555-2", "phone"),
        ("iban DE89 3704 0044", "iban"),
        ("from 81.2.69.", "ip"),
        ("from 81.22.169", "ip"),
        ("from 172.32.1.", "ip"),  # just past 172.16/12
        ("from 2a00:1450:4001:", "ip"),
        ("card 411111111111", "credit_card"),
        ("visa 411111111111", "credit_card"),
        ("key ghp_aB3dE6gH9", "secret"),
        ("key AKIAIOSF", "secret"),
        ("jwt eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOi", "secret"),
        ("password=hun", "secret"),
        ('{"api_key": "abc', "secret"),
        ("Authorization: Bearer abc12", "secret"),
        ("postgres://admin:Sup3", "secret"),
        ("key -----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC", "secret"),
        ("secret wJalrXUtnFEMI/K7MDENG/bP", "secret"),
    ],
)
def test_a_tail_cut_at_the_cap_that_could_start_a_value_is_redacted(
    tail: str, category: Category
) -> None:
    result = SCRUB.scrub(tail, truncated=True)
    assert result.text.endswith(PLACEHOLDERS[category]), result
    assert result.counts.get(category) == 1
    word = (
        tail.split()[0] if tail.split()[0] not in {"password=hun", "postgres://admin:Sup3"} else ""
    )
    assert result.text.startswith(word)


@pytest.mark.parametrize(
    "tail",
    [
        "processed 42 items in 0.532s",
        "2026-11-22 10:00:01",
        "version 1.2.3",
        "python 3.11.7",
        "total: 12345678",
        "sha 9f86d081884c7d65",
        "id=3f2a1c7e-8b1d",
        "the quick brown fox",
        "took 100 ms at 10:00:01",
        "http://localhost:8080",
        "john.doe",
        "ratio 0.30000000000000004",
        "from 192.168.1.",  # a private prefix stays private whatever follows
        "from 10.0.0",
        "fib(80) = 234167283484",  # one run of digits and no card word
    ],
)
def test_ordinary_text_cut_at_the_cap_survives(tail: str) -> None:
    assert scrubbed(tail, truncated=True) == tail


def test_tail_rules_apply_only_when_the_text_was_cut() -> None:
    assert scrubbed("contact john.doe@exa") == "contact john.doe@exa"
    assert scrubbed("card 4111 1111 1111") == "card 4111 1111 1111"


def test_output_cut_by_the_host_cap_in_the_middle_of_values_leaks_no_part_of_them() -> None:
    secret = "upstream-Credential-9f3a"  # noqa: S105 - a made-up credential to scrub
    scrubber = Scrubber(ScrubConfig(secrets=(secret,)))
    lines = f"user john.doe@example.com card 4111 1111 1111 1111 key {secret}\n"
    for cap in range(len("user john.doe@ex"), len(lines)):
        buffer = CappedBuffer(cap)
        for chunk in _read_in_chunks(f"print({lines[:-1]!r})", 7):
            buffer.append(chunk)
        assert buffer.truncated
        text = scrubber.scrub(buffer.data.decode(), truncated=True).text
        assert "john.doe@" not in text and "example" not in text, (cap, text)
        assert "1111 1111" not in text and "upstream-Cr" not in text, (cap, text)


# --- configured secrets ------------------------------------------------------------------

SECRET = "s3cr3t/Upstream+Key=42"  # noqa: S105 - a made-up credential to scrub
WITH_SECRET = Scrubber(ScrubConfig(secrets=(SECRET,)))


@pytest.mark.parametrize(
    "form",
    [
        SECRET,
        quote(SECRET, safe=""),
        quote(SECRET),
        quote_plus(SECRET),
        re.sub("%[0-9A-F]{2}", lambda m: m.group().lower(), quote(SECRET, safe="")),
        SECRET.encode().hex(),
        SECRET.encode().hex().upper(),
        json.dumps(SECRET)[1:-1],
    ],
)
def test_a_configured_secret_is_redacted_plain_url_encoded_and_hex(form: str) -> None:
    result = WITH_SECRET.scrub(f"GET /?k={form} ok")
    assert result.text == "GET /?k=[SECRET] ok"
    assert result.counts == {"secret": 1}


@pytest.mark.parametrize("prefix_len", range(0, 9))
@pytest.mark.parametrize("alphabet", ["standard", "urlsafe"])
def test_a_configured_secret_is_found_at_every_offset_inside_base64(
    prefix_len: int, alphabet: str
) -> None:
    raw = os.urandom(prefix_len) + SECRET.encode() + os.urandom(5)
    encode = base64.b64encode if alphabet == "standard" else base64.urlsafe_b64encode
    encoded = encode(raw).decode()
    text = WITH_SECRET.scrub(f"blob={encoded};").text
    assert text.count("[SECRET]") == 1, text
    before = text[len("blob=") : text.index("[SECRET]")]
    after = text[text.index("[SECRET]") + len("[SECRET]") : -1]
    # Every base64 character that holds any bit of the secret is gone.
    first_secret_char = 8 * prefix_len // 6
    last_secret_char = -(-8 * (prefix_len + len(SECRET)) // 6)
    assert encoded.startswith(before) and len(before) <= first_secret_char
    assert encoded.endswith(after) and len(encoded) - len(after) >= last_secret_char


def test_a_configured_secret_is_redacted_even_with_every_category_off() -> None:
    scrubber = Scrubber(ScrubConfig(categories=frozenset(), secrets=(SECRET,)))
    assert scrubber.scrub(f"{SECRET} john@example.com").text == "[SECRET] john@example.com"


@pytest.mark.parametrize("cut", range(4, len(SECRET)))
def test_half_a_configured_secret_at_the_cap_is_redacted(cut: int) -> None:
    assert WITH_SECRET.scrub(f"key {SECRET[:cut]}", truncated=True).text == "key [SECRET]"


@pytest.mark.parametrize("short", ["", "abc", "12345", "  abc  "])
def test_a_configured_secret_too_short_to_scrub_safely_is_refused(short: str) -> None:
    with pytest.raises(ConfigError) as err:
        ScrubConfig(secrets=("long-enough-secret", short))
    assert str(MIN_SECRET_CHARS) in str(err.value)
    assert "ordinary text" in err.value.hint


def test_unknown_categories_and_regions_are_refused_with_a_hint() -> None:
    with pytest.raises(ConfigError) as err:
        ScrubConfig(categories=frozenset({"email", "passport"}))  # type: ignore[arg-type]
    assert "passport" in str(err.value) and "email" in err.value.hint
    with pytest.raises(ConfigError):
        ScrubConfig(phone_region="XX")


# --- counts and switches -----------------------------------------------------------------

MIXED = (
    "a@example.com b@example.com c@example.org +1 415-555-2671 (212) 555-0100 "
    "123-45-6789 4111 1111 1111 1111 DE89 3704 0044 0532 0130 00 81.2.69.160 password=hunter2"
)


def test_counts_say_how_many_values_of_each_category_were_redacted() -> None:
    result = SCRUB.scrub(MIXED)
    assert result.counts == {
        "email": 3,
        "phone": 2,
        "ssn": 1,
        "credit_card": 1,
        "iban": 1,
        "ip": 1,
        "secret": 1,
    }
    assert merge_counts(result.counts, {"email": 2}, {}) == {**result.counts, "email": 5}


@pytest.mark.parametrize("category", CATEGORIES)
def test_a_scrubber_with_one_category_redacts_that_category_only(category: Category) -> None:
    result = only(category).scrub(MIXED)
    assert set(result.counts) == {category}
    for other in CATEGORIES:
        assert (PLACEHOLDERS[other] in result.text) == (other == category)


def test_with_no_category_and_no_secret_nothing_changes() -> None:
    off = Scrubber(ScrubConfig(categories=frozenset()))
    assert not off.active
    assert off.scrub(MIXED, truncated=True).text == MIXED
    assert off.scrub_value({"e": "a@example.com"}).value == {"e": "a@example.com"}


def test_overlapping_findings_are_redacted_once_under_the_stronger_category() -> None:
    result = SCRUB.scrub("password=john@example.com")
    assert result.text == "password=[SECRET]" and result.counts == {"secret": 1}


def test_past_its_validation_budget_a_scan_redacts_shape_matches_unchecked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Library checks cost up to ~40 us each: output made of thousands of number-shaped
    values must not cost the host seconds, so past the budget the scan fails closed."""
    from codecage.policy.scrub import detectors

    monkeypatch.setattr(detectors, "_VALIDATION_BUDGET", 2)
    text = "4111 1111 1111 1112, 4111 1111 1111 1113, 4111 1111 1111 1114"
    assert Scrubber().scrub(text).text == "4111 1111 1111 1112, 4111 1111 1111 1113, [CREDIT_CARD]"


def test_many_unterminated_private_key_lines_are_one_finding_each_way() -> None:
    text = "-----BEGIN PRIVATE KEY-----\n" * 2000 + "tail: done"
    assert scrubbed(text) == "[SECRET]\n" * 2000 + "tail: done"
    assert scrubbed(text, truncated=True) == "[SECRET]"


# --- JSON-like values ----------------------------------------------------------------------


def test_scrub_value_scrubs_strings_keys_and_long_ints_and_counts_them() -> None:
    value = {
        "users": [{"email": "a@example.com", "card": 4111111111111111, "n": 42}],
        "john@example.com": ("x", 3.5, None, True),
        "jane@example.com": "y",
    }
    result = SCRUB.scrub_value(value)
    assert result.value == {
        "users": [{"email": "[EMAIL]", "card": "[CREDIT_CARD]", "n": 42}],
        "[EMAIL_1]": ["x", 3.5, None, True],
        "[EMAIL_2]": "y",
    }
    assert result.counts == {"email": 3, "credit_card": 1}
    assert value["jane@example.com"] == "y"  # the input is not changed


def test_scrub_value_does_not_mix_strings_up_even_when_a_finding_spans_two() -> None:
    pem_split = ["-----BEGIN PRIVATE KEY-----\nAAAA", "BBBB\n-----END PRIVATE KEY-----", "ok"]
    assert SCRUB.scrub_value(pem_split).value == [
        "[SECRET]",
        "BBBB\n-----END PRIVATE KEY-----",
        "ok",
    ]
    with_nul = ["a\n\0\nb", "c@example.com", "x\n\0", "\ny"]
    assert SCRUB.scrub_value(with_nul).value == ["a\n\0\nb", "[EMAIL]", "x\n\0", "\ny"]


def test_scrub_value_bounds_its_depth() -> None:
    deep: object = "a@example.com"
    for _ in range(300):
        deep = [deep]
    flat = SCRUB.scrub_value(deep).value
    for _ in range(201):
        assert isinstance(flat, list)
        flat = flat[0]
    assert flat == "[TOO_DEEP]"


@FAST
@given(
    st.recursive(
        st.one_of(
            st.text(max_size=20),
            st.sampled_from([*EMAILS, *CARDS, "+1 415-555-2671", "123-45-6789", JWT, PEM]),
            st.integers(),
            st.just(4111111111111111),
            st.floats(allow_nan=False),
            st.none(),
        ),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=20,
    )
)
def test_scrub_value_agrees_with_scrubbing_each_string_on_its_own(value: object) -> None:
    # A card word anywhere in the value is context for the digits near it (a key "card"
    # before a bare card number: detectors.card_context), which one string alone lacks.
    assume(not CARD_CONTEXT.search(json.dumps(value, default=str).lower()))
    # A bare card number among other numbers of the value is judged with them (a row of
    # data: detectors._in_a_row_of_data), which one string alone lacks.
    leaves: list[str] = []
    collect_strings(value, leaves, convert_other=True)
    assume(
        not any(card_brand(t.strip()) for t in leaves if t.strip().isdigit())
        or sum(any(c.isdigit() for c in t) for t in leaves) < 2
    )

    def each(v: object) -> object:
        if isinstance(v, str):
            return SCRUB.scrub(v).text
        if isinstance(v, list):
            return [each(i) for i in v]
        if isinstance(v, dict):
            out: dict[object, object] = {}
            for k, i in v.items():
                key, n = SCRUB.scrub(k).text, 2
                while key in out:
                    key, n = f"{SCRUB.scrub(k).text}#{n}", n + 1
                out[key] = each(i)
            return out
        if isinstance(v, int) and not isinstance(v, bool) and len(str(abs(v))) >= 6:
            return SCRUB.scrub(str(v)).text if SCRUB.scrub(str(v)).text != str(v) else v
        return v

    assert SCRUB.scrub_value(value).value == each(value)


# --- the vault -----------------------------------------------------------------------------

RECORDS = {
    "customers": [
        {"name": "Ana", "email": "ana@example.com", "phone": "+1 415-555-2671"},
        {"name": "Bo", "email": "bo@example.com", "phone": "+44 20 7946 0958"},
        {"name": "Ana again", "email": "ana@example.com", "note": "call +1 415-555-2671"},
    ]
}


def test_tokenize_gives_the_same_value_the_same_token_and_others_the_next_number() -> None:
    vault = Vault(SCRUB)
    result = vault.tokenize(RECORDS)
    assert result == {
        "customers": [
            {"name": "Ana", "email": "[EMAIL_1]", "phone": "[PHONE_1]"},
            {"name": "Bo", "email": "[EMAIL_2]", "phone": "[PHONE_2]"},
            {"name": "Ana again", "email": "[EMAIL_1]", "note": "call [PHONE_1]"},
        ]
    }
    assert vault.tokenize("again: bo@example.com") == "again: [EMAIL_2]"
    assert len(vault) == 4


def test_detokenize_puts_values_back_in_arguments_also_inside_longer_strings() -> None:
    vault = Vault(SCRUB)
    vault.tokenize(RECORDS)
    arguments = {"to": ["[EMAIL_1]", "[EMAIL_2]"], "body": "Hi [EMAIL_2], call [PHONE_1]."}
    assert vault.detokenize(arguments) == {
        "to": ["ana@example.com", "bo@example.com"],
        "body": "Hi bo@example.com, call +1 415-555-2671.",
    }


def test_a_token_the_vault_never_issued_is_left_as_it_is() -> None:
    vault = Vault(SCRUB)
    vault.tokenize(RECORDS)
    assert vault.detokenize("[EMAIL_7] [PHONE_0] [SECRET_1] [email_1]") == (
        "[EMAIL_7] [PHONE_0] [SECRET_1] [email_1]"
    )


def test_token_lookalikes_in_upstream_text_come_back_as_themselves() -> None:
    vault = Vault(SCRUB)
    result = vault.tokenize({"email": "ana@example.com", "body": "quoted [EMAIL_1] here"})
    assert result == {"email": "[EMAIL_1]", "body": "quoted [TOKEN_1] here"}
    assert vault.detokenize("[TOKEN_1] vs [EMAIL_1]") == "[EMAIL_1] vs ana@example.com"


def test_secrets_are_never_tokenized_so_they_cannot_travel_to_another_tool() -> None:
    vault = Vault(Scrubber(ScrubConfig(secrets=(SECRET,))))
    result = vault.tokenize({"auth": SECRET, "key": "AKIAIOSFODNN7EXAMPLE", "e": "ana@example.com"})
    assert result == {"auth": "[SECRET]", "key": "[SECRET]", "e": "[EMAIL_1]"}
    assert vault.detokenize(result) == {
        "auth": "[SECRET]",
        "key": "[SECRET]",
        "e": "ana@example.com",
    }


def test_clearing_the_vault_forgets_every_value() -> None:
    vault = Vault(SCRUB)
    vault.tokenize(RECORDS)
    vault.clear()
    assert len(vault) == 0
    assert vault.detokenize("[EMAIL_1]") == "[EMAIL_1]"
    assert vault.tokenize("bo@example.com") == "[EMAIL_1]"


_PERSONAL = st.one_of(
    st.builds(
        lambda a, b: f"{a}@{b}.com",
        st.from_regex(r"[a-z]{1,8}", fullmatch=True),
        st.from_regex(r"[a-z]{2,8}", fullmatch=True),
    ),
    st.integers(2000, 9999).map(lambda n: f"+1 415-555-{n}"),
    st.sampled_from(CARDS),
    st.sampled_from(["ordinary", "text", "42", "ok", "[EMAIL_1]", "[PHONE_3] x"]),
)


@FAST
@given(
    st.lists(st.dictionaries(st.sampled_from(["a", "b", "c"]), _PERSONAL, max_size=3), max_size=5)
)
def test_detokenize_undoes_tokenize(records: list[dict[str, str]]) -> None:
    vault = Vault(SCRUB)
    tokenized = vault.tokenize(records)
    assert "@" not in json.dumps(tokenized) and "415-555" not in json.dumps(tokenized)
    assert vault.detokenize(tokenized) == records


# --- the benchmark runs ------------------------------------------------------------------


def test_the_scrub_benchmark_runs_and_prints_every_variant() -> None:
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_scrub.py"),
            "-n",
            "1",
            "--size-kb",
            "40",
            "--no-write",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    for variant in (
        "floor_translate",
        "all",
        "all_truncated",
        "all_dense",
        *CATEGORIES,
        "scrub_value",
    ):
        assert f"\n{variant} " in p.stdout, variant
    assert "false positives on" in p.stdout


# --- issue 33, item 10: cards printed bare, recognised by brand range + length + Luhn ---

# (a brand's published test number, its brand)
BRAND_TEST_NUMBERS = [
    ("4222222222222", "visa"),
    ("4111111111111111", "visa"),
    ("4111111111111111110", "visa"),
    ("5555555555554444", "mastercard"),
    ("2223003122003222", "mastercard"),
    ("2720992593319364", "mastercard"),
    ("378282246310005", "amex"),
    ("371449635398431", "amex"),
    ("6011111111111117", "discover"),
    ("6445644564456445", "discover"),
    ("3530111333300000", "jcb"),
    ("30569309025904", "diners"),
    ("36227206271667", "diners"),
    ("6200000000000005", "unionpay"),
    ("2200000000000004", "mir"),
    ("6759649826438453", "maestro"),
]


@pytest.mark.parametrize(("number", "brand"), BRAND_TEST_NUMBERS)
def test_each_brands_test_number_printed_bare_is_redacted(number: str, brand: str) -> None:
    assert card_brand(number) == brand
    assert scrubbed(number) == "[CREDIT_CARD]"
    assert scrubbed(f"result: {number}\n") == "result: [CREDIT_CARD]\n"
    returned = SCRUB.scrub_value(int(number))
    assert returned.value == "[CREDIT_CARD]" and returned.counts == {"credit_card": 1}


@pytest.mark.parametrize(
    ("head", "why"),
    [
        ("4111111111111", "Visa has no 14-digit cards"),
        ("378282246310001", "Amex cards have 15 digits"),
        ("5555555555554", "Mastercard has 16"),
        ("51051051051051001", "Mastercard has 16"),
        ("955555555555444", "no issuer starts with 9"),
        ("565555555555444", "56 is Maestro's only by a listed IIN"),
    ],
)
def test_a_luhn_valid_run_outside_every_brands_range_and_length_stays(head: str, why: str) -> None:
    number = luhn_complete(head)
    assert card_brand(number) is None, why
    assert scrubbed(f"total {number} today") == f"total {number} today", why


@pytest.mark.parametrize(
    "text",
    [
        "order 5555555555554444 shipped",
        'row {"order_id": 5555555555554444}',
        "invoice #378282246310005",
        "sha 5555555555554444deadbeef",
        "x5555555555554444",
        "/users/5555555555554444/profile",
        "-5555555555554444",
        "0  5555555555554444   120045   19.99",
        "5555555555554444,2024-01-03,12.50",
        "[5555555555554444, 1234567890123456]",
        "| 2024-05-01 | 378282246310005 | shipped |",
        '{"ids": [5555555555554444, 378282246310005]}',
        " order_id\n5555555555554444\n378282246310005",
    ],
)
def test_a_brand_number_inside_data_or_named_as_an_id_stays(text: str) -> None:
    assert scrubbed(text) == text


def test_a_row_made_only_of_cards_is_a_row_of_cards() -> None:
    assert scrubbed("5555555555554444 378282246310005") == "[CREDIT_CARD] [CREDIT_CARD]"
    value = SCRUB.scrub_value([5555555555554444, "378282246310005"])
    assert value.value == ["[CREDIT_CARD]", "[CREDIT_CARD]"]
    # Named as ids, the same row is data.
    named = {"ids": [5555555555554444, 378282246310005]}
    assert SCRUB.scrub_value(named).value == named


@FAST
@given(st.text("0123456789", min_size=1, max_size=19))
def test_the_fast_luhn_check_agrees_with_stdnums(digits: str) -> None:
    from stdnum import luhn

    assert luhn_ok(digits) == luhn.is_valid(digits)


def test_a_megabyte_of_random_ids_is_kept_and_scanned_without_the_budget() -> None:
    """Random 16-digit ids: about one in thirty is a Luhn-valid brand number; each sits
    among ids that are not, so all are kept (the checks of bare runs spend no budget,
    which would otherwise redact every shape past it)."""
    import random

    rng = random.Random(33)
    text = "\n".join(str(rng.randrange(10**15, 10**16)) for _ in range(60_000))
    assert SCRUB.scrub(text).counts.get("credit_card", 0) <= 3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4111111111111111,12/27,123", "[CREDIT_CARD],12/27,123"),
        ("bob 5555555555554444 12/2027 cvv", "bob [CREDIT_CARD] 12/2027 cvv"),
        ("378282246310005|01/29|1234", "[CREDIT_CARD]|01/29|1234"),
        # ids in a row with a date written year first, or a fraction, stay
        ("0  5555555555554444  2027/12", "0  5555555555554444  2027/12"),
        ("ratio 5555555555554444,12", "ratio 5555555555554444,12"),
        ("order 4111111111111111 2027-12-01", "order 4111111111111111 2027-12-01"),
    ],
)
def test_a_card_followed_by_its_expiry_date_is_a_card_in_a_row_too(
    text: str, expected: str
) -> None:
    """Issue 33, item 10 (review): a card printed as a CSV line of card, expiry and CVV
    (`4111…,12/27,123`) or beside its MM/YY came back whole: the comma read as a decimal's,
    the date as another number of a row of data. MM/YY after the digits is a card's."""
    assert scrubbed(text) == expected
