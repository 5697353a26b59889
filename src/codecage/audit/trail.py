"""The audit trail of one host process: every finished run written to the store before its
result goes back, retention applied, and a failing store reported, never ignored.

`AuditTrail.record` runs on the caller's thread after the run, once per result: building the
record and one SQLite commit (WAL, no fsync) cost well under a millisecond
(benchmarks/bench_audit.py), and writing before the result is returned is what makes "a run
whose result was returned is on record" hold through a crash of this process. When the store
fails (a full disk, a locked or read-only file, a server that is down) the record is kept in
a bounded backlog, retried with the next write, and the failure is logged as an error each
time; with `[audit] required = true`, `check` then refuses new runs until a write succeeds.
"""

from __future__ import annotations

import collections
import datetime
import logging
import threading
import time
from collections.abc import Callable

from codecage.audit.record import AuditRecord, Finished, record_of
from codecage.audit.store import AuditStore, open_store
from codecage.errors import AuditError
from codecage.models import AuditSettings

log = logging.getLogger(__name__)

BACKLOG_MAX = 10_000
"""Records kept in memory while the store fails; past this the oldest are lost (and the
loss is logged as an error with its count)."""
PRUNE_EVERY_S = 3600.0


class AuditTrail:
    """The store and the rules of `[audit]`, for one host process."""

    def __init__(
        self, store: AuditStore, settings: AuditSettings, scrub: Callable[[str], str]
    ) -> None:
        self.store = store
        self.settings = settings
        self._scrub = scrub
        self._lock = threading.Lock()
        self._backlog: collections.deque[AuditRecord] = collections.deque()
        self._lost = 0
        self._failure: str | None = None  # the last write's error, while the store fails
        self._pruned_at = 0.0
        self._pruning = threading.Lock()

    @classmethod
    def open(cls, settings: AuditSettings, scrub: Callable[[str], str]) -> AuditTrail:
        """The trail at `settings.store` (None: the default SQLite file).

        Raises:
            AuditError: the store cannot be opened.
            ConfigError: it is of a newer schema, or the location is not usable.
        """
        trail = cls(open_store(settings.store), settings, scrub)
        trail.prune_when_due()
        return trail

    @property
    def failure(self) -> str | None:
        """Why the store could not be written last time; None while it works."""
        return self._failure

    def check(self) -> None:
        """Before a run: with `required`, refuse it while the store fails (a retry of the
        backlog first: the disk may have room again).

        Raises:
            AuditError: the store fails and the operator required the audit trail.
        """
        if not self.settings.required or self._failure is None:
            return
        self._flush([])
        if self._failure is not None:
            raise AuditError(
                f"runs are refused: the audit trail is required and its store "
                f"{self.store.location} cannot be written ({self._failure})",
                hint="free space or fix the store; the operator set [audit] required = true",
            )

    def record(self, finished: Finished) -> None:
        """Put one finished run on record (with any backlog before it)."""
        record = record_of(
            finished,
            keep_code=self.settings.keep_code,
            max_code_bytes=self.settings.max_code_bytes,
            scrub=self._scrub,
        )
        self._flush([record])
        self.prune_when_due()

    def _flush(self, records: list[AuditRecord]) -> None:
        with self._lock:
            batch = [*self._backlog, *records]
            if not batch:
                return
            try:
                self.store.write(batch)
            except AuditError as exc:
                self._keep(records, str(exc))
                return
            self._backlog.clear()
            if self._failure is not None:
                log.warning("audit.store_recovered", extra={"written": len(batch)})
            self._failure = None

    def _keep(self, records: list[AuditRecord], reason: str) -> None:
        self._failure = reason
        self._backlog.extend(records)
        while len(self._backlog) > BACKLOG_MAX:
            self._backlog.popleft()
            self._lost += 1
        log.error(
            "audit.write_failed",
            extra={
                "store": self.store.location,
                "error": reason,
                "waiting": len(self._backlog),
                "lost": self._lost,
            },
        )

    def prune_when_due(self) -> None:
        """Apply retention at most once per `PRUNE_EVERY_S`, on a thread of its own."""
        now = time.monotonic()
        if self._pruned_at and now - self._pruned_at < PRUNE_EVERY_S:
            return
        if not self._pruning.acquire(blocking=False):
            return
        self._pruned_at = now
        threading.Thread(target=self._prune, name="codecage-audit-prune", daemon=True).start()

    def _prune(self) -> None:
        try:
            days = self.settings.retention_days
            older = (
                datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=days)
                if days is not None
                else None
            )
            max_bytes = self.settings.max_mb * 1024 * 1024 if self.settings.max_mb else None
            removed = self.store.prune(older_than=older, max_bytes=max_bytes)
            if removed:
                log.info("audit.pruned", extra={"removed": removed})
        except AuditError as exc:
            log.error("audit.prune_failed", extra={"error": str(exc)})
        finally:
            self._pruning.release()

    def close(self) -> None:
        """Write what is waiting (once more), then close the store."""
        self._flush([])
        if self._backlog:
            log.error("audit.unwritten_at_close", extra={"records": len(self._backlog)})
        with self._pruning:  # a prune in progress finishes first
            self.store.close()
