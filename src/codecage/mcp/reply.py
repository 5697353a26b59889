"""What the MCP tools hand back: replies sized for a model's context.

Every reply (text and structured content together) stays within a budget of estimated
tokens, `reply_max_tokens` (default 20,000: Claude Code refuses an MCP reply over 25,000
by default and warns over 10,000), and within `MAX_REPLY_BYTES` (clients of the protocols
before 2026-07-28 read a streamable-HTTP reply as one server-sent event and refuse one over
1 MiB).

Tokens are estimated, never counted with a model's tokenizer, and on the high side: one
token per 4 ASCII characters, and one per UTF-8 byte of every other character (a CJK
character is 3, an emoji 4; byte-level tokenizers never need more), of the reply's JSON as
sent. An image counts as `IMAGE_TOKENS` (what a model spends on an image after the API's
resizing), not by its base64 size; its bytes count towards `MAX_REPLY_BYTES`.

`execute_code`: the text (content[0]) holds what a model reads: stdout, stderr, the return
value, the traceback, then how the run ended, the files written and notes. The structured
content (`ExecutionReply`) holds the rest of the `ExecutionResult` for programs and
displays, and does not repeat the text: its `stdout`, `stderr` and `error.traceback` say
"in the text" (or are empty). A client that reads only the structured content still learns
the status, exit code, return value, error type and message, files, usage and events, and
where the output is; the MCP spec's advice that the text repeat the structured content as
JSON is not followed, on purpose: it would double every reply.

Over the budget, the largest pieces (stdout, stderr, traceback, return value, inline
files) are cut in the middle, head and tail kept, each with a marker line saying how much
was cut and how to get all of it; then the files and events lists, then images, are cut.
A `reply_trimmed` event, first among the events, says what was cut. The return value's
share goes to the text (its repr), which hosts show the model: the structured
`return_value` is the whole value as JSON while the text shows all of it, else only its
head as JSON (`json_head`, at most `_VALUE_HEAD_CHARS`, never more than the text shows)
with `return_value_truncated`.

Display outputs (figures, `display(obj)`, the last expression's rich form): a PNG or JPEG
becomes image content (before the images of files, and dropped by the same rules); the
text a model reads best, text/markdown else text/plain, goes into the text as a piece that
is cut like stdout. HTML and SVG never go to the model (SVG is no image for it: see
mcp/files.py). The structured content lists every output without the big parts, and says
how many bytes of each were left out.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from mcp_types import (
    BlobResourceContents,
    CallToolResult,
    ContentBlock,
    EmbeddedResource,
    ImageContent,
    TextContent,
)
from pydantic import BaseModel, ConfigDict, Field

from codecage import displays as outputs
from codecage.guest import contract
from codecage.mcp.files import MAX_IMAGE_BYTES, MAX_IMAGES
from codecage.models import (
    DEFAULT_REPLY_MAX_TOKENS,
    DisplayOutput,
    Event,
    ExecutionResult,
    FileInfo,
    Limits,
    Status,
    Usage,
)
from codecage.models.result import DisplayMime, DisplaySource, any_json_value
from codecage.output import cut_marker, neutralise_line

# Under the 1,048,576 bytes of an SSE event, with room for the JSON-RPC envelope and the
# SSE framing around the result.
MAX_REPLY_BYTES = 1_000_000
IMAGE_TOKENS = 1_600
"""What one image is counted as (Claude: about width x height / 750 after resizing to at
most ~1.15 megapixels, so at most ~1,600)."""
IN_TEXT = "in the text"
_SUMMARY_FILES = 20  # file names listed in the text (more are in the structured content)
_SUMMARY_EVENTS = 10
_EVENT_DETAIL_CHARS = 500
_VALUE_HEAD_CHARS = 2_000
"""Of the value's JSON in the structured content once the text's repr of it is cut: the
budget goes to the text, which hosts show the model (and never more than the text shows)."""
_MESSAGE_CHARS = 2_000
_FITTING_ROUNDS = 8
ENVELOPE_TOKENS = 100
"""Room for what the SDK adds to a result after the tool returns it (`_meta` with the
server's name and version, `resultType`): measured at ~25 tokens."""
_NOTE_TOKENS = (_EVENT_DETAIL_CHARS + 50) // 4
OUTPUT_CUT_WHY = (
    " to fit the reply; to get all of it, write the output to a file in /workspace and "
    "pass its name in return_files, or print less"
)
_FILE_CUT_WHY = " to fit the reply; read the file in parts, or return a summary of it"
_VALUE_CUT_WHY = (
    " of the value's repr to fit the reply; return less (a summary, a slice), or write it to "
    "a file in /workspace and pass its name in return_files"
)


class ReplyError(BaseModel):
    """The code's exception, without its traceback (which is in the text)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    type: str = Field(description="Exception class name, e.g. 'ZeroDivisionError'.")
    message: str = Field(description="str() of the exception.")
    traceback: Literal["", "in the text"] = Field(
        description="'in the text': the traceback is in the text content, not repeated here."
    )


class ReplyDisplay(BaseModel):
    """A display output in the structured content, without its large forms."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    index: int = Field(description="Position among the run's display outputs.")
    source: DisplaySource = Field(description="display, figure or last_expression.")
    in_text: str | None = Field(
        description="The MIME type whose text is in the text content (text/markdown, else "
        "text/plain); None when only its image is shown."
    )
    image: str | None = Field(
        description="image/png or image/jpeg when the output's image is in the content as "
        "image content (unless a reply_trimmed event says it was left out)."
    )
    json_value: Any = Field(
        None,
        description="Its application/json form, when it has one of at most 2,000 characters.",
        json_schema_extra=any_json_value,
    )
    left_out: dict[str, int] = Field(
        description="MIME type -> bytes of each form not in this structured content (base64 "
        "images, HTML, SVG, the text that is in the text content)."
    )


class ExecutionReply(BaseModel):
    """The structured content of `execute_code`: the `ExecutionResult` without what the
    text content already holds (stdout, stderr, the traceback)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    execution_id: str = Field(description="Unique id of this run.")
    status: Status = Field(description="How the run ended.")
    exit_code: int | None = Field(description="Exit code of the program, None if signalled.")
    signal: str | None = Field(description="Name of the signal that ended it, e.g. 'SIGKILL'.")
    stdout: Literal["", "in the text"] = Field(
        description="'in the text': what the code printed is in the text content (content[0]), "
        "first, head and tail kept if it was cut; '': it printed nothing."
    )
    stderr: Literal["", "in the text"] = Field(
        description="'in the text': stderr is in the text content after 'stderr:'; '': empty."
    )
    stdout_truncated: bool = Field(
        description="True when stdout was cut (by max_output_bytes or to fit the reply)."
    )
    stderr_truncated: bool = Field(description="True when stderr was cut.")
    return_value: Any = Field(
        description="Value of the code's last expression, as JSON (else its repr as a "
        "string); null if none. When return_value_truncated: only its head (the first items "
        "of its lists and mappings, a string's head and tail), never more than the text shows.",
        json_schema_extra=any_json_value,
    )
    return_value_truncated: bool = Field(
        False,
        description="True when the value was cut to fit the reply: the text shows more of it "
        "(head and tail) than return_value holds.",
    )
    error: ReplyError | None = Field(description="The code's exception; None if none.")
    files: list[FileInfo] = Field(description="Files in /workspace after the run.")
    files_total: int = Field(ge=0, description="How many files there were (the list may be cut).")
    usage: Usage = Field(description="Time and memory the run used.")
    limits: Limits = Field(description="The limits the run had.")
    events: list[Event] = Field(description="What happened, e.g. reply_trimmed, output_truncated.")
    backend: str = Field(description="The isolation backend that ran the code.")
    redactions: dict[str, int] = Field(description="Redactions made, by category.")
    displays: list[ReplyDisplay] = Field(
        default_factory=list,
        description="The run's rich outputs (figures, tables, display(obj)), in order.",
    )
    session_id: str | None = Field(None, description="The session it ran in; null if none.")
    node: str | None = Field(
        None, description="The Ray node that ran it (serve --ray); null: this server's host."
    )


# --- estimating -----------------------------------------------------------------------------


def estimate_tokens(text: str) -> int:
    """Tokens `text` may cost a model, estimated high (see the module docstring).

    Raises:
        Nothing.
    """
    if text.isascii():
        return math.ceil(len(text) / 4)
    encoded = text.encode("utf-8", "surrogatepass")
    ascii_count = len(text.encode("ascii", "ignore"))
    return math.ceil(ascii_count / 4) + (len(encoded) - ascii_count)


@dataclass(frozen=True, slots=True)
class ReplySize:
    """How large a reply is as sent, and what it may cost a model."""

    bytes: int
    tokens: int


def measure(reply: CallToolResult) -> ReplySize:
    """The size of `reply` as the SDK sends it (the JSON of the CallToolResult), and its
    estimated tokens (images at IMAGE_TOKENS each).

    Raises:
        Nothing.
    """
    dumped = reply.model_dump(mode="json", by_alias=True, exclude_none=True)
    sent = json.dumps(dumped, ensure_ascii=False, separators=(",", ":"))
    images = 0
    for block in dumped.get("content", []):
        if block.get("type") == "image":
            images += 1
            block["data"] = ""
    counted = json.dumps(dumped, ensure_ascii=False, separators=(",", ":"))
    return ReplySize(
        bytes=len(sent.encode("utf-8", "surrogatepass")),
        tokens=estimate_tokens(counted) + images * IMAGE_TOKENS,
    )


def fits(reply: CallToolResult, budget_tokens: int) -> bool:
    """Whether `reply`, with what the SDK adds around it, is within the budget and bound.

    Raises:
        Nothing.
    """
    size = measure(reply)
    return (
        size.tokens + ENVELOPE_TOKENS <= budget_tokens
        and size.bytes + 4 * ENVELOPE_TOKENS <= MAX_REPLY_BYTES
    )


# --- cutting --------------------------------------------------------------------------------


def cut_middle(text: str, keep_chars: int, why: str) -> str:
    """`text` with its middle cut so that about `keep_chars` characters remain, head and
    tail, on line breaks where one is near; a marker line stands where the cut was.

    Raises:
        Nothing.
    """
    if len(text) <= keep_chars:
        return text
    keep_chars = max(keep_chars, 0)
    head_end = keep_chars // 2
    tail_start = len(text) - (keep_chars - head_end)
    # Snap to line breaks within the last / first fifth of each part.
    newline = text.rfind("\n", head_end - head_end // 5, head_end)
    if newline >= 0:
        head_end = newline + 1
    newline = text.find("\n", tail_start, tail_start + (len(text) - tail_start) // 5 + 1)
    if newline >= 0:
        tail_start = newline + 1
    head, cut, tail = text[:head_end], text[head_end:tail_start], text[tail_start:]
    marker = cut_marker(cut.count("\n"), len(cut.encode("utf-8", "surrogatepass")), why)
    before = "\n" if head and not head.endswith("\n") else ""
    after = "\n" if tail else ""
    return head + before + marker + after + tail


# --- execute_code ---------------------------------------------------------------------------


@dataclass
class _Execution:
    """One reply being fitted: its pieces, and what was cut so far."""

    result: ExecutionResult
    attachments: list[ContentBlock]
    pieces: dict[str, str]
    budget: int
    cuts: list[str] = field(default_factory=list)
    files_kept: int | None = None
    events_kept: int | None = None
    value_cut: bool = False  # set by the last resort: the return value left out
    originals: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.originals = dict(self.pieces)

    def assemble(self) -> CallToolResult:
        result = self.result
        events = result.events
        if self.cuts:
            note = Event(
                kind="reply_trimmed",
                detail=(
                    f"to keep the reply within {self.budget:,} tokens: " + "; ".join(self.cuts)
                )[:_EVENT_DETAIL_CHARS],
            )
            events = [note, *events]
        events = [_short_event(e) for e in events[: self.events_kept]]
        files = result.files[: self.files_kept]
        error = None
        if result.error is not None:
            error = ReplyError(
                type=result.error.type,
                message=_clip(result.error.message, _MESSAGE_CHARS),
                traceback=IN_TEXT if self.pieces.get("traceback") else "",
            )
        structured = ExecutionReply(
            execution_id=result.execution_id,
            status=result.status,
            exit_code=result.exit_code,
            signal=result.signal,
            stdout=IN_TEXT if result.stdout else "",
            stderr=IN_TEXT if result.stderr else "",
            stdout_truncated=result.stdout_truncated or "stdout" in self.cut_pieces(),
            stderr_truncated=result.stderr_truncated or "stderr" in self.cut_pieces(),
            return_value=self.return_value(),
            return_value_truncated=self.value_truncated(),
            error=error,
            files=files,
            files_total=len(result.files),
            usage=result.usage,
            limits=result.limits,
            events=events,
            backend=result.backend,
            redactions=result.redactions,
            displays=[_reply_display(d, self.pieces) for d in result.displays],
            session_id=result.session_id,
            node=result.node,
        )
        text = _text(result, self.pieces, events)
        attachments = [
            TextContent(type="text", text=self.pieces[f"file{i}"])
            if isinstance(block, TextContent) and f"file{i}" in self.pieces
            else block
            for i, block in enumerate(self.attachments)
        ]
        return CallToolResult(
            content=[TextContent(type="text", text=text), *attachments],
            structured_content=structured.model_dump(mode="json"),
            is_error=False,
        )

    def value_piece(self) -> str | None:
        """The text piece that shows the return value: its repr, or the last expression's
        display (a DataFrame's table); None when there is no value or no such piece."""
        if self.result.return_value is None:
            return None
        if self.originals.get("value"):
            return "value"
        for d in self.result.displays:
            if d.source == "last_expression" and self.originals.get(f"display{d.index}"):
                return f"display{d.index}"
        return None

    def value_truncated(self) -> bool:
        piece = self.value_piece()
        return self.value_cut or (piece is not None and piece in self.cut_pieces())

    def return_value(self) -> Any:
        """The return value as JSON while the text shows all of it; once the text's is cut,
        the head of it, no larger than what the text shows; None after the last resort."""
        if self.value_cut:
            return None
        piece = self.value_piece()
        if piece is None or piece not in self.cut_pieces():
            return self.result.return_value
        shown = len(self.pieces.get(piece, ""))
        return json_head(self.result.return_value, min(shown, _VALUE_HEAD_CHARS))

    def cut_pieces(self) -> set[str]:
        return {name for name, text in self.pieces.items() if text != self.full(name)}

    def full(self, name: str) -> str:
        return self.originals.get(name, "")


def build(
    result: ExecutionResult,
    attachments: list[ContentBlock],
    budget_tokens: int = DEFAULT_REPLY_MAX_TOKENS,
) -> CallToolResult:
    """The reply for `result`, with `attachments` (images, inline text files) after the
    text, within `budget_tokens` and MAX_REPLY_BYTES as the module says.

    Raises:
        Nothing.
    """
    shown = _display_images(result.displays)
    # A figure shown and also saved with savefig is usually the same PNG: sent once.
    same = {block.data for block in shown if isinstance(block, ImageContent)}
    files = [b for b in attachments if not (isinstance(b, ImageContent) and b.data in same)]
    attachments = [*shown, *files]
    reply = _Execution(
        result=result,
        attachments=attachments,
        pieces=_pieces_of(result, attachments),
        budget=budget_tokens,
    )
    assembled = reply.assemble()
    if fits(assembled, budget_tokens):
        return assembled
    for step in _STEPS:
        step(reply)
        assembled = reply.assemble()
        if fits(assembled, budget_tokens):
            return assembled
    return assembled


def _pieces_of(result: ExecutionResult, attachments: list[ContentBlock]) -> dict[str, str]:
    pieces = {"stdout": result.stdout, "stderr": result.stderr}
    for display in result.displays:
        mime = _text_form(display)
        if mime is not None:
            pieces[f"display{display.index}"] = str(display.data[mime])
    shown = any(
        d.source == "last_expression" and f"display{d.index}" in pieces for d in result.displays
    )
    if result.return_value is not None:
        # A last expression shown as a display (a DataFrame's table) is not repeated as
        # its repr in the text; the structured return_value keeps it.
        pieces["value"] = "" if shown else repr(result.return_value)
    if result.error is not None:
        pieces["traceback"] = result.error.traceback
    for index, block in enumerate(attachments):
        if isinstance(block, TextContent):
            pieces[f"file{index}"] = block.text
    return pieces


def _text(result: ExecutionResult, pieces: dict[str, str], events: list[Event]) -> str:
    parts: list[str] = []
    if pieces.get("stdout"):
        parts.append(pieces["stdout"])
    if pieces.get("stderr"):
        parts.append("stderr:\n" + pieces["stderr"])
    parts += [_display_text(d, pieces) for d in result.displays]
    if pieces.get("value"):
        parts.append(f"→ {pieces['value']}")
    if result.error is not None:
        parts.append(
            pieces.get("traceback")
            or f"{result.error.type}: {_clip(result.error.message, _MESSAGE_CHARS)}"
        )
    parts.append(_status_line(result))
    parts += _files_lines(result.files)
    parts += _redaction_lines(result.redactions)
    parts += [f"note: {e.kind}: {neutralise_line(e.detail)}" for e in events[:_SUMMARY_EVENTS]]
    return "\n".join(parts)


# --- display outputs ------------------------------------------------------------------------

_JSON_VALUE_CHARS = 2_000
_DISPLAY_CUT_WHY = " to fit the reply; show a smaller part (df.head()) or save it to a file"


def _text_form(display: DisplayOutput) -> DisplayMime | None:
    """The form a model reads in the text: markdown, else plain text unless the output is
    an image (a figure's text/plain, "<Figure size ...>", says nothing the image does not)."""
    if isinstance(display.data.get("text/markdown"), str):
        return "text/markdown"
    if outputs.image_bytes(display) is None and isinstance(display.data.get("text/plain"), str):
        return "text/plain"
    return None


def _display_images(displays: list[DisplayOutput]) -> list[ContentBlock]:
    """Image content for the outputs' PNGs and JPEGs, the first MAX_IMAGES of at most
    MAX_IMAGE_BYTES each (the same bounds as the files' images)."""
    blocks: list[ContentBlock] = []
    for display in displays:
        image = outputs.image_bytes(display)
        if image is None or len(blocks) >= MAX_IMAGES or len(image[1]) > MAX_IMAGE_BYTES:
            continue
        mime = image[0]
        blocks.append(ImageContent(type="image", data=str(display.data[mime]), mime_type=mime))
    return blocks


def _display_text(display: DisplayOutput, pieces: dict[str, str]) -> str:
    """The output's line in the text: what it is, and its text when it has one to read."""
    head = f"[{neutralise_line(outputs.describe(display))}]"
    if display.source != "display":
        head += f" ({display.source.replace('_', ' ')})"
    image = outputs.image_bytes(display)
    if image is not None and len(image[1]) > MAX_IMAGE_BYTES:
        head += f" — too large to attach (over {MAX_IMAGE_BYTES // 1024} KiB): make it smaller"
    if image is not None:
        return head
    return head.split(": ", 1)[0] + "]:\n" + pieces.get(f"display{display.index}", "")


def _reply_display(display: DisplayOutput, pieces: dict[str, str]) -> ReplyDisplay:
    in_text = _text_form(display)
    image = outputs.image_bytes(display)
    left_out: dict[str, int] = {}
    json_value = None
    for mime, value in display.data.items():
        encoded = value if isinstance(value, str) else json.dumps(value, default=repr)
        if mime == "application/json" and len(encoded) <= _JSON_VALUE_CHARS:
            json_value = value
        else:
            left_out[mime] = len(encoded.encode("utf-8", "surrogatepass"))
    return ReplyDisplay(
        index=display.index,
        source=display.source,
        in_text=in_text if f"display{display.index}" in pieces else None,
        image=image[0] if image is not None and len(image[1]) <= MAX_IMAGE_BYTES else None,
        json_value=json_value,
        left_out=left_out,
    )


def _status_line(result: ExecutionResult) -> str:
    line = f"status: {result.status} · {result.usage.wall_ms} ms"
    if result.exit_code not in (None, 0):
        line += f" · exit code {result.exit_code}"
    if result.session_id is not None:
        line += f" · session {result.session_id}"
    return line


def _files_lines(files: list[FileInfo]) -> list[str]:
    if not files:
        return []
    # One name a line, each one line (the models neutralise them; again here, as that costs
    # nothing and a result can be built without validation): a file the code named
    # "x\nstatus: ok" cannot add a line of its own to what the model reads.
    shown = [f"  {neutralise_line(f.path)}" for f in files[:_SUMMARY_FILES]]
    more = len(files) - _SUMMARY_FILES
    return ["\n".join(["files:", *shown, *([f"  … and {more} more"] if more > 0 else [])])]


def _redaction_lines(redactions: dict[str, int]) -> list[str]:
    if not redactions:
        return []
    counts = ", ".join(f"{n} {category}" for category, n in redactions.items())
    return [f"redacted (personal data and secrets, by the host): {counts}"]


def summary(result: ExecutionResult) -> str:
    """The text a model reads for `result`, uncut: the output, then how the run ended."""
    return _text(result, _pieces_of(result, []), result.events)


def _short_event(event: Event) -> Event:
    """The event with its detail clipped, and its data left out when that is large."""
    large_data = event.data is not None and len(json.dumps(event.data, default=repr)) > 2_000
    if len(event.detail) <= _EVENT_DETAIL_CHARS and not large_data:
        return event
    changes: dict[str, Any] = {"detail": _clip(event.detail, _EVENT_DETAIL_CHARS)}
    if large_data:
        changes["data"] = None
    return event.model_copy(update=changes)


def _clip(text: str, chars: int) -> str:
    if len(text) <= chars:
        return text
    return text[:chars] + f"… ({len(text) - chars:,} more characters)"


# The steps, each taken only while the reply is still over: the lists first (cheap to cut,
# rarely read in full), then the big text pieces, then images.


def _cut_lists(reply: _Execution) -> None:
    files, events = reply.result.files, reply.result.events
    if len(files) > 100:
        reply.files_kept = 100
        reply.cuts.append(f"the files list cut to its first 100 of {len(files)}")
    if len(events) > 20:
        reply.events_kept = 20
        reply.cuts.append(f"the events cut to the first 20 of {len(events)}")


def _fit_pieces(reply: _Execution) -> None:
    """Cut the text pieces (and the return value's JSON), head and tail kept, so that they
    share what the rest of the reply leaves of the budget: each small piece whole, the
    large ones an equal share. Measured again after each round, the share made smaller by
    what the estimate missed."""
    originals = reply.originals
    reply.pieces = dict.fromkeys(originals, "")
    overhead = measure(reply.assemble())
    costs = {name: _json_tokens(text) for name, text in originals.items() if text}
    # The value's piece costs its text and, while whole, its JSON in the structured content
    # too; once cut, the text keeps what the piece's share leaves after the structured head.
    value_piece = reply.value_piece()
    value_json = 0
    if value_piece is not None:
        value_json = estimate_tokens(_dumps(reply.result.return_value))
        costs[value_piece] += value_json
    # Room for a marker line per piece, and for the reply_trimmed note (in the text and in
    # the events) that is added once the cuts are known.
    available = reply.budget - overhead.tokens - 80 * len(costs) - 2 * _NOTE_TOKENS
    available = min(available, (MAX_REPLY_BYTES - overhead.bytes) // 4)
    cuts = list(reply.cuts)
    for _ in range(_FITTING_ROUNDS):
        shares = _water_fill(costs, max(available, 0))
        for name, text in originals.items():
            share, cost = shares.get(name, 0), costs.get(name, 0)
            if name == value_piece and share < cost:
                cost -= value_json
                share -= min(value_json, estimate_tokens("x" * _VALUE_HEAD_CHARS))
            keep = len(text) if share >= cost else int(len(text) * max(share, 0) / max(cost, 1))
            reply.pieces[name] = cut_middle(text, keep, _why(name))
        # Measured with the note that says what was cut (in the text and the events): a
        # round that fits without it would not fit with it.
        note = _pieces_note(reply)
        reply.cuts = cuts + ([note] if note and note not in cuts else [])
        size = measure(reply.assemble())
        over = max(
            size.tokens + ENVELOPE_TOKENS - reply.budget,
            math.ceil((size.bytes - MAX_REPLY_BYTES) / 4) + ENVELOPE_TOKENS,
        )
        if over <= 0:
            break
        available -= over + 16


def _json_tokens(text: str) -> int:
    """Estimated tokens of `text` as a JSON string (escapes included)."""
    return estimate_tokens(json.dumps(text, ensure_ascii=False))


def _pieces_note(reply: _Execution) -> str:
    cut = sorted(reply.cut_pieces())
    names = [_piece_name(name, reply) for name in cut]
    return ", ".join(names) + " cut in the middle (head and tail kept)" if names else ""


def _piece_name(name: str, reply: _Execution) -> str:
    if name.startswith("file"):
        block = reply.attachments[int(name[4:])]
        if isinstance(block, TextContent):
            return "the file " + block.text.split("\n", 1)[0].strip("- ")
    if name.startswith("display"):
        return f"display output {int(name[7:]) + 1}"
    names = {"value": "the return value", "traceback": "the traceback"}
    return names.get(name, name)


def _why(name: str) -> str:
    if name.startswith("file"):
        return _FILE_CUT_WHY
    if name == "value":
        return _VALUE_CUT_WHY
    if name.startswith("display"):
        return _DISPLAY_CUT_WHY
    return OUTPUT_CUT_WHY


def _water_fill(costs: dict[str, int], available: int) -> dict[str, int]:
    """Share `available` among pieces: each small one keeps all it has, the rest split
    what is left equally."""
    shares: dict[str, int] = {}
    left = dict(costs)
    budget = available
    while left:
        equal = budget // len(left)
        small = {name: cost for name, cost in left.items() if cost <= equal}
        if not small:
            shares.update(dict.fromkeys(left, equal))
            break
        for name, cost in small.items():
            shares[name] = cost
            budget -= cost
            del left[name]
    return shares


def _limit_images(reply: _Execution) -> None:
    """Images take at most half the budget (the text is what says how the run went)."""
    while _image_count(reply) * IMAGE_TOKENS > reply.budget // 2:
        _drop_last_image(reply)


def _drop_images(reply: _Execution) -> None:
    """Images, the largest first, until the reply fits; then the text pieces refitted to the
    room the images left."""
    while not fits(reply.assemble(), reply.budget) and _image_count(reply):
        _drop_last_image(reply)
        _fit_pieces(reply)


def _image_count(reply: _Execution) -> int:
    """Images and binary files (embedded resources): what `_drop_images` may leave out."""
    return sum(isinstance(b, ImageContent | EmbeddedResource) for b in reply.attachments)


def _drop_last_image(reply: _Execution) -> None:
    """The largest image or binary file (the last of those as large) out, a line saying so
    in its place."""
    binaries = [
        (i, b)
        for i, b in enumerate(reply.attachments)
        if isinstance(b, ImageContent | EmbeddedResource)
    ]
    index, block = max(reversed(binaries), key=lambda pair: _binary_chars(pair[1]))
    if isinstance(block, ImageContent):
        described = f"an image ({block.mime_type}, {len(block.data) * 3 // 4} bytes)"
        advice = "save fewer or smaller images"
    else:
        resource = block.resource
        described = (
            f"the file {resource.uri.removeprefix('file://')} ({resource.mime_type}, "
            f"{_binary_chars(block) * 3 // 4} bytes)"
        )
        advice = "ask for fewer or smaller files in return_files"
    # Replaced, not removed: the pieces of inline files are known by their index.
    reply.attachments[index] = TextContent(
        type="text", text=f"[{described} was left out to fit the reply: {advice}]"
    )
    reply.cuts.append(f"{described} left out")


def _binary_chars(block: ImageContent | EmbeddedResource) -> int:
    if isinstance(block, ImageContent):
        return len(block.data)
    resource = block.resource
    return len(resource.blob) if isinstance(resource, BlobResourceContents) else 0


def _last_resort(reply: _Execution) -> None:
    """Only what says how the run ended: the pieces emptied to their markers, no files."""
    for name, text in list(reply.pieces.items()):
        reply.pieces[name] = cut_middle(text, 0, _why(name))
    if reply.result.return_value is not None:
        reply.value_cut = True
    reply.files_kept, reply.events_kept = 0, 1
    # Replaced, not removed: the pieces of inline files are known by their index.
    reply.attachments = [
        TextContent(type="text", text="[an image or file was left out to fit the reply]")
        if isinstance(b, ImageContent | EmbeddedResource)
        else b
        for b in reply.attachments
    ]
    reply.cuts.append("everything but the status cut")


_STEPS: tuple[Callable[[_Execution], None], ...] = (
    _cut_lists,
    _limit_images,
    _fit_pieces,
    _drop_images,
    _last_resort,
)


# --- the other tools ------------------------------------------------------------------------


def for_data(text: str, data: dict[str, Any], budget_tokens: int) -> CallToolResult:
    """A reply of a short `text` and `data` as structured content; when over the budget,
    the text is cut in the middle and the data's longest lists and strings are cut.

    Raises:
        Nothing.
    """
    reply = CallToolResult(
        content=[TextContent(type="text", text=text)], structured_content=data, is_error=False
    )
    for _ in range(_FITTING_ROUNDS):
        if fits(reply, budget_tokens):
            return reply
        over = measure(reply).tokens + ENVELOPE_TOKENS - budget_tokens
        text = cut_middle(text, max(len(text) - 4 * over, len(text) // 2), " to fit the reply")
        data = _shrunk(data)
        reply = CallToolResult(
            content=[TextContent(type="text", text=text)], structured_content=data, is_error=False
        )
    return reply


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=repr)


def json_head(value: Any, chars: int) -> Any:
    """The head of a JSON value whose JSON is at most about `chars` characters: a list's
    and a mapping's first items (the last one kept cut in its turn), a string's head and
    tail with a marker between; numbers, booleans and null as they are.

    Raises:
        Nothing.
    """
    if isinstance(value, str):
        return cut_middle(value, max(chars - 2, 0), _VALUE_CUT_WHY)
    if isinstance(value, list):
        return [v for _, v in _head_items(list(enumerate(value)), chars)]
    if isinstance(value, dict):
        return dict(_head_items(list(value.items()), chars))
    return value


def _head_items(items: list[tuple[Any, Any]], chars: int) -> list[tuple[Any, Any]]:
    kept: list[tuple[Any, Any]] = []
    left = chars - 2
    for key, item in items:
        size = len(_dumps(item)) + len(_dumps(key)) + 2
        if size <= left:
            kept.append((key, item))
            left -= size
            continue
        if isinstance(item, str | list | dict) and left > 40:
            kept.append((key, json_head(item, left - len(_dumps(key)) - 2)))
        break
    return kept


def _shrunk(value: Any) -> Any:
    """`value` with every list and string over a few items halved (for `for_data`)."""
    if isinstance(value, dict):
        return {k: _shrunk(v) for k, v in value.items()}
    if isinstance(value, list):
        kept = value[: max(len(value) // 2, 1)] if len(value) > 4 else value
        return [_shrunk(v) for v in kept]
    if isinstance(value, str) and len(value) > 200:
        return cut_middle(value, len(value) // 2, " to fit the reply")
    return value


_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/-])/(?:[\w.+@-]+/?)+")
_SANDBOX_PATHS = (contract.WORKSPACE_DIR, contract.SERVERS_DIR, contract.SKILLS_DIR)


def without_host_paths(value: Any) -> Any:
    """`value` with every absolute path of the host in its strings replaced by
    "[host path]" (paths inside the sandbox, such as /workspace, are kept): a model needs
    none of them, and they tell whoever reads the reply about the host.

    Raises:
        Nothing.
    """
    if isinstance(value, dict):
        return {k: without_host_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_host_paths(v) for v in value]
    if isinstance(value, str):
        return _ABSOLUTE_PATH.sub(_path_or_mark, value)
    return value


def _path_or_mark(match: re.Match[str]) -> str:
    path = match.group()
    if any(path == p or path.startswith(p + "/") for p in _SANDBOX_PATHS):
        return path
    return "[host path]"
