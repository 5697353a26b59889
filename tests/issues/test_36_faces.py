"""Issue 36: what a newcomer meets first on the CLI: a DataFrame shown once as the table it
is (on a pipe and on a terminal), a figure that says how to save it, messages that name
the right next step. Each test runs the installed `codecage` command for real."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import subprocess
import time
from pathlib import Path

import pytest
from tests._cli import CODECAGE, codecage
from tests.issues.test_18_packages import handmade_dir

from codecage import Options, Sandbox

pytestmark = pytest.mark.timeout(180)

TABLE = (
    "import pandas as pd\n"
    "df = pd.DataFrame({'city': ['Oslo', 'Lima', 'Pune'], 'n': [3, 4, 5]})\n"
    "df\n"
)
TABLE_LINES = ["   city  n", "0  Oslo  3", "1  Lima  4", "2  Pune  5"]


def _on_a_terminal(*args: str, cwd: Path) -> str:
    """`codecage ARGS` with a pty as its stdout and stderr (as a person runs it): all it
    wrote there, carriage returns (the pty turns each newline into CR LF) and terminal
    escapes dropped."""
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
    text = shown.decode("utf-8", "replace").replace("\r", "")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)  # colours and cursor moves


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


# --- paper cuts ---------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
_LINK = re.compile(r"\]\(((?:docs/)?[\w./-]*\.md)?#([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # a "# comment" in code is none
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE)}


def test_every_link_to_a_section_of_the_docs_finds_it() -> None:
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in _LINK.findall(page.read_text(encoding="utf-8")):
            linked = (page.parent / target).resolve() if target else page
            if not linked.is_file() or anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    assert broken == []


def test_packages_remove_says_what_it_removed_not_zero_added(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)  # a packages directory must be trusted: no pytest 0700 above it
    directory = handmade_dir(tmp_path)
    done = codecage("packages", "remove", "cc_added_pkg", "--packages-dir", str(directory))
    assert done.returncode == 0, done.stderr
    assert "- cc-added-pkg==1.2.3" in done.stderr
    assert f"1 removed; {directory} now holds no package you added" in done.stderr
    assert "added in" not in done.stderr


@pytest.mark.parametrize(
    ("given", "suggested"),
    [
        ("--ouput", "(Possible options: --out)"),
        ("--memory", "(Possible options: --memory-mb)"),
        ("--allow-hosts", "(Possible options: --allow-host)"),
        ("--host", None),
        ("--output-dir", None),
    ],
)
def test_an_unknown_option_suggests_only_close_ones(
    tmp_path: Path, given: str, suggested: str | None
) -> None:
    done = codecage("run", given, "x", "--code", "1", "--json", cwd=tmp_path)
    assert done.returncode == 2
    message = json.loads(done.stdout)["error"]["message"]
    assert message.startswith(f"No such option: {given}")
    if suggested is None:
        assert "Possible options" not in message, message
    else:
        assert message.endswith(suggested), message


def test_no_spinner_for_upstream_servers_when_none_are_configured(tmp_path: Path) -> None:
    shown = _on_a_terminal("run", "--code", "1", cwd=tmp_path)
    assert "codecage: ok" in shown, shown
    assert "upstream MCP servers" not in shown


def test_a_missing_data_package_names_the_data_extra(tmp_path: Path) -> None:
    """pandas is installed here (the tests need it): the code takes the packages off its
    own sys.path, so that the import fails as on a host without them, through the guest's
    real import hook."""
    hide = "import sys\nsys.path[:] = [p for p in sys.path if 'site-packages' not in p]\n"
    with Sandbox(pool=False, options=Options(import_policy=False)) as sandbox:
        pandas = sandbox.run(hide + "import pandas")
        other = sandbox.run(hide + "import tabulate")
    assert pandas.error is not None and pandas.error.type == "ModuleNotFoundError"
    assert "pip install 'codecage[data]'" in pandas.error.message
    assert "codecage packages add pandas" in pandas.error.message
    assert other.error is not None and "codecage[data]" not in other.error.message
    assert "codecage packages add tabulate" in other.error.message
