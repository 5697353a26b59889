"""The host engine: one execution end to end (`run`), its supervision, the warm pool, the
run's workspace, and the self-test that proves the layers before the first run.

What the layers above use is named here; the modules hold the rest."""

from codecage.engine.run import (
    RUN_DIR_PREFIX,
    LimitsNotApplicable,
    RunRequest,
    SandboxSpec,
    StartedSandbox,
    ceilings,
    check_request,
    execute,
    prepare,
    run_in,
    start,
    sweep_stale_runs,
    wait_ready,
)

__all__ = [
    "RUN_DIR_PREFIX",
    "LimitsNotApplicable",
    "RunRequest",
    "SandboxSpec",
    "StartedSandbox",
    "ceilings",
    "check_request",
    "execute",
    "prepare",
    "run_in",
    "start",
    "sweep_stale_runs",
    "wait_ready",
]
