"""The audit trail of one host process: every finished run on disk before its result goes
back, the store written off the run's path, retention applied, a failing store reported.

`AuditTrail.record` runs on the caller's thread after the run: it builds the record (the
code scrubbed) and appends it to this process's journal (`audit.journal`: one write, on disk
in the page cache when it returns, so a run whose result came back is on record even if the
process is killed next). A writer thread then puts the records into the store in batches and
empties the journal when it has them all. What this costs a run is measured by
benchmarks/bench_audit.py.

When the store fails (a full disk, a locked or read-only file, a server that is down) the
writer keeps the records (in memory and in the journal), logs the failure as an error, and
retries every `RETRY_S`; with `[audit] required = true`, `check` refuses new runs until a
write succeeds.

`[audit] max_mb` holds at write time: the store writes only the records that keep what
they take (`AuditStore.used_bytes`) within it (`AuditStore.write(max_bytes=)`). A full store
refuses the rest, and keeps what it has (a flood of runs cannot push the oldest records,
the evidence, out; `retention_days` ages them out, `codecage audit erase` frees space now).
It says so: a warning in the log (`audit.store_full`), `full` (for /readyz) and the
`on_full` callbacks (the alerter's `audit_full`). With `required`, the records wait and new
runs are refused until there is room; without it, runs go on and the refused records are
dropped and counted (`dropped`).

When the journal cannot be written either, the record stays in memory only, the error says
so, and `required` refuses the next run. At open, the journals of dead
processes on the same store are put into it (`journal.recover`).
"""

from __future__ import annotations

import collections
import datetime
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from codecage import forks
from codecage.audit import journal as journals
from codecage.audit.record import AuditRecord, Finished, RecordedEvent, bounded_events, record_of
from codecage.audit.store import AuditStore, open_store
from codecage.errors import AuditError
from codecage.models import AuditSettings

log = logging.getLogger(__name__)

BACKLOG_MAX = 10_000
"""Records kept in memory while the store fails; past this the oldest are dropped from
memory (they stay in the journal, for the next start's recovery)."""
BATCH_MAX = 500
RETRY_S = 1.0
PRUNE_EVERY_S = 3600.0
CLOSE_WAIT_S = 10.0
CHECK_WAIT_S = 2.0
"""How long a run waits, while a required trail fails, for the writer's retry."""


@dataclass(frozen=True, slots=True)
class StoreFull:
    """The store reached `[audit] max_mb`: what its records take, and its bound."""

    used_bytes: int
    max_bytes: int

    @property
    def reason(self) -> str:
        return (
            f"the audit store is full: its records take {self.used_bytes / 2**20:.2f} MiB "
            f"of its max_mb {self.max_bytes / 2**20:g} MiB"
        )


@dataclass(frozen=True, slots=True)
class _Note:
    execution_id: str
    events: list[RecordedEvent]


