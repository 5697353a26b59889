"""Which backends the containment suite runs on, and what each cannot meet, by test name.

A gap is a strict xfail: the test keeps running on that backend and must keep failing
there; when a backend closes a gap, the XPASS says to remove the line. Every entry names
why (docs/security-model.md says the same to users).
"""

from __future__ import annotations

BACKENDS_UNDER_TEST: tuple[str, ...] = ("bwrap",)

KNOWN_GAPS: dict[str, dict[str, str]] = {}
