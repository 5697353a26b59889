"""The tools' wrapper: arguments checked (unknown ones refused, errors one readable line per
bad field), refusals worded for a model, and one log line per call.

The call log keeps the server's logger name (`codecage.mcp.server`): operators filter on it,
and `codecage serve` shows it at INFO.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import anyio
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp.server.mcpserver.tools import Tool
from mcp.server.mcpserver.utilities.func_metadata import ArgModelBase
from mcp_types import CallToolResult, ToolAnnotations
from pydantic import ConfigDict, ValidationError

from codecage.errors import CodecageError
from codecage.output import neutralise_line

log = logging.getLogger("codecage.mcp.server")

_F = TypeVar("_F", bound=Callable[..., Any])
_MAX_ARGUMENT_ERRORS = 10
_SHOWN_VALUE_CHARS = 60


@dataclass(slots=True)
class CallLog:
    """What the per-call log line reports that only the tool's body knows."""

    queue_ms: float = 0.0


current_call: ContextVar[CallLog | None] = ContextVar("codecage_server_call", default=None)


class _CheckedTool(Tool):
    """A tool whose argument errors read well, and whose every call is logged.

    The SDK reports a pydantic ValidationError as "Error executing tool X: 1 validation error
    for XArguments ..." (pydantic's multi-line dump); here it becomes one line per bad field.
    """

    async def run(
        self, arguments: dict[str, Any], context: Context[Any, Any], convert_result: bool = False
    ) -> Any:
        call = CallLog()
        token = current_call.set(call)
        started = time.monotonic()
        status, execution_id = "failed", None
        try:
            result = await super().run(arguments, context, convert_result=convert_result)
        except UnexpectedToolError:
            raise  # a crash: the SDK logs it with its traceback, and tells the caller nothing
        except ToolError as exc:
            status = "refused"
            if isinstance(exc.__cause__, ValidationError):
                # From the cause, so that the SDK still logs the field names (not the values).
                accepted = list(self.parameters.get("properties", {}))
                message = _argument_errors(self.name, accepted, exc.__cause__)
                raise ToolError(message) from exc.__cause__
            raise
        except BaseException as exc:
            status = "cancelled" if isinstance(exc, anyio.get_cancelled_exc_class()) else "failed"
            raise
        else:
            status, execution_id = _outcome(result)
            return result
        finally:
            current_call.reset(token)
            log.info(
                "server.call",
                extra={
                    "tool": self.name,
                    "status": status,
                    "wall_ms": round((time.monotonic() - started) * 1000, 2),
                    "queue_ms": round(call.queue_ms, 2),
                    "execution_id": execution_id,
                },
            )


def registrar(tools: list[Tool]) -> Callable[..., Callable[[_F], _F]]:
    """A decorator like `MCPServer.tool(description=...)` that adds a `_CheckedTool` to
    `tools` (for `MCPServer(tools=...)`)."""

    def register(*, description: str, annotations: ToolAnnotations) -> Callable[[_F], _F]:
        def add(fn: _F) -> _F:
            checked = _CheckedTool.from_function(
                fn,
                title=annotations.title,
                description=description,
                # The title once, the tool's own: not again in its annotations.
                annotations=annotations.model_copy(update={"title": None}),
            )
            tools.append(lean_schemas(refusing_unknown_arguments(checked)))
            return fn

        return add

    return register


def refusing_unknown_arguments(tool: Tool) -> Tool:
    """Make `tool` refuse arguments it does not take (a typo such as `timout` must not run
    with the default silently), and say so in its input schema (additionalProperties: false).

    The SDK's argument model ignores unknown keys (pydantic's default) and has no option for
    it; FuncMetadata reads its public `arg_model` at each call (its docstring says reassigning
    it takes effect), so a subclass that forbids extras replaces it, and the published schema
    is regenerated from that subclass.
    """
    loose = tool.fn_metadata.arg_model
    strict = cast(
        type[ArgModelBase],
        type(
            loose.__name__,
            (loose,),
            {"model_config": ConfigDict(extra="forbid"), "__module__": loose.__module__},
        ),
    )
    tool.fn_metadata.arg_model = strict
    tool.parameters = strict.model_json_schema(by_alias=True)
    return tool


# What a schema says to a person, or bounds a producer keeps: what a typed client builds
# its types from (types, properties, required, enums, $defs and $refs) stays.
_OUTPUT_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "pattern",
        # The server sends every field of its reply models (each result is checked against
        # the full model first): `required` would only repeat that, at 1 KB a session.
        "required",
    }
)


def lean_schemas(tool: Tool) -> Tool:
    """`tool` with schemas a client loads with every session kept small (tools/list was
    27 KB, three quarters of it output schemas, all loaded into a model's context by some
    hosts): the input schema without its titles (the property names say them; its
    descriptions are what a model reads to call the tool), and the output schema without
    descriptions, titles, defaults and bounds. The output schema keeps every type,
    property, `required`, enum and `$ref`, which is what typed clients (fastmcp) build their
    result types from and what the SDK's client validates structured content against; the
    server still checks each result against the full model. docs/mcp.md describes the
    fields."""
    tool.parameters = _without(tool.parameters, frozenset({"title"}), output=False)
    if tool.fn_metadata.output_schema is not None:
        tool.fn_metadata.output_schema = _without(
            tool.fn_metadata.output_schema, _OUTPUT_ANNOTATIONS, output=True
        )
    return tool


