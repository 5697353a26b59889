"""The `codecage` command line: the typer app, its commands (one module per group: run.py,
info.py, gen.py, serve.py, packages.py, session.py) and `main`, which turns usage errors
into exit 2. A command parses its flags (options.py; those that go together come as one
group, groups.py), builds the library's inputs (setup.py), calls the library and renders
what it gets (render.py); `session` calls a running `codecage serve --http` instead
(remote.py).

Exit codes: 0 the code ran and succeeded; 1 it ran and did not succeed, or a check failed,
or the host could not run it; 2 a usage error or a refused request (ConfigError).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from codecage._version import __version__
from codecage.cli.render import print_json, stderr

try:  # typer 0.2x carries its own copy of click; older ones use click itself
    from typer._click.exceptions import ClickException, NoSuchOption
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException, NoSuchOption  # type: ignore[assignment]

_HELP_NAMES = ["-h", "--help"]


def _typer() -> typer.Typer:
    return typer.Typer(
        help="Run code written by AI agents with real OS isolation, and get a structured result.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode="rich",
        # Inherited by every command's context: `codecage run -h` as well as --help.
        context_settings={"help_option_names": _HELP_NAMES},
    )


def reflow(doc: str) -> str:
    """`doc` with the lines of each prose paragraph joined, for the terminal to wrap.
    Indented lines (examples) stay one to a line, as written."""
    paragraphs = []
    for paragraph in inspect.cleandoc(doc).split("\n\n"):
        lines: list[str] = []
        for line in paragraph.splitlines():
            if lines and not line.startswith(" ") and not lines[-1].startswith(" "):
                lines[-1] += " " + line.strip()
            else:
                lines.append(line.rstrip())
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


def _show_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"codecage {__version__}\n")
        raise typer.Exit(0)


def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            "-V",
            help="Print codecage's version and exit.",
            is_eager=True,
            callback=_show_version,
        ),
    ] = False,
) -> None:
    pass


# In this order in --help.
_COMMANDS = ("run", "validate", "info", "doctor", "gen", "serve", "run-batch")
_GROUPS = ("packages", "session", "audit")


def _command(name: str) -> Any:
    """The function of command `name`, or the typer app of group `name`, its module
    imported now: a command loads its own module only (`codecage run` none of the audit
    views, the MCP server's options or the session client). Each by its module's own path,
    never `from codecage.cli import ...`: that names this package, whose `main` imports
    this module (a cycle to a reader of the imports)."""
    if name in ("run", "validate"):
        from codecage.cli.run import run, validate

        return run if name == "run" else validate
    if name in ("info", "doctor"):
        from codecage.cli.info import doctor, info

        return info if name == "info" else doctor
    if name == "gen":
        from codecage.cli.gen import gen

        return gen
    if name == "serve":
        from codecage.cli.serve import serve

        return serve
    if name == "run-batch":
        from codecage.cli.batch import run_batch

        return run_batch
    return _group(name)


def _group(name: str) -> typer.Typer:
    if name == "packages":
        from codecage.cli.packages import app as packages_app

        return packages_app
    if name == "session":
        from codecage.cli.session import app as session_app

        return session_app
    from codecage.cli.audit import app as audit_app

    return audit_app


def _build(names: Sequence[str]) -> typer.Typer:
    built = _typer()
    built.callback()(_options)
    for name in names:
        if name in _GROUPS:
            built.add_typer(_group(name), name=name)
        else:
            built.command(name=name)(_command(name))
    return built


if TYPE_CHECKING:
    app: typer.Typer  # every command: built on first use (`__getattr__`)


def __getattr__(name: str) -> object:
    """`app`, the typer app of every command, built (and its modules imported) on first
    use: a command run from `main` builds an app of its own (`_app_for`)."""
    if name == "app":
        return _full_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _app_for(args: list[str]) -> typer.Typer:
    """For `codecage COMMAND ...` an app of that one command, else `app`: typer builds the
    click parser of every command it holds at each start (~25 ms for all of them), and
    importing every command's module costs more (the audit views, the MCP server's and the
    session client's options); `codecage run` needs one. What it parses and prints is the
    same: the command's own options and help; the others only show in `codecage --help`
    and its usage errors."""
    if args and args[0] in _COMMANDS:
        return _build([args[0]])
    return _full_app()


@functools.cache
def _full_app() -> typer.Typer:
    """The app of every command, built once."""
    return _build([*_COMMANDS, *_GROUPS])


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run the CLI. Usage errors (a bad flag or value) exit 2 as click's do, and with
    --json they are one JSON object on stdout like every other error."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _click_command(_app_for(args)).main(
            args=args, prog_name="codecage", standalone_mode=False
        )
    except ClickException as exc:
        _usage_error(exc, as_json=_wants_json(args))
    except typer.Abort:
        stderr.print("Aborted.", markup=False)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


def _click_command(app: typer.Typer | None = None) -> Any:
    """The click command typer builds, with its help fitted to an 80-column terminal: each
    command's docstring reflowed (typer keeps the source's line breaks inside a paragraph,
    which leave one word on a line), a flag shown without `<bool>` and a repeatable option
    with its element type. Sub-apps added with `app.add_typer` get the same."""
    command = typer.main.get_command(app if app is not None else _full_app())
    pending = [command]
    while pending:
        current = pending.pop()
        pending += getattr(current, "commands", {}).values()
        if current.help:
            current.help = reflow(current.help)
        help_names = _HELP_NAMES
        help_option = current.get_help_option(typer.Context(current, help_option_names=help_names))
        for param in [*current.params, *([help_option] if help_option else [])]:
            if getattr(param, "is_flag", False):
                param.metavar = ""
            elif getattr(param, "multiple", False) and param.metavar is None:
                param.metavar = "<str>"
    return command


_CLOSE = 0.8


def _closer(exc: NoSuchOption) -> NoSuchOption:
    """`exc` suggesting only options close to the one given: a longer or shorter spelling
    of it (--memory: --memory-mb) or one a typo away (--ouput: --out). click offers what
    difflib finds at 0.6, which named unrelated ones (--ouput: --out, --timeout)."""
    given = exc.option_name

    def close(option: str) -> bool:
        if min(len(given), len(option)) > 4 and (
            option.startswith(given) or given.startswith(option)
        ):
            return True
        return difflib.SequenceMatcher(None, given, option).ratio() >= _CLOSE

    kept = [p for p in exc.possibilities or [] if close(p)]
    return NoSuchOption(given, message=exc.message, possibilities=kept, ctx=exc.ctx)


def _wants_json(args: list[str]) -> bool:
    return "--json" in args[: args.index("--")] if "--" in args else "--json" in args


def _usage_error(exc: ClickException, *, as_json: bool) -> NoReturn:
    if isinstance(exc, NoSuchOption):
        exc = _closer(exc)
    context = getattr(exc, "ctx", None)
    command = context.command_path if context is not None else "codecage"
    hint = f"`{command} --help` lists its options and arguments"
    if as_json:
        message = exc.format_message()
        print_json({"error": {"type": "UsageError", "message": message, "hint": hint}})
        stderr.print(f"Error: {message}", markup=False)
    else:
        from typer import rich_utils

        rich_utils.rich_format_error(exc)
    sys.exit(exc.exit_code)
