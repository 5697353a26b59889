"""`codecage packages add | list | remove`: the packages the operator adds for the
sandboxes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from codecage import packages as added
from codecage.cli.groups import FlagGroup, takes_groups
from codecage.cli.logs import configure_logging
from codecage.cli.options import ConfigOpt, JsonOpt, VerboseOpt
from codecage.cli.render import (
    fail,
    print_json,
    progress,
    render_package_change,
    render_package_list,
)
from codecage.cli.setup import load_config
from codecage.errors import CodecageError

app = typer.Typer(
    help="Packages the operator adds for the sandboxes (scikit-learn, seaborn, openpyxl...): "
    "installed with this environment's pip into codecage's packages directory, pinned and "
    "recorded, and bound read-only at /opt/packages for the profiles that allow them.",
    short_help="Add packages for the sandboxes (the operator's): add, list, remove.",
    no_args_is_help=True,
)

PackagesDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--packages-dir",
        help="The packages directory (default: CODECAGE_PACKAGES_DIR, else the config's "
        "\\[packages] dir, else /var/lib/codecage/packages for root and "
        "$XDG_DATA_HOME/codecage/packages for others). Owned by you or root, not "
        "group/world-writable.",
        envvar=added.ENV_DIR,
        file_okay=False,
        show_default=False,
    ),
]
AllowSourceOpt = Annotated[
    bool,
    typer.Option(
        "--allow-source",
        help="Build a package from source when it has no wheel (its build runs on this host).",
    ),
]
IgnoreHostVersionsOpt = Annotated[
    bool,
    typer.Option(
        "--ignore-host-versions",
        help="Resolve without pinning the dependencies the host already has to its versions "
        "(the added versions then shadow the host's in the sandbox).",
    ),
]


@dataclass(frozen=True, slots=True)
class ChangeFlags(FlagGroup):
    """The flags of `packages add` and `remove`: where the packages are, what pip may do,
    and how the change is shown."""

    packages_dir: PackagesDirOpt = None
    allow_source: AllowSourceOpt = False
    ignore_host_versions: IgnoreHostVersionsOpt = False
    config_file: ConfigOpt = None
    as_json: JsonOpt = False
    verbose: VerboseOpt = False


@app.command("add")
@takes_groups
def packages_add(
    names: Annotated[
        list[str],
        typer.Argument(
            help="NAME or NAME==VERSION (extras allowed), one or more.",
            metavar="NAME[==VERSION]",
            show_default=False,
        ),
    ],
    flags: ChangeFlags,
) -> None:
    """Install packages (and what they need) for the sandboxes; a package already added is
    replaced by the version given.

    Examples:

        codecage packages add scikit-learn seaborn openpyxl

        codecage packages add tabulate==0.9.0
    """
    _change_packages(added.add, "installing with pip", names, flags)


@app.command("remove")
@takes_groups
def packages_remove(
    names: Annotated[
        list[str],
        typer.Argument(help="Names of added packages.", metavar="NAME", show_default=False),
    ],
    flags: ChangeFlags,
) -> None:
    """Remove added packages and what only they needed (the rest is installed again at the
    recorded versions).

    Example:

        codecage packages remove seaborn
    """
    _change_packages(added.remove, "reinstalling the rest with pip", names, flags)


def _change_packages(
    change_with: Callable[..., added.Change], doing: str, names: list[str], flags: ChangeFlags
) -> None:
    """`packages add` and `remove`: one change of the operator's packages, shown as done."""
    configure_logging(flags.verbose)
    try:
        directory = _packages_dir(flags.packages_dir, flags.config_file, for_writing=True)
        with progress(doing, enabled=not flags.as_json):
            change = change_with(
                directory,
                names,
                allow_source=flags.allow_source,
                host_versions=not flags.ignore_host_versions,
            )
    except CodecageError as exc:
        fail(exc, as_json=flags.as_json, verbose=flags.verbose)
    render_package_change(change, as_json=flags.as_json)


@app.command("list")
def packages_list(
    packages_dir: PackagesDirOpt = None,
    config_file: ConfigOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """List the added packages with their versions (the record, packages.lock.json).

    Example:

        codecage packages list --json
    """
    configure_logging(verbose)
    try:
        directory = _packages_dir(packages_dir, config_file, for_writing=False)
        record = added.installed(directory)
    except CodecageError as exc:
        fail(exc, as_json=as_json, verbose=verbose)
    if as_json:
        print_json({"directory": str(directory), **record.model_dump(mode="json")})
        return
    render_package_list(directory, record)


def _packages_dir(argument: Path | None, config_file: Path | None, *, for_writing: bool) -> Path:
    settings = None if argument is not None else load_config(config_file)
    return added.location(argument, settings, for_writing=for_writing)[0]
