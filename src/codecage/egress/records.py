"""What one run's egress did: a record per connection attempt, kept within a bound.

The proxy appends from its loop thread and the lead reads from others, so the log takes a
lock. A run that makes thousands of attempts keeps the first `RECORD_LIMIT` and a count of
the rest, which `RecordLog.snapshot` folds into one summary record at the end.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

RECORD_LIMIT = 500


@dataclass(frozen=True, slots=True)
class ConnectionRecord:
    """One connection (or request) through the proxy, allowed or refused."""

    allowed: bool
    """The policy let it through (it may still have been cut off: see `reason`)."""
    host: str
    """The host the code asked for (as normalised); "" when the request could not be read."""
    port: int
    address: str | None
    """The IP address actually connected to (None: refused before, or not resolved)."""
    method: str
    """"CONNECT", "GET", ...; "" when the request could not be read."""
    status: int | None
    """The HTTP status the client got for plain HTTP and refusals; None for a tunnel."""
    bytes_out: int
    """Bytes sent to the server (what left the host)."""
    bytes_in: int
    """Bytes received from the server."""
    duration_ms: float
    reason: str | None = None
    """Why it was refused or cut off ("rate limit", "idle timeout", "byte limit", ...)."""


class RecordLog:
    """The bounded, thread-safe list of one run's records."""

    def __init__(self, limit: int = RECORD_LIMIT) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._records: list[ConnectionRecord] = []
        self._dropped_allowed = 0
        self._dropped_refused = 0
        self._dropped_out = 0
        self._dropped_in = 0

    def add(self, record: ConnectionRecord) -> None:
        with self._lock:
            if len(self._records) < self._limit:
                self._records.append(record)
                return
            if record.allowed:
                self._dropped_allowed += 1
            else:
                self._dropped_refused += 1
            self._dropped_out += record.bytes_out
            self._dropped_in += record.bytes_in

    def clear(self) -> None:
        with self._lock:
            self._records.clear()
            self._dropped_allowed = self._dropped_refused = 0
            self._dropped_out = self._dropped_in = 0

    def snapshot(self) -> list[ConnectionRecord]:
        """The records so far; past the bound, a last one counting those not kept."""
        with self._lock:
            records = list(self._records)
            dropped = self._dropped_allowed + self._dropped_refused
            if dropped:
                records.append(self._summary(dropped))
        return records

    def _summary(self, dropped: int) -> ConnectionRecord:
        return ConnectionRecord(
            allowed=False,
            host="",
            port=0,
            address=None,
            method="",
            status=None,
            bytes_out=self._dropped_out,
            bytes_in=self._dropped_in,
            duration_ms=0.0,
            reason=(
                f"{dropped} more connections not listed ({self._dropped_allowed} allowed, "
                f"{self._dropped_refused} refused)"
            ),
        )
