"""Scrubbing of what a run returns, in real sandboxes: the host redacts personal data and
secrets from stdout, stderr, the error, the return value, events and file names, on every
path (cold, warm, blocked), counts them in `redactions`, and really stops when turned off.

The detectors themselves (positives, near misses, the cap-boundary rules) are tested in
test_scrub.py; here the question is whether every way out of a sandbox goes through them.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from codecage import Options, Sandbox, ScrubSettings
from codecage.bridge.broker import Broker
from codecage.bridge.upstreams import parse
from codecage.models import ExecutionResult

CODECAGE = str(Path(sys.executable).parent / "codecage")

EMAIL = "alice.smith@example.com"
PHONE = "+1 415 555 2671"
SSN = "536-22-1234"
CARD = "4111 1111 1111 1111"
IBAN = "DE89 3704 0044 0532 0130 00"
IP = "81.2.69.160"  # public: private and documentation addresses are kept
AWS_KEY = "AKIAIOSFODNN7EXAMPLE"
GITHUB_TOKEN = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
SECRET = "hunter2-correct-horse-battery"  # noqa: S105 (a test value)

VALUES = {
    "email": EMAIL,
    "phone": PHONE,
    "ssn": SSN,
    "credit_card": CARD,
    "iban": IBAN,
    "ip": IP,
}


@pytest.fixture(scope="module")
def scrubbing() -> Sandbox:
    """The default: scrubbing on, every category, plus one configured secret."""
    return Sandbox(options=Options(import_policy=False, scrub=ScrubSettings(secrets=[SECRET])))


def everything_said(result: ExecutionResult) -> str:
    """Every text the result carries, as a caller would see it."""
    return (
        json.dumps(result.model_dump(mode="json"))
        + result.raw_stdout().decode("utf-8", "replace")
        + result.raw_stderr().decode("utf-8", "replace")
    )


def assert_none_of(values: list[str], result: ExecutionResult) -> None:
    said = everything_said(result)
    leaked = [v for v in values if v in said]
    assert leaked == [], f"leaked: {leaked}"


def test_every_category_is_redacted_from_stdout_and_counted(scrubbing: Sandbox) -> None:
    lines = [f"{category}: {value}" for category, value in VALUES.items()]
    code = f"print({chr(10).join(lines)!r})\nprint('aws', {AWS_KEY!r}, 'gh', {GITHUB_TOKEN!r})"
    result = scrubbing.run(code)
    assert result.status == "ok", result.error
    assert_none_of([*VALUES.values(), AWS_KEY, GITHUB_TOKEN], result)
    assert result.stdout.splitlines() == [
        "email: [EMAIL]",
        "phone: [PHONE]",
        "ssn: [SSN]",
        "credit_card: [CREDIT_CARD]",
        "iban: [IBAN]",
        "ip: [IP_ADDRESS]",
        "aws [SECRET] gh [SECRET]",
    ]
    assert result.redactions == {
        "email": 1,
        "phone": 1,
        "ssn": 1,
        "credit_card": 1,
        "iban": 1,
        "ip": 1,
        "secret": 2,
    }
    assert result.raw_stdout().decode() == result.stdout  # --raw shows the scrubbed bytes


def test_ordinary_program_output_survives_untouched(scrubbing: Sandbox) -> None:
    code = """
import hashlib, uuid, datetime
print(12345678901234, 3.14159, -42, 10**18)
print(datetime.date(2026, 11, 24).isoformat(), "2026-11-24T06:01:46+00:00", "06:01:46")
print(uuid.UUID(int=0x1234567890abcdef1234567890abcdef))
print(hashlib.sha256(b"x").hexdigest(), hashlib.md5(b"x").hexdigest())
print("python 3.11.7", "numpy==1.26.4", "v2.0.1-beta", "127.0.0.1:8000", "order 100234")
print("total: $1,234.56", "ratio 0.75", "id=42", "a[1::2]")
"""
    result = scrubbing.run(code)
    assert result.status == "ok", result.error
    assert result.redactions == {}
    assert "[" not in result.stdout.replace("a[1::2]", ""), result.stdout


def test_a_value_split_across_writes_is_still_caught_at_every_split_point(
    scrubbing: Sandbox,
) -> None:
    # Each piece is its own write(2) (os.write on the raw fd, no buffering): the host
    # reads them as separate chunks and must scrub the stream whole.
    code = f"""
