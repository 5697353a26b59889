"""OpenTelemetry traces: a span per `execute_code` run, when the SDK is installed and the
operator configured an exporter; otherwise off, at the cost of one None check per run.

On when `configure` finds, in the environment (the SDK's own variables, nothing of
codecage's):
- a tracer provider already installed (the process runs under `opentelemetry-instrument`,
  or an embedding application set one): its spans go where that one sends them; or
- `OTEL_TRACES_EXPORTER` naming exporters other than "none", or an
  `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (then "otlp", the
  SDK's default exporter): a provider of codecage's own, its spans batched off the run's
  thread. Exporters are found as the SDK finds them (the `opentelemetry_traces_exporter`
  entry points: "console" is built in, "otlp" needs opentelemetry-exporter-otlp); "console"
  writes to stderr, since stdout is the stdio transport's.
`OTEL_SDK_DISABLED=true` keeps it off. The resource is the SDK's (`OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES`), with service.name "codecage" unless those name one.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from importlib.metadata import entry_points
from types import TracebackType
from typing import TYPE_CHECKING, Any

from codecage.models import ExecutionResult

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger(__name__)

SPAN_NAME = "execute_code"
_ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


class _State:
    tracer: Tracer | None = None


_STATE = _State()


def configure(environ: Mapping[str, str] | None = None) -> bool:
    """Turn traces on when the environment asks for them and the SDK is there (see the
    module's docstring); whether they are on. A configured exporter that cannot be loaded
    is logged (`server.otel_exporter_unavailable`) and left out."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    names = _exporter_names(env)
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
    except ImportError:
        if names:
            log.warning("server.otel_sdk_missing", extra={"exporters": names})
        return False
    installed = trace.get_tracer_provider()
    if isinstance(installed, TracerProvider):
        use(installed)
        return True
    if not names:
        return False
    provider = _provider(names, env)
    if provider is None:
        return False
    atexit.register(provider.shutdown)  # the batched spans are sent before the process ends
    use(provider)
    return True


def use(provider: Any | None) -> None:
    """Trace runs with this `TracerProvider` (None: off). For tests, and for an embedding
    application that holds its own."""
    _STATE.tracer = provider.get_tracer("codecage") if provider is not None else None


def enabled() -> bool:
    return _STATE.tracer is not None


def _exporter_names(env: Mapping[str, str]) -> list[str]:
    listed = env.get("OTEL_TRACES_EXPORTER")
    if listed is None:
        return ["otlp"] if any(env.get(name) for name in _ENDPOINTS) else []
    return [n.strip() for n in listed.split(",") if n.strip() and n.strip() != "none"]


def _provider(names: list[str], env: Mapping[str, str]) -> TracerProvider | None:
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    found = {e.name: e for e in entry_points(group="opentelemetry_traces_exporter")}
    exporters: list[Any] = []
    for name in names:
        if name == "console":
            exporters.append(ConsoleSpanExporter(out=sys.stderr))
        elif name in found:
            exporters.append(found[name].load()())
        else:
            log.warning(
                "server.otel_exporter_unavailable",
                extra={
                    "exporter": name,
                    "hint": "install its package (e.g. opentelemetry-exporter-otlp for otlp) "
                    "or set OTEL_TRACES_EXPORTER to one installed: " + ", ".join(found),
                },
            )
    if not exporters:
        return None
    detected = OTELResourceDetector().detect()
    named = "service.name" in detected.attributes or env.get("OTEL_SERVICE_NAME")
    resource = Resource.create({} if named else {"service.name": "codecage"})
    provider = TracerProvider(resource=resource)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


# --- a run's span ---------------------------------------------------------------------------


class RunSpan:
    """A run's span while it lasts; `ended(result)` sets what the run came to. The no-op
    one (`NO_SPAN`) is what every run gets when traces are off."""

    def __init__(self, span: Span | None = None) -> None:
        self.span = span

    def ended(self, result: ExecutionResult) -> None:
        if self.span is None:
            return
        self.span.set_attributes(
            {
                "codecage.execution_id": result.execution_id,
                "codecage.status": result.status,
                "codecage.backend": result.backend,
                "codecage.wall_ms": result.usage.wall_ms,
            }
        )
        if result.session_id is not None:
            self.span.set_attribute("codecage.session_id", result.session_id)


class _NoSpan(contextlib.AbstractContextManager[RunSpan]):
    _span = RunSpan()

    def __enter__(self) -> RunSpan:
        return self._span

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None


NO_SPAN = _NoSpan()


def run_span(
    profile: str | None, queue_ms: float | None = None
) -> contextlib.AbstractContextManager[RunSpan]:
    """The span of one run (import profile `profile`; "none" without a policy), a child of
    the context's current span; an exception out of it marks the span an error."""
    tracer = _STATE.tracer
    if tracer is None:
        return NO_SPAN
    return _span(tracer, profile, queue_ms)


@contextlib.contextmanager
def _span(tracer: Tracer, profile: str | None, queue_ms: float | None) -> Iterator[RunSpan]:
    attributes: dict[str, str | float] = {"codecage.profile": profile or "none"}
    if queue_ms is not None:
        attributes["codecage.queue_ms"] = round(queue_ms, 3)
    with tracer.start_as_current_span(SPAN_NAME, attributes=attributes) as span:
        yield RunSpan(span)
