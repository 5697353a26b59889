"""How many of codecage's modules does one `codecage run --code 'print(1)'` cross?

Runs the CLI in this process under a profile hook that notes every function of codecage's
host side that is called after the imports are done (the command itself, not the module
bodies that importing runs). Prints the count of modules, the count of distinct functions,
and, with --list, the modules in the order they were first entered.

    .venv/bin/python benchmarks/bench_hops.py            # this checkout's src/
    .venv/bin/python benchmarks/bench_hops.py --src OLD/src --list

The sandbox's own process (guest/) runs elsewhere and is not counted; nor are imports.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", default=str(ROOT / "src"), help="the tree whose code runs")
    parser.add_argument("--list", action="store_true", help="print the modules in order")
    parser.add_argument("--code", default="print(1)")
    args = parser.parse_args()
    src = Path(args.src).resolve()
    sys.path.insert(0, str(src))
    import codecage.cli  # before the hook: imports are not hops

    package = str(src / "codecage")
    modules: dict[str, None] = {}
    functions: set[tuple[str, str]] = set()

    def hook(frame: types.FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        filename = frame.f_code.co_filename
        if not filename.startswith(package) or frame.f_code.co_name == "<module>":
            return
        module = filename[len(package) + 1 :].removesuffix(".py").replace("/", ".")
        modules.setdefault(module, None)
        functions.add((module, frame.f_code.co_qualname))

    sys.argv = ["codecage", "run", "--code", args.code]
    sys.setprofile(hook)
    try:
        codecage.cli.main()
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
    host_side = [m for m in modules if not m.startswith("guest")]
    print(
        f"modules crossed: {len(host_side)}   functions called: {len(functions)}", file=sys.stderr
    )
    if args.list:
        print("\n".join(host_side), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
