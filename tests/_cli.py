"""The installed `codecage` command run from a test, as a user runs it (or as an MCP host
starts `codecage serve`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client

CODECAGE = str(Path(sys.executable).with_name("codecage"))


def codecage(
    *args: str,
    stdin: str | None = None,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
    command: Sequence[str] = (CODECAGE,),
) -> subprocess.CompletedProcess[str]:
    """`codecage ARGS`, fed `stdin`, its output captured as text; any exit status returns.
    `command` is how codecage is started (`python -m codecage.cli` where a test means it)."""
    return subprocess.run(
        [*command, *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
        check=False,
    )


@contextlib.asynccontextmanager
async def serve_stdio(
    workdir: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    read_timeout: float = 60,
    faults: list[Exception] | None = None,
) -> AsyncIterator[Client]:
    """An MCP client of `codecage serve ARGS` over stdio, started in `workdir` as an MCP
    host starts it: this checkout's code (PYTHONPATH passed on) and nothing else of this
    process's environment but `env`; the server's stderr goes to workdir/stderr.log. Each
    stdout line that was not a protocol message is added to `faults`."""
    passed = {k: v for k, v in os.environ.items() if k == "PYTHONPATH"}
    params = StdioServerParameters(
        command=CODECAGE, args=["serve", *args], cwd=str(workdir), env={**passed, **(env or {})}
    )

    async def on_message(message: Any) -> None:
        if isinstance(message, Exception) and faults is not None:
            faults.append(message)

    handler = {} if faults is None else {"message_handler": on_message}
    with (workdir / "stderr.log").open("w", encoding="utf-8") as errlog:
        async with Client(
            stdio_client(params, errlog=errlog), read_timeout_seconds=read_timeout, **handler
        ) as client:
            yield client


@contextlib.asynccontextmanager
async def serve_configured(
    workdir: Path, config: str | None, *args: str, read_timeout: float = 120
) -> AsyncIterator[Client]:
    """`serve_stdio` with `config` (TOML) as its config file, written 0600 as the server
    requires of one; with None, no config file at all (XDG_CONFIG_HOME points at nothing)."""
    if config is None:
        env = {"XDG_CONFIG_HOME": str(workdir / "no-config")}
    else:
        path = workdir / "config.toml"
        path.write_text(config, encoding="utf-8")
        path.chmod(0o600)
        env = {"CODECAGE_CONFIG": str(path)}
    async with serve_stdio(workdir, *args, env=env, read_timeout=read_timeout) as client:
        yield client
