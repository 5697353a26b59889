"""From the flags to the library's inputs: the code, the settings, the upstream tools, the
scrub option and the Sandbox of `run` and `validate`; each made in one function."""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from codecage import config
from codecage.cli.options import AuditFlags, NetworkFlags, OutputFlags, SandboxFlags, ToolFlags
from codecage.cli.render import stderr
from codecage.egress import grants
from codecage.errors import ConfigError, Face
from codecage.kept import check_relpath
from codecage.models import ScrubSettings
from codecage.options import Options
from codecage.output import neutralise_line

if TYPE_CHECKING:
    from codecage.bridge.hosts import HostServers
    from codecage.bridge.upstreams import Upstream
    from codecage.toolsetup import ToolSetup

log = logging.getLogger("codecage.cli")  # the same name under `python -m codecage.cli`

_MAX_TOOL_CALLS = 100_000  # as [tools] max_calls allows


def read_code(source: str | None, code: str | None, file: Path | None) -> tuple[str, str]:
    given = [x for x in (source, code, file) if x is not None]
    if len(given) != 1:
        raise ConfigError(
            "give the code exactly one way",
            hint="use --code SRC, --file PATH, or - to read stdin",
        )
    if code is not None:
        return code, "main.py"
    if file is not None:
        try:
            data = file.read_bytes()
        except OSError as exc:
            # The reason is the message; no hint says more than "No such file or directory".
            raise ConfigError(f"cannot read {file}: {exc.strerror or exc}", hint="") from exc
        return _read_text(data, str(file)), file.name
    if source != "-":
        raise ConfigError(
            f"unexpected argument {source!r}",
            hint="to run a file use --file PATH; to read stdin use -",
        )
    return _read_text(sys.stdin.buffer.read(), "stdin"), "main.py"


def _read_text(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{where} is not UTF-8 text (byte {exc.start})",
            hint="pass Python source code, not a binary file",
        ) from exc


def load_config(config_file: Path | None) -> config.Settings:
    """The settings, with the config file in force logged (INFO, shown by -v).

    Raises:
        ConfigError: the file is not trusted or not valid, or a variable is invalid.
    """
    settings = config.load(config_file)
    log.info(
        "config.file",
        extra={
            "path": str(settings.config_file) if settings.config_file else None,
            "origin": settings.config_origin,
            "searched": [str(p) for p in settings.config_searched],
        },
    )
    return settings


def servers_of_hosts(
    names: list[str] | None, mcp_config: Path | None
) -> tuple[dict[str, Upstream] | None, list[HostServers]]:
    """The servers of the --mcp-host hosts, each host's finding said on stderr. A server
    the --mcp-config file names too is the file's (`tooling.configured_servers`): the
    report says so.

    Raises:
        ConfigError: an unknown host, an untrusted or malformed file, or no server found.
    """
    if not names:
        return None, []
    from codecage.bridge import hosts, upstreams

    servers, reports = hosts.load([n.strip() for item in names for n in item.split(",") if n])
    for name in upstreams.load(mcp_config) if mcp_config is not None else {}:
        for report in reports:
            if report.servers.pop(name, None) is not None:
                report.skipped[name] = "--mcp-config names a server of that name, used instead"
    for report in reports:
        stderr.print(f"codecage: {report.describe()}", markup=False)
    return servers, reports


def refuse_mcp_config_in(workspace: Path | None, mcp_config: Path | None) -> None:
    """Refuse an --mcp-config inside the workspace: like the config file, it names the
    commands the host starts, and code in the run could rewrite it for the next run.

    Raises:
        ConfigError: the workspace contains the file.
    """
    if workspace is None or mcp_config is None:
        return
    root = Path(workspace).resolve()
    for place in (mcp_config.resolve(), mcp_config.absolute()):
        if place.is_relative_to(root):
            raise ConfigError(
                f"the workspace {workspace} contains the --mcp-config file {mcp_config}: code "
                "run there could rewrite the commands this host starts for later runs",
                hint="keep the MCP config outside the workspace",
            )


