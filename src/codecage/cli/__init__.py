"""The command line: `codecage run | validate | info | doctor | serve | gen | packages`.

`main` loads the command line (cli/app.py) only when called: importing this package costs
nothing, `codecage serve` over stdio starts answering MCP's `initialize` (mcp/early.py)
before the imports of the command, and `codecage run` is handed to the user's local server
when one is running (cli/handoff.py), before them too.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import typer

    from codecage.cli.app import app

__all__ = ["app", "main"]


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """The `codecage` command (cli/app.py `main`)."""
    if argv is None:  # the process's own arguments, so its own stdin and stdout
        if sys.argv[1:2] == ["run"]:
            from codecage.cli import handoff

            handoff.run_if_served(sys.argv[1:])  # returns when the run stays in-process
        from codecage.mcp import early

        early.start(sys.argv[1:])
    from codecage.cli.app import main as run

    run(argv)


class _Package(types.ModuleType):
    """This package, whose `app` is the typer app of every command, built on first use.
    cli/app.py is a module of the same name, and importing a submodule binds its name on
    the package: the property keeps `codecage.cli.app` the typer app, as it always was."""

    @property
    def app(self) -> typer.Typer:
        from codecage.cli.app import app as built

        return built

    @app.setter
    def app(self, _module: object) -> None:
        """The import system binding cli/app.py: the name stays the typer app's."""


sys.modules[__name__].__class__ = _Package
