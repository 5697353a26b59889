"""Batches (`codecage.batch`, `Sandbox.run_many` / `arun_many`, `codecage run-batch`): real
sandboxes, results in input order, per-item limits, nothing run twice, refusals before
anything runs, and the CLI end to end."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sqlite3
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from _cli import codecage
from codecage import ConfigError, ExecutionResult, Limits, Options, Sandbox, SandboxError
from codecage.batch import BatchResult, Program, run_many
from codecage.cli import batch as batch_cli

SLEEPY = "import time; time.sleep({s}); {i}"


@pytest.fixture
def audited(tmp_path: Path) -> Iterator[tuple[Sandbox, Path]]:
    """A Sandbox whose every run is recorded in a real SQLite audit trail: the record
    counts the runs that happened, independently of what `run_many` returns."""
    db = tmp_path / "audit.db"
    with Sandbox(
        pool=False, options=Options(import_policy=False, scrub=False, audit=db)
    ) as sandbox:
        yield sandbox, db


def runs_recorded(db: Path) -> list[tuple[str, str]]:
    if not db.exists():
        return []
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute("SELECT code, status FROM executions").fetchall()


def test_results_come_back_in_input_order_whatever_order_they_finish_in(
    sandbox: Sandbox,
) -> None:
    # The first program sleeps longest: under concurrency it finishes last.
    sleeps = [1.5, 0.6, 0.0, 0.0]
    programs = [{"code": SLEEPY.format(s=s, i=i), "id": f"p{i}"} for i, s in enumerate(sleeps)]
    seen: list[tuple[int, int, int]] = []
    results = sandbox.run_many(
        programs, concurrency=4, on_progress=lambda d, t, r: seen.append((d, t, r.index))
    )
    assert [r.index for r in results] == [0, 1, 2, 3]
    assert [r.id for r in results] == ["p0", "p1", "p2", "p3"]
    assert [r.result.return_value for r in results if r.result] == [0, 1, 2, 3]
    assert [d for d, _, _ in seen] == [1, 2, 3, 4] and {t for _, t, _ in seen} == {4}
    finished = [i for _, _, i in seen]
    assert sorted(finished) == [0, 1, 2, 3]  # each reported once
    assert finished[-1] == 0  # they ran at once: the order of the results is run_many's doing


def test_an_items_limits_apply_to_it_alone(sandbox: Sandbox) -> None:
    results = sandbox.run_many(
        [
            "1",
            Program(code="import time; time.sleep(30)", id="slow", limits={"timeout": 0.5}),
            {"code": "3", "limits": {"memory_mb": 128}},
        ],
        concurrency=3,
    )
    statuses = [r.status for r in results]
    assert statuses == ["ok", "timeout", "ok"]
    limits = [r.result.limits for r in results if r.result]
    assert limits[0] == sandbox.limits
    assert limits[1].timeout == 0.5 and limits[1].memory_mb == sandbox.limits.memory_mb
    assert limits[2].memory_mb == 128 and limits[2].timeout == sandbox.limits.timeout


def test_a_program_that_kills_its_sandbox_is_reported_once_and_never_run_again(
    audited: tuple[Sandbox, Path],
) -> None:
    sandbox, db = audited
    crash = "import os; os.kill(os.getpid(), 9)"
    results = sandbox.run_many(["1", crash, "3"], concurrency=2)
    sandbox.close()  # the audit trail is written through
    assert [r.status for r in results] == ["ok", "killed", "ok"]
    assert results[1].result is not None and results[1].result.signal == "SIGKILL"
    recorded = runs_recorded(db)
    assert sorted(code for code, _ in recorded) == sorted(["1", crash, "3"])  # once each
    assert (crash, "killed") in recorded


def test_a_run_refused_at_run_time_is_that_items_error_and_the_others_run(
    audited: tuple[Sandbox, Path],
) -> None:
    sandbox, db = audited
    # A file and a directory of the same name: found only when the workspace is written.
    clash = {"code": "1", "id": "clash", "files": {"a": "x", "a/b": "y"}}
    progress: list[int] = []
    results = sandbox.run_many(
        ["'before'", clash, "'after'"], on_progress=lambda d, t, r: progress.append(r.index)
    )
    sandbox.close()
    assert [r.status for r in results] == ["ok", "failed", "ok"]
    error = results[1].error
    assert error is not None and error.type == "ConfigError" and "a/b" in error.message
    assert error.code == "refused"  # the item's fault: a pipeline fixes it, not retries it
    assert results[1].id == "clash" and results[1].result is None
    assert sorted(progress) == [0, 1, 2]
    assert sorted(code for code, _ in runs_recorded(db)) == ["'after'", "'before'"]


class _FailingSandbox:
    """A stand-in whose `run` raises SandboxError for one program and counts every call.

    Why not a real sandbox: the host judges whatever the code does (a guest that kills
    itself is "killed", see the test above), so no program can make codecage itself fail
    on demand; this checks what run_many does when it does fail: report, never retry."""

    def __init__(self) -> None:
        self.limits = Limits()
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def run(
        self,
        code: str,
        *,
        limits: Limits,
        filename: str,
        files: Mapping[str, bytes | str] | None,
        cancel: threading.Event | None,
    ) -> ExecutionResult:
        with self._lock:
            self.calls.append(code)
        if code == "fail":
            raise SandboxError("the sandbox failed to start: test", hint="run doctor")
        with Sandbox(pool=False, options=Options(import_policy=False)) as real:
            return real.run(code, limits=limits)


def test_a_sandbox_failure_is_reported_as_the_items_error_and_not_retried() -> None:
    stand_in = _FailingSandbox()
    results = run_many(stand_in, ["1", "fail", "2"], concurrency=2)
    assert sorted(stand_in.calls) == ["1", "2", "fail"]  # each once
    assert [r.status for r in results] == ["ok", "failed", "ok"]
    assert results[1].error is not None
    assert results[1].error.type == "SandboxError" and results[1].error.hint == "run doctor"
    assert results[1].error.code == "sandbox_error"  # not the program's fault: run it again


def test_a_batch_over_max_queued_is_refused_before_anything_runs(
    audited: tuple[Sandbox, Path],
) -> None:
    sandbox, db = audited
    with pytest.raises(ConfigError, match=r"more than max_queued=3") as caught:
        sandbox.run_many(["1", "2", "3", "4"], max_queued=3)
    assert "max_queued" in caught.value.hint
    # An endless generator is refused too, without being drained.
    with pytest.raises(ConfigError, match="max_queued=5"):
        sandbox.run_many((str(i) for i in itertools.count()), max_queued=5)
    sandbox.close()
    assert runs_recorded(db) == []


def test_an_item_with_bad_limits_refuses_the_batch_naming_it(
    audited: tuple[Sandbox, Path],
) -> None:
    sandbox, db = audited
    programs: list[object] = ["1", {"code": "2", "id": "big", "limits": {"memory_mb": 1}}]
    with pytest.raises(ConfigError, match=r"programs\[1\] \(id 'big'\).*memory_mb"):
        sandbox.run_many(programs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"programs\[0\].*no_such_limit"):
        sandbox.run_many([{"code": "1", "limits": {"no_such_limit": 1}}])
    with pytest.raises(ConfigError, match=r"programs\[0\].*cod"):
        sandbox.run_many([{"cod": "1"}])
    with pytest.raises(ConfigError, match="concurrency=0"):
        sandbox.run_many(["1"], concurrency=0)
    with pytest.raises(ConfigError, match="not a list of programs"):
        sandbox.run_many("1")
    sandbox.close()
    assert runs_recorded(db) == []


def test_arun_many_returns_results_in_order(sandbox: Sandbox) -> None:
    async def main() -> list[BatchResult]:
        return await sandbox.arun_many([SLEEPY.format(s=0.5, i=0), "1"], concurrency=2)

    results = asyncio.run(main())
    assert [r.result.return_value for r in results if r.result] == [0, 1]


# --- codecage run-batch ----------------------------------------------------------------


def test_run_batch_writes_one_line_per_program_in_order_and_a_summary(tmp_path: Path) -> None:
    lines = [
        {"id": "slow", "code": SLEEPY.format(s=1, i=0)},
        {"id": 7, "code": "print('hi')"},
        {"id": "tiny", "code": "import time; time.sleep(30)", "limits": {"timeout": 0.5}},
        {"id": "clash", "code": "1", "files": {"a": "x", "a/b": "y"}},
        {"id": "killer", "code": "import os; os.kill(os.getpid(), 9)"},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines[:2]) + "\n\n" + "\n".join(
        json.dumps(line) for line in lines[2:]
    ) + "\n", encoding="utf-8")  # fmt: skip
    out = tmp_path / "out.jsonl"
    proc = codecage(
        "run-batch", "--jsonl", str(source), "--out", str(out), "-j", "3",
        "--timeout", "20", "--no-import-policy", "--json",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr  # "clash" could not run
    assert proc.stdout == ""
    written = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [w["id"] for w in written] == ["slow", 7, "tiny", "clash", "killer"]
    assert [w["index"] for w in written] == [0, 1, 2, 3, 4]
    assert written[0]["result"]["return_value"] == 0
    assert written[1]["result"]["stdout"] == "hi\n"
    assert written[1]["result"]["limits"]["timeout"] == 20  # the flag, for every program
    assert written[2]["result"]["status"] == "timeout"
    assert written[2]["result"]["limits"]["timeout"] == 0.5  # the line's own, over the flag
    assert written[3]["result"] is None and written[3]["error"]["type"] == "ConfigError"
    assert written[4]["result"]["status"] == "killed"
    summary = json.loads(proc.stderr.strip().splitlines()[-1])
    assert summary["programs"] == 5 and summary["failed"] == 1
    assert summary["statuses"] == {"failed": 1, "killed": 1, "ok": 2, "timeout": 1}
    assert summary["runs_per_s"] > 0


def test_run_batch_from_stdin_to_stdout_exits_0_when_every_program_ran() -> None:
    stdin = '{"id": "a", "code": "1 + 1"}\n{"id": "b", "code": "1 / 0"}\n'
    proc = codecage("run-batch", "--jsonl", "-", stdin=stdin)
    assert proc.returncode == 0, proc.stderr
    written = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(w["id"], w["result"]["status"]) for w in written] == [("a", "ok"), ("b", "error")]
    assert "2 programs in" in proc.stderr and "error 1, ok 1" in proc.stderr


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "is a JSON list, not an object"),
        ('{"code": 1}', "is not a program: code=1"),
        ('{"code": "1", "extra": 2}', "extra"),
        ('{"code": "1", "limits": {"timeout": -1}}', "invalid limits: timeout"),
    ],
)
def test_run_batch_refuses_a_bad_line_by_its_number_and_runs_nothing(
    tmp_path: Path, line: str, said: str
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"code": "1"}\n\n' + line + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    proc = codecage("run-batch", "--jsonl", str(source), "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert "line 3" in proc.stderr and said in proc.stderr
    assert not out.exists()  # nothing ran, nothing written


def test_run_batch_bounds_the_line_size_and_the_number_of_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"code": "1"}\n{"code": "' + "x" * 100 + '"}\n', encoding="utf-8")
    monkeypatch.setattr(batch_cli, "MAX_LINE_BYTES", 64)
    with pytest.raises(ConfigError, match="line 2 is longer than"):
        batch_cli.read_programs(str(source), {})
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="more than 1 programs"):
        batch_cli.read_programs(str(source), {}, max_programs=1)
    programs, numbers = batch_cli.read_programs(str(source), {"timeout": 3})
    assert numbers == [1, 2] and programs[0].limits == {"timeout": 3}


def test_run_batch_help_teaches_by_example() -> None:
    proc = codecage("run-batch", "--help")
    assert proc.returncode == 0
    assert "codecage run-batch --jsonl tasks.jsonl --out results.jsonl -j 4" in proc.stdout
