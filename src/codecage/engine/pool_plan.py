"""The warm pool's bookkeeping, apart from its threads: which keys it keeps, how many of each
it aims for, which key to start next, what a hit, a miss, a crash or a failed start does.

`PoolPlan` is plain state and rules: no threads, no lock, no clock (every method that
depends on time takes `now`, a `time.monotonic()` value) and nothing done to a sandbox (it
holds the idle ones as opaque values, and tells the caller which to bury). `engine.pool`
calls it under its lock and acts on what it decides; tests drive it directly.

The rules:

- a key aims for `target` sandboxes ready, from `min_idle`; a miss, or a take that had to
  wait, raises it by one (up to `max_idle`); after `SHRINK_AFTER_S` without a miss it
  comes back down by one, and again after as long;
- the key most short of its target starts next, never more than `max_starting` at once;
  a start waits `HOLD_OFF_S` after the last take (the caller skips that when someone waits);
- a start that fails, or is not ready within `ready_timeout`, pauses its key for
  0.1 s x 2^(failures in a row), at most `MAX_BACKOFF_S`; a ready one clears the count;
- once closed, nothing starts and nothing becomes idle; `drain` hands back every idle one.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from codecage.engine import SandboxSpec
from codecage.models import PoolConfig, PoolKeyState, PoolSizes

SHRINK_AFTER_S = 30.0  # a key grown under load shrinks back by one after this long calm
MAX_BACKOFF_S = 30.0
HOLD_OFF_S = 0.02  # a start waits this long after a take (a start takes ~20 ms itself)

S = TypeVar("S")  # a sandbox, opaque here


@dataclass(slots=True)
class KeyPlan(Generic[S]):
    """The sandboxes of one key and its counters."""

    spec: SandboxSpec
    sizes: PoolSizes
    target: int
    idle: collections.deque[S] = field(default_factory=collections.deque)
    starting: int = 0  # marked by `next_to_start`, until ready, failed or closed
    hits: int = 0
    misses: int = 0
    started: int = 0
    crashed: int = 0
    failed_starts: int = 0
    failures_in_a_row: int = 0
    paused_until: float = 0.0
    last_error: str | None = None
    last_miss: float = 0.0

    @property
    def profile(self) -> str:
        """The profile its policy is of, as reports and logs name it."""
        return self.spec.policy.profile if self.spec.policy else "none"

    def state(self) -> PoolKeyState:
        """The key's counters as `Pool.state` reports them (memory filled in there)."""
        return PoolKeyState(
            profile=self.profile,
            preload=list(self.spec.preload),
            workspace_mb=self.spec.workspace_mb,
            tmp_mb=self.spec.tmp_mb,
            idle=len(self.idle),
            starting=self.starting,
            target=self.target,
            min_idle=self.sizes.min_idle,
            max_idle=self.sizes.max_idle,
            hits=self.hits,
            misses=self.misses,
            started=self.started,
            crashed=self.crashed,
            failed_starts=self.failed_starts,
            last_error=self.last_error,
            idle_rss_mb=None,
            idle_pss_mb=None,
        )


