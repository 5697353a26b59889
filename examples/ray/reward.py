"""A reward function for an RL or evaluation pipeline: score a batch of model completions
against their tests on a Ray cluster through `codecage.ray` (`pip install 'codecage[ray]'`).

A completion scores 1.0 when its tests pass in the sandbox and 0.0 when they fail (an
exception, a timeout, a memory limit: the program's fault). When codecage could not run it
at all (its node was lost, the sandbox failed, no answer in time) the score is None: the
program is not to blame, so the pipeline retries it or leaves it out, never rewards it 0.

    python examples/ray/reward.py auto       # on a node of a running cluster
    python examples/ray/reward.py            # a local Ray instance, for a try
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from codecage import ray as cluster

TIMEOUT_S = 10
"""Each program's wall time: a completion that loops for ever scores 0, it does not stall."""


def reward(
    completions: Sequence[str], tests: Sequence[str], *, address: str | None = None
) -> list[float | None]:
    """One score per completion, in order: 1.0 passed, 0.0 failed, None not judged."""
    programs = [
        {"id": n, "code": f"{completion}\n\n{test}\n", "limits": {"timeout": TIMEOUT_S}}
        for n, (completion, test) in enumerate(zip(completions, tests, strict=True))
    ]
    scores: list[float | None] = []
    for outcome in cluster.run_many(programs, address=address):
        if outcome.result is not None:
            scores.append(1.0 if outcome.result.status == "ok" else 0.0)
        elif outcome.error is not None and outcome.error.code == "refused":
            scores.append(0.0)  # the item itself was refused (e.g. its files): its fault
        else:
            scores.append(None)  # node_lost, sandbox_error, timed_out: run it again
    return scores


if __name__ == "__main__":
    test = "assert add(2, 3) == 5 and add(-1, 1) == 0"
    completions = [
        "def add(a, b):\n    return a + b",
        "def add(a, b):\n    return a - b",
        "def add(a, b):\n    while True:\n        pass",
    ]
    print(reward(completions, [test] * len(completions), address=(sys.argv[1:] or [None])[0]))
