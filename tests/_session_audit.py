"""This test run's own audit store, instead of the host-wide default.

The default store (/var/lib/codecage/audit.db for root) is shared by every codecage on the
host: a test run that used it mixed its records with other runs' (other worktrees, other
schema versions) and wrote into the one file that every codecage process run as root
writes. A test that means the default location asks for it by name (`default_location`
is patched only in this process, by conftest; subprocesses get CODECAGE_AUDIT)."""

from __future__ import annotations

import tempfile
from pathlib import Path

SESSION_STORE = Path(tempfile.mkdtemp(prefix="codecage-test-audit-")) / "audit.db"
"""Made once per test process (each xdist worker its own)."""
