"""The audit trail in PostgreSQL: the same tables as SQLite, for a fleet's shared store.

Not built yet (issue 23 is in progress): opening one says so.
"""

from __future__ import annotations

from codecage.audit.store import AuditStore
from codecage.errors import ConfigError


def connect(url: str) -> AuditStore:
    raise ConfigError(
        "the PostgreSQL audit store is not built yet",
        hint="use a SQLite file for [audit] store",
    )
