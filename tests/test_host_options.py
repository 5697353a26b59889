"""Options resolved once, one complete host, faces that hold it (the structure issue, items
1 and 2): the options object says where each value came from, the factory builds a Host
that nothing can change afterwards, and `Sandbox` is a thin facade with a small, public
signature."""

from __future__ import annotations

import ast
import collections.abc
import dataclasses
import inspect
import pathlib
import sys
import types
import typing
from pathlib import Path

import pytest

import codecage
from codecage import Options, Sandbox, engine
from codecage import host as hosts
from codecage import sandbox as sandboxes
from codecage.audit.metrics import ServerMetrics
from codecage.config import load
from codecage.mcp import health
from codecage.mcp.server import build_server
from codecage.models import AlertSettings, Limits

SRC = Path(codecage.__file__).parent


# --- item 2: Sandbox is a thin facade -------------------------------------------------------


def test_sandbox_takes_at_most_twelve_keywords() -> None:
    params = inspect.signature(Sandbox.__init__).parameters
    keywords = [p for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert len(keywords) <= 12, [p.name for p in keywords]
    # The ones a newcomer reaches for stay keywords; the rest are `Options` fields.
    everyday = {"limits", "backend", "profile", "allowed_imports", "pool", "tools"}
    assert everyday | {"allowed_tools", "allow_hosts", "config", "options"} <= {
        p.name for p in keywords
    }
    assert {p.name for p in keywords} - {"options"} <= {f.name for f in dataclasses.fields(Options)}


def _classes_in(hint: object) -> set[type]:
    """Every class a type hint names (through unions, generics and callables)."""
    found: set[type] = set()
    origin = typing.get_origin(hint)
    if origin is not None:
        if isinstance(origin, type) and origin not in (types.UnionType,):
            found.add(origin)
        for arg in typing.get_args(hint):
            found |= _classes_in(arg)
    elif isinstance(hint, list):  # Callable's parameter list
        for arg in hint:
            found |= _classes_in(arg)
    elif isinstance(hint, type) and hint is not type(None):
        found.add(hint)
    return found


def test_the_sandbox_signature_names_only_public_types() -> None:
    """Every type in `Sandbox(...)`'s signature is in `codecage.__all__` or the standard
    library: a caller can spell every argument without reaching into internals."""
    public = {getattr(codecage, name) for name in codecage.__all__ if name != "__version__"}
    namespace = {name: getattr(codecage, name) for name in codecage.__all__}
    hints = typing.get_type_hints(
        Sandbox.__init__, globalns={**vars(sandboxes), **namespace}, localns=namespace
    )
    stdlib = (sys.modules["builtins"], collections.abc, pathlib, typing)
    leaked = set()
    for name, hint in hints.items():
        for cls in _classes_in(hint):
            if cls in public or sys.modules.get(cls.__module__) in stdlib:
                continue
            leaked.add(f"{name}: {cls.__module__}.{cls.__qualname__}")
    assert not leaked, sorted(leaked)


def test_the_sandbox_forwards_nothing_of_its_host() -> None:
    """No property that only reads the Host through: the face holds it (`sandbox.host`)."""
    forwarding = [name for name, member in vars(Sandbox).items() if isinstance(member, property)]
    assert forwarding == []


def test_a_sandbox_keyword_wins_over_the_same_option() -> None:
    with Sandbox(
        profile="basic", pool=False, options=Options(profile="standard", fork_server=False)
    ) as sandbox:
        assert sandbox.policy is not None and sandbox.policy.profile == "basic"
        assert sandbox.host.templates is None  # the option of its own came through
        assert sandbox.run("1 + 1").return_value == 2


# --- item 1: one complete host, nothing set on it afterwards ---------------------------------


def _true_command() -> list[str]:
    return ["/bin/true"]


def test_the_host_cannot_be_changed_once_built() -> None:
    alerts = AlertSettings(command=_true_command())
    with Sandbox(pool=False, options=Options(alerts=alerts, audit=False)) as sandbox:
        runtime = sandbox.host
        assert runtime.alerter is not None and runtime.alerter in runtime.observers
        for name, value in (("audit", None), ("observers", []), ("limits", Limits())):
            with pytest.raises(AttributeError, match="after the Host is built"):
                setattr(runtime, name, value)
        with pytest.raises(AttributeError):
            runtime.observers.append(print)  # type: ignore[attr-defined]


def test_every_face_builds_its_host_complete(tmp_path: Path) -> None:
    """The library, the MCP server and its HTTP endpoints hold one Host each: its observers
    (the server's metrics among them) are given to the factory, none added later."""
    metrics = ServerMetrics()
    options = Options(pool=False, face="mcp", audit=tmp_path / "audit.db").resolve()
    runtime = hosts.build(options, observers=(metrics.observe,))
    try:
        observers = runtime.observers
        health.watch(metrics, runtime)
        build_server(runtime, metrics=metrics)
        assert runtime.observers is observers and observers == (metrics.observe,)
        assert runtime.audit is not None  # the face "mcp" keeps an audit trail by default
        library = sandboxes.over(runtime)
        assert library.run("6 * 7").return_value == 42
        assert b"codecage_runs_total" in metrics.exposition()
    finally:
        runtime.close()


# --- item 1: options resolved once, with their origins ---------------------------------------


def test_options_say_where_each_value_came_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[limits]\ntimeout = 7\n\n[policy]\nprofile = 'basic'\n", encoding="utf-8")
    path.chmod(0o600)
    monkeypatch.setenv("CODECAGE_MEMORY_MB", "300")
    monkeypatch.setenv("CODECAGE_POOL", "0")
    resolved = Options(config=path, limits={"cpu_seconds": 3}, backend="bwrap").resolve()
    assert resolved.origin("timeout") == f"file {path}"
    assert resolved.origin("profile") == f"file {path}"
    assert resolved.origin("memory_mb") == "env CODECAGE_MEMORY_MB"
    assert resolved.origin("pool") == "env CODECAGE_POOL"
    assert resolved.origin("cpu_seconds") == "argument"
    assert resolved.origin("backend") == "argument"
    assert resolved.origin("max_processes") == "default"
    assert resolved.origin("scrub") == "default"
    assert (resolved.limits.timeout, resolved.limits.memory_mb) == (7, 300)
    assert resolved.limits.cpu_seconds == 3
    assert resolved.policy is not None and resolved.policy.profile == "basic"
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.limits = Limits()  # type: ignore[misc]


def test_options_resolve_over_settings_loaded_once(tmp_path: Path) -> None:
    settings = load(environ={})
    resolved = Options(config=settings, profile="basic").resolve()
    assert resolved.settings is settings
    assert resolved.origin("profile") == "argument"
    assert resolved.limit_sources["profile"] == "argument"


# --- the library's faces import one way ------------------------------------------------------


def _imported(module: Path) -> set[str]:
    """The codecage modules `module` imports anywhere (functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_the_session_face_does_not_import_the_sandbox() -> None:
    """`sandbox` imports `session`; `session` holds the Host, never the Sandbox."""
    assert "codecage.sandbox" not in _imported(SRC / "session.py")
    assert "codecage.session" in _imported(SRC / "sandbox.py")


# --- item 3: a run carries only the run ------------------------------------------------------


def test_a_run_request_carries_none_of_the_hosts_values() -> None:
    """What is the same for every run of a host lives in one `HostContext`, made once when
    the host is built; a request holds what this run asked for, and points to it."""
    host_wide = {
        "tool_limits", "servers_dir", "skills_dir", "packages_dir", "data_dir",
        "wider_profile", "identity", "network_limits",
    }  # fmt: skip
    assert not host_wide & {f.name for f in dataclasses.fields(engine.RunRequest)}
    assert host_wide == {f.name for f in dataclasses.fields(engine.HostContext)}
    with Sandbox(pool=False, options=Options(import_policy=False)) as sandbox:
        runtime = sandbox.host
        request = hosts.Request(hosts.Program("1"), limits=runtime.limits, policy=None)
        first = runtime._engine_request(request, runtime.backend, None)
        second = runtime._engine_request(request, runtime.backend, None)
        assert first.context is second.context  # made once, not per run
        assert first.context.identity is runtime.identity


def test_a_face_asks_for_a_run_in_a_few_small_frozen_groups() -> None:
    """`host.Request` holds what one run asks for, grouped: the program, who asks, how they
    follow it. What the host decides itself (the tools [approval] judged a run by) is not
    a field a face could set."""
    fields = {f.name: f.type for f in dataclasses.fields(hosts.Request)}
    assert len(fields) <= 10, sorted(fields)
    assert "judged_tools" not in fields
    for group in (hosts.Program, hosts.Asker, hosts.Hooks):
        params = group.__dataclass_params__  # type: ignore[attr-defined]
        assert params.frozen, group
        assert len(dataclasses.fields(group)) <= 4, group
    # Nothing is in two places: a grouped field is not also on the request.
    grouped = {
        f.name for g in (hosts.Program, hosts.Asker, hosts.Hooks) for f in dataclasses.fields(g)
    }
    assert not grouped & set(fields)
