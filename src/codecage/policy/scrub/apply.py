"""Scrubbing of what a run returns: the policy of what is scrubbed, and when.

`codecage.policy.scrub` knows how to find personal data and secrets in text; this module applies
it, in the host, to every text of an `ExecutionResult` before it reaches a caller: stdout
and stderr (whole streams, so a value written in two pieces is whole again; with the cap
rules when the host cut a stream), the error's message and traceback, the return value
(keys included), the events' details and data, and the text of the display outputs
(text/plain, text/markdown, text/html, image/svg+xml and application/json: images are not
read, so a picture of a card number leaves as it is). The runtime's `logger` writes to
stderr, so it is covered there. The guest is never trusted to scrub its own output.

`Sandbox.run` calls `scrub_result` on every path (cold, warm, blocked by validation), so
the CLI, the MCP server and library callers all see the same scrubbed result.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any, cast

from codecage.models import (
    DisplayOutput,
    ErrorInfo,
    Event,
    ExecutionResult,
    FileInfo,
    ScrubSettings,
    ScrubState,
)
from codecage.output import neutralise
from codecage.policy.scrub import MIN_SECRET_CHARS, Category, Scrubber, ScrubConfig, merge_counts

__all__ = ["build_scrubber", "scrub_result", "state"]

log = logging.getLogger(__name__)

_MAX_EVENT_DETAIL = 2000  # Event.detail's bound: a placeholder may lengthen a text


def build_scrubber(
    settings: ScrubSettings,
    *,
    extra_secrets: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> Scrubber | None:
    """The scrubber `settings` ask for, or None when scrubbing is off.

    `extra_secrets` are values the host knows to be credentials (the upstream MCP servers'
    env and header values): one shorter than `MIN_SECRET_CHARS` is skipped with a warning,
    since it would redact ordinary words. `settings.secrets_env` names variables of
    `environ` (default: this process's environment); an unset one is skipped.

    Raises:
        ConfigError: a configured secret is too short, or a category or region is unknown.
    """
    if not settings.enabled:
        return None
    env = os.environ if environ is None else environ
    from_env = [env[name] for name in settings.secrets_env if env.get(name)]
    secrets = [*settings.secrets, *from_env]
    for secret in extra_secrets:
        if len(secret.strip()) >= MIN_SECRET_CHARS:
            secrets.append(secret)
        elif secret.strip():  # e.g. DEBUG=1 in a server's env: not a credential
            log.debug(
                "scrub.short_secret_skipped",
                extra={"chars": len(secret.strip()), "minimum": MIN_SECRET_CHARS},
            )
    config = ScrubConfig(
        categories=frozenset(cast(list[Category], settings.categories())),
        secrets=tuple(secrets),
        phone_region=settings.phone_region,
    )
    return Scrubber(config)


def state(settings: ScrubSettings, scrubber: Scrubber | None, source: str) -> ScrubState:
    """What `info` reports: the categories and the number of secrets, never their values."""
    return ScrubState(
        enabled=scrubber is not None,
        categories=sorted(scrubber.config.categories) if scrubber is not None else [],
        secrets=len(scrubber.config.secrets) if scrubber is not None else 0,
        phone_region=settings.phone_region,
        source=source,
    )


def scrub_result(result: ExecutionResult, scrubber: Scrubber | None) -> ExecutionResult:
    """`result` with every finding in what it returns replaced by a typed placeholder, and
    `redactions` counting them; `result` itself when `scrubber` is None.

    Raises:
        Nothing.
    """
    if scrubber is None or not scrubber.active:
        return result
    raw_stdout, stdout, stdout_counts = _scrub_stream(
        scrubber, result.raw_stdout(), result.stdout, truncated=result.stdout_truncated
    )
    raw_stderr, stderr, stderr_counts = _scrub_stream(
        scrubber, result.raw_stderr(), result.stderr, truncated=result.stderr_truncated
    )
    error, error_counts = _scrub_error(scrubber, result.error)
    returned = scrubber.scrub_value(result.return_value)
    events, event_counts = _scrub_events(scrubber, result.events)
    files, file_counts = _scrub_file_names(scrubber, result.files)
    displays, display_counts = _scrub_displays(scrubber, result.displays)
    counts = merge_counts(
        result.redactions,
        stdout_counts,
        stderr_counts,
        error_counts,
        returned.counts,
        event_counts,
        file_counts,
        display_counts,
    )
    scrubbed = result.model_copy(
        update={
            "stdout": stdout,
            "stderr": stderr,
            "error": error,
            "return_value": returned.value if returned.counts else result.return_value,
            "events": events,
            "files": files,
            "displays": displays,
            "redactions": counts,
        }
    )
    return scrubbed.with_raw_output(raw_stdout, raw_stderr)


def _scrub_stream(
    scrubber: Scrubber, raw: bytes, shown: str, *, truncated: bool
) -> tuple[bytes, str, dict[str, int]]:
    """A stream's raw bytes and shown text, scrubbed once: the raw bytes are decoded so that
    every byte survives (`surrogateescape`), scrubbed, encoded back, and shown neutralised,
    exactly as the engine shows the bytes it read."""
    if not raw:  # a result the host made itself (blocked): only the text exists
        done = scrubber.scrub(shown, truncated=truncated)
        return raw, done.text, done.counts
    done = scrubber.scrub(raw.decode("utf-8", "surrogateescape"), truncated=truncated)
    if not done.counts:
        return raw, shown, {}
    scrubbed_raw = done.text.encode("utf-8", "surrogateescape")
    return scrubbed_raw, neutralise(scrubbed_raw), done.counts


def _scrub_error(
    scrubber: Scrubber, error: ErrorInfo | None
) -> tuple[ErrorInfo | None, dict[str, int]]:
    if error is None:
        return None, {}
    done = scrubber.scrub_value([error.type, error.message, error.traceback])
    if not done.counts:
        return error, {}
    kind, message, traceback = cast(list[str], done.value)
    return ErrorInfo(type=kind, message=message, traceback=traceback), done.counts


def _scrub_events(scrubber: Scrubber, events: list[Event]) -> tuple[list[Event], dict[str, int]]:
    if not events:
        return events, {}
    details = scrubber.scrub_value([[e.detail, e.data] for e in events])
    if not details.counts:
        return events, {}
    pairs = cast(list[list[Any]], details.value)
    scrubbed = [
        event.model_copy(update={"detail": str(detail)[:_MAX_EVENT_DETAIL], "data": data})
        for event, (detail, data) in zip(events, pairs, strict=True)
    ]
    return scrubbed, details.counts


def _scrub_file_names(
    scrubber: Scrubber, files: list[FileInfo]
) -> tuple[list[FileInfo], dict[str, int]]:
    """A file named after a customer (``alice@example.com.csv``) leaks in its name, and so
    does one named by a card in a directory (``out/4111111111111111.txt``): each name is
    read with its separators as spaces (`Scrubber.scrub_name`)."""
    if not files:
        return files, {}
    names = [scrubber.scrub_name(f.path) for f in files]
    counts = merge_counts(*(n.counts for n in names))
    if not counts:
        return files, {}
    return [f.model_copy(update={"path": n.text}) for f, n in zip(files, names, strict=True)], (
        counts
    )


_IMAGE_MIMES = frozenset({"image/png", "image/jpeg"})  # base64 of pixels: nothing to read


def _scrub_displays(
    scrubber: Scrubber, displays: list[DisplayOutput]
) -> tuple[list[DisplayOutput], dict[str, int]]:
    """Every text form of every output (JSON values: their strings, keys included), like
    stdout; the images as they are."""
    if not displays:
        return displays, {}
    texts = [{m: v for m, v in d.data.items() if m not in _IMAGE_MIMES} for d in displays]
    done = scrubber.scrub_value(texts)
    if not done.counts:
        return displays, {}
    scrubbed = [
        display.model_copy(update={"data": {**display.data, **cast(dict[str, Any], text)}})
        for display, text in zip(displays, cast(list[Any], done.value), strict=True)
    ]
    return scrubbed, done.counts