class AuditTrail:
    """The store, its journal and the rules of `[audit]`, for one host process."""

    def __init__(
        self, store: AuditStore, settings: AuditSettings, scrub: Callable[[str], str]
    ) -> None:
        self.store = store
        self.settings = settings
        self._scrub = scrub
        self._journal = journals.Journal(journals.directory_for(store.location))
        self._cond = threading.Condition()
        self._waiting: collections.deque[AuditRecord | _Note] = collections.deque()
        self._writing = 0  # records the writer took and has not finished with
        self._unjournaled = False  # a record is in memory only (the journal failed)
        self._failure: str | None = None  # why the store (or journal) failed, while it does
        self._closing = False
        self._closed = False
        self._pruned_at = 0.0
        self._full: StoreFull | None = None
        self._dropped = 0  # records refused by a full store and not kept (not required)
        self.on_full: list[Callable[[StoreFull], None]] = []
        """Told once each time the store becomes full (the alerter's `audit_full`)."""
        self._writer = threading.Thread(target=self._write_loop, name="codecage-audit", daemon=True)
        self._writer.start()
        forks.close_at_exit(self)  # the last records written, the journal removed
        self._measure_at_open()

    def _measure_at_open(self) -> None:
        """Full already? Then say so from the first run on (a required trail refuses it)."""
        max_mb = self.settings.max_mb
        if max_mb is None:
            return
        used = self.store.used_bytes()
        if used >= max_mb * 1024 * 1024:
            full = self._now_full(used, max_mb * 1024 * 1024)
            if self.settings.required:
                self._failure = full.reason

    @classmethod
    def open(cls, settings: AuditSettings, scrub: Callable[[str], str]) -> AuditTrail:
        """The trail at `settings.store` (None: the default SQLite file), with what dead
        processes left in their journals put into it.

        Raises:
            AuditError: the store or its journal cannot be opened.
            ConfigError: it is of a newer schema, or the location is not usable.
        """
        store = open_store(settings.store)
        try:
            journals.recover(store, journals.directory_for(store.location))
            return cls(store, settings, scrub)
        except BaseException:
            store.close()
            raise

    @property
    def failure(self) -> str | None:
        """Why the store could not be written last time; None while it works."""
        return self._failure

    @property
    def full(self) -> StoreFull | None:
        """The store is full (`[audit] max_mb`), and how; None while it has room."""
        return self._full

    @property
    def dropped(self) -> int:
        """Records a full store refused and the trail did not keep (not required), since
        this process started."""
        return self._dropped

    def check(self) -> None:
        """Before a run: with `required`, refuse it while records cannot be written (after
        one more try, waited for up to `CHECK_WAIT_S`).

        Raises:
            AuditError: the trail fails and the operator required it.
        """
        if not self.settings.required or self._failure is None:
            return
        if self._full is not None:
            self._measure_room()  # an erase or the retention may have made room
        with self._cond:
            self._cond.notify_all()  # the writer tries again now: there may be room again
        self.flush(0.0 if self._full is not None else CHECK_WAIT_S)
        if self._failure is None:
            return
        if self._full is not None:
            raise AuditError(
                f"runs are refused: the audit trail is required and {self._full.reason}",
                hint="free space: `codecage audit erase --before DATE`, a shorter "
                "[audit] retention_days, or a larger [audit] max_mb",
            )
        raise AuditError(
            f"runs are refused: the audit trail is required and its store "
            f"{self.store.location} cannot be written ({self._failure})",
            hint="free space or fix the store; the operator set [audit] required = true",
        )

    def record(self, finished: Finished) -> None:
        """Put one finished run on record: in the journal now, in the store soon."""
        record = record_of(
            finished,
            keep_code=self.settings.keep_code,
            max_code_bytes=self.settings.max_code_bytes,
            scrub=self._scrub,
        )
        line = record.model_dump_json().encode() + b"\n"
        # Lock order: the journal's, then the writer's condition (`_all_written` too).
        with self._journal.lock:
            try:
                self._journal.append_locked(line)
            except AuditError as exc:
                self._unjournaled = True
                self._failed(str(exc))
            with self._cond:
                self._waiting.append(record)
                while len(self._waiting) > BACKLOG_MAX:
                    self._waiting.popleft()  # still in the journal (or logged as lost)
                    if self._unjournaled:
                        log.error("audit.record_lost", extra={"store": self.store.location})
                self._cond.notify()

    def note(self, execution_id: str, events: list[RecordedEvent]) -> None:
        """Add `events` to a record written (or waiting) already: what a face learnt after
        the run (the MCP reply trimmed). Written after the record; not journaled (a note
        lost to a crash loses no run)."""
        if not events:
            return
        with self._cond:
            self._waiting.append(_Note(execution_id, bounded_events(events)))
            self._cond.notify()

    def flush(self, timeout: float = CLOSE_WAIT_S) -> bool:
        """Wait until the store has every record so far; False on timeout (it fails)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._waiting or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    # --- the writer thread -------------------------------------------------------------------

    def _write_loop(self) -> None:
        self._prune()
        while True:
            with self._cond:
                while not self._waiting and not self._closing:
                    self._cond.wait(PRUNE_EVERY_S)
                    if not self._waiting and not self._closing:
                        break  # an hour idle: prune below
                if self._closing and not self._waiting:
                    return
                batch = [self._waiting.popleft() for _ in range(min(BATCH_MAX, len(self._waiting)))]
                self._writing = len(batch)
            written = self._write(batch)
            with self._cond:
                self._writing = 0
                if not written:
                    self._waiting.extendleft(reversed(batch))
            if written:
                self._all_written()
            with self._cond:
                self._cond.notify_all()
            waiting_for_room = self._full is not None and self.settings.required
            if self._closing and (waiting_for_room or not written):
                # What is not written stays in the journal, for the next start: retrying
                # without a pause (closing) spun on a failing store, after close too.
                return
            if not written or waiting_for_room:
                self._pause()  # a failing store, or records waiting for room
            if time.monotonic() - self._pruned_at >= PRUNE_EVERY_S:
                self._prune()

    def _write(self, batch: list[AuditRecord | _Note]) -> bool:
        if not batch:
            return True
        try:
            records = [r for r in batch if isinstance(r, AuditRecord)]
            _, refused = self._room_for(records)
            for note in batch:
                if isinstance(note, _Note):
                    self.store.add_events(note.execution_id, note.events)
            if refused and self._full is not None:
                return self._refused(refused, self._full)
        except AuditError as exc:
            self._failed(str(exc))
            return False
        except Exception as exc:  # a store's bug must not kill the writer: keep the records
            log.exception("audit.store_crashed")
            self._failed(f"{type(exc).__name__}: {exc}")
            return False
        waiting_for_room = self._full is not None and self.settings.required
        if self._failure is not None and not self._unjournaled and not waiting_for_room:
            log.warning("audit.store_recovered", extra={"store": self.store.location})
            self._failure = None
        return True

    def _all_written(self) -> None:
        """When the store has every record, empty the journal. Under the journal's lock, a
        record is either not appended yet or already waiting: none is lost between."""
        with self._journal.lock, self._cond:
            if self._waiting or self._writing:
                return
            self._journal.empty_locked()
            if self._unjournaled:
                self._unjournaled = False
                self._failure = None

    # --- max_mb, at write time ------------------------------------------------------------

    def _room_for(self, records: list[AuditRecord]) -> tuple[int, list[AuditRecord]]:
        """Write `records` within `max_mb` (the store holds the bound as it writes); how
        many went in, and those a full store refused. Raises AuditError as the store does."""
        max_mb = self.settings.max_mb
        limit = max_mb * 1024 * 1024 if max_mb is not None else None
        written = self.store.write(records, max_bytes=limit)
        if written == len(records) or limit is None:
            if records:
                self._room()
            return written, []
        self._now_full(self.store.used_bytes(), limit)
        return written, records[written:]

    def _measure_room(self) -> None:
        """Measure the store now (not on the writer's thread): room again clears `full`."""
        max_mb = self.settings.max_mb
        try:
            used = self.store.used_bytes()
        except AuditError:
            return
        if max_mb is None or used < max_mb * 1024 * 1024:
            self._room()

    def _now_full(self, used: int, limit: int) -> StoreFull:
        was = self._full
        full = self._full = StoreFull(used, limit)
        if was is not None:
            return full
        log.warning(
            "audit.store_full",
            extra={"store": self.store.location, "used_bytes": used, "max_bytes": limit},
        )
        for told in self.on_full:
            try:
                told(self._full)
            except Exception:  # telling must not stop the writer
                log.exception("audit.on_full_failed")
        return full

    def _room(self) -> None:
        if self._full is not None:
            log.warning(
                "audit.store_has_room",
                extra={"store": self.store.location, "dropped": self._dropped},
            )
            self._full = None
            if self._failure is not None and self._failure.startswith("the audit store is full"):
                self._failure = None

    def _refused(self, refused: list[AuditRecord], full: StoreFull) -> bool:
        """A full store refused `refused` (the others of the batch are written). Required:
        they wait, and runs are refused. Else: they are dropped, and counted."""
        if self.settings.required:
            with self._cond:
                self._waiting.extendleft(reversed(refused))
            self._failure = full.reason
            return True
        self._dropped += len(refused)
        log.warning(
            "audit.records_dropped",
            extra={"store": self.store.location, "dropped": len(refused), "total": self._dropped},
        )
        return True

    def _failed(self, reason: str) -> None:
        self._failure = reason
        log.error(
            "audit.write_failed",
            extra={"store": self.store.location, "error": reason, "waiting": len(self._waiting)},
        )

    def _pause(self) -> None:
        with self._cond:
            if not self._closing:
                self._cond.wait(RETRY_S)

    def _prune(self) -> None:
        self._pruned_at = time.monotonic()
        days = self.settings.retention_days
        older = (
            datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=days)
            if days is not None
            else None
        )
        try:
            # By age only: max_mb is held at write time, by refusing (see the docstring).
            removed = self.store.prune(older_than=older, max_bytes=None)
        except AuditError as exc:
            log.error("audit.prune_failed", extra={"error": str(exc)})
            return
        if removed:
            log.info("audit.pruned", extra={"removed": removed})

    def close(self) -> None:
        """Write what is waiting (for up to `CLOSE_WAIT_S`), then close the store. What
        could not be written stays in the journal, for the next start. Idempotent."""
        with self._cond:
            if self._closed:
                return  # a second close (atexit after the owner's) must not close twice
            self._closed = True
        waiting_for_room = self._full is not None and self.settings.required
        written = self.flush(0.0 if waiting_for_room else CLOSE_WAIT_S)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._writer.join(CLOSE_WAIT_S)
        if self._writer.is_alive():
            # A write still under way (a store locked this long): it ends on its own; the
            # journal closed below is no fd of its any more (`Journal.close`), and the
            # store's close waits for that write.
            log.error("audit.writer_busy_at_close", extra={"store": self.store.location})
        if not written:
            log.error(
                "audit.unwritten_at_close",
                extra={"records": len(self._waiting), "journal": str(self._journal.path)},
            )
        self._journal.close(remove=written and not self._unjournaled)
        self.store.close()