def tool_setup(
    mcp_config: Path | None,
    servers_dir: Path | None,
    skills_dir: Path | None,
    allow_tool: list[str] | None,
    tokenize: bool,
    settings: config.Settings,
    *,
    max_tool_calls: int | None = None,
    host_servers: Mapping[str, Upstream] | None = None,
) -> ToolSetup:
    """The tool flags, with the config file's [mcpServers.*] and [tools] for what they
    leave out."""
    from codecage import toolsetup
    from codecage.bridge import tooling

    setup = toolsetup.prepare(
        mcp_config,
        servers_dir=servers_dir,
        skills_dir=skills_dir,
        allowed_tools=[t for item in allow_tool or [] for t in item.split(",") if t],
        tokenize=True if tokenize else None,
        settings=settings,
        host_servers=host_servers,
    )
    if max_tool_calls is None:
        return setup
    if not 1 <= max_tool_calls <= _MAX_TOOL_CALLS:
        setup.close()
        raise ConfigError(
            f"--max-tool-calls {max_tool_calls} is out of range",
            hint=f"give 1 to {_MAX_TOOL_CALLS} tool calls per run",
        )
    limits = setup.tool_limits or tooling.bridge_limits(settings.tools)
    return dataclasses.replace(
        setup, tool_limits=dataclasses.replace(limits, max_calls=max_tool_calls)
    )


def tool_setup_of(
    flags: ToolFlags,
    settings: config.Settings,
    host_servers: Mapping[str, Upstream] | None,
) -> ToolSetup:
    """`tool_setup` of a command's tool flags (`run`, `serve`), with the servers of its
    --mcp-host hosts."""
    return tool_setup(
        flags.mcp_config,
        flags.servers_dir,
        flags.skills_dir,
        flags.allow_tool,
        flags.tokenize,
        settings,
        max_tool_calls=flags.max_tool_calls,
        host_servers=host_servers,
    )


def scrub_option(
    no_scrub: bool, categories: str | None, settings: config.Settings
) -> bool | ScrubSettings | None:
    """`Options(scrub=...)` for the flags: None leaves it to the config.

    Raises:
        ConfigError: an unknown category, or --no-scrub with --scrub-categories.
    """
    if no_scrub and categories is not None:
        raise ConfigError(
            "--no-scrub and --scrub-categories contradict each other",
            hint="give one: --no-scrub turns scrubbing off, --scrub-categories narrows it",
        )
    if no_scrub:
        return False
    if categories is None:
        return None
    wanted = [c.strip() for c in categories.split(",") if c.strip()]
    base = settings.scrub.model_copy(update={"enabled": True})
    return config.with_categories(base, wanted, "--scrub-categories")


def host_options(
    settings: config.Settings,
    tools: ToolSetup,
    *,
    profile: str | None = None,
    allow_import: list[str] | None = None,
    backend: str = "auto",
    allow_degraded: bool = False,
    replace_imports: bool = False,
    import_policy: bool = True,
    scrub: bool | ScrubSettings | None = None,
    pool: bool | None = None,
    fork_server: bool | None = None,
    face: Face = "cli",
    data_dir: Path | None = None,
    allow_host: list[str] | None = None,
    audit: str | None = None,
    alerts: bool = False,
) -> Options:
    """The options of a command's host, from its flags (`serve` builds the host itself).

    Raises:
        ConfigError: an --allow-host rule that is malformed or denied by the config.
    """
    hosts = allowed_hosts(allow_host)
    grants.Grants.of(settings.network, hosts, face="cli")  # refused in --allow-host's terms
    return Options(
        backend=backend,
        allow_degraded=allow_degraded,
        profile=profile,
        allowed_imports=[m for item in allow_import or [] for m in item.split(",") if m],
        replace_imports=replace_imports,
        import_policy=import_policy,
        config=settings,
        pool=pool,
        fork_server=fork_server,
        scrub=scrub,
        face=face,
        data_dir=data_dir,
        allow_hosts=hosts,
        audit=audit_argument(audit),
        alerts=alerts,
        **tools.sandbox_arguments(),
    )


