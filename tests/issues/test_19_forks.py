"""Issue 19: fork handling in one place (`codecage.forks`), and every host object with threads
follows its one rule: a forked child uses nothing, and closes nothing, that the parent made.

Each test forks the test process (as a pre-forking server or `multiprocessing` does) and
asks the child what it saw; the parent then checks that its own objects were not touched.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from tests._forking import in_forked_child

from codecage import forks
from codecage.backends.base import load_backend
from codecage.bridge import channel
from codecage.bridge.broker import Broker
from codecage.bridge.upstreams import Upstream
from codecage.engine import SandboxSpec
from codecage.engine.pool import Pool
from codecage.models import Limits, PoolConfig, PoolSizes

pytestmark = pytest.mark.timeout(90)


class _Recorder:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_a_guard_is_owned_by_the_process_that_made_it_and_not_by_a_child() -> None:
    parents = forks.ForkGuard()

    def in_child() -> bytes:
        childs = forks.ForkGuard()
        grandchild = in_forked_child(
            lambda: json.dumps([parents.owned_here(), childs.owned_here()]).encode(), timeout=10
        )
        assert grandchild is not None
        return json.dumps(
            {
                "parents": parents.owned_here(),
                "childs": childs.owned_here(),
                "grand": grandchild.decode(),
            }
        ).encode()

    reported = in_forked_child(in_child, timeout=20)
    assert reported
    seen = json.loads(reported)
    assert seen["parents"] is False and seen["childs"] is True
    assert json.loads(seen["grand"]) == [False, False]  # the grandchild owns neither
    assert parents.owned_here()


def test_a_per_process_helper_is_made_anew_in_a_child_after_its_copy_is_let_go() -> None:
    forgotten: list[int] = []
    made = iter(range(100))
    helper = forks.PerProcess(lambda: next(made), forget=forgotten.append)
    first = helper.get()
    assert helper.get() == first  # one per process

    def in_child() -> bytes:
        return json.dumps([helper.get(), helper.get(), forgotten]).encode()

    reported = in_forked_child(in_child, timeout=10)
    assert reported
    assert json.loads(reported) == [first + 1, first + 1, [first]]
    assert helper.get() == first and forgotten == []  # the parent's is untouched


def test_a_childs_exit_closes_what_the_child_made_and_not_what_the_parent_made() -> None:
    parents = _Recorder()
    forks.close_at_exit(parents)

    def in_child() -> bytes:
        childs = _Recorder()
        forks.close_at_exit(childs)
        forks._close_at_exit()  # what the child's interpreter runs at its exit
        return json.dumps([parents.closed, childs.closed]).encode()

    reported = in_forked_child(in_child, timeout=10)
    assert reported
    assert json.loads(reported) == [0, 1]
    assert parents.closed == 0


def test_a_forked_child_neither_takes_nor_closes_the_parents_pool() -> None:
    spec = SandboxSpec()
    config = PoolConfig(enabled=True, sizes=PoolSizes(min_idle=1, max_idle=1))
    with Pool(load_backend("auto"), config, Limits()) as pool:
        pool.register(spec)
        assert pool.wait_ready(30)
        with pool._cond:
            (idle,) = pool._plan.keys[spec].idle

        def in_child() -> bytes:
            other = SandboxSpec(tmp_mb=spec.tmp_mb + 1)
            pool.register(other)
            started = time.monotonic()
            taken = pool.take(spec)
            ready = pool.wait_ready(5)
            state = pool.state()
            pool.close()
            return json.dumps(
                {
                    "taken": taken is not None,
                    "ready": ready,
                    "enabled": state.enabled,
                    "keys": len(pool._plan.keys),
                    "closed": pool._plan.closed,
                    "seconds": time.monotonic() - started,
                }
            ).encode()

        reported = in_forked_child(in_child, timeout=30)
        assert reported, "the forked child did not finish"
        seen = json.loads(reported)
        assert seen == {**seen, "taken": False, "ready": False, "enabled": False, "keys": 1}
        assert seen["closed"] is False and seen["seconds"] < 2
        # The parent's idle sandbox is still there, alive, and its to take.
        assert idle.alive() and pool.take(spec) is idle
        pool.release(idle)


def test_a_forked_child_gets_a_refusal_from_the_parents_broker_and_leaves_it_open() -> None:
    # A server that never answers: a child that used the parent's dead loop would hang.
    never = Upstream(command="/bin/sleep", args=("600",))
    with Broker({"never": never}) as broker:

        def in_child() -> bytes:
            started = time.monotonic()
            try:
                broker.call("never", "tool", {}).result(timeout=10)
                outcome = "answered"
            except Exception as exc:
                outcome = f"{getattr(exc, 'kind', type(exc).__name__)}: {exc}"
            broker.close()
            return json.dumps([outcome, time.monotonic() - started]).encode()

        reported = in_forked_child(in_child, timeout=30)
        assert reported, "the forked child did not finish"
        outcome, seconds = json.loads(reported)
        assert outcome.startswith("upstream_error: ") and "forked" in outcome
        assert seconds < 2
        assert not broker._closed and broker._loop.is_running()


def test_a_forked_child_gets_a_bridge_watcher_of_its_own_with_a_live_thread() -> None:
    parents = channel.watcher()

    def in_child() -> bytes:
        own = channel.watcher()
        threads = [t.name for t in threading.enumerate()]
        return json.dumps(
            [own is parents, own is channel.watcher(), threads.count("codecage-bridge-watch")]
        ).encode()

    reported = in_forked_child(in_child, timeout=10)
    assert reported
    assert json.loads(reported) == [False, True, 1]
    assert channel.watcher() is parents


AT_EXIT = """
import os, sys
from codecage.backends.base import load_backend
from codecage.bridge.broker import Broker
from codecage.bridge.upstreams import Upstream
from codecage.engine import SandboxSpec, StartedSandbox
from codecage.engine.pool import Pool
from codecage.models import Limits, PoolConfig, PoolSizes

def say(*words):
    os.write(1, (" ".join(map(str, words)) + "\\n").encode())

destroy, close = StartedSandbox.destroy, Broker.close
def destroyed(sandbox):
    say("destroyed", sandbox.execution_id, os.getpid())
    destroy(sandbox)
def closed(broker):
    say("broker_closed", os.getpid())
    close(broker)
StartedSandbox.destroy, Broker.close = destroyed, closed

broker = Broker({"never": Upstream(command="/bin/sleep", args=("600",))})
sizes = PoolSizes(min_idle=1, max_idle=1)
pool = Pool(load_backend("auto"), PoolConfig(enabled=True, sizes=sizes), Limits())
pool.register(SandboxSpec())
assert pool.wait_ready(30)
say("ready", pool._plan.keys[SandboxSpec()].idle[0].execution_id, os.getpid())
child = os.fork()
if child == 0:
    sys.exit(0)  # the child's interpreter exits: its atexit handlers run
os.waitpid(child, 0)
say("child_exited")
"""


def test_at_exit_a_process_closes_its_own_pool_and_broker_and_a_childs_exit_closes_neither() -> (
    None
):
    done = subprocess.run(
        [sys.executable, "-c", AT_EXIT], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    (ready,) = [line for line in lines if line[0] == "ready"]
    _, idle_id, parent = ready
    closing = [line for line in lines if line[0] in ("destroyed", "broker_closed")]
    # Only the parent closed them, and only when it exited, after its child.
    assert sorted(closing) == sorted([["destroyed", idle_id, parent], ["broker_closed", parent]])
    assert lines.index(["child_exited"]) < min(lines.index(line) for line in closing)
