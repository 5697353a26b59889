"""The warm pool's bookkeeping (`PoolPlan`), driven directly: no threads, no sandboxes (the
idle ones are plain strings here), no clock (each step passes `now`)."""

from __future__ import annotations

from codecage.engine import SandboxSpec
from codecage.engine.pool_plan import HOLD_OFF_S, MAX_BACKOFF_S, SHRINK_AFTER_S, PoolPlan
from codecage.models import PoolConfig, PoolSizes

SPEC = SandboxSpec()
OTHER = SandboxSpec(tmp_mb=SPEC.tmp_mb + 1)


def _plan(min_idle: int = 1, max_idle: int = 3, max_starting: int = 4) -> PoolPlan[str]:
    sizes = PoolSizes(min_idle=min_idle, max_idle=max_idle)
    return PoolPlan(PoolConfig(enabled=True, sizes=sizes, max_starting=max_starting))


def _start_ready(plan: PoolPlan[str], name: str, now: float = 0.0) -> None:
    """One start of whatever key is next, through to ready."""
    key = plan.next_to_start(now)
    assert key is not None
    assert plan.launched(key)
    assert plan.ready(key, name)


def test_a_registered_key_aims_for_min_idle_and_starts_nothing_more() -> None:
    plan = _plan(min_idle=2)
    assert plan.next_to_start(0.0) is None  # no key yet
    assert plan.register(SPEC) and not plan.register(SPEC)  # once
    _start_ready(plan, "a")
    assert not plan.all_ready()
    _start_ready(plan, "b")
    assert plan.all_ready()
    assert plan.next_to_start(0.0) is None
    key = plan.keys[SPEC]
    assert (key.started, key.starting, list(key.idle)) == (2, 0, ["a", "b"])


def test_a_take_pops_the_oldest_idle_and_counts_a_hit() -> None:
    plan = _plan()
    plan.register(SPEC)
    _start_ready(plan, "a")
    key = plan.keys[SPEC]
    assert plan.pop_idle(key) == "a" and plan.pop_idle(key) is None
    plan.took(key, now=5.0, waited=False)
    assert (key.hits, key.target, plan.in_use) == (1, 1, 1)
    assert plan.start_not_before() == 5.0 + HOLD_OFF_S  # the replacement holds off
    plan.released(SPEC, now=5.1, ran=True)
    assert plan.in_use == 0 and key.misses == 0


def test_a_miss_grows_the_key_by_one_up_to_max_idle() -> None:
    plan = _plan(min_idle=1, max_idle=3)
    plan.register(SPEC)
    key = plan.keys[SPEC]
    for expected in (2, 3, 3):
        plan.missed(key, now=1.0)
        assert key.target == expected
    assert key.misses == 3
    # A take that had to wait grows it too; a sandbox that could not take its request
    # turns its hit into a miss.
    plan = _plan(min_idle=1, max_idle=3)
    plan.register(SPEC)
    key = plan.keys[SPEC]
    plan.took(key, now=1.0, waited=True)
    assert key.target == 2
    plan.released(SPEC, now=1.1, ran=False)
    assert (key.hits, key.misses, key.target) == (0, 1, 3)


def test_a_grown_key_starts_more_and_the_one_most_short_goes_first() -> None:
    plan = _plan(min_idle=1, max_idle=3)
    plan.register(SPEC)
    plan.register(OTHER)
    _start_ready(plan, "a")
    _start_ready(plan, "b")
    assert {tuple(k.idle) for k in plan.keys.values()} == {("a",), ("b",)}
    plan.missed(plan.keys[OTHER], now=1.0)
    plan.missed(plan.keys[OTHER], now=1.0)  # OTHER is 2 short, SPEC is not
    assert plan.next_to_start(1.0) is plan.keys[OTHER]
    assert plan.next_to_start(1.0) is plan.keys[OTHER]
    assert plan.next_to_start(1.0) is None


