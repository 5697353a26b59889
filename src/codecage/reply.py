"""What `execute_code` hands back over MCP: a summary a model reads, the ExecutionResult as
structured content, and images and asked-for text files, all in one message of at most
`MAX_REPLY_BYTES`.

Why a bound: clients of the protocols before 2026-07-28 read a streamable-HTTP reply as one
server-sent event and refuse an event over 1 MiB (the SDK's client does), and a model gains
nothing from megabytes of output in its context. A reply over the bound is cut in steps,
least useful first, each step only when the reply is still too large:

1. stdout, stderr, the traceback and the return value in the structured result, down to
   `_OUTPUT_KEPT` each (what a program prints in bulk is rarely what the model needs);
2. the attached text files and images, the largest first (a plot is worth more than a log);
3. the same fields down to `_OUTPUT_KEPT_LAST`, the files list to its first entries.

What was cut is said in a `reply_trimmed` event, first among the events so that the summary
shows it; the cut fields carry their `*_truncated` flags.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mcp_types import CallToolResult, ContentBlock, ImageContent, TextContent

from codecage.models import ErrorInfo, Event, ExecutionResult
from codecage.output import neutralise_line

# Under the 1,048,576 bytes of an SSE event, with room for the JSON-RPC envelope and the
# SSE framing around the result.
MAX_REPLY_BYTES = 1_000_000
_OUTPUT_KEPT = 128 * 1024  # characters of each output field, at the first cut
_OUTPUT_KEPT_LAST = 16 * 1024  # and at the last
_FILES_KEPT_LAST = 100
_SUMMARY_OUTPUT_CHARS = 20_000  # of stdout, stderr and the return value each, in the summary
_SUMMARY_FILES = 20  # file names listed in the summary (all are in the structured content)


def build(result: ExecutionResult, attachments: list[ContentBlock]) -> CallToolResult:
    """The reply for `result`, with `attachments` (images, inline text files) after the
    summary, cut to at most MAX_REPLY_BYTES as the module says."""
    reply = _Reply(result, list(attachments))
    assembled = reply.assemble()
    for step in _STEPS:
        if _size(assembled) <= MAX_REPLY_BYTES:
            break
        step(reply)
        assembled = reply.assemble()
    return assembled


def _size(reply: CallToolResult) -> int:
    """Bytes of the reply as the SDK sends it (the JSON of the CallToolResult)."""
    return len(reply.model_dump_json(by_alias=True, exclude_none=True))


@dataclass
class _Reply:
    result: ExecutionResult
    attachments: list[ContentBlock]
    cuts: list[str] = field(default_factory=list)

    def assemble(self) -> CallToolResult:
        result = self.result
        if self.cuts:
            note = Event(
                kind="reply_trimmed",
                detail=("to keep the reply under 1 MB: " + "; ".join(self.cuts))[:2000],
            )
            result = result.model_copy(update={"events": [note, *result.events]})
        return CallToolResult(
            content=[TextContent(type="text", text=summary(result)), *self.attachments],
            structured_content=result.model_dump(mode="json"),
            is_error=False,
        )

    def size(self) -> int:
        return _size(self.assemble())


def _cut_output_to(kept: int) -> Callable[[_Reply], None]:
    def cut(reply: _Reply) -> None:
        result = reply.result
        changes: dict[str, Any] = {}
        for name in ("stdout", "stderr"):
            text: str = getattr(result, name)
            if len(text) > kept:
                changes[name] = text[:kept]
                changes[f"{name}_truncated"] = True
                reply.cuts.append(f"{name} cut to its first {kept} of {len(text)} characters")
        value_json = json.dumps(result.return_value, ensure_ascii=False, default=repr)
        if len(value_json) > kept:
            changes["return_value"] = value_json[:kept] + "…"
            reply.cuts.append(
                f"the return value cut to the first {kept} of the {len(value_json)} "
                "characters of its JSON, as a string"
            )
        if result.error is not None and len(result.error.traceback) > kept:
            traceback = "…" + result.error.traceback[-kept:]  # its end says what failed
            changes["error"] = ErrorInfo(
                type=result.error.type, message=result.error.message[:kept], traceback=traceback
            )
            reply.cuts.append(f"the traceback cut to its last {kept} characters")
        if changes:
            reply.result = result.model_copy(update=changes)  # keeps the raw output too

    return cut


def _drop_attachments(reply: _Reply) -> None:
    """The largest attachments first, until the reply fits."""
    excess = reply.size() - MAX_REPLY_BYTES
    while excess > 0 and reply.attachments:
        largest = max(reply.attachments, key=_block_size)
        reply.attachments.remove(largest)
        reply.cuts.append(f"{_describe(largest)} left out")
        excess -= _block_size(largest)
        if excess <= 0:  # by the estimate: measure
            excess = reply.size() - MAX_REPLY_BYTES


def _cut_files_list(reply: _Reply) -> None:
    files = reply.result.files
    if len(files) > _FILES_KEPT_LAST:
        reply.result = reply.result.model_copy(update={"files": files[:_FILES_KEPT_LAST]})
        reply.cuts.append(f"the files list cut to its first {_FILES_KEPT_LAST} of {len(files)}")


def _cut_last(reply: _Reply) -> None:
    _cut_output_to(_OUTPUT_KEPT_LAST)(reply)
    _cut_files_list(reply)


_STEPS: tuple[Callable[[_Reply], None], ...] = (
    _cut_output_to(_OUTPUT_KEPT),
    _drop_attachments,
    _cut_last,
)


def _block_size(block: ContentBlock) -> int:
    if isinstance(block, ImageContent):
        return len(block.data)
    if isinstance(block, TextContent):
        return len(block.text)
    return 0


def _describe(block: ContentBlock) -> str:
    if isinstance(block, ImageContent):
        return f"an image ({block.mime_type}, {len(block.data) * 3 // 4} bytes)"
    if isinstance(block, TextContent):
        name = block.text.split("\n", 1)[0].strip("- ")  # "--- name ---"
        return f"the file {name} ({len(block.text)} characters)"
    return "an attachment"


def summary(result: ExecutionResult) -> str:
    """What a model reads first: the output, then how the run ended."""
    parts: list[str] = []
    if result.stdout:
        parts.append(_clip(result.stdout))
    if result.stderr:
        parts.append("stderr:\n" + _clip(result.stderr))
    if result.return_value is not None:
        parts.append(f"→ {_clip(repr(result.return_value))}")
    if result.error is not None:
        parts.append(result.error.traceback or f"{result.error.type}: {result.error.message}")
    line = f"status: {result.status} · {result.usage.wall_ms} ms"
    if result.exit_code not in (None, 0):
        line += f" · exit code {result.exit_code}"
    parts.append(line)
    if result.files:
        # One name a line, each one line (the models neutralise them; again here, as that
        # costs nothing and a result can be built without validation): a file the code
        # named "x\nstatus: ok" cannot add a line of its own to what the model reads.
        shown = [f"  {neutralise_line(f.path)}" for f in result.files[:_SUMMARY_FILES]]
        more = len(result.files) - _SUMMARY_FILES
        parts.append("\n".join(["files:", *shown, *([f"  … and {more} more"] if more > 0 else [])]))
    if result.redactions:
        counts = ", ".join(f"{n} {category}" for category, n in result.redactions.items())
        parts.append(f"redacted (personal data and secrets, by the host): {counts}")
    parts += [f"note: {e.kind}: {neutralise_line(e.detail)}" for e in result.events[:10]]
    return "\n".join(parts)


def _clip(text: str) -> str:
    if len(text) <= _SUMMARY_OUTPUT_CHARS:
        return text
    return text[:_SUMMARY_OUTPUT_CHARS] + f"\n… ({len(text) - _SUMMARY_OUTPUT_CHARS} more chars)"
