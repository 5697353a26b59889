"""Who the sandbox is on the host: never root, and never the same id as another run.

Inside, the code runs as uid/gid 1000 of its own user namespace. What counts on the host
is the id that maps to: the kernel checks a few things against the *global* root id
without asking for a capability (sysctls, RLIMIT_NPROC's exemption, and anything that
would escape the mount namespace), so a sandbox mapped to host uid 0 is weaker than one
mapped to anyone else; and it checks signals, ptrace, /proc, Unix sockets and files
against the host uid, so two runs of one id could reach each other.

- codecage run by root: each sandbox (a run, a session for its whole life, a warm pool's
  sandbox from its start) leases an id of its own from a dedicated range, `[sandbox]
  id_base` and `id_count` (default `DEFAULT_ID` and `DEFAULT_ID_COUNT`: ids no account or
  container range uses); uid and gid are the same number. The range's first id, `base`,
  is no run's: a fork server's template runs as it (it runs no code of a run) and maps
  the whole range into its user namespace, so that each forked run drops to its own id.
  A lease is a lock file per id under `ID_STATE`, root's, held with flock for the life of
  the sandbox: threads and other codecage processes on the host never get the same id,
  and a process that dies frees its ids with it. The engine returns an id only once the
  sandbox's processes are gone and its files removed or given back.
- `[sandbox] uid`/`gid` set: every sandbox runs as that one id (shared: weaker; kept for
  hosts that must name the id, e.g. in a quota).
- codecage run by an ordinary user: the sandbox maps to that user (nothing else is
  possible without privileges): every run has the same host id; `info` says so.

Everything the sandbox reads must then be readable by that id (`isolation.staging`), and
its workspace belongs to it (`engine.workspace.ownership`). `ensure_not_root` checks the
launched process itself, on every start: if it would be host root, the run is refused.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import grp
import logging
import os
import pwd
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from codecage.errors import ConfigError, HostError, SandboxError
from codecage.models import LayerStatus


@dataclass(frozen=True, slots=True)
class Identity:
    """The host uid and gid a sandbox's processes run as (never 0: `plan` and
    `ensure_not_root` see to it)."""

    uid: int
    gid: int


log = logging.getLogger(__name__)

DEFAULT_ID = 2_000_000_000
"""The first id of the default range of sandbox ids when codecage runs as root: above
Debian's accounts (1000-59999), systemd's dynamic users (61184-65519) and container ranges
(524288-1879048191), and below 2^31, which some tools read as signed. No file on the host
is owned by an id of the range, so a sandbox can write nothing outside its own."""
DEFAULT_ID_COUNT = 65_536
"""How many ids the default range holds: `DEFAULT_ID` (templates) and one per sandbox alive
at once, for all codecage processes of the host together."""

MAX_ID = 2**32 - 2  # (uid_t)-1 means "no change" to the kernel
ID_STATE = Path("/var/lib/codecage/ids")
"""Root's directory of the lock files of the ids in use (one file per id, flock'ed)."""


@dataclass(frozen=True, slots=True)
class IdRange:
    """A dedicated range of host ids: `base` (a fork server's templates), then one id per
    sandbox, `base + 1` to `base + count - 1`."""

    base: int
    count: int

    @property
    def last(self) -> int:
        return self.base + self.count - 1

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, int) and self.base <= uid <= self.last


@dataclass(frozen=True, slots=True)
class IdentityPlan:
    """The ids a host's sandboxes run as, and where they came from (for `info`/`doctor`).
    `identity` is the one id of every sandbox, or, with a `range`, the range's own (its
    base: what templates run as, and what is checked for reading the host's files)."""

    identity: Identity
    source: str  # "range", "config" or "caller"
    range: IdRange | None = None


def plan(
    uid: int | None = None,
    gid: int | None = None,
    *,
    id_base: int = DEFAULT_ID,
    id_count: int = DEFAULT_ID_COUNT,
    euid: int | None = None,
) -> IdentityPlan:
    """The sandboxes' host ids: as root, one id per sandbox from the range `id_base`,
    `id_count` (or, when `uid`/`gid` are configured, that one id for all); otherwise the
    caller's own ids, whatever was configured (an ordinary user cannot map to another id).

    Raises:
        ConfigError: a configured id is 0 or out of range; the range overlaps root, an
            account, a group or a subordinate range of /etc/subuid or /etc/subgid.
    """
    running_as = os.geteuid() if euid is None else euid
    if running_as != 0:
        return IdentityPlan(Identity(os.getuid(), os.getgid()), "caller")
    for name, value in (("uid", uid), ("gid", gid)):
        if value is not None and not 1 <= value <= MAX_ID:
            raise ConfigError(
                f"[sandbox] {name} = {value} is not allowed: the sandbox must never be host "
                f"{'root' if value == 0 else 'an invalid id'}",
                hint=f"use an unused id between 1 and {MAX_ID}, or leave uid and gid unset: "
                "each sandbox then gets its own id from [sandbox] id_base/id_count",
            )
    if uid is not None or gid is not None:
        return IdentityPlan(Identity(uid or DEFAULT_ID, gid or DEFAULT_ID), "config")
    ids = check_range(id_base, id_count)
    return IdentityPlan(Identity(ids.base, ids.base), "range", ids)


@functools.cache
def check_range(base: int, count: int) -> IdRange:
    """`base`, `count` as a range of sandbox ids, once it is known to be nobody's.

    Raises:
        ConfigError: it includes 0 or passes `MAX_ID`, or overlaps an account's uid, a
            group's gid, or a subordinate range of /etc/subuid or /etc/subgid.
    """
    ids = IdRange(base, count)
    hint = (
        f"choose [sandbox] id_base and id_count so that the range is nobody's; the default, "
        f"id_base = {DEFAULT_ID} and id_count = {DEFAULT_ID_COUNT}, is outside every usual one"
    )
    if base < 1 or count < 2 or ids.last > MAX_ID:
        raise ConfigError(
            f"[sandbox] id_base = {base}, id_count = {count} is not a range of sandbox ids: "
            f"it must lie within 1 to {MAX_ID} and hold at least 2 ids",
            hint=hint,
        )
    taken = [(f"user {e.pw_name}", e.pw_uid) for e in pwd.getpwall() if e.pw_uid in ids]
    taken += [(f"group {e.gr_name}", e.gr_gid) for e in grp.getgrall() if e.gr_gid in ids]
    for path in (Path("/etc/subuid"), Path("/etc/subgid")):
        for owner, start, length in _subordinate(path):
            if start <= ids.last and base <= start + length - 1:
                taken.append((f"{owner}'s range in {path}", start))
    if taken:
        who, which = taken[0]
        raise ConfigError(
            f"[sandbox] ids {base} to {ids.last} overlap {who} (id {which}): a sandbox "
            "would share its ids and reach its files and processes",
            hint=hint,
        )
    return ids


def _subordinate(path: Path) -> list[tuple[str, int, int]]:
    """The ranges of /etc/subuid or /etc/subgid (owner, first id, count); none when the
    file is not there."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        parts = line.strip().split(":")
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            out.append((parts[0], int(parts[1]), int(parts[2])))
    return out


class Lease:
    """One sandbox's host id, held until `release` (or the end of a `with`); a lease of a
    fixed id (the caller's, the config's) holds nothing."""

    def __init__(self, identity: Identity, fd: int | None = None) -> None:
        self.identity = identity
        self._fd = fd

    @property
    def own(self) -> bool:
        """Whether the id is this sandbox's alone (from a range), not one shared by all."""
        return self._fd is not None

    def release(self) -> None:
        """Give the id back (idempotent): only once no process of the sandbox is left and
        its files are removed or given back. The SysV IPC objects the id left in this
        process's IPC namespace go first (`clear_ipc`)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            clear_ipc(self.identity.uid)
            os.close(fd)  # the flock goes with the last descriptor of its file

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def lease(who: IdentityPlan | Identity | None) -> Lease:
    """A sandbox's id: its own from `who`'s range, else `who`'s one id (None: this
    process's default plan).

    Raises:
        HostError: every id of the range is in use, or the lock files cannot be made.
    """
    if who is None:
        who = plan()
    if isinstance(who, Identity):
        return Lease(who)
    if who.range is None:
        return Lease(who.identity)
    return _allocator(who.range).take()


@functools.cache
def _allocator(ids: IdRange) -> _Allocator:
    return _Allocator(ids, ID_STATE)


class _Allocator:
    """The ids of one range, handed out round robin (an id just returned is the last to be
    given again). A thread lock orders this process's threads; the lock files order
    processes: `flock` conflicts between two opens of one file even in one process."""

    def __init__(self, ids: IdRange, state: Path) -> None:
        self.ids = ids
        self.state = state
        self._lock = threading.Lock()
        self._next = 0

    def take(self) -> Lease:
        """An id of the range no one holds, held until the lease is released.

        Raises:
            HostError: every id is in use, or the lock directory cannot be used.
        """
        slots = self.ids.count - 1
        with self._lock:
            directory = self._open_state()
            try:
                for step in range(slots):
                    slot = (self._next + step) % slots
                    fd = self._try(directory, self.ids.base + 1 + slot)
                    if fd is not None:
                        self._next = slot + 1
                        uid = self.ids.base + 1 + slot
                        clear_ipc(uid)  # a holder killed before its release left them
                        return Lease(Identity(uid, uid), fd)
            finally:
                os.close(directory)
        raise HostError(
            f"every sandbox id of {self.ids.base + 1} to {self.ids.last} is in use "
            f"({slots} sandboxes alive on this host)",
            hint="wait for runs to end, or raise [sandbox] id_count",
        )

    def _open_state(self) -> int:
        try:
            self.state.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.state, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise HostError(
                f"cannot use {self.state} for the sandbox ids' locks: {exc.strerror}",
                hint="codecage needs to write /var/lib/codecage when it runs as root",
            ) from exc
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            os.close(fd)
            raise HostError(
                f"{self.state} is not root's alone (uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):o}): another user could hold the sandbox ids",
                hint=f"remove it, or make it root's with mode 0700: chmod 700 {self.state}",
            )
        return fd

    @staticmethod
    def _try(directory: int, uid: int) -> int | None:
        """The lock file of `uid`, locked; None when another holder has it."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(str(uid), flags, 0o600, dir_fd=directory)
        except OSError as exc:
            raise HostError(
                f"cannot make the lock file of sandbox id {uid}: {exc.strerror}",
                hint="check that /var/lib/codecage/ids is root's and writable",
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return fd


_SYSVIPC = Path("/proc/sysvipc")
_IPC_RMID = 0
# /proc/sysvipc/<kind>: the id's column, and the columns of its owner's and creator's uids
_IPC_COLUMNS: dict[str, tuple[int, int, int]] = {
    "shm": (1, 7, 9),
    "msg": (1, 7, 9),
    "sem": (1, 4, 6),
}


def clear_ipc(uid: int) -> int:
    """Remove every SysV shared memory segment, message queue and semaphore set of this
    process's IPC namespace that `uid` owns or made; how many. They outlive the processes
    that made them: a run on the Landlock fallback (no IPC namespace of its own) left them
    on the host, holding host memory after the run, and readable by the next run lent the
    same id. Only for an id of the range, which nothing but sandboxes ever is.

    Raises:
        Nothing: what cannot be read or removed is logged (``identity.ipc_kept``).
    """
    removed = 0
    libc = _libc()
    for kind, (id_col, uid_col, cuid_col) in _IPC_COLUMNS.items():
        try:
            rows = (_SYSVIPC / kind).read_text(encoding="ascii").splitlines()[1:]
        except OSError:
            continue  # no SysV IPC in this kernel
        for row in rows:
            cols = row.split()
            if len(cols) <= max(id_col, uid_col, cuid_col):
                continue
            if str(uid) not in (cols[uid_col], cols[cuid_col]):
                continue
            if _remove_ipc(libc, kind, int(cols[id_col])) == 0:
                removed += 1
            else:
                log.warning("identity.ipc_kept", extra={"kind": kind, "id": cols[id_col]})
    return removed


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _remove_ipc(libc: ctypes.CDLL, kind: str, ipc_id: int) -> int:
    if kind == "shm":
        return int(libc.shmctl(ipc_id, _IPC_RMID, None))
    if kind == "msg":
        return int(libc.msgctl(ipc_id, _IPC_RMID, None))
    return int(libc.semctl(ipc_id, 0, _IPC_RMID))


def probe(identity_plan: IdentityPlan) -> LayerStatus:
    """What `info` says about who the sandbox is on the host."""
    ids = identity_plan.identity
    if identity_plan.range is not None:
        r = identity_plan.range
        return LayerStatus(
            name="host identity",
            active=True,
            mechanism=f"one uid and gid per sandbox, from {r.base + 1} to {r.last} on the "
            "host (1000 inside)",
            detail=f"a dedicated range (the config's sandbox table: id_base = {r.base}, "
            f"id_count = {r.count}; "
            f"{r.base} is the fork server's templates'): no run shares its id with another; "
            "every start refuses a sandbox that would be host root",
        )
    whose = {
        "caller": "the user running codecage (not root): every run has this one id, so "
        "runs are not kept apart by their host id (run codecage as root for one id per run)",
        "config": "one id for every sandbox, from the config's sandbox table (uid, gid): "
        "runs are not kept apart by their host id (unset uid and gid for one id per run)",
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
