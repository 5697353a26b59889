"""`codecage audit` over a real store that real runs filled: list and its filters, show,
export as JSONL and CSV (parsed back), stats, and erasure that leaves no trace in the file."""

from __future__ import annotations

import csv
import io
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests._postgres import postgres_server, postgres_url

from codecage import Options, Sandbox
from codecage.audit import Erasure, journal, open_store
from test_server import CODECAGE, server_env

__all__ = ["postgres_server", "postgres_url"]  # fixtures, used by name

CANARY = "canary-7f3e1b"


@dataclass
class Filled:
    db: Path
    ok: str
    error: str
    refused: str


def cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CODECAGE, "audit", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=server_env(),
        timeout=120,
    )


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Filled]:
    db = tmp_path_factory.mktemp("audit") / "audit.db"
    with Sandbox(pool=False, profile="basic", options=Options(audit=db)) as sandbox:
        ok = sandbox.run(f"open('out.txt', 'w').write('{CANARY}')\nprint('fine')")
        error = sandbox.run("1 / 0")
        refused = sandbox.run("import socket")
    yield Filled(db, ok.execution_id, error.execution_id, refused.execution_id)


def listed(*args: str) -> list[dict[str, object]]:
    done = cli("list", "--json", *args)
    assert done.returncode == 0, done.stderr
    executions: list[dict[str, object]] = json.loads(done.stdout)["executions"]
    return executions


def test_list_shows_the_runs_newest_first_and_filters_them(filled: Filled) -> None:
    store = ("--store", str(filled.db))
    assert [e["execution_id"] for e in listed(*store)] == [filled.refused, filled.error, filled.ok]
    assert [e["execution_id"] for e in listed(*store, "--status", "ok")] == [filled.ok]
    assert [e["execution_id"] for e in listed(*store, "--event", "import_blocked")] == [
        filled.refused
    ]
    assert listed(*store, "--client", "nobody") == []
    assert listed(*store, "--since", "2000-01-01", "--limit", "1")[0]["execution_id"] == (
        filled.refused
    )
    human = cli("list", *store)
    assert human.returncode == 0 and filled.ok[:12] in human.stdout and "error" in human.stdout


def test_show_finds_a_run_by_a_prefix_of_its_id(filled: Filled) -> None:
    done = cli("show", filled.ok[:10], "--store", str(filled.db), "--json")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["execution_id"] == filled.ok
    assert record["files"][0]["path"] == "out.txt"
    short = cli("show", filled.ok[:4], "--store", str(filled.db))
    assert short.returncode == 2 and "first 8 characters" in short.stderr


def test_export_as_jsonl_and_csv_parses_back(filled: Filled, tmp_path: Path) -> None:
    jsonl = cli("export", "--format", "jsonl", "--store", str(filled.db))
    assert jsonl.returncode == 0, jsonl.stderr
    ids = [json.loads(line)["execution_id"] for line in jsonl.stdout.splitlines()]
    assert ids == [filled.ok, filled.error, filled.refused]  # oldest first
    out = tmp_path / "runs.csv"
    done = cli("export", "--format", "csv", "--out", str(out), "--store", str(filled.db))
    assert done.returncode == 0 and "exported 3 records" in done.stderr
    rows = list(csv.DictReader(io.StringIO(out.read_text(encoding="utf-8"))))
    assert [r["execution_id"] for r in rows] == ids
    assert rows[2]["event_kinds"] == "import_blocked" and rows[1]["error_type"] == (
        "ZeroDivisionError"
    )


def test_stats_counts_statuses_denials_and_clients(filled: Filled) -> None:
    done = cli("stats", "--since", "7d", "--store", str(filled.db), "--json")
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)
    assert stats["runs"] == 3
    assert stats["by_status"] == {"error": 2, "ok": 1}
    # The import policy runs in the guest: its refusal is the guest's claim, counted apart.
    assert stats["denials"]["import_blocked"] == 0
    assert stats["guest_claims"]["import_blocked"] == 1
    assert stats["top_clients"][0]["runs"] == 3 and stats["top_clients"][0]["failures"] == 2
    assert stats["wall"]["p50_ms"] is not None


def test_a_missing_store_is_named_not_made(tmp_path: Path) -> None:
    done = cli("list", "--store", str(tmp_path / "none.db"))
    assert done.returncode == 2 and "no audit store" in done.stderr
    assert not (tmp_path / "none.db").exists()


def test_erase_refuses_without_a_selector_or_a_confirmation(filled: Filled) -> None:
    nothing = cli("erase", "--store", str(filled.db))
    assert nothing.returncode == 2 and "--execution" in nothing.stderr
    unconfirmed = cli("erase", "--before", "2000-01-01", "--store", str(filled.db))
    assert unconfirmed.returncode == 2 and "--yes" in unconfirmed.stderr


def _file_bytes(db: Path) -> bytes:
    return b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*") if p.is_file())


def test_erasing_a_client_leaves_no_trace_of_it_in_the_files(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    with Sandbox(pool=False, options=Options(audit=db)) as sandbox:
        sandbox.run(f"print('{CANARY}')")
        sandbox.run(f"x = '{CANARY}'")
    assert CANARY.encode() in _file_bytes(db)
    caller = sandbox.caller.name
    done = cli("erase", "--client", caller, "--yes", "--store", str(db))
    assert done.returncode == 0, done.stderr
    assert "erased 2 records" in done.stdout
    assert CANARY.encode() not in _file_bytes(db)
    assert caller.encode() not in _file_bytes(db)


def test_the_journal_of_a_killed_process_shows_in_the_list(tmp_path: Path) -> None:
    """A host killed before its writer wrote: the commands put its journal in first."""
    db = tmp_path / "audit.db"
    with Sandbox(pool=False, options=Options(audit=db)) as sandbox:
        result = sandbox.run("print('journaled')")
    trail = open_store(db)
    record = trail.get(result.execution_id)
    assert record is not None
    trail.erase(Erasure(execution_id=record.execution_id))  # as if the writer never wrote it
    trail.close()
    pending = journal.directory_for(str(db))
    dead = _dead_pid()
    (pending / f"{dead}-00000000.jsonl").write_text(record.model_dump_json() + "\n")
    assert [e["execution_id"] for e in listed("--store", str(db))] == [result.execution_id]
    assert not list(pending.glob(f"{dead}-*"))


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_list_reads_a_postgresql_store(postgres_url: str) -> None:
    with Sandbox(pool=False, options=Options(audit=postgres_url)) as sandbox:
        result = sandbox.run("print('in postgres')")
    assert [e["execution_id"] for e in listed("--store", postgres_url)] == [result.execution_id]