import os, time
for value in ({EMAIL!r}, {CARD!r}, {GITHUB_TOKEN!r}, {SECRET!r}):
    for cut in range(1, len(value)):
        os.write(1, value[:cut].encode())
        time.sleep(0.0005)
        os.write(1, (value[cut:] + "\\n").encode())
"""
    result = scrubbing.run(code)
    assert result.status == "ok", result.error
    assert_none_of([EMAIL, CARD, GITHUB_TOKEN, SECRET, "alice.smith", "hunter2-correct"], result)
    splits = sum(len(v) - 1 for v in (EMAIL, CARD, GITHUB_TOKEN, SECRET))
    assert len(result.stdout.splitlines()) == splits
    assert sum(result.redactions.values()) == splits


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (EMAIL, "alice.smith@ex"),
        (CARD, "4111 1111 1111"),
        (GITHUB_TOKEN, "ghp_a1B2c3D4e5F6"),
        (SECRET, "hunter2-cor"),
    ],
    ids=["email", "card", "github-token", "configured-secret"],
)
def test_a_value_cut_by_the_output_cap_leaves_no_part_of_itself(
    scrubbing: Sandbox, value: str, shown: str
) -> None:
    cap = 4096
    keep = len(shown)  # the cap falls right after this much of the value
    code = f"import sys\nsys.stdout.write('x' * {cap - keep - 1} + ' ' + {value!r} + ' more')"
    result = scrubbing.run(code, limits={"max_output_bytes": cap})
    assert result.stdout_truncated
    assert result.stdout.startswith("x" * (cap - keep - 1) + " [")
    assert shown not in result.stdout, result.stdout[-60:]
    assert shown.encode() not in result.raw_stdout()
    assert sum(result.redactions.values()) >= 1


def test_the_error_the_traceback_and_stderr_are_scrubbed(scrubbing: Sandbox) -> None:
    code = f"""
import sys
print("contact", {EMAIL!r}, file=sys.stderr)
api_key = {GITHUB_TOKEN!r}
raise ValueError("no account for " + {EMAIL!r} + " with " + api_key)
"""
    result = scrubbing.run(code)
    assert result.status == "error"
    assert result.error is not None
    assert result.error.message == "no account for [EMAIL] with [SECRET]"
    assert "[SECRET]" in result.error.traceback  # the source line with the literal
    assert result.stderr.startswith("contact [EMAIL]")
    assert_none_of([EMAIL, GITHUB_TOKEN], result)


def test_the_return_value_is_scrubbed_keys_included(scrubbing: Sandbox) -> None:
    code = f"""
{{
    {EMAIL!r}: {{"phone": {PHONE!r}, "cards": [{CARD.replace(" ", "")}, "none"]}},
    "note": "ok",
    "count": 3,
    "hits": {{"10.0.0.1": 4, "10.0.0.2": 5}},
}}
"""
    result = scrubbing.run(code)
    assert result.status == "ok", result.error
    assert result.return_value == {
        "[EMAIL_1]": {"phone": "[PHONE]", "cards": ["[CREDIT_CARD]", "none"]},
        "note": "ok",
        "count": 3,
        "hits": {"10.0.0.1": 4, "10.0.0.2": 5},
    }
    assert result.redactions == {"email": 1, "phone": 1, "credit_card": 1}


def test_card_numbers_printed_or_returned_bare_are_redacted(scrubbing: Sandbox) -> None:
    """Issue 33, item 10: an Amex test number in stdout and a Mastercard one returned, no
    separators and no card word: a brand's range and length and Luhn make them cards;
    ids named as such in the same run stay."""
    code = (
        "print(378282246310005)\n"
        "print('order 5105105105105100 shipped')\n"
        "[5555555555554444, {'user_id': 2223003122003222}]"
    )
    result = scrubbing.run(code)
    assert result.status == "ok", result.error
    assert result.stdout == "[CREDIT_CARD]\norder 5105105105105100 shipped\n"
    assert result.return_value == ["[CREDIT_CARD]", {"user_id": 2223003122003222}]
    assert result.redactions == {"credit_card": 2}


def test_the_runtime_logger_is_scrubbed_on_the_way_out(scrubbing: Sandbox) -> None:
    code = f"""
