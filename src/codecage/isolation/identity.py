"""Who the sandbox is on the host: never root.

Inside, the code runs as uid/gid 1000 of its own user namespace. What counts on the host
is the id that maps to: the kernel checks a few things against the *global* root id
without asking for a capability (sysctls, RLIMIT_NPROC's exemption, and anything that
would escape the mount namespace), so a sandbox mapped to host uid 0 is weaker than one
mapped to anyone else.

- codecage run by root: the sandbox gets a dedicated unprivileged id, `[sandbox] uid` and
  `gid` in the config (default `DEFAULT_ID`, an id no account or container range uses);
  the backend's launcher drops to it before it makes the namespaces.
- codecage run by an ordinary user: the sandbox maps to that user (nothing else is
  possible without privileges, and nothing else is needed).

Everything the sandbox reads must then be readable by that id (`isolation.staging`), and
its workspace belongs to it (`engine.workspace.ownership`). `ensure_not_root` checks the
launched process itself, on every start: if it would be host root, the run is refused.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from codecage.backends.base import Identity
from codecage.errors import ConfigError, SandboxError
from codecage.models import LayerStatus

DEFAULT_ID = 2_000_000_000
"""The default host uid and gid of sandboxes when codecage runs as root: an id no account
or range uses: above Debian's accounts (1000-59999), systemd's dynamic users (61184-65519)
and container ranges (524288-1879048191), and below 2^31, which some tools read as signed.
No file on the host is owned by it, so the sandbox can write nothing outside its own."""

MAX_ID = 2**32 - 2  # (uid_t)-1 means "no change" to the kernel


@dataclass(frozen=True, slots=True)
class IdentityPlan:
    """The ids a host's sandboxes run as, and where they came from (for `info`/`doctor`)."""

    identity: Identity
    source: str  # "config", "default" or "caller"


def plan(
    uid: int | None = None, gid: int | None = None, *, euid: int | None = None
) -> IdentityPlan:
    """The sandbox's host ids: as root, `uid`/`gid` (config) or `DEFAULT_ID`; otherwise the
    caller's own ids, whatever was configured (an ordinary user cannot map to another id).

    Raises:
        ConfigError: a configured id is 0 or out of range.
    """
    running_as = os.geteuid() if euid is None else euid
    if running_as != 0:
        return IdentityPlan(Identity(os.getuid(), os.getgid()), "caller")
    for name, value in (("uid", uid), ("gid", gid)):
        if value is not None and not 1 <= value <= MAX_ID:
            raise ConfigError(
                f"[sandbox] {name} = {value} is not allowed: the sandbox must never be host "
                f"{'root' if value == 0 else 'an invalid id'}",
                hint=f"use an unused id between 1 and {MAX_ID}, e.g. the default {DEFAULT_ID}",
            )
    source = "config" if uid is not None or gid is not None else "default"
    return IdentityPlan(Identity(uid or DEFAULT_ID, gid or DEFAULT_ID), source)


def probe(identity_plan: IdentityPlan) -> LayerStatus:
    """What `info` says about who the sandbox is on the host."""
    ids = identity_plan.identity
    whose = {
        "caller": "the user running codecage (not root)",
        "default": f"a dedicated id (the default, {DEFAULT_ID}; the config's sandbox "
        "table sets uid and gid)",
        "config": "a dedicated id, from the config's sandbox table (uid, gid)",
    }[identity_plan.source]
    return LayerStatus(
        name="host identity",
        active=ids.uid != 0 and ids.gid != 0,
        mechanism=f"uid {ids.uid}, gid {ids.gid} on the host (1000 inside)",
        detail=f"{whose}; every start refuses a sandbox that would be host root",
    )


def ensure_not_root(pid: int) -> Identity:
    """The host ids process `pid` runs as (real, effective, saved and filesystem ids read
    from /proc); refuses when any of them is 0. Called on every sandbox's first process
    before the guest starts: the identity plan above is the intent, this is the fact.

    Raises:
        SandboxError: the process is (partly) host root, or cannot be read.
    """
    try:
        text = Path(f"/proc/{pid}/status").read_text(encoding="ascii", errors="replace")
    except OSError as exc:
        raise SandboxError(f"cannot read the sandbox's ids: {exc.strerror}") from exc
    ids: dict[str, list[int]] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name in ("Uid", "Gid"):
            ids[name] = [int(v) for v in value.split()]
    if len(ids.get("Uid", [])) != 4 or len(ids.get("Gid", [])) != 4:
        raise SandboxError("cannot read the sandbox's ids from /proc")
    if 0 in ids["Uid"] or 0 in ids["Gid"]:
        raise SandboxError(
            f"refused: the sandbox would run as host root (uid {ids['Uid']}, gid {ids['Gid']})",
            hint="run codecage as root with [sandbox] uid/gid unset or non-zero, or as an "
            "ordinary user; `codecage doctor` shows the ids in force",
        )
    return Identity(ids["Uid"][0], ids["Gid"][0])


def can_read(path: Path, identity: Identity) -> bool:
    """Can `identity` (no supplementary groups, no capabilities) reach `path` and read it:
    search permission on every directory above it, read (and search, for a directory) on
    it. Symlinks are resolved first, as a bind mount's source is."""
    try:
        real = path.resolve(strict=True)
        parents = list(reversed(real.parents))
        for directory in parents:
            if not _allows(directory.stat(), identity, stat.S_IXOTH):
                return False
        st = real.stat()
    except OSError:
        return False
    need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(st.st_mode) else 0)
    return _allows(st, identity, need)


def _allows(st: os.stat_result, identity: Identity, other_bits: int) -> bool:
    """Do `st`'s mode bits grant `other_bits` (expressed as the "other" bits) to `identity`?"""
    if st.st_uid == identity.uid:
        bits = other_bits << 6
    elif st.st_gid == identity.gid:
        bits = other_bits << 3
    else:
        bits = other_bits
    return st.st_mode & bits == bits
