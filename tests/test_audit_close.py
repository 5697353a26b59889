"""A closed audit trail touches no descriptor again: its writer thread may outlive `close`
(a store that stays locked past `CLOSE_WAIT_S`), and the journal's fd number, once closed,
is soon another file's: in a host that opens stores again (a test run, an MCP server made
per test), SQLite's database file. The writer emptying "its journal" then (an
`ftruncate(fd, 0)` through the stale number) cut another store's database short: a
"database disk image is malformed" store whose header names more pages than the file has.
Real SQLite, a real trail, a real lock held by another connection; the only stand-in is the
victim file put on the freed fd number (`dup2`), which is where the kernel's lowest-free-fd
rule puts the next open anyway, made certain here."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests._finished import finished_run

from codecage import ExecutionResult, Options, Sandbox
from codecage.audit import AuditTrail
from codecage.audit import trail as trails
from codecage.audit.record import Caller, Finished
from codecage.models import AuditSettings

VICTIM = b"a database page that must stay\n" * 8


@pytest.fixture(scope="module")
def a_result() -> ExecutionResult:
    with Sandbox(pool=False, options=Options(audit=False)) as sandbox:
        return sandbox.run("print('hi')")


def finished(result: ExecutionResult) -> Finished:
    return finished_run(
        result, "print('hi')", caller=Caller("library", name="tester"), fresh_id=True
    )


@contextlib.contextmanager
def write_locked(db: Path) -> Iterator[sqlite3.Connection]:
    """Another process's write transaction on `db` (a connection of our own, same effect)."""
    conn = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    finally:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        conn.close()


def is_closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_a_writer_outliving_close_never_writes_through_the_closed_journal_fd(
    tmp_path: Path, a_result: ExecutionResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trails, "CLOSE_WAIT_S", 0.3)
    db = tmp_path / "audit.db"
    trail = AuditTrail.open(AuditSettings(store=str(db)), scrub=str)
    journal_fd = trail._journal._fd
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    put: list[int] = []

    def reuse_the_number_then_unlock(blocker: sqlite3.Connection) -> None:
        # Once close let go of the journal's fd: the next file opened takes its number;
        # then the store is free again and the writer's pending write goes through.
        deadline = time.monotonic() + 30
        while not is_closed(journal_fd) and time.monotonic() < deadline:
            time.sleep(0.001)
        fd = os.open(victim, os.O_RDWR | os.O_CLOEXEC)
        if fd != journal_fd:
            os.dup2(fd, journal_fd, inheritable=False)
            os.close(fd)
        put.append(journal_fd)
        blocker.execute("ROLLBACK")

    with write_locked(db) as blocker:
        trail.record(finished(a_result))  # the writer cannot write it: the store is locked
        helper = threading.Thread(target=reuse_the_number_then_unlock, args=(blocker,))
        helper.start()
        trail.close()  # gives up waiting: the writer is still at it
        helper.join(30)
    try:
        trail._writer.join(10)
        assert put == [journal_fd]
        assert victim.read_bytes() == VICTIM  # not emptied through the stale fd number
        # Nor does it spin on a closed store (it did, logging a failure each turn).
        assert not trail._writer.is_alive(), "the writer of a closed trail never ends"
    finally:
        if put:
            os.close(journal_fd)