class PoolPlan(Generic[S]):
    """The bookkeeping of one pool (see the module's docstring). Not thread-safe: the
    pool calls it with its lock held."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.keys: dict[SandboxSpec, KeyPlan[S]] = {}
        self.closed = False
        self.in_use = 0  # taken and not yet released
        self.last_take = 0.0

    # --- keys and the callers' side ----------------------------------------------------------

    def register(self, spec: SandboxSpec, profile: str | None = None) -> bool:
        """Keep `spec` warm (sizes of `profile`, else of its policy's); False if it already
        is, or the pool is closed."""
        if self.closed or spec in self.keys:
            return False
        sizes = self.config.sizes_for(profile or (spec.policy.profile if spec.policy else "none"))
        self.keys[spec] = KeyPlan(spec=spec, sizes=sizes, target=sizes.min_idle)
        return True

    def pop_idle(self, key: KeyPlan[S]) -> S | None:
        """The oldest idle sandbox of `key`, for a take to check (`took` or `found_dead`)."""
        return key.idle.popleft() if key.idle else None

    def took(self, key: KeyPlan[S], now: float, *, waited: bool) -> None:
        """A take got a live sandbox; if it had to wait, demand outran the pool."""
        key.hits += 1
        self.in_use += 1
        self.last_take = now
        if waited:
            self._grow(key, now)

    def found_dead(self, key: KeyPlan[S]) -> None:
        """A take popped an idle sandbox that had died: the caller buries it."""
        key.crashed += 1

    def missed(self, key: KeyPlan[S], now: float) -> None:
        """A take found none ready in time: the caller starts a cold one."""
        key.misses += 1
        self._grow(key, now)

    def released(self, spec: SandboxSpec, now: float, *, ran: bool) -> None:
        """A taken sandbox came back; `ran=False`: it could not take its request, so the
        run went cold and counts as a miss."""
        self.in_use -= 1
        key = self.keys.get(spec)
        if not ran and key is not None:
            key.hits -= 1
            self.missed(key, now)

    def all_ready(self) -> bool:
        """Every key has its `min_idle` ready."""
        return all(len(k.idle) >= k.sizes.min_idle for k in self.keys.values())

    def _grow(self, key: KeyPlan[S], now: float) -> None:
        """One more kept ready (up to max_idle); it shrinks back after a calm spell."""
        key.last_miss = now
        key.target = min(key.sizes.max_idle, max(key.target, key.sizes.min_idle) + 1)

    # --- starting ------------------------------------------------------------------------------

    def next_to_start(self, now: float) -> KeyPlan[S] | None:
        """The key most short of its target, marked as starting one more; None when nothing
        is short, every short key is paused, or `max_starting` are starting already."""
        if self.closed:
            return None
        if sum(k.starting for k in self.keys.values()) >= self.config.max_starting:
            return None
        needy = [
            k
            for k in self.keys.values()
            if len(k.idle) + k.starting < k.target and k.paused_until <= now
        ]
        if not needy:
            return None
        key = min(needy, key=lambda k: len(k.idle) + k.starting - k.target)
        key.starting += 1
        return key

    def start_not_before(self) -> float:
        """When a start may begin: `HOLD_OFF_S` after the last take, so it does not compete
        with that take's run for the CPUs."""
        return self.last_take + HOLD_OFF_S

    def launched(self, key: KeyPlan[S]) -> bool:
        """A sandbox of `key` was started; False when the pool closed meanwhile (the caller
        buries it)."""
        key.started += 1
        if self.closed:
            key.starting -= 1
            return False
        return True

    def ready(self, key: KeyPlan[S], sandbox: S) -> bool:
        """A started sandbox said it is ready: idle now; False when the pool closed
        meanwhile (nobody will take it: the caller buries it)."""
        key.starting -= 1
        key.failures_in_a_row = 0
        if self.closed:
            return False
        key.idle.append(sandbox)
        return True

    def too_slow(self, started_at: float, now: float) -> bool:
        """Whether a sandbox started at `started_at` and not ready yet has had its time."""
        return now - started_at > self.config.ready_timeout

    def start_failed(self, key: KeyPlan[S], error: str, now: float) -> None:
        """A start of `key` failed (or was too slow): note it; pause the key, longer each
        time in a row."""
        key.starting -= 1
        key.failed_starts += 1
        key.failures_in_a_row += 1
        key.last_error = error[:500]
        key.paused_until = now + min(MAX_BACKOFF_S, 0.1 * 2**key.failures_in_a_row)

    def started_elsewhere(self, key: KeyPlan[S]) -> bool:
        """A sandbox of `key` started outside the pool (a caller's cold start): starts work
        again, so a back-off ends now. True if there was one to end."""
        if key.failures_in_a_row == 0:
            return False
        key.failures_in_a_row = 0
        key.paused_until = 0.0
        return True

    def idle_died(self, key: KeyPlan[S], sandbox: S) -> bool:
        """An idle sandbox's process ended; True if it was still idle (a crash: the caller
        buries it), False if a take had it or the pool is closing (its starters' exit kills
        the idle ones: not a crash)."""
        if self.closed or sandbox not in key.idle:
            return False
        key.idle.remove(sandbox)
        key.crashed += 1
        return True

    def shrink_calm_keys(self, now: float) -> None:
        for key in self.keys.values():
            if key.target > key.sizes.min_idle and now - key.last_miss > SHRINK_AFTER_S:
                key.target -= 1
                key.last_miss = now

    # --- closing -------------------------------------------------------------------------------

    def close(self) -> bool:
        """Stop starting; False if it was closed already."""
        if self.closed:
            return False
        self.closed = True
        return True

    def drain(self) -> list[S]:
        """On close: every idle sandbox, for the caller to bury; nothing counts as starting."""
        idle = [sandbox for key in self.keys.values() for sandbox in key.idle]
        for key in self.keys.values():
            key.idle.clear()
            key.starting = 0
        return idle
