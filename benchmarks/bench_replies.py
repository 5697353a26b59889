"""How large are the MCP tools' replies for typical runs, before and after issue 18?

Each case is one tool call through the official SDK's in-memory client
(`Client(build_server(Sandbox(pool=False)))`), once with the code of this tree and once with
the code of an older commit (`--before`, exported with `git archive` into a temporary directory);
each side runs in its own Python process with PYTHONPATH pointing at its `src`.

Measured per reply: `bytes`, the length of the CallToolResult's JSON as the client received
it (`model_dump_json(by_alias=True, exclude_none=True)`), and `tokens`, estimated as
codecage's reply budget estimates them (docs/mcp.md): one token per 4 ASCII characters of
that JSON, one per UTF-8 byte of any other character, an image 1,600 (its base64 not
counted). No tokenizer is run.

    .venv/bin/python benchmarks/bench_replies.py                 # writes a results file
    .venv/bin/python benchmarks/bench_replies.py --no-write      # prints the table only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "9b1373a"  # main before issue 18's replies work

CHART = """\
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
x = np.linspace(0, 10, 200)
plt.plot(x, np.sin(x), label="sin")
plt.plot(x, np.cos(x), label="cos")
plt.legend()
plt.title("waves")
plt.savefig("chart.png", dpi=80)
print("saved chart.png")
"""
PANDAS = """\
import numpy as np
import pandas as pd
rng = np.random.default_rng(0)
df = pd.DataFrame(rng.normal(size=(1000, 5)), columns=list("abcde"))
print(df.describe())
"""
TRACEBACK = """\
def load(rows):
    return [parse(r) for r in rows]

def parse(row):
    key, value = row.split("=")
    return key, int(value)

load(["a=1", "b=2", "c=three"])
"""
VALIDATE = """\
import subprocess
import pickle
data = pickle.loads(open("x.bin", "rb").read())
subprocess.run("ls " + data, shell=True)
eval(input())
"""
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("hello world", "execute_code", {"code": "print('hello, world')"}),
    ("pandas describe()", "execute_code", {"code": PANDAS, "profile": "data_science"}),
    (
        "100k-line print loop",
        "execute_code",
        {"code": "for i in range(100_000):\n    print(f'line {i}: value {i * i}')"},
    ),
    ("a traceback", "execute_code", {"code": TRACEBACK}),
    ("a chart file (PNG)", "execute_code", {"code": CHART, "profile": "data_science"}),
    ("get_sandbox_info", "get_sandbox_info", {}),
    ("get_sandbox_info detail=true", "get_sandbox_info", {"detail": True}),
    ("validate_code", "validate_code", {"code": VALIDATE}),
]

CHILD = """
import json, sys, anyio
from mcp import Client
try:
    from codecage import Sandbox
    from codecage.mcp.server import build_server

    def make_server():
        sandbox = Sandbox(pool=False)
        # Since the structure issue the server holds the host; before, the Sandbox.
        return build_server(getattr(sandbox, "host", None) and sandbox.host
                            if "runtime" in build_server.__code__.co_varnames else sandbox)
except ImportError:  # an older commit's code, from before the mcp/ package (issue 19)
    from codecage.server import build_server

    def make_server():
        return build_server(pool=False)

def tokens(result):
    data = result.model_dump(mode="json", by_alias=True, exclude_none=True)
    images = 0
    for block in data["content"]:
        if block["type"] == "image":
            images += 1
            block["data"] = ""
    sent = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    ascii_chars = sum(1 for ch in sent if ord(ch) < 128)
    other = len(sent.encode("utf-8", "surrogatepass")) - ascii_chars
    return -(-ascii_chars // 4) + other + 1600 * images

async def main():
    cases = json.loads(sys.argv[1])
    out = []
    async with Client(make_server(), read_timeout_seconds=300) as client:
        names = {t.name: t for t in (await client.list_tools()).tools}
        for label, tool, arguments in cases:
            accepted = set(names[tool].input_schema.get("properties", {}))
            if not set(arguments) <= accepted:
                out.append({"case": label, "skipped": "argument not accepted"})
                continue
            result = await client.call_tool(tool, arguments)
            sc = result.structured_content or {}
            out.append({
                "case": label,
                "bytes": len(result.model_dump_json(by_alias=True, exclude_none=True).encode()),
                "tokens": tokens(result),
                "is_error": result.is_error,
                "status": sc.get("status"),
                "images": sum(1 for b in result.content if b.type == "image"),
            })
    print(json.dumps(out))

anyio.run(main)
"""


def measure(src: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(CASES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=True,
    )
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=BEFORE, help="the commit to compare with")
    parser.add_argument("--no-write", action="store_true", help="print, write no results file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-replies-") as tmp:
        archive = subprocess.run(
            ["git", "archive", args.before, "src"], cwd=ROOT, capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        before = measure(Path(tmp) / "src")
    after = measure(ROOT / "src")
    rows = []
    print(f"{'case':32} {'before bytes':>13} {'tokens':>8} {'after bytes':>12} {'tokens':>8}")
    for old, new in zip(before, after, strict=True):
        rows.append({"case": new["case"], "before": old, "after": new})
        old_bytes = f"{old['bytes']:,}" if "bytes" in old else "n/a"
        old_tokens = f"{old['tokens']:,}" if "tokens" in old else "n/a"
        print(
            f"{new['case']:32} {old_bytes:>13} {old_tokens:>8} "
            f"{new['bytes']:>12,} {new['tokens']:>8,}"
        )
    if not args.no_write:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        out = ROOT / "benchmarks" / "results" / f"replies-{stamp}.json"
        report = {
            "bench": "replies",
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
            "host": platform.node(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "git_sha": sha,
            "before_sha": args.before,
            "method": "in-memory SDK client, pool off; bytes of the CallToolResult JSON; "
            "tokens = ASCII chars / 4 + other UTF-8 bytes + 1,600 per image",
            "results": rows,
        }
        out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
