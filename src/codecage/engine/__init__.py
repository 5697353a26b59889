"""The host engine: one execution end to end (`run`: the host's facts and the resources
acquired in `launch`, the pure launch plan in `plan`, its supervision, its judging in
`judge`), the warm pool, the run's workspace, and the self-test
that proves the layers before the first run. No backend is named here: a backend starts a
sandbox from a `backends.base.LaunchSpec` and hands back a `SandboxProcess`.

What the layers above use is named here; the modules hold the rest."""

from codecage.engine.launch import RUN_DIR_PREFIX, sweep_stale_runs
from codecage.engine.plan import SandboxSpec
from codecage.engine.run import (
    HostContext,
    LimitsNotApplicable,
    RunRequest,
    StartedSandbox,
    apply_limits,
    ceilings,
    check_request,
    execute,
    prepare,
    run_in,
    start,
    wait_ready,
)

__all__ = [
    "RUN_DIR_PREFIX",
    "HostContext",
    "LimitsNotApplicable",
    "RunRequest",
    "SandboxSpec",
    "StartedSandbox",
    "apply_limits",
    "ceilings",
    "check_request",
    "execute",
    "prepare",
    "run_in",
    "start",
    "sweep_stale_runs",
    "wait_ready",
]
