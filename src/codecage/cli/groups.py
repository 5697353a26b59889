"""Flag groups: a frozen dataclass whose fields are typer options (`LimitFlags`,
`ToolFlags`, ... in options.py), declared once and taken whole by every command that
offers them. A command names a group as one parameter (`limits: LimitFlags`);
`takes_groups` spreads it into its flags for typer, which reads a command's flags from its
signature, and gathers the parsed values back into the group when the command is called.
A flag added to a group is then a flag of every command that takes the group: one edit.

typer has no such thing of its own (0.2x: no dependencies, no dataclass parameters),
hence this small piece.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

R = TypeVar("R")


class FlagGroup:
    """A group of flags: subclasses are `@dataclass(frozen=True, slots=True)`, each
    field `name: Annotated[type, typer.Option(...)] = default`."""

    __slots__ = ()
    if TYPE_CHECKING:  # for mypy: a subclass is a dataclass (not an annotation at run time)
        __dataclass_fields__: ClassVar[dict[str, Any]]

    @classmethod
    def parameters(cls) -> list[inspect.Parameter]:
        """The group's flags as the keyword parameters typer reads, in field order."""
        # The module's namespace as globals: by default a class's annotations are evaluated
        # with the class's own as globals, and a callback written in one (a lambda) would
        # then not find the module's functions when called.
        module = vars(sys.modules[cls.__module__])
        hints = typing.get_type_hints(cls, globalns=module, include_extras=True)
        return [
            inspect.Parameter(
                field.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=field.default,
                annotation=hints[field.name],
            )
            for field in dataclasses.fields(cls)
        ]

    @classmethod
    def gather(cls, flags: dict[str, Any]) -> Any:
        """The group built from its flags, taken out of `flags` (typer's keyword arguments)."""
        names = [field.name for field in dataclasses.fields(cls)]
        return cls(**{name: flags.pop(name) for name in names})


def group_of(annotation: object) -> type[FlagGroup] | None:
    """The flag group `annotation` names, if it names one."""
    if isinstance(annotation, type) and issubclass(annotation, FlagGroup):
        return annotation
    return None


def takes_groups(command: Callable[..., R]) -> Callable[..., R]:
    """`command` with each flag-group parameter spread into the group's flags (for typer)
    and gathered back into the group when it is called; its other parameters unchanged.

    Raises:
        TypeError: two parameters would take the same name (a group's flag and another
            parameter, or two groups'): a programming error, found at import.
    """
    hints = typing.get_type_hints(command, include_extras=True)
    spread: list[inspect.Parameter] = []
    groups: dict[str, type[FlagGroup]] = {}
    for param in inspect.signature(command).parameters.values():
        group = group_of(hints[param.name])
        if group is not None:
            groups[param.name] = group
            spread += group.parameters()
        else:
            kind = inspect.Parameter.KEYWORD_ONLY  # typer passes every value by name
            spread.append(param.replace(annotation=hints[param.name], kind=kind))
    names = [param.name for param in spread]
    if len(set(names)) != len(names):
        clashes = sorted({name for name in names if names.count(name) > 1})
        raise TypeError(f"{command.__name__}: more than one parameter named {clashes}")

    @functools.wraps(command)
    def gathered(**flags: Any) -> R:
        for name, group in groups.items():
            flags[name] = group.gather(flags)
        return command(**flags)

    gathered.__signature__ = inspect.Signature(spread)  # type: ignore[attr-defined]
    gathered.__annotations__ = {param.name: param.annotation for param in spread}
    return gathered


def groups_of(command: Callable[..., Any]) -> dict[str, type[FlagGroup]]:
    """The flag groups a command takes, by parameter name (empty for a plain function)."""
    original = inspect.unwrap(command)
    hints = typing.get_type_hints(original, include_extras=True)
    return {name: group for name, hint in hints.items() if (group := group_of(hint)) is not None}
