"""`codecage info` and `codecage doctor`: what this host provides, and proof of it."""

from __future__ import annotations

from typing import Annotated

import typer

from codecage.cli.logs import configure_logging
from codecage.cli.options import BackendOpt, ConfigOpt, JsonOpt, VerboseOpt
from codecage.cli.render import fail, progress, render_doctor, render_info, show
from codecage.cli.setup import load_config
from codecage.errors import CodecageError
from codecage.isolation import userns
from codecage.options import Options
from codecage.sandbox import Sandbox


def info(
    as_json: JsonOpt = False,
    backend: BackendOpt = "auto",
    config_file: ConfigOpt = None,
    pool: Annotated[
        bool,
        typer.Option(
            "--pool",
            help="Start the warm pool (sized as the config says), wait until it is ready, "
            "and report its state: idle sandboxes and the memory each costs.",
        ),
    ] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Show the backend, the isolation layers really in force here, the default limits,
    the profiles and the warm pool's settings.

    Examples:

        codecage info --json

        codecage info --pool        # measure what an idle warm sandbox costs here
    """
    configure_logging(verbose)
    try:
        settings = load_config(config_file)
        with Sandbox(backend=backend, pool=pool, options=Options(config=settings)) as sb:
            if pool:
                with progress("warming the pool", enabled=not as_json):
                    sb.warm(timeout=settings.pool.ready_timeout)
            report = sb.info()
    except CodecageError as exc:
        fail(exc, as_json=as_json, verbose=verbose)
    show(report, render_info, as_json=as_json)


def doctor(
    as_json: JsonOpt = False, backend: BackendOpt = "auto", verbose: VerboseOpt = False
) -> None:
    """Prove each isolation layer by running probes in a real sandbox.

    A file is planted on the host, a TCP listener opened on 127.0.0.1, and a probe program
    inside the sandbox tries to read the one and reach the other, calls denied syscalls and
    sets off the memory and process limits. One line per layer; exit 1 if any fails.

    Example:

        codecage doctor
    """
    configure_logging(verbose)
    try:
        with progress("probing every layer in a real sandbox", enabled=not as_json):
            report = Sandbox(backend=backend, options=Options(selftest=False)).doctor()
    except CodecageError as exc:
        fail(exc, as_json=as_json, verbose=verbose)
    show(report, render_doctor, as_json=as_json)
    usable, why = userns.available()
    if not usable and not as_json:  # the Landlock fallback: say how to get full isolation
        typer.echo(f"user namespaces are unavailable ({why}); for full isolation:")
        for step in userns.changes():
            typer.echo(f"  - {step}")
    raise typer.Exit(0 if report.passed else 1)
