"""Issue 36: what a newcomer meets first on the CLI: a DataFrame shown once as the table it
is (on a pipe and on a terminal), a figure that says how to save it, messages that name
the right next step. Each test runs the installed `codecage` command for real."""

from __future__ import annotations

import contextlib
import os
import pty
import select
import subprocess
import time
from pathlib import Path

import pytest
from tests._cli import CODECAGE, codecage

pytestmark = pytest.mark.timeout(180)

TABLE = (
    "import pandas as pd\n"
    "df = pd.DataFrame({'city': ['Oslo', 'Lima', 'Pune'], 'n': [3, 4, 5]})\n"
    "df\n"
)
TABLE_LINES = ["   city  n", "0  Oslo  3", "1  Lima  4", "2  Pune  5"]


def _on_a_terminal(*args: str, cwd: Path) -> str:
    """`codecage ARGS` with a pty as its stdout and stderr (as a person runs it): all it
    wrote there, carriage returns dropped (the pty turns each newline into CR LF)."""
    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    with subprocess.Popen(
        [CODECAGE, *args],
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=follower,
        cwd=cwd,
        env=env,
    ) as proc:
        os.close(follower)
        shown = b""
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            if select.select([leader], [], [], 1)[0]:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: the child closed its end
                    break
                if not chunk:
                    break
                shown += chunk
            elif proc.poll() is not None:
                break
        proc.wait(timeout=30)
    with contextlib.suppress(OSError):
        os.close(leader)
    return shown.decode("utf-8", "replace").replace("\r", "")


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.split("\n")]


def test_a_dataframe_is_shown_once_as_its_table_on_a_pipe(tmp_path: Path) -> None:
    done = codecage("run", "--profile", "data_science", "--code", TABLE, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = _lines(done.stderr)
    at = lines.index(TABLE_LINES[0])
    assert lines[at : at + 4] == TABLE_LINES  # real lines, not "\n" escapes
    assert "\\n" not in done.stderr
    assert done.stderr.count("Oslo") == 1  # once: not again as the return value's repr
    assert "→" not in done.stderr


def test_a_dataframe_is_shown_once_as_its_table_on_a_terminal(tmp_path: Path) -> None:
    shown = _on_a_terminal("run", "--profile", "data_science", "--code", TABLE, cwd=tmp_path)
    lines = _lines(shown)
    assert TABLE_LINES[0] in lines, shown
    at = lines.index(TABLE_LINES[0])
    assert lines[at : at + 4] == TABLE_LINES
    assert "\\n" not in shown and shown.count("Oslo") == 1, shown


PLOT = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()\n"


def test_a_figure_through_run_says_that_out_saves_it(tmp_path: Path) -> None:
    done = codecage("run", "--code", PLOT, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "figure 1: image/png" in done.stderr
    assert "--out DIR" in done.stderr
    saved = codecage("run", "--code", PLOT, "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr
    assert (tmp_path / "o" / "figure-1.png").is_file() and "--out DIR" not in saved.stderr