from codecage.runtime import logger
logger.info("signed up", extra={{"email": {EMAIL!r}, "ip": {IP!r}}})
"""
    result = scrubbing.run(code)
    assert result.status == "ok", result.error
    entry = json.loads(result.stderr.strip())
    assert entry["msg"] == "signed up"
    assert (entry["email"], entry["ip"]) == ("[EMAIL]", "[IP_ADDRESS]")


def test_event_details_and_file_names_are_scrubbed(scrubbing: Sandbox) -> None:
    # The import hook reports the refused name in an import_blocked event.
    code = f"""
open({EMAIL + ".csv"!r}, "w").write("x")
try:
    __import__({EMAIL!r})
except ImportError:
    pass
"""
    sandbox = Sandbox(profile="basic", options=Options(scrub=True))
    result = sandbox.run(code)
    assert result.status == "ok", result.error
    kinds = [e.kind for e in result.events]
    assert "import_blocked" in kinds
    assert [f.path for f in result.files] == ["[EMAIL].csv"]
    assert_none_of([EMAIL], result)
    assert result.redactions["email"] >= 2


def test_a_card_in_a_file_name_is_scrubbed_whatever_separates_it() -> None:
    """Issue 33, item 10 (review): a card in a directory (`out/<card>.txt`) or joined to a
    word by `_` came back in `files` as it was, as the text detectors read a digit after
    `/` as a path's and `card_<digits>` as one word. Ids named so, and timestamps, stay."""
    code = """
import os
os.makedirs("out", exist_ok=True)
for name in ("out/4111111111111111.txt", "card_5555555555554444.csv",
             "ids/order_6011111111111117.json", "runs/1700000000123.log"):
    os.makedirs(os.path.dirname(name) or ".", exist_ok=True)
    open(name, "w").write("x")
"""
    result = Sandbox(profile="standard", options=Options(scrub=True)).run(code)
    assert result.status == "ok", result.error
    assert sorted(f.path for f in result.files) == [
        "card_[CREDIT_CARD].csv",
        "ids/order_6011111111111117.json",
        "out/[CREDIT_CARD].txt",
        "runs/1700000000123.log",
    ]
    assert result.redactions == {"credit_card": 2}


def test_a_result_blocked_by_validation_is_scrubbed_too(scrubbing: Sandbox) -> None:
    code = f"import socket\nsocket.create_connection(({IP!r}, 80))  # {EMAIL}\n"
    sandbox = Sandbox(profile="basic")
    result = sandbox.run(code, strict=True)
    assert result.status == "blocked"
    assert_none_of([IP, EMAIL], result)


@pytest.mark.parametrize(
    "spelling",
    [
        pytest.param(lambda s: s, id="plain"),
        pytest.param(lambda s: base64.b64encode(s.encode()).decode(), id="base64"),
        pytest.param(lambda s: quote(s, safe=""), id="url-encoded"),
    ],
)
def test_a_configured_secret_is_redacted_in_every_spelling(
    scrubbing: Sandbox, spelling: object
) -> None:
    shown = spelling(SECRET)  # type: ignore[operator]
    result = scrubbing.run(f"print('token is', {shown!r})")
    assert result.stdout == "token is [SECRET]\n"
    assert result.redactions == {"secret": 1}


def test_secrets_named_by_environment_variable_are_redacted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CODECAGE_TEST_DB_PASSWORD", "pg-Very-Private-42")
    sandbox = Sandbox(
        options=Options(scrub=ScrubSettings(secrets_env=["CODECAGE_TEST_DB_PASSWORD", "UNSET_X"]))
    )
    result = sandbox.run("print('pg-Very-Private-42')")
    assert result.stdout == "[SECRET]\n"
    assert sandbox.info().scrub is not None
    assert sandbox.info().scrub.secrets == 1  # the unset one adds nothing


def test_the_upstream_servers_credentials_are_redacted(tmp_path: Path) -> None:
    # The server is never started (sessions start at the first call): only its config
    # counts. Its short values (DEBUG=1) are not secrets; its token is.
    config = {
        "mcpServers": {
            "crm": {
                "command": "/bin/false",
                "env": {"CRM_TOKEN": "crm-tok-8f14e45fceea167a", "DEBUG": "1"},
            }
        }
    }
    broker = Broker(parse(config, source="test", environ={}))
    try:
        sandbox = Sandbox(tools=broker)
        result = sandbox.run("print('crm-tok-8f14e45fceea167a', 'DEBUG', 1)")
        assert result.stdout == "[SECRET] DEBUG 1\n"
    finally:
        broker.close()


