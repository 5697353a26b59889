"""How long does scrubbing 1 MB of program output take, per category, next to its floors?

Measures in ONE run, interleaved (each round runs every variant once) so that machine
drift hits every variant alike, on a generated corpus of typical program output (log
lines, JSON records, CSV rows, floats, dates, UUIDs, hex digests, versions, tracebacks,
prose) with a personal value or a secret on every 150th line:

    floor_translate   one `str.translate` pass over the text (the least any scan costs)
    naive_regex       one hand-written regex that starts with \\d (an SSN pattern with a
                      lookbehind): what each detector would cost without literal pivots
    all               `Scrubber()` with every category and 3 configured secrets
    all_truncated     the same with truncated=True (the cap-boundary rules too)
    all_dense         `all` on a corpus where every 10th line holds a personal value
    <category>        one category alone (email, phone, ssn, credit_card, iban, ip, secret)
    phone_region_de   phone alone with phone_region="DE" (national numbers with a trunk 0)
    configured        3 configured secrets alone (no category)
    scrub_value       `scrub_value` on the same corpus as a list of JSON records, per MB of JSON
    result            `redaction.scrub_result` of a run whose stdout is the corpus: what the
                      host pays after a run (decode, scrub, encode, neutralise, the rest)

It also scrubs the corpus generated *without* personal values and reports every finding
there: those are false positives on ordinary output. `--libraries` times the libraries
that were rejected for finding values in text (phonenumbers' PhoneNumberMatcher over the
whole text; detect-secrets and Presidio if installed).

    .venv/bin/python benchmarks/bench_scrub.py                       # n=20, 1 MB
    .venv/bin/python benchmarks/bench_scrub.py -n 2 --size-kb 64 --no-write   # smoke
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from hashlib import sha1, sha256
from pathlib import Path

from codecage.models import ExecutionResult, Limits, Usage
from codecage.output import neutralise
from codecage.policy.scrub import CATEGORIES, Scrubber, ScrubConfig
from codecage.policy.scrub import apply as redaction

ROOT = Path(__file__).resolve().parent.parent
SECRETS = ("upstream-Token-7f3a9c2e", "pg-Password!2026", "sk-internal-0123456789")
MB = 1_000_000
DENSE_EVERY = 10  # the "all_dense" variant: every 10th line holds a personal value


# --- the corpus ------------------------------------------------------------------------


def _ordinary_line(rng: random.Random, when: datetime) -> str:
    kind = rng.randrange(9)
    if kind == 0:
        return (
            f"{when:%Y-%m-%d %H:%M:%S},{rng.randrange(1000):03d} INFO worker-{rng.randrange(8)}"
            f" processed batch {rng.randrange(10**6)} in {rng.random():.3f}s"
            f" request_id={uuid.UUID(int=rng.getrandbits(128), version=4)}"
        )
    if kind == 1:
        record = {
            "id": rng.randrange(10**9),
            "sku": f"SKU-{rng.randrange(10**5):05d}",
            "price": round(rng.uniform(1, 500), 2),
            "qty": rng.randrange(100),
            "created": (when - timedelta(days=rng.randrange(900))).isoformat() + "Z",
            "etag": sha256(rng.randbytes(8)).hexdigest(),
            "tags": rng.sample(["new", "sale", "eu", "us", "b2b"], 2),
        }
        return json.dumps(record)
    if kind == 2:
        return ",".join(f"{rng.gauss(0, 1000):.4f}" for _ in range(10))
    if kind == 3:
        return (
            f'  File "/usr/lib/python3.11/site-packages/pandas/core/frame.py",'
            f" line {rng.randrange(9999)}, in __getitem__"
        )
    if kind == 4:
        return (
            f"commit {sha1(rng.randbytes(8)).hexdigest()} v{rng.randrange(3)}.{rng.randrange(30)}"
            f".{rng.randrange(30)} build {rng.randrange(10**4)} took {rng.randrange(10**4)} ms"
        )
    if kind == 5:
        row = [rng.randrange(10**4), rng.random(), rng.randrange(-500, 500), rng.random() * 1e6]
        return f"{rng.randrange(10**5):>6} " + "  ".join(f"{v!r:>22}" for v in row)
    if kind == 6:
        return (
            f"epoch={int(when.timestamp())} ms={int(when.timestamp() * 1000)}"
            f" ns={int(when.timestamp() * 1e9)} ratio={rng.random()} pct={rng.random() * 100:.1f}%"
        )
    if kind == 7:
        return (
            f"The model converged after {rng.randrange(300)} epochs; loss {rng.random():.5f},"
            f" accuracy {rng.random():.2%}, {rng.randrange(10**5)} tokens, max_tokens=4096,"
            f" version 1.{rng.randrange(40)}.{rng.randrange(40)}"
        )
    return f"{when:%H:%M:%S} GET /api/v1/items/{rng.randrange(10**6)}?page={rng.randrange(50)} 200"


def _card(rng: random.Random) -> str:
    digits = [4] + [rng.randrange(10) for _ in range(14)]
    total = 0
    for i, d in enumerate(reversed(digits)):
        d = d * 2 if i % 2 == 0 else d
        total += d - 9 if d > 9 else d
    digits.append((10 - total % 10) % 10)
    text = "".join(map(str, digits))
    return " ".join(text[i : i + 4] for i in range(0, 16, 4))


def _sensitive_line(rng: random.Random) -> str:
    name = rng.choice(["ana", "bo", "chen", "dara", "eli"])
    kind = rng.randrange(8)
    if kind == 0:
        return f"sent invoice to {name}.{rng.randrange(99)}@example.com"
    if kind == 1:
        local = rng.randrange(2000, 9999)
        return f"callback +1 415-555-{local} or (212) 555-0{rng.randrange(100, 199)}"
    if kind == 2:
        return f"charged card {_card(rng)} for order {rng.randrange(10**15, 10**16)}"
    if kind == 3:
        return "iban DE89 3704 0044 0532 0130 00 ssn 123-45-6789"
    if kind == 4:
        return (
            f"client {rng.randrange(1, 223)}.{rng.randrange(256)}.{rng.randrange(256)}.7 connected"
        )
    if kind == 5:
        # an api_key value must look generated (16+ characters) to be a secret
        record = {
            "user": name,
            "password": f"pw-{rng.randrange(10**6)}",
            "api_key": "k1x9Qw7Zp3Lm8Rt2vB",
        }
        return json.dumps(record)
    if kind == 6:
        return f"using {SECRETS[rng.randrange(3)]} for upstream"
    return "aws AKIAIOSFODNN7EXAMPLE ghp_" + "".join(rng.choices("abcdefXYZ0123456789", k=36))


def make_corpus(size: int, *, seed: int = 7, sensitive_every: int = 150) -> str:
    """About `size` characters of program output; every `sensitive_every`-th line holds a
    personal value or a secret (0: none, the false-positive corpus)."""
    rng = random.Random(seed)
    when = datetime(2026, 11, 22, 10, 0, 0)
    lines: list[str] = []
    total = 0
    while total < size:
        when += timedelta(milliseconds=rng.randrange(2000))
        if sensitive_every and len(lines) % sensitive_every == sensitive_every - 1:
            line = _sensitive_line(rng)
        else:
            line = _ordinary_line(rng, when)
        lines.append(line)
        total += len(line) + 1
    return "\n".join(lines)[:size]


def as_records(text: str) -> list[object]:
    """The corpus as a JSON-like value: its JSON lines parsed, the other lines as strings."""
    records: list[object] = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line) if line.startswith("{") else line)
        except json.JSONDecodeError:  # the last line, cut at the corpus size
            records.append(line)
    return records


# --- measuring -------------------------------------------------------------------------


def variants(text: str, dense: str, records: list[object]) -> dict[str, Callable[[], object]]:
    table = str.maketrans("0123456789", "0000000000")
    naive = re.compile(r"(?<![\w.])\d{3}-\d{2}-\d{4}")
    every = Scrubber(ScrubConfig(secrets=SECRETS))
    out: dict[str, Callable[[], object]] = {
        "floor_translate": lambda: text.translate(table),
        "naive_regex": lambda: naive.findall(text),
        "all": lambda: every.scrub(text),
        "all_truncated": lambda: every.scrub(text, truncated=True),
        "all_dense": lambda: every.scrub(dense),
    }
    for category in CATEGORIES:
        one = Scrubber(ScrubConfig(categories=frozenset({category})))
        out[category] = lambda one=one: one.scrub(text)  # type: ignore[misc]
    german = Scrubber(ScrubConfig(categories=frozenset({"phone"}), phone_region="DE"))
    out["phone_region_de"] = lambda: german.scrub(text)
    configured = Scrubber(ScrubConfig(categories=frozenset(), secrets=SECRETS))
    out["configured"] = lambda: configured.scrub(text)
    out["scrub_value"] = lambda: every.scrub_value(records)
    run = _result_with_stdout(text)
    out["result"] = lambda: redaction.scrub_result(run, every)
    return out


def _result_with_stdout(text: str) -> ExecutionResult:
    raw = text.encode()
    return ExecutionResult(
        execution_id="0" * 32,
        status="ok",
        exit_code=0,
        signal=None,
        stdout=neutralise(raw),
        stderr="",
        stdout_truncated=False,
        stderr_truncated=False,
        return_value=None,
        error=None,
        files=[],
        usage=Usage(wall_ms=1, cpu_ms=1, peak_memory_mb=None),
        limits=Limits(),
        events=[],
        backend="bwrap",
    ).with_raw_output(raw, b"")


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def measure(fns: dict[str, Callable[[], object]], n: int) -> dict[str, list[float]]:
    for fn in fns.values():  # warm: compile, phonenumbers metadata, caches
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(n):
        for name, fn in fns.items():
            samples[name].append(_timed(fn))
    return samples


def summarise(
    samples: dict[str, list[float]], sizes: dict[str, int]
) -> dict[str, dict[str, float]]:
    floor = statistics.median(samples["floor_translate"])
    table = {}
    for name, values in samples.items():
        p50 = statistics.median(values)
        table[name] = {
            "p50_ms": round(p50, 2),
            "p95_ms": round(percentile(values, 0.95), 2),
            "p99_ms": round(percentile(values, 0.99), 2),
            "ms_per_mb": round(p50 * MB / sizes.get(name, sizes["text"]), 2),
            "ratio_to_floor": round(p50 / floor, 1),
        }
    return table


def false_positives(size: int) -> dict[str, object]:
    """Findings on the corpus without personal values: each one is a false positive."""
    clean = make_corpus(size, sensitive_every=0)
    scrubber = Scrubber()
    spans = scrubber.find(clean)
    counts: dict[str, int] = {}
    for _, _, category in spans:
        counts[category] = counts.get(category, 0) + 1
    examples = [f"{c}: {clean[a:b]!r}" for a, b, c in spans[:10]]
    return {"chars": len(clean), "findings": len(spans), "counts": counts, "examples": examples}


def libraries(text: str) -> dict[str, object]:
    """The rejected alternatives, timed once on the same text (scaled to ms per MB)."""
    found: dict[str, object] = {}
    import phonenumbers

    piece = text[: max(1, len(text) // 10)]
    start = time.perf_counter()
    matches = sum(1 for _ in phonenumbers.PhoneNumberMatcher(piece, "US"))
    elapsed = (time.perf_counter() - start) * 1000
    found["phonenumbers.PhoneNumberMatcher"] = {
        "ms_per_mb": round(elapsed * MB / len(piece), 1),
        "matches_in_sample": matches,
    }
    if importlib.util.find_spec("detect_secrets") is not None:
        from detect_secrets.core.scan import scan_line
        from detect_secrets.settings import default_settings

        with default_settings():
            start = time.perf_counter()
            for line in text.splitlines():
                list(scan_line(line))
            elapsed = (time.perf_counter() - start) * 1000
        found["detect_secrets.scan_line"] = {"ms_per_mb": round(elapsed * MB / len(text), 1)}
    else:
        found["detect_secrets"] = "not installed"
    if importlib.util.find_spec("presidio_analyzer") is None:
        found["presidio_analyzer"] = "not installed"
    return found


def environment(n: int, size: int) -> dict[str, object]:
    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    ).stdout.strip()
    return {
        "bench": "scrub",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "kernel": platform.release(),
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "git_sha": sha,
        "n": n,
        "corpus_chars": size,
        "configured_secrets": len(SECRETS),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=20, help="rounds (default 20)")
    parser.add_argument("--size-kb", type=int, default=1000, help="corpus size (default 1000)")
    parser.add_argument("--libraries", action="store_true", help="also time rejected libraries")
    parser.add_argument("--no-write", action="store_true", help="print only, write no JSON")
    args = parser.parse_args(argv)
    size = args.size_kb * 1000
    text = make_corpus(size)
    dense = make_corpus(size, sensitive_every=DENSE_EVERY)
    records = as_records(text)
    sizes = {
        "text": len(text.encode()),
        "all_dense": len(dense.encode()),
        "scrub_value": len(json.dumps(records).encode()),
    }
    table = summarise(measure(variants(text, dense, records), args.n), sizes)
    every = Scrubber(ScrubConfig(secrets=SECRETS))
    found, found_dense = every.scrub(text).counts, every.scrub(dense).counts
    print(f"corpus {sizes['text'] / MB:.2f} MB, n={args.n}; redacted {found}")
    print(f"dense corpus (every {DENSE_EVERY}th line sensitive): redacted {found_dense}")
    print(f"{'variant':<17}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'ms/MB':>9}{'x floor':>9}")
    for name, row in table.items():
        print(
            f"{name:<17}{row['p50_ms']:>9.1f}{row['p95_ms']:>9.1f}{row['p99_ms']:>9.1f}"
            f"{row['ms_per_mb']:>9.1f}{row['ratio_to_floor']:>9.1f}"
        )
    fp = false_positives(size)
    print(f"false positives on {fp['chars']} chars of ordinary output: {fp['findings']}")
    for example in fp["examples"]:  # type: ignore[attr-defined]
        print(f"  {example}")
    result: dict[str, object] = {
        **environment(args.n, size),
        "redacted": found,
        "redacted_dense": found_dense,
        "results": table,
        "false_positives": fp,
    }
    if args.libraries:
        result["libraries"] = libraries(text)
        print(json.dumps(result["libraries"], indent=2))
    if not args.no_write:
        out = ROOT / "benchmarks" / "results"
        out.mkdir(exist_ok=True)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        path = out / f"scrub-{stamp}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
