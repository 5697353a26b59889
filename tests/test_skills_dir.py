"""A skills directory: the operator's reusable functions, read-only at /skills and
importable as `skills.<module>` from agent code, through the library and the CLI."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests._cli import codecage

from codecage import Options, Sandbox
from codecage.errors import ConfigError

HELPERS = '''"""Reusable helpers for agent code."""

import statistics


def top(rows, key, n=2):
    """The n rows with the largest `key`."""
    return sorted(rows, key=lambda row: row[key], reverse=True)[:n]


def spread(values):
    return statistics.pstdev(values)
'''


@pytest.fixture(scope="module")
def skills(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("skills")
    (directory / "helpers.py").write_text(HELPERS, encoding="utf-8")
    (directory / "reports").mkdir()
    (directory / "reports" / "__init__.py").write_text("TITLE = 'weekly'\n", encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def sandbox(skills: Path) -> Iterator[Sandbox]:
    with Sandbox(
        pool=False, allowed_imports=["pathlib"], options=Options(skills_dir=skills, scrub=False)
    ) as box:
        yield box


def test_agent_code_imports_and_uses_a_skill(sandbox: Sandbox) -> None:
    code = """
from skills.helpers import spread, top
from skills.reports import TITLE
rows = [{"name": "a", "total": 3}, {"name": "b", "total": 9}, {"name": "c", "total": 5}]
[TITLE, [r["name"] for r in top(rows, "total")], spread([1, 1, 1])]
"""
    result = sandbox.run(code)
    assert result.status == "ok", result.error
    assert result.return_value == ["weekly", ["b", "c"], 0.0]


def test_the_skills_are_readable_at_slash_skills(sandbox: Sandbox) -> None:
    result = sandbox.run(
        "import pathlib\nsorted(p.name for p in pathlib.Path('/skills').iterdir())"
    )
    assert result.status == "ok", result.error
    assert result.return_value == ["helpers.py", "reports"]


@pytest.mark.parametrize(
    "path", ["/skills/helpers.py", "/skills/new.py", "/opt/codecage/skills/helpers.py"]
)
def test_the_code_cannot_change_a_skill(sandbox: Sandbox, skills: Path, path: str) -> None:
    result = sandbox.run(f"open({path!r}, 'a').write('import os; os.system(\"x\")')")
    assert result.status == "error"
    assert result.error is not None and result.error.type in ("OSError", "PermissionError")
    assert "os.system" not in (skills / "helpers.py").read_text(encoding="utf-8")
    assert not (skills / "new.py").exists()


def test_without_a_skills_dir_there_is_no_skills_package() -> None:
    with Sandbox(pool=False, options=Options(scrub=False)) as plain:
        result = plain.run("import skills.helpers")
    assert result.status == "error"
    assert result.error is not None and result.error.type == "ModuleNotFoundError"


def test_a_missing_skills_dir_is_a_clear_error(tmp_path: Path) -> None:
    with (
        Sandbox(pool=False, options=Options(skills_dir=tmp_path / "nope")) as box,
        pytest.raises(ConfigError, match="does not exist"),
    ):
        box.run("1")


def test_the_cli_mounts_the_skills_dir(skills: Path) -> None:
    code = "from skills.helpers import top\ntop([{'v': 1}, {'v': 2}], 'v', n=1)"
    run = codecage("run", "--json", "--skills-dir", str(skills), "-", stdin=code)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["return_value"] == [{"v": 2}]


def test_the_cli_refuses_a_missing_skills_dir(tmp_path: Path) -> None:
    run = codecage("run", "--skills-dir", str(tmp_path / "nope"), "-", stdin="1")
    assert run.returncode == 2
    assert "nope" in run.stderr
    assert "Traceback" not in run.stderr