def test_calm_keys_shrink_back_by_one_per_calm_spell_and_never_below_min_idle() -> None:
    plan = _plan(min_idle=1, max_idle=3)
    plan.register(SPEC)
    key = plan.keys[SPEC]
    plan.missed(key, now=100.0)
    plan.missed(key, now=100.0)
    assert key.target == 3
    plan.shrink_calm_keys(now=100.0 + SHRINK_AFTER_S)  # not calm long enough yet
    assert key.target == 3
    plan.shrink_calm_keys(now=100.0 + SHRINK_AFTER_S + 1)
    assert key.target == 2
    plan.shrink_calm_keys(now=100.0 + SHRINK_AFTER_S + 2)  # the next spell starts now
    assert key.target == 2
    plan.shrink_calm_keys(now=100.0 + 2 * SHRINK_AFTER_S + 2)
    assert key.target == 1
    plan.shrink_calm_keys(now=100.0 + 10 * SHRINK_AFTER_S)
    assert key.target == 1


def test_no_more_than_max_starting_start_at_once() -> None:
    plan = _plan(min_idle=3, max_idle=3, max_starting=2)
    plan.register(SPEC)
    plan.register(OTHER)
    first, second = plan.next_to_start(0.0), plan.next_to_start(0.0)
    assert first is not None and second is not None
    assert first is not second  # the most short first: one each
    assert plan.next_to_start(0.0) is None  # 2 starting, though 6 are wanted
    assert plan.launched(first) and plan.ready(first, "a")
    assert plan.next_to_start(0.0) is not None  # one slot free again
    assert plan.next_to_start(0.0) is None


def test_failed_starts_pause_the_key_longer_each_time_until_one_is_ready() -> None:
    plan = _plan()
    plan.register(SPEC)
    key = plan.keys[SPEC]
    now = 10.0
    pauses = []
    for _ in range(12):
        assert plan.next_to_start(now) is key
        plan.start_failed(key, "bwrap: no", now)
        pauses.append(round(key.paused_until - now, 3))
        assert key.starting == 0
        assert plan.next_to_start(key.paused_until - 0.001) is None  # held off
        now = key.paused_until
    assert pauses[:4] == [0.2, 0.4, 0.8, 1.6] and pauses[-1] == MAX_BACKOFF_S
    assert (key.failed_starts, key.last_error) == (12, "bwrap: no")
    assert plan.next_to_start(now) is key
    assert plan.launched(key) and plan.ready(key, "a")
    assert key.failures_in_a_row == 0
    plan.missed(key, now)
    assert plan.next_to_start(now) is key
    plan.start_failed(key, "x" * 1000, now)
    assert key.paused_until == now + 0.2  # the count started again
    assert key.last_error == "x" * 500  # bounded


def test_a_start_not_ready_within_the_ready_timeout_is_too_slow() -> None:
    plan = _plan()
    limit = plan.config.ready_timeout
    assert not plan.too_slow(started_at=1.0, now=1.0 + limit)
    assert plan.too_slow(started_at=1.0, now=1.0 + limit + 0.01)


def test_an_idle_sandbox_that_died_counts_as_a_crash_only_while_it_was_idle() -> None:
    plan = _plan(min_idle=2, max_idle=2)
    plan.register(SPEC)
    _start_ready(plan, "a")
    _start_ready(plan, "b")
    key = plan.keys[SPEC]
    assert plan.idle_died(key, "a") and list(key.idle) == ["b"] and key.crashed == 1
    assert not plan.idle_died(key, "a")  # gone already (taken, or buried)
    assert plan.pop_idle(key) == "b"
    plan.found_dead(key)  # a take found it dead
    assert key.crashed == 2


def test_a_closed_plan_starts_nothing_and_hands_back_every_idle_sandbox() -> None:
    plan = _plan(min_idle=2, max_idle=2)
    plan.register(SPEC)
    _start_ready(plan, "a")
    key = plan.keys[SPEC]
    starting = plan.next_to_start(0.0)
    assert starting is key
    late = plan.next_to_start(0.0)
    assert late is None  # 1 idle + 1 starting = target
    assert plan.close() and not plan.close()
    assert plan.next_to_start(0.0) is None
    assert not plan.register(OTHER)
    assert not plan.launched(key)  # started after the close: to be buried
    assert plan.drain() == ["a"]
    assert key.starting == 0 and not key.idle
    assert not plan.ready(key, "b")  # ready after the close: to be buried
    assert not plan.idle_died(key, "a")  # the starters' exit kills idle ones: no crash