def options_of(
    settings: config.Settings,
    tools: ToolSetup,
    flags: SandboxFlags,
    network: NetworkFlags,
    audit: AuditFlags,
    output: OutputFlags,
    *,
    pool: bool,
    replace_imports: bool = False,
    fork_server: bool | None = None,
) -> Options:
    """The options of `run`'s and `run-batch`'s host, from the flag groups they share (for
    `run-batch --ray`, of each node's Sandbox).

    Raises:
        ConfigError: an --allow-host rule that is malformed or denied by the config, bad
            --scrub-categories.
    """
    return host_options(
        settings,
        tools,
        profile=flags.profile,
        allow_import=flags.allow_import,
        backend=flags.backend,
        allow_degraded=flags.allow_degraded,
        replace_imports=replace_imports,
        import_policy=not flags.no_import_policy,
        scrub=scrub_option(output.no_scrub, output.scrub_categories, settings),
        pool=pool,
        fork_server=fork_server,
        allow_host=network.allow_host,
        audit=audit.audit,
    )


def audit_argument(flag: str | None) -> bool | str | None:
    """--audit as `Options(audit=)` takes it: on/off, a store, or None (the config's)."""
    if flag is None:
        return None
    if flag.lower() in ("on", "1", "true", "yes"):
        return True
    if flag.lower() in ("off", "0", "false", "no"):
        return False
    return flag


def allowed_hosts(allow_host: list[str] | None) -> list[str]:
    """--allow-host's rules: repeated, or separated with commas."""
    return [h.strip() for item in allow_host or [] for h in item.split(",") if h.strip()]


MAX_INPUT_FILES = 100


def read_inputs(specs: list[str] | None, max_bytes: int) -> dict[str, bytes] | None:
    """`--in FILE[:NAME]` as the library's `files`: each host FILE read (a regular file, at
    most `max_bytes`, all of them together too) under NAME (default: FILE's basename).
    A spec that names an existing path as a whole is that file (its name may hold ':').

    Raises:
        ConfigError: a missing file, a directory or other non-regular file, too many or too
            big, a NAME with '..', NUL or a leading '/', or two inputs of the same NAME.
    """
    if not specs:
        return None
    if len(specs) > MAX_INPUT_FILES:
        raise ConfigError(
            f"--in was given {len(specs)} times; at most {MAX_INPUT_FILES} files are taken",
            hint="put the files in a directory and pass it with --workspace instead",
        )
    files: dict[str, bytes] = {}
    for spec in specs:
        path, name = _input_spec(spec)
        data = _read_input(path, max_bytes - sum(map(len, files.values())), max_bytes)
        _check_input_name(spec, name)
        if name in files:
            raise ConfigError(
                f"two --in files are named {name!r} in /workspace",
                hint="give one of them another name: --in FILE:NAME",
            )
        files[name] = data
    return files


def _input_spec(spec: str) -> tuple[Path, str]:
    head, sep, tail = spec.rpartition(":")
    if not sep or os.path.lexists(spec) or not head:
        path, name = Path(spec), Path(spec).name
    else:
        path, name = Path(head), tail
    return path, name


def _check_input_name(spec: str, name: str) -> None:
    try:
        check_relpath(name)
    except ConfigError as exc:
        raise ConfigError(
            f"--in {neutralise_line(spec)}: {exc}",
            hint="name it by a relative path inside /workspace: --in FILE:data.csv "
            "or --in FILE:input/data.csv",
        ) from None


def _read_input(path: Path, left: int, max_bytes: int) -> bytes:
    """`path`'s bytes, when it is a regular file of at most `left` bytes. O_NONBLOCK: a FIFO
    named by mistake must not hang the command (fstat refuses it)."""
    shown = neutralise_line(str(path))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(
            f"--in {shown}: {exc.strerror or exc}",
            hint="give the path of a readable host file: --in FILE or --in FILE:NAME",
        ) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(
                f"--in {shown}: not a regular file"
                + (" (a directory)" if stat.S_ISDIR(st.st_mode) else ""),
                hint="pass files one by one with --in, or a directory with --workspace",
            )
        chunks: list[bytes] = []
        got = 0
        while st.st_size <= left and got <= left and (chunk := os.read(fd, 1 << 20)):
            chunks.append(chunk)
            got += len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if st.st_size > left or len(data) > left:
        raise ConfigError(
            f"--in {shown}: the input files are more than the workspace's "
            f"{max_bytes // 2**20} MiB together",
            hint="pass smaller files, or raise --workspace-mb",
        )
    return data
