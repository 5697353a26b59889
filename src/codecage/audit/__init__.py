"""The audit trail: one record per execution, kept in SQLite (default) or PostgreSQL.

`record` (what one execution leaves on record, and who asked: `Caller`), `schema` (the
tables, shared by every store, and their migrations), `store` (the store interface,
choosing one, rows to records), `sqlite` and `postgres` (the stores), `trail` (writing
each finished run before its result returns, retention, a failing store reported),
`alerts` (`[alerts]`: a webhook or a command told of chosen events, rate-limited, recorded).
"""

from codecage.audit.record import AuditRecord, Caller, Finished
from codecage.audit.rows import Erasure, Query
from codecage.audit.store import AuditStore, open_store
from codecage.audit.trail import AuditTrail

__all__ = [
    "AuditRecord",
    "AuditStore",
    "AuditTrail",
    "Caller",
    "Erasure",
    "Finished",
    "Query",
    "open_store",
]
