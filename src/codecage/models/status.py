"""How a run ended: the status vocabulary, below both the result that carries it and the
settings whose `[alerts]` triggers name it (`status:timeout`, ...)."""

from __future__ import annotations

from typing import Literal

Status = Literal["ok", "error", "timeout", "cpu_limit", "memory_limit", "killed", "blocked"]
"""How a run ended, judged by the host from what it observed (never from the guest's word)."""

STATUSES: tuple[Status, ...] = Status.__args__  # type: ignore[attr-defined]
