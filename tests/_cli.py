"""The installed `codecage` command run from a test, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

CODECAGE = str(Path(sys.executable).with_name("codecage"))


def codecage(
    *args: str,
    stdin: str | None = None,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """`codecage ARGS`, fed `stdin`, its output captured as text; any exit status returns."""
    return subprocess.run(
        [CODECAGE, *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
        check=False,
    )
