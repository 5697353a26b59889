"""`needs_runsc`: the mark of a test that starts gVisor sandboxes."""

from __future__ import annotations

import os
import shutil

import pytest


def runsc_missing() -> str | None:
    """Why the gVisor backend cannot run here, or None when it can."""
    if shutil.which("runsc") is None:
        return "runsc is not installed (scripts/setup --test installs it)"
    if os.geteuid() != 0:
        return "the gVisor backend needs root"
    return None


# CI installs runsc and runs as root: there a missing runsc fails the test instead of skipping.
needs_runsc = pytest.mark.skipif(
    runsc_missing() is not None and os.environ.get("CI") != "true",
    reason=str(runsc_missing()),
)