def test_turning_scrubbing_off_really_turns_it_off() -> None:
    sandbox = Sandbox(options=Options(scrub=False))
    code = f"print({EMAIL!r}, {CARD!r}, {GITHUB_TOKEN!r})\n{{'who': {EMAIL!r}}}"
    result = sandbox.run(code)
    assert result.stdout == f"{EMAIL} {CARD} {GITHUB_TOKEN}\n"
    assert result.return_value == {"who": EMAIL}
    assert result.redactions == {}
    info = sandbox.info().scrub
    assert info is not None and not info.enabled and info.categories == []


def test_a_category_switched_off_passes_while_the_others_are_redacted() -> None:
    sandbox = Sandbox(options=Options(scrub=ScrubSettings(ip=False, phone=False)))
    result = sandbox.run(f"print({IP!r}, {PHONE!r}, {EMAIL!r})")
    assert result.stdout == f"{IP} {PHONE} [EMAIL]\n"
    assert result.redactions == {"email": 1}


def test_warm_sandboxes_are_scrubbed_like_cold_ones() -> None:
    with Sandbox(pool=True) as sandbox:
        assert sandbox.warm(30)
        result = sandbox.run(f"print({EMAIL!r})")
        assert sandbox.host.pool is not None
        assert sum(k.hits for k in sandbox.host.pool.state().keys) == 1  # it ran warm
    assert result.stdout == "[EMAIL]\n"
    assert result.redactions == {"email": 1}


# --- the command line ----------------------------------------------------------------


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CODECAGE, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.fixture
def no_config(tmp_path: Path) -> Iterator[dict[str, str]]:
    """An environment whose config file is an empty one (the user's must not count)."""
    empty = tmp_path / "empty.toml"
    empty.write_text("", encoding="utf-8")
    yield {"CODECAGE_CONFIG": str(empty)}


def test_cli_json_counts_redactions_and_no_scrub_turns_it_off(no_config: dict[str, str]) -> None:
    code = f"print({EMAIL!r})"
    on = json.loads(cli("run", "--json", "-c", code, env=no_config).stdout)
    assert (on["stdout"], on["redactions"]) == ("[EMAIL]\n", {"email": 1})
    off = json.loads(cli("run", "--json", "--no-scrub", "-c", code, env=no_config).stdout)
    assert (off["stdout"], off["redactions"]) == (f"{EMAIL}\n", {})
    by_env = cli("run", "--json", "-c", code, env={**no_config, "CODECAGE_SCRUB": "0"})
    assert json.loads(by_env.stdout)["stdout"] == f"{EMAIL}\n"


def test_cli_raw_output_and_summary_are_scrubbed(no_config: dict[str, str]) -> None:
    done = cli("run", "--raw", "-c", f"print('\\x1b[1m', {EMAIL!r})", env=no_config)
    assert done.stdout == "\x1b[1m [EMAIL]\n"
    assert "redacted 1 email" in done.stderr


def test_cli_scrub_categories_narrows_and_refuses_unknown_ones(
    no_config: dict[str, str],
) -> None:
    code = f"print({EMAIL!r}, {IP!r})"
    only_ip = cli("run", "--json", "--scrub-categories", "ip", "-c", code, env=no_config)
    assert json.loads(only_ip.stdout)["stdout"] == f"{EMAIL} [IP_ADDRESS]\n"
    bad = cli("run", "--scrub-categories", "emails", "-c", code, env=no_config)
    assert bad.returncode == 2
    assert "unknown scrub categories: emails" in bad.stderr
    assert "choose from: email, phone" in bad.stderr


def test_cli_config_file_switches_categories_and_info_says_so(tmp_path: Path) -> None:
    config = tmp_path / "codecage.toml"
    config.write_text('[scrub]\nip = false\nsecrets = ["zebra-crossing-77"]\n', encoding="utf-8")
    env = {"CODECAGE_CONFIG": str(config)}
    done = cli("run", "--json", "-c", f"print({IP!r}, 'zebra-crossing-77')", env=env)
    assert json.loads(done.stdout)["stdout"] == f"{IP} [SECRET]\n"
    info = json.loads(cli("info", "--json", env=env).stdout)["scrub"]
    assert info["enabled"] and "ip" not in info["categories"] and info["secrets"] == 1
    assert "zebra" not in json.dumps(info)  # info never shows a secret
