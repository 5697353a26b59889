"""The host runtime: what a codecage process holds once, whichever face asks it to run.

A face (the library's `Sandbox`, the CLI through it, the MCP server) resolves its options
once (`codecage.options`), has `build` make its one complete `Host` from them, then hands it
one `Request` per run. Nothing is set on a Host after it is built. The split follows what
can change between two runs and what cannot:

- host-wide, in `Host`: the resolved options and their origins, the default limits, the
  backend, the warm pool, the scrubber(s), the audit trail, alerter and observers, the
  broker of upstream tools and the bounds of their calls, the tool trees and the packages
  directory, the self-test verdict, and the `engine.HostContext` every run shares;
- per run, in `Request`: the `Program` (code, file name, input files or a workspace
  directory), its limits, its import policy (a profile plus imports, resolved by
  `Host.policy`), its hosts, the tools it may call, `strict`, the backend and session
  asked for, who asks (`Asker`) and how they follow it (`Hooks`).

What is process-wide whatever Hosts a process builds (the sweep of stale run directories,
the self-test verdict memo and its lock) is `_PROCESS`, in this module only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from codecage import config as configuration
from codecage import engine, forks, offline, packages
from codecage._version import __version__
from codecage.audit import AuditTrail, Caller, Finished
from codecage.audit import alerts as alerting
from codecage.audit import store as audit_store
from codecage.audit.record import utc_now
from codecage.backends.base import (
    Backend,
    auto_candidates,
    available_backends,
    backend_states,
    load_backend,
)
from codecage.bridge import channel as bridge
from codecage.bridge import tooling
from codecage.config import Settings
from codecage.egress import grants as egress_grants
from codecage.egress.rules import EgressPolicy
from codecage.engine import forkserver, guardian, selftest
from codecage.engine import session as sessions_engine
from codecage.engine.pool import Pool

# What a face reads of a run's workspace in its `on_files` hook: the one way file content
# leaves a workspace (the faces hold the host, not the engine).
from codecage.engine.workspace import keep as keep
from codecage.engine.workspace import private_parent
from codecage.engine.workspace import read_file as read_file
from codecage.errors import ConfigError, Face, HostError, SandboxError
from codecage.isolation import cgroups, datadir, lending, rootfs, seccomp, staging, tmpfs
from codecage.isolation import identity as identities
from codecage.kept import KeptFiles
from codecage.models import (
    ApprovalRequest,
    AuditState,
    DoctorReport,
    ErrorInfo,
    Event,
    ExecutionResult,
    FileInfo,
    ForkServerState,
    HostInfo,
    LayerStatus,
    Limits,
    NetworkState,
    PoolState,
    ScrubSettings,
    TemplateState,
    ToolsState,
    ValidationReport,
)
from codecage.options import Resolved, resolve_policy
from codecage.policy import approval as approvals
from codecage.policy import profiles
from codecage.policy import scrub as scrubbing
from codecage.policy import validate as validation
from codecage.policy.profiles import ImportPolicy
from codecage.policy.scrub import apply as redaction

if TYPE_CHECKING:
    from codecage.bridge.broker import RunTools
    from codecage.egress.setup import EgressSetup

log = logging.getLogger(__name__)

LIBRARY_CALLER = Caller("library")


@dataclass(frozen=True, slots=True)
class Program:
    """What a run runs: its code under a file name, and what its /workspace starts as:
    input files written into a fresh one, or a host directory lent instead (not both)."""

    code: str
    filename: str = "main.py"
    files: Mapping[str, bytes] | None = None  # into the fresh /workspace before the code runs
    workspace: Path | None = None  # a host directory at /workspace instead of a fresh one


@dataclass(frozen=True, slots=True)
class Asker:
    """Who asks for a run: the face its hints are worded for, the caller on the audit
    trail, the client a session belongs to (only the client that opened it may use it),
    and how a person is asked when [approval] requires it (policy/approval.py; None: code
    that needs approval is refused with a ConfigError)."""

    face: Face = "library"
    caller: Caller = LIBRARY_CALLER
    client: str = ""
    approve: approvals.Approver | None = None


@dataclass(frozen=True, slots=True)
class Hooks:
    """How the asker follows a run while it lasts: a cancel event (set: the run is
    killed), what it printed as it prints (("stdout" | "stderr", text), scrubbed as results
    are, on a thread of the engine's own: engine/stream.py), and its workspace's files
    before the sandbox is destroyed."""

    cancel: threading.Event | None = None
    on_output: Callable[[str, str], None] | None = None
    on_files: Callable[[Path, list[FileInfo]], None] | None = None


@dataclass(frozen=True, slots=True)
class Request:
    """One run as a face asks for it: all that may differ from the run before.

    `limits` are whole (the face merged its overrides into the defaults and validated them
    once); `policy` is what `Host.policy` resolved, or None for no import policy; `egress`
    the hosts the run may reach, as `Host.network_for` resolved them (None: no network).
    """

    program: Program
    limits: Limits
    policy: ImportPolicy | None
    egress: EgressPolicy | None = None
    allowed_tools: tuple[str, ...] | None = None  # "server.tool" patterns; None: all
    strict: bool = False  # validate first; a refusal is a `blocked` result
    backend: str | None = None  # one of `Host.call_backends`; None: the host's own
    session_id: str | None = None  # run in this open session (see `Host.open_session`)
    asker: Asker = Asker()
    hooks: Hooks = Hooks()


@dataclass(frozen=True, slots=True)
class SessionRequest:
    """A session as a face asks for it. `limits` hold for the whole session (memory,
    processes, disk) and are the defaults of its runs (timeout, CPU seconds, output)."""

    limits: Limits
    policy: ImportPolicy | None
    idle_ttl: float | None = None  # None: the settings' [sessions]
    lifetime: float | None = None
    client: str = ""
    face: Face = "library"
    egress: EgressPolicy | None = None  # the hosts of every run in it (Host.network_for)


@dataclass(frozen=True, slots=True)
class Placed:
    """What a `Placement` gives back for one run: its result as the sandbox produced it
    (not yet scrubbed, `node` naming where it ran) and the files it left, up to the bytes
    asked for (None: none asked for, or none left)."""

    result: ExecutionResult
    kept: KeptFiles | None = None


class Placement(Protocol):
    """Where a Host runs the runs that need nothing of this machine, instead of in its own
    sandboxes: the nodes of a Ray cluster (`codecage.ray.ClusterRuns`, `serve --ray`).

    The Host keeps every other step of `run`: the checks, strict validation, approval,
    scrubbing, the audit record and its observers. It sends the sandbox step only, for a
    run with no lent directory that is not in a session (those run here); a Host with
    upstream tools takes no placement (a node cannot reach this host's broker).
    """

    def run(self, request: Request, keep_bytes: int) -> Placed:
        """Run `request` elsewhere (its hooks' `cancel` followed; `on_output` and
        `on_files` stay here: the Host calls `on_files` with the files it gets back, up
        to `keep_bytes`).

        Raises:
            CapacityError: every node holds as many runs as it may: retry later.
            RemoteRunError: its node was lost, did not answer in time, or failed.
            CodecageError: the node refused it, as this host would have.
        """
        ...

    def close(self) -> None:
        """Stop what the placement started (its actors)."""
        ...


_MAX_RECORDED_IMPORTS = 500
"""Modules of a run's import policy kept in its audit record."""

_PER_RUN_LIMITS = frozenset({"timeout", "cpu_seconds", "max_output_bytes"})
"""What a run in a session may set for itself; the rest is the session's."""


class _ProcessWide:
    """What one process does once however many Hosts it builds: sweep the leftovers of
    killed codecage processes, and prove the host's isolation (the self-test verdict, kept
    per backend and version; a passing one is also cached on disk until reboot)."""

    def __init__(self) -> None:
        self.sweep_lock = threading.Lock()
        self.swept = False
        self.verdict_lock = threading.Lock()  # one self-test at a time; the others wait
        self.verdicts: dict[str, DoctorReport] = {}
        # The verdicts' keys, per backend object (a Host's own) and ids: every run asks
        # (`missing_layers`), and a key reads boot_id, asks the backend's version and
        # hashes the probe program (~0.1 ms), none of which changes under a Host.
        self.keys: weakref.WeakKeyDictionary[Backend, dict[identities.Identity | None, str]]
        self.keys = weakref.WeakKeyDictionary()

    def verdict_key(self, backend: Backend, identity: identities.Identity | None) -> str:
        try:
            known = self.keys.setdefault(backend, {})
        except TypeError:  # a backend object that takes no weak reference: not kept
            return selftest.cache_key(backend, identity)
        key = known.get(identity)
        if key is None:
            key = known[identity] = selftest.cache_key(backend, identity)
        return key

    def sweep_once(self) -> None:
        with self.sweep_lock:
            if self.swept:
                return
            self.swept = True
        engine.sweep_stale_runs()

    def verdict(self, key: str, prove: Callable[[], DoctorReport]) -> DoctorReport:
        with self.verdict_lock:
            if key in self.verdicts:
                return self.verdicts[key]
            report = _read_cached(key)
            if report is None:
                report = prove()
                if report.passed:  # a failure is checked again next time: hosts get fixed
                    _write_cached(key, report)
            self.verdicts[key] = report
            return report


_PROCESS = _ProcessWide()


class Host:
    """The host runtime of one face: built complete by `build`, then `run` per `Request`.

    Every part is an argument of the constructor (the factory `build` makes them from
    `Resolved` options in the order that refuses early: grants, backend, audit trail,
    alerter, then the pool); nothing is set on a Host after it is built (assigning an
    attribute raises), so what a face reads of it is what it was built with.
    """

    def __init__(
        self,
        options: Resolved,
        *,
        backend: Backend,
        identity: identities.IdentityPlan,
        grants: egress_grants.Grants,
        scrubbers: Scrubbers,
        audit: AuditTrail | None,
        alerter: alerting.Alerter | None,
        observers: tuple[Callable[[Finished], None], ...],
        templates: tuple[forkserver.Templates | None, str | None],
        pool: tuple[Pool | None, bool],
        places: tuple[Path, Path | None],
        sessions: sessions_engine.Sessions,
        egress: EgressCell,
        placement: Placement | None = None,
    ) -> None:
        settings = options.settings
        self.options = options
        self.settings = settings
        self.audit = audit  # closed by `close` (the alerter first, which records in it)
        self.alerter = alerter
        # Told of every finished run after the audit trail (metrics, alerts); one that
        # raises is logged and never fails the run.
        self.observers = observers
        self.grants = grants  # the operator's with the config's [network]
        self.limits = options.limits
        self.limit_sources = options.limit_sources
        self.identity = identity
        self.allow_degraded = options.options.allow_degraded
        self._selftest = options.options.selftest
        self.backend: Backend = backend
        self.tools = options.options.tools
        self.tool_limits = options.options.tool_limits or tooling.bridge_limits(settings.tools)
        self.tokenize = options.options.tokenize
        self.servers_dir = _resolved_dir(options.options.servers_dir)
        self.skills_dir = _resolved_dir(options.options.skills_dir)
        self.packages_dir, self.data_dir = places
        self.scrub_settings = scrubbers.settings
        self._scrub_source = scrubbers.source
        self.scrubber = scrubbers.scrubber
        self._scrubbers = scrubbers
        self.templates, self.fork_server_off = templates
        self.pool, self._owns_pool = pool
        self._other_backends: dict[str, Backend] = {}
        self._other_backends_lock = threading.Lock()
        self.sessions = sessions
        self._egress = egress  # the host proxy, made at the first egress run
        self.placement = placement  # where runs go instead of this host's sandboxes
        # Each profile's egress when a run asks for no host of its own (`network_for`).
        self._egress_of: dict[str, EgressPolicy | None] = {}
        # What every run's engine request shares, made once here (not copied per run).
        self._context = engine.HostContext(
            tool_limits=self.tool_limits,
            servers_dir=self.servers_dir,
            skills_dir=self.skills_dir,
            packages_dir=self.packages_dir,
            data_dir=self.data_dir,
            identity=identity,
            wider_profile=self.wider_profile,
            network_limits=settings.network.limits,
        )
        self._built = True

    def __setattr__(self, name: str, value: object) -> None:
        """Refuse to set anything once built: the factory made the Host complete."""
        if getattr(self, "_built", False):
            raise AttributeError(
                f"Host.{name} cannot be set after the Host is built: pass it to "
                "codecage.host.build (or Options) instead"
            )
        object.__setattr__(self, name, value)

    def _own_places(self) -> tuple[lending.Place, ...]:
        """What a lent directory must neither be, hold nor lie in (`isolation.lending`):
        codecage's interpreter and package, its state, config and packages directories."""
        state = [private_parent(), staging.STAGE_ROOT, rootfs.cache_dir()]
        # The egress CA lives in /var/lib/codecage or the user's data dir, both listed.
        state += [audit_store.default_location().parent]
        state += [packages.user_data_dir("packages").parent, Path("/var/lib/codecage")]
        config = [
            *([self.settings.config_file] if self.settings.config_file else []),
            *self.settings.config_searched,
            configuration.SYSTEM_CONFIG.parent,
            *(p.parent for origin, p in configuration.candidate_paths(os.environ)
              if origin == "user"),
        ]  # fmt: skip
        bundled = [packages.user_data_dir("packages"), packages.SYSTEM_DIR]
        return lending.own_places(
            state=state,
            config=config,
            packages=[*([self.packages_dir] if self.packages_dir else []), *bundled],
        )

    @property
    def call_backends(self) -> tuple[str, ...]:
        """The backends a run may ask for by name: the host's own, and those the operator
        enabled (the config's [serve] backends)."""
        enabled = self.settings.serve.backends or []
        return (self.backend.name, *(b for b in enabled if b != self.backend.name))

    def backend_for(self, name: str | None) -> Backend:
        """The backend a run asked for: the host's own when `name` is None or names it,
        else one the operator enabled, loaded once and proven by its self-test.

        Raises:
            ConfigError: `name` is not enabled here.
            HostError: it cannot run here, or its self-test finds a layer missing.
        """
        if name is None or name == self.backend.name:
            return self.backend
        if name not in self.call_backends:
            raise ConfigError(
                f"backend {name!r} is not enabled here",
                hint=f"choose one of: {', '.join(self.call_backends)} (the operator enables "
                "more in the config's [serve] backends)",
            )
        with self._other_backends_lock:
            if name not in self._other_backends:
                backend = load_backend(name, allow_degraded=self.allow_degraded)
                missing = self._failed_layers(backend) if self._selftest else ()
                if missing and not self.allow_degraded:
                    raise HostError(
                        f"backend {name!r} fails its self-test here: {', '.join(missing)}",
                        hint=f"run `codecage doctor --backend {name}` to see why",
                    )
                self._other_backends[name] = backend
            return self._other_backends[name]

    def _failed_layers(self, backend: Backend) -> tuple[str, ...]:
        return failed_layers(backend, self.identity)

    def _verdict_of(self, backend: Backend) -> DoctorReport:
        return verdict_of(backend, self.identity)

    # --- policy ----------------------------------------------------------------------------

    def policy(
        self, profile: str | None, allowed_imports: Iterable[str] = (), replace: bool = False
    ) -> ImportPolicy:
        """`resolve_policy` under this Host's settings.

        Raises:
            ConfigError: a profile is unknown, or not among the operator's enabled ones.
        """
        return resolve_policy(self.settings, profile, allowed_imports, replace)

    def network_for(
        self, policy: ImportPolicy | None, requested: Iterable[str] | None, face: Face
    ) -> tuple[EgressPolicy | None, ImportPolicy | None]:
        """A run's egress (the config's, its profile's and the operator's hosts, and the
        caller's `requested` ones within the ceiling; None: no network) and its import
        policy, which allows the network modules too when it has egress.

        Raises:
            ConfigError: a requested rule is malformed, outside the ceiling, or denied;
                worded for `face`.
        """
        profile = policy.profile if policy is not None else self.settings.profile
        if requested:
            egress = self.grants.policy(profile, requested, face=face)
        else:  # what most runs ask: the same answer for a profile every time (grants are fixed)
            egress = self._egress_of.get(profile)
            if egress is None and profile not in self._egress_of:
                egress = self._egress_of[profile] = self.grants.policy(profile, None, face=face)
        return egress, profiles.with_network(policy) if egress is not None else policy

    @property
    def wider_profile(self) -> str | None:
        """The profile an import refusal suggests: the default one, which refuses nothing,
        when the operator lets callers choose it."""
        enabled = self.settings.enabled_profiles
        if enabled is not None and profiles.DEFAULT_PROFILE not in enabled:
            return None
        return profiles.DEFAULT_PROFILE

    def keep_warm(self, policy: ImportPolicy | None, *, egress: bool = False) -> None:
        """Have the pool keep sandboxes of `policy` (at the default limits' sizes, made
        for egress when the runs have hosts) ready; runs of another spec start cold.
        Nothing without a pool."""
        if self.pool is None:
            return
        spec = self._spec(policy, self.limits, egress=egress)
        engine.prepare(spec)  # here, not in a starter thread that a stop cannot wait for
        self.pool.register(spec, policy.profile if policy else "none")

    def _spec(
        self, policy: ImportPolicy | None, limits: Limits, *, egress: bool = False
    ) -> engine.SandboxSpec:
        """What a warm sandbox for a run of `policy` and `limits` (with hosts: `egress`)
        was started with. A run's hosts are its grant, not the sandbox's: one spec for all."""
        return engine.SandboxSpec(
            egress=self._egress_setup() if egress else None,
            policy=policy,
            workspace_mb=limits.workspace_mb,
            tmp_mb=limits.tmp_mb,
            preload=profiles.preload_for(policy),
            servers_dir=self.servers_dir,
            skills_dir=self.skills_dir,
            packages_dir=self.packages_dir,
            data_dir=self.data_dir,
            identity=self.identity,
        )

    # --- running ---------------------------------------------------------------------------

    def run(self, request: Request) -> ExecutionResult:
        """Run one request, warm when the pool has its spec, and scrub what it returns.

        Raises:
            ConfigError: the request was refused before anything ran.
            HostError: the host cannot provide the isolation (see `doctor()`).
            SandboxError: the sandbox itself failed.
        """
        configuration.check_workspace(self.settings, request.program.workspace)
        packages.check_workspace(self.packages_dir, request.program.workspace)
        if request.program.workspace is not None:
            lending.check(request.program.workspace, self._own_places())
        if request.program.files and request.program.workspace is not None:
            raise ConfigError(
                "input files and a workspace directory were both given",
                hint="put the files in the workspace directory, or pass no workspace",
            )
        if self.audit is not None:
            self.audit.check()
        started_at = utc_now()
        if request.session_id is not None:  # its runs have the session's policy and hosts
            terms = self.sessions.get(request.session_id, request.asker.client).terms
            request = dataclasses.replace(request, policy=terms.policy, egress=terms.egress)
        try:
            produced = self._result_of(request)
        except approvals.Unavailable as exc:  # on record as blocked, then the face's error
            self._finished(request, redaction.scrub_result(exc.result, self.scrubber), started_at)
            raise ConfigError(str(exc), hint=exc.verdict.hint) from None
        result = redaction.scrub_result(produced, self.scrubber)
        if request.egress is None:  # no network: say so where the code's error looks flaky
            profile = request.policy.profile if request.policy else self.settings.profile
            may_allow = bool(self.grants.ceiling_of(profile))
            result = offline.noted(result, request.asker.face, may_allow=may_allow)
        self._finished(request, result, started_at)
        return result

    def _result_of(self, request: Request) -> ExecutionResult:
        if request.strict:
            blocked = self._blocked_by_validation(request)
            if blocked is not None:
                return blocked
        # The tools [approval] judged the run by (None: it judged none): all it may call.
        asked, judged = self._judged(request)
        if asked is None:
            return self._run_now(request, judged)
        verdict = self._ask(request, asked)
        if verdict.decision != "approved":
            blocked = approvals.blocked_result(asked, verdict, request.limits, self.backend.name)
            if verdict.decision == "unavailable":
                raise approvals.Unavailable(blocked, verdict)
            return blocked
        result = self._run_now(request, judged)
        events = [approvals.event(asked, verdict), *result.events]
        return result.model_copy(update={"events": events})

    def approval_for(self, request: Request) -> ApprovalRequest | None:
        """What a person must approve before `request` runs, or None when the config's
        [approval] does not ask for it: decided by what the run is granted (its declared
        capabilities), never by its code's text, whose findings go along as advice
        (policy/approval.py).

        Raises:
            ConfigError: the run's allowed_tools has a malformed pattern, or its session is
                not this client's.
        """
        return self._judged(request)[0]

    def _judged(
        self, request: Request
    ) -> tuple[ApprovalRequest | None, approvals.JudgedTools | None]:
        """`approval_for`, and the tools the run was judged by (None: [approval] is off or
        there are no tools), which are then all it may call: a tool a server adds later
        was never weighed."""
        settings = self.settings.approval
        if settings.require is None:
            return None, None
        if request.session_id is not None:  # its runs have the session's policy and hosts
            terms = self.sessions.get(request.session_id, request.asker.client).terms
            request = dataclasses.replace(request, policy=terms.policy, egress=terms.egress)
        declared = self._declared(request)
        judged = approvals.JudgedTools.of(declared.tools) if self.tools is not None else None
        grants = approvals.waiting_for(approvals.declared_grants(declared), settings)
        if grants is None:
            return None, judged
        return ApprovalRequest(
            code=request.program.code,
            code_sha256=approvals.code_sha256(request.program.code),
            grants=grants,
            findings=approvals.advice(self.validate(request.program.code, None)),
            require=settings.require,
            timeout=settings.timeout,
            caller=request.asker.caller.label,
        ), judged

    def _declared(self, request: Request) -> approvals.Declared:
        """What `request` is granted, as [approval] judges it."""
        egress = request.egress
        hosts = tuple(r.text for r in egress.allow) if egress is not None else ()
        tools = (
            tuple(self.tools.reachable_tools(request.allowed_tools))
            if self.tools is not None
            else ()
        )
        default = self.policy(None)
        policy = request.policy
        every = (policy is None or policy.allows_every_module) and not default.allows_every_module
        wider: tuple[str, ...] = ()
        if policy is not None and not policy.allows_every_module and not every:
            network = profiles.NETWORK_MODULES if egress is not None else frozenset()
            wider = tuple(sorted(policy.modules - default.modules - network))
        return approvals.Declared(
            hosts=hosts,
            tools=tools,
            workspace=str(request.program.workspace)
            if request.program.workspace is not None
            else None,
            packages=self._added_packages_for(policy),
            wider_modules=wider,
            every_module=every,
            profile=policy.profile if policy is not None else None,
            limits=_above(request.limits, self.limits),
        )

    def _added_packages_for(self, policy: ImportPolicy | None) -> tuple[str, ...]:
        """The operator's added packages a run of `policy` may import (none: no directory,
        nothing added, or an untrusted one, which the run itself then refuses)."""
        if self.packages_dir is None or not self.packages_dir.exists():
            return ()
        try:
            names = packages.read_record(packages.check_trusted(self.packages_dir)).top_level()
        except ConfigError:
            return ()
        return tuple(sorted(n for n in names if policy is None or policy.allows(n)))

    def _ask(self, request: Request, asked: ApprovalRequest) -> approvals.Verdict:
        """The face's verdict on `asked`.

        Raises:
            ConfigError: the face has no way to ask.
        """
        if request.asker.approve is None:
            raise ConfigError(
                f"this run needs a person's approval ([approval] require = "
                f"'{asked.require}'; granted: {asked.reason()}) and this caller has no way "
                "to ask one",
                hint="pass Sandbox(approve=callback), or run without what needs approval "
                "(the config's [approval] capabilities)",
            )
        return request.asker.approve(asked)

    def _run_now(self, request: Request, judged: approvals.JudgedTools | None) -> ExecutionResult:
        if request.session_id is not None:
            return self._run_in_session(request, judged)
        return self._execute(request, judged)

    def _finished(self, request: Request, result: ExecutionResult, started_at: datetime) -> None:
        """Put the run on record, then tell the observers (see `observers`)."""
        if self.audit is None and not self.observers:
            return
        policy = request.policy
        finished = Finished(
            result=result,
            code=request.program.code,
            caller=request.asker.caller,
            face=request.asker.face,
            profile=policy.profile if policy is not None else None,
            allowed_imports=tuple(sorted(policy.modules))[:_MAX_RECORDED_IMPORTS]
            if policy is not None and not policy.allows_every_module
            else (),
            started_at=started_at,
            finished_at=utc_now(),
        )
        if self.audit is not None:
            self.audit.record(finished)
        for observe in self.observers:
            try:
                observe(finished)
            except Exception:
                log.exception("host.observer_failed", extra={"observer": repr(observe)})

    def _tools_for(self, request: Request, judged: approvals.JudgedTools | None) -> RunTools | None:
        if self.tools is None:
            return None
        return self.tools.for_run(
            allowed_tools=request.allowed_tools,
            scrubber=self._scrubbers.asked,
            tokenize=self.tokenize,
            judged=judged,
        )

    def execute(self, request: Request) -> ExecutionResult:
        """The sandbox step of `run` alone, on this host: no approval, no scrubbing, no
        audit record. For a node of a cluster running what another Host admitted, which
        does those (`codecage.ray`'s actors under `serve --ray`); never with tools.

        Raises:
            ConfigError: the request was refused before anything ran.
            HostError: the host cannot provide the isolation.
            SandboxError: the sandbox itself failed.
        """
        if self.tools is not None:
            raise ConfigError(
                "Host.execute runs what another Host admitted, which has no tools here",
                hint="use Host.run",
            )
        return self._execute(request, None, here=True)

    def _execute(
        self, request: Request, judged: approvals.JudgedTools | None, *, here: bool = False
    ) -> ExecutionResult:
        placement = self.placement
        if placement is not None and not here and request.program.workspace is None:
            return self._execute_elsewhere(placement, request)
        backend = self.backend_for(request.backend)
        tools = self._tools_for(request, judged)
        run = self._engine_request(request, backend, tools)
        try:
            waited_ms = 0
            pool = self.pool
            if pool is not None and run.workspace_dir is None and backend is self.backend:
                result, waited_ms = self._run_warm(pool, run)
                if result is not None:
                    return _with_wait(result, waited_ms)
            templates = self.templates if backend is self.backend else None
            cold = engine.execute(run, backend, templates)
            if pool is not None and run.workspace_dir is None and backend is self.backend:
                pool.started_cold(self._spec(run.policy, run.limits, egress=run.egress is not None))
            return _with_wait(cold, waited_ms)
        finally:
            if tools is not None:
                tools.close()  # the run's token vault goes with it

    def _execute_elsewhere(self, placement: Placement, request: Request) -> ExecutionResult:
        """The run on the placement's nodes; its files, when the request reads them, put in
        a private directory of this host's for its `on_files` hook while it reads them
        (the hook reads them as it reads a workspace: no link followed, bounded)."""
        on_files = request.hooks.on_files
        keep_bytes = self.options.keep_files_mb * 2**20 if on_files is not None else 0
        placed = placement.run(request, keep_bytes)
        if on_files is not None and placed.result.files:
            with tempfile.TemporaryDirectory(prefix="codecage-placed-") as landed:
                if placed.kept is not None:
                    placed.kept.save(Path(landed), overwrite=False, partial=True)
                on_files(Path(landed), placed.result.files)
        return placed.result

    def _engine_request(
        self, request: Request, backend: Backend, tools: RunTools | None
    ) -> engine.RunRequest:
        return engine.RunRequest(
            code=request.program.code,
            filename=request.program.filename,
            limits=request.limits,
            workspace_dir=request.program.workspace,
            files=request.program.files,
            degraded=self.missing_layers()
            if backend is self.backend
            else self._failed_layers(backend)
            if self._selftest
            else (),
            policy=request.policy,
            cancel=request.hooks.cancel,
            on_files=request.hooks.on_files,
            tools=tools or bridge.NoServers(self._scrub_asked),
            face=request.asker.face,
            on_output=request.hooks.on_output,
            scrub_output=self._stream_scrub() if request.hooks.on_output is not None else None,
            egress=request.egress,
            egress_setup=self._egress_setup() if request.egress is not None else None,
            context=self._context,
        )

    def _egress_setup(self) -> EgressSetup:
        """The host proxy of this Host's runs, started at the first run allowed egress."""
        return self._egress.get(self.settings)

    # --- sessions ----------------------------------------------------------------------------

    def open_session(self, request: SessionRequest) -> sessions_engine.Session:
        """Open a session: a sandbox of its own (from the pool when one of its spec is
        warm, else started now) whose runs share one interpreter.

        Raises:
            SessionError: the client or this process has as many sessions as allowed.
            HostError: the host cannot provide the isolation.
            SandboxError: the sandbox failed to start.
        """
        engine.check_request("", "main.py", request.limits)
        self.missing_layers()  # the self-test verdict, as before any run
        terms = sessions_engine.SessionTerms(
            limits=request.limits,
            owner=request.client,
            idle_ttl=request.idle_ttl,
            lifetime=request.lifetime,
            policy=request.policy,
            egress=request.egress,
        )
        return self.sessions.open(terms, lambda: self._session_sandbox(terms))

    def _session_sandbox(
        self, terms: sessions_engine.SessionTerms
    ) -> tuple[engine.StartedSandbox, str, Callable[[engine.StartedSandbox], None]]:
        """A ready sandbox for a new session, its backend's name and how to dispose of it.
        Runs on the session registry's own thread (the sandbox lives as long as it)."""
        spec = self._spec(terms.policy, terms.limits, egress=terms.egress is not None)
        pool = self.pool
        if pool is not None:
            sandbox = pool.take(spec)
            if sandbox is not None:
                try:
                    engine.apply_limits(sandbox, terms.limits)
                except engine.LimitsNotApplicable:
                    pool.release(sandbox, ran=False)
                else:
                    return sandbox, self.backend.name, pool.release
        sandbox = engine.start(spec, terms.limits, self.backend)
        try:
            engine.wait_ready(sandbox, _SESSION_START_TIMEOUT_S)
        except BaseException:
            sandbox.destroy()
            raise
        return sandbox, self.backend.name, engine.StartedSandbox.destroy

    def _run_in_session(
        self, request: Request, judged: approvals.JudgedTools | None
    ) -> ExecutionResult:
        assert request.session_id is not None  # noqa: S101 - the caller checked
        if request.program.workspace is not None:
            raise ConfigError(
                "a session has its own workspace; a workspace directory cannot be given",
                hint="write files in the session's /workspace, or pass them as {files}",
            )
        session = self.sessions.get(request.session_id, request.asker.client)
        _check_session_limits(session.terms.limits, request.limits)
        tools = self._tools_for(request, judged)  # `run` gave the request the session's terms
        run = self._engine_request(request, self.backend, tools)
        engine.check_request(run.code, run.filename, run.limits, run.files)
        try:
            return session.run(run)
        finally:
            if tools is not None:
                tools.close()

    def _stream_scrub(self) -> Callable[[str, bool], str] | None:
        """How streamed output is scrubbed: as the result's streams are (None: not at all)."""
        scrubber = self.scrubber
        if scrubber is None or not scrubber.active:
            return None
        return lambda text, cut: scrubber.scrub(text, truncated=cut).text

    def audit_scrub(self, text: str) -> str:
        """What the audit trail keeps of a run's code: scrubbed as results are (the
        default detectors when results are not scrubbed: a record holds nothing in clear)."""
        return self._scrubbers.audit(text)

    def _scrub_asked(self, text: str) -> str:
        # Detectors only: the configured secrets would make it an oracle on them.
        return self._scrubbers.asked.without_secrets().scrub(text).text

    def _run_warm(
        self, pool: Pool, request: engine.RunRequest
    ) -> tuple[ExecutionResult | None, int]:
        """Run in a warm sandbox, and the ms spent waiting for one; no result when there is
        none for this request (its spec is not kept warm, none became ready in time, or it
        cannot take the limits): then run cold."""
        engine.check_request(request.code, request.filename, request.limits, request.files)
        asked = time.monotonic()
        spec = self._spec(request.policy, request.limits, egress=request.egress is not None)
        sandbox = pool.take(spec)
        waited_ms = int((time.monotonic() - asked) * 1000)
        if sandbox is None:
            return None, waited_ms
        ran = True
        try:
            return engine.run_in(sandbox, request, backend_name=self.backend.name), waited_ms
        except engine.LimitsNotApplicable as exc:
            log.info("sandbox.warm_refused_limits", extra={"error": str(exc)})
            ran = False
            return None, waited_ms
        finally:
            pool.release(sandbox, ran=ran)

    def _blocked_by_validation(self, request: Request) -> ExecutionResult | None:
        report = self.validate(request.program.code, request.policy, strict=True)
        if report.valid:
            return None
        refusing = [f for f in report.findings if f.severity == "high"] or report.findings
        listing = "\n".join(f"line {f.line}:{f.col} {f.rule_id} {f.message}" for f in refusing[:50])
        return ExecutionResult.blocked(
            error=ErrorInfo(type="ValidationError", message=report.message, traceback=listing),
            events=[
                Event(
                    kind="validation_finding",
                    detail=f"{f.rule_id} {f.severity} line {f.line}: {f.message}"[:2000],
                )
                for f in refusing[:50]
            ],
            limits=request.limits,
            backend=self.backend.name,
        )

    def validate(
        self, code: str, policy: ImportPolicy | None, *, strict: bool = False
    ) -> ValidationReport:
        """Check `code` against `policy` and this host's tool directories without running
        it: by the rule the sandbox's import hook applies, so `validate` and `run` agree
        (findings, never raises)."""
        given = {"servers": self.servers_dir, "skills": self.skills_dir}
        return validation.validate(
            code,
            allowed_modules=policy.modules if policy else None,
            profile_name=policy.profile if policy else "none",
            strict=strict,
            tool_packages=[name for name, path in given.items() if path is not None],
        )

    # --- the self-test ---------------------------------------------------------------------

    def missing_layers(self) -> tuple[str, ...]:
        """The layers the self-test found missing (none when it is off).

        Raises:
            HostError: some are missing and degraded runs were not allowed.
        """
        if not self._selftest:
            return ()
        missing = self._failed_layers(self.backend)
        if missing and not self.allow_degraded:
            verdict = self._verdict_of(self.backend)
            details = "; ".join(f"{p.layer}: {p.detail}" for p in verdict.probes if not p.passed)
            raise HostError(f"isolation layers missing on this host: {details}")
        if missing:
            log.warning("sandbox.degraded", extra={"missing": list(missing)})
        return missing

    def selftest_missing(self) -> tuple[str, ...] | None:
        """The layers the self-test finds missing for this host's backend, without raising
        (None: the self-test is off). Proven once per process, like `missing_layers`."""
        return self._failed_layers(self.backend) if self._selftest else None

    def doctor(self) -> DoctorReport:
        """Prove each layer by running probes in a real sandbox (never cached).

        Raises:
            HostError: the host cannot start a sandbox at all.
            SandboxError: the sandbox itself failed.
        """
        return selftest.run_probes(self.backend, self.identity)

    # --- reports and lifecycle -------------------------------------------------------------

    def info(
        self,
        *,
        policy: ImportPolicy | Literal["default"] | None = "default",
        allowed_tools: tuple[str, ...] | Literal["default"] | None = "default",
        limit_sources: Mapping[str, str] | None = None,
    ) -> HostInfo:
        """What this host provides: backend, layers really in force, defaults (those of a
        run with `policy` and `allowed_tools`; "default": the face's own), ceilings."""
        if policy == "default":
            policy = self.options.policy
        if allowed_tools == "default":
            allowed_tools = self.options.allowed_tools
        if limit_sources is None:
            limit_sources = self.limit_sources
        layers: list[LayerStatus] = [
            *self.backend.probe(),
            identities.probe(self.identity),
            seccomp.probe(),
            *cgroups.probe(),
            tmpfs.probe(),
        ]
        interpreter = rootfs.find_interpreter()
        settings = self.settings
        return HostInfo(
            version=__version__,
            backend=self.backend.name,
            backends=available_backends(),
            backend_states=backend_states(self.backend.name),
            bwrap_version=self.backend.version() if self.backend.runs_bubblewrap else None,
            python=f"{interpreter.executable} ({interpreter.version})",
            layers=layers,
            default_limits=self.limits,
            limit_sources=dict(limit_sources),
            profiles=profiles.describe(
                default=settings.profile,
                custom=settings.custom_profiles,
                enabled=settings.enabled_profiles,
            ),
            config_file=str(settings.config_file) if settings.config_file else None,
            config_origin=settings.config_origin,
            import_policy=policy.profile if policy else None,
            ceilings=engine.ceilings(),
            pool=(
                self.pool.state()
                if self.pool is not None
                else PoolState(
                    enabled=settings.pool.enabled, config=settings.pool, keys=[], host_rss_mb=None
                )
            ).model_copy(update={"fork_server": self._fork_server_state()}),
            scrub=redaction.state(self.scrub_settings, self.scrubber, self._scrub_source),
            tools=self._tools_state(allowed_tools),
            packages=packages.added_packages(self.packages_dir),
            data_dir=str(self.data_dir) if self.data_dir is not None else None,
            sessions=self.settings.sessions,
            open_sessions=self.sessions.open_count(),
            network=self._network_state(),
            audit=self._audit_state(),
        )

    def _audit_state(self) -> AuditState:
        trail = self.audit
        if trail is None:
            return AuditState(enabled=False)
        return AuditState(
            enabled=True,
            store=trail.store.location,
            required=trail.settings.required,
            failure=trail.failure,
        )

    def _network_state(self) -> NetworkState:
        network, grants = self.settings.network, self.grants
        return NetworkState(
            allow=[r.text for r in grants.allow],
            deny=[r.text for r in grants.deny],
            granted=[r.text for r in grants.operator],
            ceiling=[r.text for r in grants.ceiling_of("")],
            profiles={
                name: [r.text for r in rules] for name, rules in (grants.profiles or {}).items()
            },
            limits=network.limits,
        )

    def _tools_state(self, allowed_tools: tuple[str, ...] | None) -> ToolsState:
        limits = self.tool_limits
        return ToolsState(
            servers=sorted(self.tools.servers) if self.tools is not None else [],
            configured_servers=sorted(self.settings.mcp_servers),
            sandboxed_servers=self._sandboxed_servers(),
            allowed_tools=list(allowed_tools) if allowed_tools is not None else None,
            tokenize=self.tokenize,
            max_calls=limits.max_calls,
            max_in_flight=limits.max_in_flight,
            max_result_mb=round(limits.max_result_bytes / (1024 * 1024), 2),
            servers_dir=str(self.servers_dir) if self.servers_dir is not None else None,
            skills_dir=str(self.skills_dir) if self.skills_dir is not None else None,
        )

    def _sandboxed_servers(self) -> list[str]:
        """The upstream servers started in a sandbox of their own (`sandbox = true`)."""
        if self.tools is not None:
            return sorted(name for name, cfg in self.tools.servers.items() if cfg.sandbox)
        configured = self.settings.mcp_servers.items()
        return sorted(n for n, e in configured if isinstance(e, dict) and e.get("sandbox") is True)

    def warm(self, timeout: float) -> bool:
        """Wait until the pool has its warm sandboxes ready; False on timeout or no pool."""
        return self.pool.wait_ready(timeout) if self.pool is not None else False

    def _fork_server_state(self) -> ForkServerState:
        if self.templates is None:
            return ForkServerState(enabled=False, why_not=self.fork_server_off)
        return ForkServerState(
            enabled=True,
            forked=self.templates.forked,
            prefork=self.templates.prefork,
            spares=self.templates.spares(),
            spares_taken=self.templates.spares_taken,
            templates=[
                TemplateState(profile=profile, rss_mb=rss, pss_mb=pss)
                for profile, (rss, pss) in self.templates.memory().items()
            ],
        )

    def close(self) -> None:
        """Close every session, then stop this Host's own pool, killing its idle sandboxes
        (a shared one stays), its egress proxy, its alerter and its audit trail."""
        self.sessions.close_all()
        if self.placement is not None:
            self.placement.close()
        if self.pool is not None and self._owns_pool:
            self.pool.close()
        if self.templates is not None:
            self.templates.close()
        self._egress.close()
        if self.alerter is not None:  # before the audit trail it records in
            self.alerter.close()
        if self.audit is not None:
            self.audit.close()


_SESSION_START_TIMEOUT_S = 60.0


def _check_session_limits(session: Limits, run: Limits) -> None:
    """A run in a session sets its own timeout, CPU seconds and output cap only: memory,
    processes and disk are the session's, fixed when it was opened.

    Raises:
        ConfigError: the run asks for another value of one of those.
    """
    for name in Limits.model_fields:
        if name not in _PER_RUN_LIMITS and getattr(run, name) != getattr(session, name):
            raise ConfigError(
                f"{name} is the session's ({getattr(session, name)}), set when it was "
                f"opened; a run in it sets only timeout, cpu_seconds and max_output_bytes",
                hint="open a new session with the limits you need ({open_session})",
            )


def _above(limits: Limits, defaults: Limits) -> tuple[str, ...]:
    """The limits of `limits` above `defaults`, as "name value (default d)"."""
    found: list[str] = []
    for name in Limits.model_fields:
        value, default = getattr(limits, name), getattr(defaults, name)
        if isinstance(value, int | float) and isinstance(default, int | float) and value > default:
            found.append(f"{name} {value:g} (default {default:g})")
    return tuple(found)


def _cache_file(key: str) -> Path:
    return rootfs.cache_dir() / f"selftest-{key}.json"


def _read_cached(key: str) -> DoctorReport | None:
    try:
        return DoctorReport.model_validate_json(_cache_file(key).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_cached(key: str, report: DoctorReport) -> None:
    path = _cache_file(key)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.write_text(json.dumps(report.model_dump(mode="json")), encoding="utf-8")


def _with_wait(result: ExecutionResult, waited_ms: int) -> ExecutionResult:
    """`result` with the time its call waited for a warm sandbox (`Usage.waited_ms`)."""
    if not waited_ms:
        return result
    return result.model_copy(
        update={"usage": result.usage.model_copy(update={"waited_ms": waited_ms})}
    )


# --- the factory -----------------------------------------------------------------------------


def build(
    options: Resolved,
    *,
    observers: Iterable[Callable[[Finished], None]] = (),
    sessions: sessions_engine.Sessions | None = None,
    placement: Placement | None = None,
) -> Host:
    """The complete Host of `options`: its grants and identity, its backend (proven by the
    self-test), its scrubbers, audit trail and alerter, its fork server and pool, keeping
    the face's default spec warm. What could be refused is refused before the pool starts.

    Args:
        options: resolved once by the face (`Options.resolve`).
        observers: told of every finished run after the audit trail and the alerter (the
            MCP server's metrics).
        sessions: the session registry (None: one of the settings' [sessions]).
        placement: where the runs that need nothing of this host run instead (a Ray
            cluster: `codecage.ray.ClusterRuns`); None: here. Closed with the Host.

    Raises:
        ConfigError: a malformed tool pattern or network rule, no backend of that name, a
            bad data directory or alert command; a placement with upstream tools.
        HostError: no backend can run on this host.
        AuditError: the audit store cannot be opened.
    """
    settings, asked = options.settings, options.options
    if placement is not None:
        check_placeable(options)
    tooling.allow_patterns(options.allowed_tools)  # a malformed one fails here, not in a run
    grants = egress_grants.Grants.of(settings.network, asked.allow_hosts, face="library")
    identity = identities.plan(
        settings.sandbox.uid,
        settings.sandbox.gid,
        id_base=settings.sandbox.id_base,
        id_count=settings.sandbox.id_count,
    )
    backend = choose_backend(options, identity)
    packages_dir = packages.location(asked.packages_dir, settings)[0]
    data_dir = (
        datadir.check(asked.data_dir, _state_dirs(settings, packages_dir), identity.identity)
        if asked.data_dir is not None
        else None
    )
    _PROCESS.sweep_once()
    guardian.ensure()  # what this process leaves if it is killed is swept then
    scrubbers = Scrubbers.of(options)
    with contextlib.ExitStack() as undo:  # what is open closes when a later part is refused
        trail = AuditTrail.open(options.audit, scrubbers.audit) if options.audit else None
        if trail is not None:
            undo.callback(trail.close)
        alerter = _alerter(options, trail, scrubbers)
        if alerter is not None:
            undo.callback(alerter.close)
        templates = _templates(options, backend)
        pool = _pool(options, backend, templates[0])
        built = Host(
            options,
            backend=backend,
            identity=identity,
            grants=grants,
            scrubbers=scrubbers,
            audit=trail,
            alerter=alerter,
            observers=(*((alerter,) if alerter is not None else ()), *observers),
            templates=templates,
            pool=pool,
            places=(packages_dir, data_dir),
            sessions=sessions or sessions_engine.Sessions(settings.sessions),
            egress=EgressCell(),
            placement=placement,
        )
        undo.callback(built.close)
        # Runs with egress import the network modules too and need sandboxes made for
        # egress: keep that kind warm.
        egress, warm_policy = built.network_for(options.policy, None, options.face)
        built.keep_warm(warm_policy, egress=egress is not None)
        undo.pop_all()
    return built


def check_placeable(options: Resolved) -> None:
    """Refuse to send the runs of `options` to a placement (a Ray cluster) when they need
    this host: upstream tools (a node has no way back to the tool bridge).

    Raises:
        ConfigError: the options give the code upstream tools.
    """
    if options.options.tools is not None:
        raise ConfigError(
            "runs sent to a Ray cluster cannot call this host's upstream MCP tools: a node "
            "has no way back to the tool bridge",
            hint="serve without --ray to give the code tools, or without --mcp-config / "
            "--mcp-host (and the config's [mcp_servers]) to run it on the cluster",
        )


def _resolved_dir(path: str | Path | None) -> Path | None:
    return Path(path).resolve() if path is not None else None


def _state_dirs(settings: Settings, packages_dir: Path | None) -> list[Path]:
    """codecage's own places, which a data directory must neither be in nor hold."""
    # The config file and the places one is looked for (files: a data directory must not
    # hold them); not the directories above them, which hold everything (/ among them).
    config_files = [settings.config_file] if settings.config_file else []
    places = [
        private_parent(),
        staging.STAGE_ROOT,
        rootfs.cache_dir(),
        *config_files,
        *settings.config_searched,
    ]
    return places + ([packages_dir] if packages_dir is not None else [])


def choose_backend(options: Resolved, identity: identities.IdentityPlan) -> Backend:
    """The backend asked for, or for "auto" the first of the candidates (in the order the
    config's sandbox table gives, else `AUTO_ORDER`) whose self-test passes here; with the
    self-test off, the first that loads. When none passes, the first: its run then fails
    with what is missing (or runs degraded, when allowed).

    Raises:
        ConfigError: no backend has that name.
        HostError: no backend can run on this host.
    """
    asked = options.options
    if asked.backend != "auto":
        return load_backend(asked.backend, allow_degraded=asked.allow_degraded)
    order = options.settings.sandbox.backends
    candidates = auto_candidates(
        tuple(order) if order is not None else None, allow_degraded=asked.allow_degraded
    )
    if not asked.selftest:
        return candidates[0]
    for candidate in candidates:
        try:
            failed = failed_layers(candidate, identity)
        except SandboxError as exc:
            # A backend whose self-test sandbox cannot even start (bwrap in a container
            # that masks /proc: "Can't mount proc") fails it; the next candidate may hold.
            failed = (f"its self-test sandbox did not start: {exc}",)
        if not failed:
            return candidate
        log.warning(
            "sandbox.backend_failed_selftest",
            extra={"backend": candidate.name, "failed": list(failed)},
        )
    return candidates[0]


def failed_layers(backend: Backend, identity: identities.IdentityPlan) -> tuple[str, ...]:
    """The layers `backend`'s self-test finds missing here, less its gaps by design
    (the Landlock fallback's: accepted by choosing it, and named in each result by
    `Backend.lost_layers`)."""
    gaps = backend.selftest_gaps
    return tuple(
        layer for layer in verdict_of(backend, identity).failed_layers() if layer not in gaps
    )


def verdict_of(backend: Backend, identity: identities.IdentityPlan) -> DoctorReport:
    """`backend`'s self-test verdict for these sandbox ids: once per process, and from the
    disk cache while it passes."""

    def prove() -> DoctorReport:
        log.info("sandbox.selftest", extra={"backend": backend.name})
        return selftest.run_probes(backend, identity)

    return _PROCESS.verdict(_PROCESS.verdict_key(backend, identity.identity), prove)


def _templates(
    options: Resolved, backend: Backend
) -> tuple[forkserver.Templates | None, str | None]:
    """The fork server of the Host's runs, or None and why not (engine/forkserver.py)."""
    pool = options.settings.pool
    wanted = options.options.fork_server
    if not (pool.fork_server if wanted is None else wanted):
        return None, "turned off ([pool] fork_server, CODECAGE_FORK_SERVER, fork_server=)"
    why_not = forkserver.supported(backend)
    if why_not is not None:
        return None, why_not
    templates = forkserver.Templates(
        backend,
        options.limits,
        max_runs=pool.template_max_runs,
        max_age_s=pool.template_max_age,
        # Without a pool (none asked for, none in the config) the default is still warm:
        # after each run the next sandbox of its kind is forked ahead. `pool=False` (the
        # CLI's one-shot `run`) means cold starts only.
        prefork=pool.prefork and options.options.pool is None and not pool.enabled,
    )
    return templates, None


def _pool(
    options: Resolved, backend: Backend, templates: forkserver.Templates | None
) -> tuple[Pool | None, bool]:
    """The Host's pool and whether it is its own (which `close` stops)."""
    pool, settings = options.options.pool, options.settings
    if isinstance(pool, Pool):
        return pool, False
    if pool is False or (pool is None and not settings.pool.enabled):
        return None, False
    config = settings.pool.model_copy(update={"enabled": True})
    return Pool(backend, config, options.limits, templates=templates), True


def _alerter(
    options: Resolved, trail: AuditTrail | None, scrubbers: Scrubbers
) -> alerting.Alerter | None:
    """The alerter `options` ask for, recording in `trail`.

    Raises:
        ConfigError: the command is not an executable program.
    """
    if options.alerts is None:
        return None
    asked = options.options
    given = {"servers": _resolved_dir(asked.servers_dir), "skills": _resolved_dir(asked.skills_dir)}
    tool_packages = [name for name, path in given.items() if path is not None]

    def validate(code: str) -> ValidationReport:
        return validation.validate(
            code, allowed_modules=None, profile_name="none", strict=True,
            tool_packages=tool_packages,
        )  # fmt: skip

    return alerting.start(options.alerts, trail, scrubbers.audit, validate)


@dataclass(frozen=True, slots=True)
class Scrubbers:
    """What a Host scrubs with: results' (None: not scrubbed), and the one code asks for
    (`codecage.runtime.scrub`), which has the default detectors even when results are not
    scrubbed; the audit trail keeps code scrubbed by the latter."""

    settings: ScrubSettings
    source: str
    scrubber: scrubbing.Scrubber | None
    asked: scrubbing.Scrubber

    @classmethod
    def of(cls, options: Resolved) -> Scrubbers:
        tools = options.options.tools
        scrubber = redaction.build_scrubber(
            options.scrub, extra_secrets=tools.secrets() if tools is not None else ()
        )
        return cls(
            options.scrub, options.origin("scrub"), scrubber, scrubber or scrubbing.Scrubber()
        )

    def audit(self, text: str) -> str:
        """What the audit trail keeps of a run's code: nothing in clear."""
        return self.asked.scrub(text).text


class EgressCell:
    """The host proxy of a Host's runs, started at the first run allowed egress (imported
    then too: most runs have no network, and the proxy needs asyncio, h11)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._setup: EgressSetup | None = None
        self._made_here = forks.ForkGuard()  # whose process made `_setup`

    def get(self, settings: Settings) -> EgressSetup:
        from codecage.egress import setup as egress_setup

        with self._lock:
            if self._setup is not None and not self._made_here.owned_here():
                # A forked child has the parent's proxy but not its loop thread: leave it
                # (the parent's to close) and make one of its own.
                self._setup = None
            if self._setup is None:
                self._made_here = forks.ForkGuard()
                config_file = settings.config_file
                self._setup = egress_setup.build(
                    settings.network,
                    base_dir=config_file.parent if config_file is not None else None,
                    ca_dir=settings.config_relative(settings.network.ca_dir),
                )
            return self._setup

    def close(self) -> None:
        with self._lock:
            if self._setup is not None and self._made_here.owned_here():
                self._setup.proxy.close()
                self._setup = None


def input_files(files: Mapping[str, bytes | str] | None) -> dict[str, bytes] | None:
    """A face's input files as a `Request` takes them: bytes (str as UTF-8)."""
    if not files:
        return None
    return {
        name: data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
        for name, data in files.items()
    }
