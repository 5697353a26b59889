"""The tiers of the suite (tests/_tiers.py, docs/testing.md) name tests that exist: a test
renamed or removed must leave its tier too, or the long tier would silently shrink (and a
serial test would start running beside others)."""

from __future__ import annotations

import pytest
from tests._tiers import LONG, SERIAL

from conftest import COLLECTED


def test_every_name_in_a_tier_is_a_test_of_the_suite() -> None:
    files = {name for name in COLLECTED if "::" not in name}
    if len(files) < 100:
        pytest.skip("only part of the suite was collected: names outside it cannot be checked")
    listed = set(LONG) | {name for names in SERIAL.values() for name in names}
    assert sorted(listed - COLLECTED) == []
