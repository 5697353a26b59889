"""The operator's data directory: a host directory every sandbox of a server (or of a
`Sandbox(data_dir=...)`) sees read-only at /data, so large inputs need not travel through
the model.

It is a read-only bind like the tool trees: the sandbox can read, not write (the mount is
read-only, whatever the files' modes). A symlink in it is resolved inside the sandbox's own
root (bwrap and gVisor: the sandbox's mount namespace; Landlock: only the paths its rules
grant), so a link to /etc/shadow shows the sandbox's /etc, never the host's. It is never
staged (`engine.plan.host_sources` leaves it out): a copy of a large tree per change would
be a surprise; the sandbox's host id must be able to read it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Final

from codecage.errors import ConfigError
from codecage.isolation import identity as identities
from codecage.isolation.identity import Identity
from codecage.isolation.rootfs import Mount

DATA_DIR: Final = "/data"
"""Where the sandbox sees the operator's data directory."""

_HINT = "pass {data_dir} an absolute path to a directory of data only (not /, not a parent "
_HINT += "of codecage's state or run directories), e.g. /srv/codecage-data"


def check(
    data_dir: str | Path, state_dirs: Iterable[Path], identity: Identity | None = None
) -> Path:
    """`data_dir` resolved, when it may be given to sandboxes: absolute, an existing
    directory, not /, and neither inside nor above one of codecage's `state_dirs` (the
    private parent of run directories and workspaces, the stage, the cache, the packages,
    the config's places): the sandbox would read codecage's own state, or other runs'.
    With `identity` (the sandbox's host ids), that id must be able to read it: it is bound
    as it is, never copied.

    Raises:
        ConfigError: the message names the path and what is wrong with it.
    """
    given = Path(data_dir)
    if not given.is_absolute():
        raise ConfigError(f"the data directory {given} is not an absolute path", hint=_HINT)
    if not given.exists():
        raise ConfigError(f"the data directory {given} does not exist", hint=_HINT)
    if not given.is_dir():
        raise ConfigError(f"the data directory {given} is not a directory", hint=_HINT)
    root = given.resolve()
    if root == Path("/"):
        raise ConfigError("the data directory is / (the whole host)", hint=_HINT)
    for state in state_dirs:
        place = state.resolve()
        if place.is_relative_to(root) or root.is_relative_to(place):
            raise ConfigError(
                f"the data directory {given} overlaps codecage's own {place}: the sandbox "
                "would see codecage's state, or the workspaces of other runs",
                hint=_HINT,
            )
    if identity is not None and not identities.can_read(root, identity):
        raise ConfigError(
            f"the data directory {given} cannot be read by the sandbox's host id "
            f"{identity.uid}: it is bound as it is, never copied",
            hint="make it and the directories above it readable by others (chmod o+rx), "
            "or choose another {data_dir}",
        )
    return root


def mounts(data_dir: Path | None) -> tuple[Mount, ...]:
    """The read-only bind of `data_dir` at /data (checked by `check`), or nothing."""
    if data_dir is None:
        return ()
    return (Mount("ro-bind", DATA_DIR, str(data_dir)),)
