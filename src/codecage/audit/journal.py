"""The audit trail's journal: each record appended to a file of this process's before the
run's result returns, so a record is on disk however the process ends, while the store is
written on a thread of its own (`audit.trail`).

One file per process (`<pid>-<random>.jsonl`, 0600, in a 0700 directory beside the store:
`audit.db.pending/` for a SQLite file, the state directory's `audit-pending/<url hash>/`
for PostgreSQL), one JSON record per line, appended with one `write` on an O_APPEND
descriptor (the page cache has it once the call returns: a SIGKILL or an OOM kill loses
nothing; a power cut may). Emptied whenever the store has every record in it. `recover`
puts the records of the journals of dead processes into the store (a record already there
is left as it is) and deletes those journals: the next trail on the same store does it at
start, and the `codecage audit` commands before they read.

Which journals are a dead process's is decided by a lock, not a pid (a pid means nothing
in another PID namespace, where every process of this one looks dead): the writer holds an
exclusive `flock` on its journal for as long as it lives, taken before the journal can hold
a record (made, locked, kept only if still linked once locked), and `recover` takes a
journal only when it can take that lock itself, non-blocking, and holds it while it reads
and deletes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import secrets
import threading
from pathlib import Path

from pydantic import ValidationError

from codecage.audit.record import AuditRecord
from codecage.audit.store import AuditStore, default_location
from codecage.errors import AuditError
from codecage.fdio import lock_if_unheld

log = logging.getLogger(__name__)

SUFFIX = ".jsonl"


def directory_for(location: str) -> Path:
    """Where the journals of the store at `location` (its path or URL) live."""
    if location.startswith(("postgresql://", "postgres://")):
        digest = hashlib.sha256(location.encode()).hexdigest()[:16]
        return default_location().parent / "audit-pending" / digest
    path = Path(location)
    return path.with_name(path.name + ".pending")


class Journal:
    """This process's journal for one store."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.path, self._fd = _make_locked(directory)
        except OSError as exc:
            raise AuditError(
                f"the audit journal in {directory} cannot be made: {exc.strerror or exc}",
                hint="point {audit} (or [audit] store, CODECAGE_AUDIT) at a writable place, "
                "or turn the trail off: {audit=off}",
            ) from exc

    def append(self, record: AuditRecord) -> None:
        """Put `record` on disk (one write).

        Raises:
            AuditError: it could not be written (a full disk): the caller keeps it.
        """
        line = record.model_dump_json().encode() + b"\n"
        with self._lock:
            self.append_locked(line)

    def append_locked(self, line: bytes) -> None:
        """`append` of a serialised record; the caller holds `lock`."""
        if self._fd < 0:
            raise AuditError(f"the audit journal {self.path} is closed")
        try:
            written = os.write(self._fd, line)
        except OSError as exc:
            raise AuditError(f"the audit journal {self.path}: {exc.strerror}") from exc
        if written != len(line):  # a full disk part-way: leave no half line behind
            self._cut_back(written)
            raise AuditError(f"the audit journal {self.path}: the disk is full")

    def _cut_back(self, written: int) -> None:
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, os.fstat(self._fd).st_size - written)

    @property
    def lock(self) -> threading.Lock:
        """Held while appending (and by the caller while it hands the record on): hold it
        to know that no record is in the journal and not yet handed on."""
        return self._lock

    def empty_locked(self) -> None:
        """Forget every record (the store has them all); the caller holds `lock`. Nothing
        once closed: the fd's number may be another file's by then (a store's database)."""
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)

    def close(self, *, remove: bool) -> None:
        """Close the fd (once: a second close would close whatever file has its number by
        then) and forget its number, so no later append or empty writes through it."""
        with self._lock:
            if self._fd < 0:
                return
            fd, self._fd = self._fd, -1
            os.close(fd)
            if remove:
                with contextlib.suppress(OSError):
                    self.path.unlink()


def _make_locked(directory: Path) -> tuple[Path, int]:
    """A new journal in `directory` and its fd, holding its lock (see the module docstring).

    Raises:
        OSError: it cannot be made, or its lock was taken away every time.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
    for _ in range(8):
        path = directory / f"{os.getpid()}-{secrets.token_hex(8)}{SUFFIX}"
        fd = os.open(path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_nlink > 0:
                return path, fd
        except OSError:
            pass  # a recovery took the fresh (empty) journal first: make another
        os.close(fd)
    raise OSError(0, "its lock was taken by another process every time")


def recover(store: AuditStore, directory: Path) -> int:
    """Write the records of dead processes' journals in `directory` into `store` (records
    already there are kept as they are), then delete those journals. Returns how many
    records were in them. A line that is not a whole record (the process died while
    writing it) is skipped and logged.

    Raises:
        AuditError: the store cannot be written (the journals stay for the next try).
    """
    total = 0
    for journal in _journals(directory):
        fd = _lock_if_dead(journal)
        if fd is None:
            continue
        try:
            records = _read(journal)
            if records:
                store.write(records)
            journal.unlink(missing_ok=True)
        finally:
            os.close(fd)
        total += len(records)
    if total:
        log.warning("audit.journal_recovered", extra={"records": total, "dir": str(directory)})
    return total


def _journals(directory: Path) -> list[Path]:
    try:
        entries = sorted(directory.iterdir())
    except OSError:
        return []
    return [entry for entry in entries if entry.name.endswith(SUFFIX)]


def _lock_if_dead(journal: Path) -> int | None:
    """An fd of `journal` holding its lock (its writer is gone), or None: its writer
    lives, or it was recovered meanwhile."""
    try:
        fd = os.open(journal, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    return lock_if_unheld(fd)


def _read(journal: Path) -> list[AuditRecord]:
    records = []
    try:
        text = journal.read_bytes()
    except OSError:
        return []
    for line in text.splitlines():
        try:
            records.append(AuditRecord.model_validate_json(line))
        except ValidationError:
            log.error("audit.journal_line_skipped", extra={"journal": str(journal)})
    return records
