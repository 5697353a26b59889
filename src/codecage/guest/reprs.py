"""A repr bounded in depth, items and length, which a hostile `__repr__` cannot break: what
the guest sends for a value it cannot send as JSON (a return value, a display's
text/plain). Standard library only, like all of the guest; loaded when first needed, and
`reprlib` with it (a cold start does not pay for either)."""

from __future__ import annotations

import reprlib
from typing import Any


def bounded_repr(value: Any, max_chars: int, *, max_items: int) -> str:
    """`value`'s repr, nested at most six deep, `max_items` of each container, at most
    `max_chars` long; a repr that raises is named by its type instead."""
    limiter = reprlib.Repr()
    limiter.maxlevel = 6
    limiter.maxstring = limiter.maxother = max_chars
    limiter.maxlist = limiter.maxtuple = limiter.maxdict = limiter.maxset = max_items
    try:
        text = limiter.repr(value)
    except Exception as exc:  # a hostile __repr__ must not lose the report
        text = f"<unrepresentable {type(value).__name__}: {type(exc).__name__}>"
    return text[:max_chars]
