"""Static validation: each rule fires on a positive and stays quiet on clean code; obfuscated
dynamic execution is never clean; pathological input comes back quickly."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codecage.policy.validate import (
    MAX_PARSE_TOKENS,
    MAX_SOURCE_BYTES,
    Finding,
    ValidationReport,
    validate,
)

BASIC = frozenset(
    {"math", "statistics", "json", "csv", "collections", "base64", "codecs", "zlib", "re"}
)

CLEAN = '''\
"""Summarise a CSV of measurements."""
import csv
import json
import statistics
from collections import defaultdict

groups: dict[str, list[float]] = defaultdict(list)
with open("/workspace/measurements.csv", newline="", encoding="utf-8") as fh:
    for row in csv.DictReader(fh):
        try:
            groups[row["site"]].append(float(row["value"]))
        except (KeyError, ValueError):
            continue

summary = {
    site: {"n": len(vals), "mean": statistics.mean(vals), "stdev": statistics.pstdev(vals)}
    for site, vals in groups.items()
    if vals
}
with open("/workspace/summary.json", "w", encoding="utf-8") as out:
    json.dump(summary, out, indent=2)
summary
'''


def rules(report: ValidationReport) -> set[str]:
    return {f.rule_id for f in report.findings}


def first(report: ValidationReport, rule_id: str) -> Finding:
    return next(f for f in report.findings if f.rule_id == rule_id)


# --- clean code -------------------------------------------------------------------------


def test_clean_data_analysis_has_no_medium_or_high_findings() -> None:
    report = validate(CLEAN, allowed_modules=BASIC)
    assert report.valid, report.message
    assert [f for f in report.findings if f.severity != "low"] == []
    assert report.analysis.bandit_ran
    assert report.analysis.imports == ["collections", "csv", "json", "statistics"]


def test_clean_code_is_valid_in_strict_mode_too() -> None:
    assert validate(CLEAN, allowed_modules=BASIC, strict=True).valid


def test_analysis_counts_lines_functions_classes_loops_and_nesting() -> None:
    code = (
        "class A:\n"
        "    def f(self, xs):\n"
        "        for x in xs:\n"
        "            if x and x > 1:\n"
        "                print(x)\n"
        "        return [y for y in xs if y]\n"
    )
    a = validate(code).analysis
    assert (a.lines, a.characters) == (6, len(code))
    assert (a.functions, a.classes, a.loops) == (1, 1, 2)
    assert a.max_nesting_depth == 4  # class > def > for > if
    # 1 + for + if + `and` + comprehension for + comprehension if
    assert a.complexity == 6
    assert any("/workspace files" in r for r in a.recommendations)


# --- syntax and imports -----------------------------------------------------------------


def test_syntax_error_reports_line_and_column() -> None:
    report = validate("x = 1\nif x\n    y = 2\n")
    assert not report.valid
    f = first(report, "CC001")
    assert (f.kind, f.line, f.col) == ("syntax", 2, 5)
    assert "line 2" in report.message


def test_disallowed_import_is_found_with_line_and_how_to_allow_it() -> None:
    code = "import json\nimport os.path\nfrom socket import socket\nfrom . import sibling\n"
    report = validate(code, allowed_modules=BASIC, profile_name="basic")
    assert not report.valid
    refused = [f for f in report.findings if f.rule_id == "CC002"]
    assert [(f.line, f.col) for f in refused] == [(2, 1), (3, 1)]
    assert "'os'" in refused[0].message and "'basic'" in refused[0].message
    assert "--allow-import os" in refused[0].message
    assert "profile that has it" in report.message


def test_literal_dynamic_imports_are_checked_against_the_profile() -> None:
    code = (
        "a = __import__('subprocess')\nimport importlib\nb = importlib.import_module('os.path')\n"
    )
    report = validate(code, allowed_modules=BASIC)
    modules = [f.message.split("'")[1] for f in report.findings if f.rule_id == "CC002"]
    assert modules == ["subprocess", "importlib", "os.path"]  # the name the run refuses


def test_import_check_is_skipped_without_a_module_set() -> None:
    report = validate("import os\n")
    assert report.valid
    assert "CC002" not in rules(report)
    assert any("import policy" in s for s in report.analysis.skipped)


def test_future_imports_are_always_allowed() -> None:
    assert validate("from __future__ import annotations\n", allowed_modules=BASIC).valid


# --- security rules: positive and clean negative ----------------------------------------


@pytest.mark.parametrize(
    ("rule_id", "positive", "negative"),
    [
        ("CC101", "def run(src):\n    exec(src)\n", "exec('x = 1')\n"),
        ("CC101", "e = eval\n", "value = 'eval'\n"),
        ("CC102", "def load(n):\n    return __import__(n)\n", "m = __import__('json')\n"),
        ("CC103", "import builtins\nf = getattr(builtins, 'open')\n", "f = getattr(obj, 'open')\n"),
        ("CC104", "subs = ().__class__.__base__.__subclasses__()\n", "n = type(x).__name__\n"),
        ("CC104", "g = func.__globals__\n", "d = obj.__dict__\n"),
        ("CC104", "class A: pass\nA.__dict__\n", "class A: pass\nA().__dict__\n"),
        ("CC104", "x = getattr(f, '__code__')\n", "x = getattr(f, '__name__')\n"),
        ("CC104", "b = __builtins__\n", "b = 'builtins'\n"),
        ("CC105", "import ctypes\n", "import math\n"),
        ("CC105", "from cffi import FFI\n", "from json import dumps\n"),
        ("CC105", "import mmap\n", "import heapq\n"),
        ("CC106", "open('/etc/passwd')\n", "open('/workspace/data.csv')\n"),
        ("CC106", "import os\nos.listdir('/proc/self/fd')\n", "import os\nos.listdir('/tmp')\n"),
        ("CC106", "from pathlib import Path\nPath('/root')\n", "Path('/workspace') / 'out'\n"),
        ("CC106", "open('/workspace/../etc/shadow')\n", "open('relative.txt')\n"),
        ("CC108", "s = ''.join(map(chr, [104, 105]))\n", "s = ''.join(['h', 'i'])\n"),
    ],
)
def test_each_rule_fires_on_a_positive_and_not_on_a_negative(
    rule_id: str, positive: str, negative: str
) -> None:
    assert rule_id in rules(validate(positive)), positive
    assert rule_id not in rules(validate(negative)), negative


def test_bandit_findings_carry_rule_id_severity_and_position() -> None:
    report = validate("x = 1\nvalue = eval(input())\n")
    f = first(report, "B307")
    assert (f.source, f.severity, f.line, f.col) == ("bandit", "medium", 2, 9)
    assert report.analysis.bandit_ran


def test_nosec_comments_do_not_silence_bandit() -> None:
    assert "B307" in rules(validate("value = eval(input())  # nosec\n"))


def test_security_findings_alone_leave_the_code_valid_unless_strict() -> None:
    code = "import builtins\nf = getattr(builtins, 'exec')\n"
    assert validate(code).valid
    strict = validate(code, strict=True)
    assert not strict.valid
    assert "strict" in strict.message


# --- obfuscation ----------------------------------------------------------------------


OBFUSCATED = {
    "chr_join_exec": "s = ''.join(chr(c) for c in [112, 114, 105, 110, 116])\nexec(s + '(1)')\n",
    "chr_sum_exec": "exec(chr(112) + chr(114) + chr(105) + chr(110) + chr(116) + '(1)')\n",
    "b64_exec": "import base64\nexec(base64.b64decode('cHJpbnQoMSk='))\n",
    "b64_via_variables": (
        "import base64\npayload = 'cHJpbnQoMSk='\nraw = base64.b64decode(payload)\n"
        "src = raw.decode()\ncode = compile(src, 'x', 'exec')\nexec(code)\n"
    ),
    "codecs_rot13": "import codecs\nexec(codecs.decode('cevag(1)', 'rot13'))\n",
    "zlib": "import zlib\neval(zlib.decompress(blob))\n",
    "fromhex": "exec(bytes.fromhex('7072696e74283129'))\n",
    "reversed": "exec(')1(tnirp'[::-1])\n",
    "concat_exec": "a = 'pri'\nb = 'nt(1)'\nexec(a + b)\n",
    "fstring_exec": "name = 'print'\nexec(f'{name}(1)')\n",
    "getattr_builtins_concat": "getattr(__builtins__, 'ex' + 'ec')('print(1)')\n",
    "getattr_module_concat": "import os\ngetattr(os, 'sys' + 'tem')('id')\n",
    "alias_exec": "import base64\nrun = exec\nrun(base64.b64decode(p))\n",
    "dynamic_import_built": "m = __import__('o' + 's')\n",
}


@pytest.mark.parametrize("code", OBFUSCATED.values(), ids=OBFUSCATED.keys())
def test_obfuscated_dynamic_execution_is_never_clean(code: str) -> None:
    report = validate(code)
    high = [f for f in report.findings if f.severity == "high" and f.source == "codecage"]
    assert high, report.findings
    assert not validate(code, strict=True).valid


def test_dynamic_execution_in_code_that_decodes_is_high_even_without_a_traced_flow() -> None:
    code = "import base64\ndata = base64.b64decode(x)\ndef run(s):\n    exec(s)\n"
    assert first(validate(code), "CC107").severity == "high"


# --- bounds ---------------------------------------------------------------------------


def bounded(code: str, seconds: float = 5.0) -> ValidationReport:
    start = time.monotonic()
    report = validate(code, allowed_modules=BASIC)
    assert time.monotonic() - start < seconds
    return report


@pytest.mark.timeout(10)
def test_source_over_ten_mib_is_refused_at_once() -> None:
    report = bounded("#" * (MAX_SOURCE_BYTES + 1), seconds=2)
    assert not report.valid
    assert rules(report) == {"CC003"}


@pytest.mark.timeout(10)
def test_ten_mib_of_code_is_not_parsed() -> None:
    report = bounded("value = compute(alpha, beta) + 1\n" * (MAX_SOURCE_BYTES // 34), seconds=2)
    assert rules(report) == {"CC004"}
    assert not report.analysis.bandit_ran


@pytest.mark.timeout(10)
def test_a_million_line_file_is_not_parsed() -> None:
    report = bounded("x = 1\n" * 1_000_000, seconds=2)
    assert rules(report) == {"CC004"}
    assert report.analysis.lines == 1_000_000


@pytest.mark.timeout(10)
def test_a_ten_mib_string_literal_is_analysed() -> None:
    report = bounded("s = '" + "a" * (MAX_SOURCE_BYTES - 100) + "'\n")
    assert report.valid


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "code",
    [
        "(" * 100_000 + ")" * 100_000,
        "x = " + "[" * 50_000 + "]" * 50_000,
        "-" * 100_000 + "x",
        "+".join(["1"] * 30_000),
        "a" + ".b" * 30_000,
    ],
    ids=["parens_100k", "lists_50k", "unary_100k", "sum_30k", "attributes_30k"],
)
def test_pathological_nesting_returns_quickly_as_a_finding(code: str) -> None:
    report = bounded(code, seconds=2)
    assert not report.valid
    assert rules(report) <= {"CC001", "CC004", "CC005"}


@pytest.mark.timeout(20)
def test_code_at_the_parse_budget_is_analysed_without_bandit_in_bounded_time() -> None:
    code = "x = f(a, b)\n" * (MAX_PARSE_TOKENS // 9)
    report = bounded(code)
    assert report.valid
    assert not report.analysis.bandit_ran
    assert any(s.startswith("bandit:") for s in report.analysis.skipped)


# --- never raises ---------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_validate_never_raises_on_arbitrary_text(code: str) -> None:
    report = validate(code, allowed_modules=BASIC)
    assert isinstance(report, ValidationReport)
    assert report.message


@pytest.mark.parametrize("code", ["", "\x00", "x = '\\d'\n", "\ud800", "\ufeffx = 1\n"])
def test_odd_inputs_return_a_report(code: str) -> None:
    assert isinstance(validate(code), ValidationReport)


def test_thousands_of_findings_are_listed_up_to_a_bound_and_counted() -> None:
    report = validate("import ctypes\n" * 3000, allowed_modules=BASIC)
    assert not report.valid
    assert len(report.findings) == 200
    assert report.omitted_findings >= 3000 - 200  # one import finding per line at least
    assert [f.line for f in report.findings] == sorted(f.line for f in report.findings)
    assert len(report.model_dump_json()) < 100_000