_OPEN_ENUM = 8
"""An output enum of more values than this is an open set (event kinds: issues add them,
never rename them), published as its type: a client that checked the enum would refuse a
reply from a later server."""


def _without(schema: Any, keywords: frozenset[str], *, output: bool) -> Any:
    """`schema` without `keywords`, at every level; a property that happens to be named like
    one (a field called "title") is kept: a keyword's value is never a schema object. For
    an output schema, also without `additionalProperties: false` (what the server promises
    itself, not a type) and without the values of an open enum."""
    if isinstance(schema, list):
        return [_without(item, keywords, output=output) for item in schema]
    if not isinstance(schema, dict):
        return schema
    kept: dict[str, Any] = {}
    if not output and _is_optional(schema):
        # An optional argument: `anyOf [T, null]` with `default: null` says what leaving it
        # out says (null is still accepted).
        schema = {k: v for k, v in schema.items() if k not in ("anyOf", "default")} | (
            schema["anyOf"][0]
        )
    for key, value in schema.items():
        if key in ("properties", "$defs") and isinstance(value, dict):
            kept[key] = {n: _without(sub, keywords, output=output) for n, sub in value.items()}
        elif not _left_out(key, value, schema, keywords, output=output):
            kept[key] = _without(value, keywords, output=output)
    return kept


def _left_out(
    key: str, value: Any, schema: dict[str, Any], keywords: frozenset[str], *, output: bool
) -> bool:
    if key in keywords:
        return True
    if key == "additionalProperties":
        # true is JSON Schema's default; false, in a reply, is the server's own promise.
        return value is True or (output and value is False)
    return output and key == "enum" and len(value) > _OPEN_ENUM and "type" in schema


def _is_optional(schema: dict[str, Any]) -> bool:
    variants = schema.get("anyOf")
    return (
        "default" in schema
        and schema["default"] is None
        and isinstance(variants, list)
        and len(variants) == 2
        and variants[1] == {"type": "null"}
        and isinstance(variants[0], dict)
    )


def _outcome(result: Any) -> tuple[str, str | None]:
    """The status and execution id a tool's result reports, for the log line."""
    if not isinstance(result, CallToolResult):
        return "ok", None
    if result.is_error:
        return "error", None
    content = result.structured_content or {}
    status, execution_id = content.get("status"), content.get("execution_id")
    return (
        status if isinstance(status, str) else "ok",
        execution_id if isinstance(execution_id, str) else None,
    )


def _argument_errors(tool: str, accepted: list[str], exc: ValidationError) -> str:
    """One line per bad argument, for a model to read and fix: `timeout: must be greater
    than 0 (got -1)`; an unknown argument lists the ones the tool takes."""
    lines = [f"Invalid arguments for {tool} (nothing ran):"]
    errors = exc.errors(include_url=False)
    for error in errors[:_MAX_ARGUMENT_ERRORS]:
        where = _argument_path(error["loc"])
        kind = error["type"]
        if kind == "extra_forbidden":
            takes = ", ".join(accepted) if accepted else "no arguments"
            lines.append(f"{where}: not an argument of {tool}; it takes {takes}")
        elif kind == "missing":
            lines.append(f"{where}: required, but not given")
        else:
            lines.append(f"{where}: {_plain(error['msg'])} (got {_shown(error['input'])})")
    if len(errors) > _MAX_ARGUMENT_ERRORS:
        lines.append(f"… and {len(errors) - _MAX_ARGUMENT_ERRORS} more")
    return "\n".join(lines)


def _argument_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    # One line: an unknown argument's name is the caller's to choose, and a line break in it
    # would forge lines of this message (`code: required, but not given`).
    return neutralise_line(path) or "arguments"


def _plain(message: str) -> str:
    """pydantic's "Input should be greater than 0" as "must be greater than 0"."""
    for prefix, replacement in (("Input should be ", "must be "), ("Value error, ", "")):
        if message.startswith(prefix):
            return replacement + message[len(prefix) :]
    return message[:1].lower() + message[1:]


def _shown(value: Any) -> str:
    """The rejected value as JSON, bounded (it may be megabytes of code)."""
    long = isinstance(value, str) and len(value) > _SHOWN_VALUE_CHARS
    text = json.dumps(value[:_SHOWN_VALUE_CHARS] if long else value, default=repr)
    return text[:_SHOWN_VALUE_CHARS] + "…" if long or len(text) > _SHOWN_VALUE_CHARS else text


def refusal(exc: CodecageError) -> str:
    """A refusal as the model reads it: what happened, and what to do in this tool's terms
    (its argument names; "ask the operator" for settings no argument reaches)."""
    hint = exc.hint_for("mcp")
    return f"{exc} ({hint})" if hint else str(exc)
