"""Packages an operator adds: `codecage packages add | list | remove`.

The sandbox sees the host's interpreter, its stdlib and the packages installed next to
codecage; an operator who wants more (scikit-learn, seaborn, openpyxl) adds them here, into
a directory codecage owns, never into codecage's own environment:

- **where**: the packages directory, one name in four spellings: `--packages-dir` (the
  `packages` commands), `CODECAGE_PACKAGES_DIR`, the config file's `[packages] dir`,
  `Options(packages_dir=...)`. By default `/var/lib/codecage/packages` for root, else
  `$XDG_DATA_HOME/codecage/packages` (`~/.local/share/...`); a user without packages of
  their own uses root's, when it exists. It must be trusted as the config file is (owned by
  this user or root, not writable by group or others, nor any directory above it): what is
  in it runs inside every sandbox that imports it, and the operator chose it.
- **how**: this environment's pip (`python -m pip install --target`), with the host's own
  pip configuration (index, proxy, certificates), binary wheels only unless the operator
  allows source builds, for this interpreter (the sandbox runs the same one). Each change
  installs the whole set afresh into a new tree, `trees/<id>`, constrained to the versions
  of the packages the host already has (a package added here then imports the host's
  numpy, not a second one that the host's pandas was not built for).
- **record**: `packages.lock.json` names the tree in force and every distribution in it
  (name, version, whether the operator asked for it, its top-level modules, the archive's
  hashes). It is replaced atomically, and that replacement is the commit: a sandbox starts
  with the old tree or the new one, never half of either. The previous tree is kept (warm
  sandboxes may still have it bound); older ones are removed.
- **in the sandbox**: the tree is bound read-only at /opt/packages, first on `sys.path`
  (the bootstrap adds it), for runs whose import policy allows at least one of its
  top-level modules, or that run without a policy; the policy then decides, per module,
  what the code may import (library code imports its own dependencies freely).

Installing is an operator action on the host: no MCP tool and nothing in the sandbox can
reach it (the sandbox has no network, and the tree is read-only there).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from codecage.config import create_directory, trusted_directory, untrusted_reason
from codecage.errors import ConfigError, HostError
from codecage.fdio import locked
from codecage.guest.bootstrap import DISTRIBUTIONS
from codecage.guest.contract import PACKAGES_DIR
from codecage.isolation import rootfs
from codecage.models import AddedPackage

if TYPE_CHECKING:
    from codecage.config import Settings
    from codecage.policy.profiles import ImportPolicy

log = logging.getLogger(__name__)

ENV_DIR = "CODECAGE_PACKAGES_DIR"
SYSTEM_DIR = Path("/var/lib/codecage/packages")
GUEST_DIR = PACKAGES_DIR  # first on the code's sys.path (the bootstrap puts it there)
RECORD_NAME = "packages.lock.json"
TREES = "trees"
_LOCK_NAME = ".lock"
_RECORD_MAX_BYTES = 4 * 1024 * 1024
_TREE_ID = re.compile(r"[0-9a-f]{32}")
_PIP_TIMEOUT_S = 1800.0  # a big set (scipy, torch) over a slow link; bounded all the same


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Entry(_Model):
    """One distribution in the tree."""

    name: str
    version: str
    requested: bool = Field(description="Named by the operator; else pulled in by one.")
    requirement: str | None = Field(
        None, description="What `add` was given, pinned to the version installed (requested)."
    )
    top_level: list[str] = Field([], description="Its importable top-level names.")
    hashes: dict[str, str] = Field({}, description="The archive's hashes, as pip reported.")


class Record(_Model):
    """`packages.lock.json`: the tree in force and what is in it."""

    version: int = 1
    python: str = Field(description="The interpreter the tree was installed for (X.Y).")
    tree: str | None = Field(None, description="The tree's id under trees/; None: empty.")
    packages: list[Entry] = []

    def top_level(self) -> frozenset[str]:
        return frozenset(name for entry in self.packages for name in entry.top_level)

    def requested(self) -> list[Entry]:
        return [entry for entry in self.packages if entry.requested]


@dataclass(frozen=True, slots=True)
class Change:
    """What `add` or `remove` did."""

    directory: Path
    before: Record
    after: Record
    notes: tuple[str, ...] = ()


def _empty() -> Record:
    return Record(python=_python_version())


def _python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def canonical(name: str) -> str:
    """The registry's form of a distribution name (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


# --- where -------------------------------------------------------------------------------


def location(
    argument: str | Path | None = None,
    settings: Settings | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    for_writing: bool = False,
) -> tuple[Path, str]:
    """The packages directory and where that choice came from (see the module docstring).

    For reading (a sandbox's mounts, `list`), a user without a directory of their own
    sees root's; `add` and `remove` write the user's own.
    """
    env = os.environ if environ is None else environ
    if argument is not None:
        return Path(argument).expanduser().absolute(), "argument"
    if env.get(ENV_DIR):
        return Path(env[ENV_DIR]).expanduser().absolute(), f"env {ENV_DIR}"
    if settings is not None and settings.packages.dir is not None:
        path = settings.config_relative(settings.packages.dir)
        assert path is not None  # noqa: S101 - dir is set
        return path.absolute(), f"file {settings.config_file}"
    if os.geteuid() == 0:
        return SYSTEM_DIR, "default"
    user = _user_dir(env)
    if for_writing or os.path.lexists(user) or not os.path.lexists(SYSTEM_DIR):
        return user, "default"
    return SYSTEM_DIR, "default"


def _user_dir(env: Mapping[str, str]) -> Path:
    return user_data_dir("packages", env)


def user_data_dir(name: str, environ: Mapping[str, str] | None = None) -> Path:
    """codecage's place called `name` in this user's data: `$XDG_DATA_HOME/codecage/<name>`
    (`~/.local/share/codecage/<name>`); root's counterpart is /var/lib/codecage/<name>."""
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_DATA_HOME", "")
    if not Path(xdg).is_absolute():  # the XDG spec: a relative value is invalid, ignore it
        xdg = str(Path.home() / ".local" / "share")
    return Path(xdg) / "codecage" / name


def check_workspace(
    directory: Path, workspace: str | Path | None, environ: Mapping[str, str] | None = None
) -> None:
    """Refuse a workspace that holds a packages directory a later run could read, or lies
    inside one: code in the run writes its workspace as this user, so what it wrote there
    would pass the trust check and run in later sandboxes (as `config.check_workspace`
    refuses a workspace holding the configuration).

    Raises:
        ConfigError: the workspace and a packages directory overlap.
    """
    if workspace is None:
        return
    root = Path(workspace).resolve()
    env = os.environ if environ is None else environ
    for place in dict.fromkeys((directory, _user_dir(env), SYSTEM_DIR)):
        for form in (place.absolute(), place.resolve()):
            if form.is_relative_to(root) or root.is_relative_to(form):
                raise ConfigError(
                    f"the workspace {workspace} and the packages directory {place} overlap: "
                    "code run there could change the packages of later runs",
                    hint="choose a workspace directory apart from codecage's packages "
                    "directory (not your home, ~/.local or /var/lib)",
                )


def check_trusted(directory: Path) -> Path:
    """The real path of `directory`, once it and every directory above it are known to be
    changeable only by root or this user (the config file's rule: `config.untrusted_reason`).

    Raises:
        ConfigError: it does not exist, is not a directory, or is not trusted.
    """
    return trusted_directory(
        directory,
        "the packages directory",
        hint="what is in it runs in the sandboxes: only root or you may be able to "
        "change it and the directories above it (chown it to you or root and "
        "`chmod go-w` it), or choose another with --packages-dir / "
        f"{ENV_DIR} / [packages] dir",
        missing_hint="add a package with `codecage packages add NAME` to create it",
    )


# --- the record --------------------------------------------------------------------------


def read_record(directory: Path) -> Record:
    """The record of a trusted directory (`check_trusted`); empty when there is none yet.

    Raises:
        ConfigError: the record is not trusted or not valid.
    """
    path = directory / RECORD_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return _empty()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(handle.fileno())
        reason = (
            untrusted_reason(path, st, sticky_ok=False)
            if stat.S_ISREG(st.st_mode)
            else f"{path} is not a regular file"
        )
        if reason is not None:
            raise ConfigError(
                f"the packages record is not trusted: {reason}",
                hint="only root or you may be able to change it (`chmod go-w` it)",
            )
        raw = handle.read(_RECORD_MAX_BYTES + 1)
    try:
        if len(raw) > _RECORD_MAX_BYTES:
            raise ValueError(f"larger than {_RECORD_MAX_BYTES} bytes")
        record = Record.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as exc:
        raise ConfigError(
            f"{path} is not a valid packages record: {exc}",
            hint="it is written by `codecage packages`; re-add the packages to rewrite it",
        ) from exc
    if record.tree is not None and not _TREE_ID.fullmatch(record.tree):
        raise ConfigError(f"{path}: bad tree id {record.tree!r}")
    return record


def _write_record(directory: Path, record: Record) -> None:
    """Replace the record in one step: this is the commit of `add` and `remove`."""
    data = json.dumps(record.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
    fd, name = tempfile.mkstemp(prefix=".record-", dir=directory)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.chmod(0o644)
        tmp.replace(directory / RECORD_NAME)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):  # the rename itself, durable
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


# --- list, add, remove ---------------------------------------------------------------------


def installed(directory: Path) -> Record:
    """What the directory holds (empty when it does not exist yet).

    Raises:
        ConfigError: the directory or its record is not trusted.
    """
    if not os.path.lexists(directory):
        return _empty()
    return read_record(check_trusted(directory))


def added_packages(directory: Path) -> list[AddedPackage]:
    """For `codecage info`: every distribution in the tree, with its version."""
    return [
        AddedPackage(name=e.name, version=e.version, requested=e.requested)
        for e in installed(directory).packages
    ]


def add(
    directory: Path,
    requirements: Sequence[str],
    *,
    allow_source: bool = False,
    host_versions: bool = True,
) -> Change:
    """Install `requirements` (NAME or NAME==VERSION, extras allowed) with the packages
    already added, into a new tree; a name already added is replaced (new version).

    Raises:
        ConfigError: a requirement is not valid, or the directory is not trusted.
        HostError: pip failed (the message carries its reason).
    """
    wanted, notes = _parse(requirements)
    if not wanted:
        raise ConfigError("name at least one package", hint="codecage packages add tabulate")
    real = _prepare(directory)
    with locked(real / _LOCK_NAME):
        before = read_record(real)
        keep = {canonical(e.name): e.requirement or e.name for e in before.requested()}
        keep.update(wanted)
        after = _build(
            real,
            list(keep.values()),
            before,
            allow_source=allow_source,
            host_versions=host_versions,
        )
    return Change(real, before, after, tuple(notes))


def remove(
    directory: Path,
    names: Sequence[str],
    *,
    allow_source: bool = False,
    host_versions: bool = True,
) -> Change:
    """Remove added packages (and what only they needed): the rest is installed again at
    their recorded versions into a new tree.

    Raises:
        ConfigError: a name was not added, or the directory is not trusted.
        HostError: pip failed while installing the rest.
    """
    if not names:
        raise ConfigError("name at least one package", hint="`codecage packages list` shows them")
    real = check_trusted(directory)
    with locked(real / _LOCK_NAME):
        before = read_record(real)
        requested = {canonical(e.name): e for e in before.requested()}
        every = {canonical(e.name) for e in before.packages}
        gone = {canonical(DISTRIBUTIONS.get(n, n)) for n in names}
        for name in sorted(gone - set(requested)):
            if name in every:
                raise ConfigError(
                    f"{name} was not added by name: it is a dependency of the added packages",
                    hint="remove the package that needs it",
                )
            raise ConfigError(
                f"{name} is not among the added packages",
                hint=f"added: {', '.join(sorted(requested)) or 'none'}",
            )
        rest = [e.requirement or e.name for key, e in requested.items() if key not in gone]
        after = _build(real, rest, before, allow_source=allow_source, host_versions=host_versions)
    return Change(real, before, after)


def _parse(requirements: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    from packaging.requirements import InvalidRequirement, Requirement

    wanted: dict[str, str] = {}
    notes: list[str] = []
    for text in requirements:
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            raise ConfigError(
                f"{text!r} is not a package requirement: {exc}",
                hint="give NAME or NAME==VERSION, e.g. scikit-learn==1.5.2",
            ) from None
        if req.url or req.marker:
            raise ConfigError(
                f"{text!r}: only a name, extras and a version may be given",
                hint="give NAME or NAME==VERSION, from the registry the host can reach",
            )
        if req.name in DISTRIBUTIONS and canonical(req.name) != canonical(DISTRIBUTIONS[req.name]):
            notes.append(f"{req.name} is an import name: adding {DISTRIBUTIONS[req.name]}")
            req.name = DISTRIBUTIONS[req.name]
        wanted[canonical(req.name)] = str(req)
    return wanted, notes


def _prepare(directory: Path) -> Path:
    """Create the directory (0755, and any missing parents) if needed; check it."""
    create_directory(
        directory,
        "the packages directory",
        mode=0o755,
        hint="run as the directory's owner (root for /var/lib/codecage), or choose "
        f"another with --packages-dir / {ENV_DIR}",
    )
    return check_trusted(directory)


def _build(
    directory: Path,
    requirements: list[str],
    before: Record,
    *,
    allow_source: bool,
    host_versions: bool,
) -> Record:
    """Install `requirements` into a new tree, commit it (the record), drop old trees."""
    trees = directory / TREES
    trees.mkdir(mode=0o755, exist_ok=True)
    if not requirements:
        after = _empty()
    else:
        tree_id = uuid.uuid4().hex
        staging = trees / f".tmp-{tree_id}"
        try:
            staging.mkdir(mode=0o755)
            report = _pip_install(
                staging, requirements, allow_source=allow_source, host_versions=host_versions
            )
            entries = _entries(staging, report, requirements)
            staging.rename(trees / tree_id)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        after = Record(python=_python_version(), tree=tree_id, packages=entries)
    _write_record(directory, after)
    _drop_old_trees(trees, keep={t for t in (after.tree, before.tree) if t})
    return after


def _pip_install(
    target: Path, requirements: list[str], *, allow_source: bool, host_versions: bool
) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="codecage-pip-") as scratch:
        report_file = Path(scratch) / "report.json"
        argv = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--target",
            str(target),
            "--no-input",
            "--disable-pip-version-check",
            "--no-warn-script-location",
            "--progress-bar",
            "off",
            "--report",
            str(report_file),
        ]
        if not allow_source:
            argv += ["--only-binary", ":all:"]
        if host_versions:
            constraints = Path(scratch) / "host-versions.txt"
            named = {canonical(_requirement_name(r)) for r in requirements}
            constraints.write_text("\n".join(_host_versions(exclude=named)) + "\n")
            argv += ["--constraint", str(constraints)]
        argv += requirements  # each parsed as a requirement: none can be an option
        try:
            proc = subprocess.run(  # this interpreter's pip, with the operator's names
                argv,
                capture_output=True,
                text=True,
                encoding="utf-8",
                errors="replace",
                check=False,
                timeout=_PIP_TIMEOUT_S,
                umask=0o022,  # the tree is read by the sandbox's user, written by nobody
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise HostError(f"pip did not finish: {exc}", hint=_PIP_HINT) from exc
        if proc.returncode != 0:
            raise HostError(
                f"pip could not install {' '.join(requirements)}:\n{_tail(proc)}",
                hint=_failure_hint(proc.stderr, allow_source=allow_source),
            )
        try:
            report: dict[str, object] = json.loads(report_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise HostError(f"pip wrote no installation report: {exc}", hint=_PIP_HINT) from exc
    return report


_PIP_HINT = (
    "codecage installs with this environment's pip (`python -m pip`); check that it runs and "
    "that the host reaches its package registry (pip's own configuration applies)"
)


def _failure_hint(stderr: str, *, allow_source: bool) -> str:
    if "No module named pip" in stderr:
        return "this environment has no pip: install it (python -m ensurepip) and retry"
    if "conflict" in stderr.lower() or "ResolutionImpossible" in stderr:
        return (
            "the packages need versions other than the host's own (see above): name the "
            "package pinned to the host's version, or pass --ignore-host-versions to resolve "
            "them apart (the added versions then shadow the host's in the sandbox)"
        )
    if not allow_source and "No matching distribution" in stderr:
        return (
            "check the name and version (`pip index versions NAME`); a package with no wheel "
            "for this Python needs --allow-source (it is then built on this host)"
        )
    return _PIP_HINT


def _tail(proc: subprocess.CompletedProcess[str], lines: int = 15) -> str:
    text = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
    return "\n".join(text[-lines:])


def _requirement_name(text: str) -> str:
    from packaging.requirements import Requirement

    return Requirement(text).name


def _host_versions(*, exclude: set[str]) -> list[str]:
    """`name==version` for the distributions this environment has: those are what the
    sandbox's other packages were built against."""
    from importlib import metadata

    pins: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"] if dist.metadata else None
        if not name or canonical(name) in exclude or "+" in dist.version:
            continue  # a local build (e.g. codecage itself) is on no registry
        pins.setdefault(canonical(name), f"{canonical(name)}=={dist.version}")
    return sorted(pins.values())


def _entries(staging: Path, report: dict[str, object], requirements: list[str]) -> list[Entry]:
    from importlib import metadata

    from packaging.requirements import Requirement

    asked = {canonical(Requirement(r).name): Requirement(r) for r in requirements}
    tops: dict[str, list[str]] = {}
    for dist in metadata.distributions(path=[str(staging)]):
        tops[canonical(dist.metadata["Name"])] = _top_level(dist)
    entries: list[Entry] = []
    for item in report.get("install", []) or []:  # type: ignore[attr-defined]
        meta = item.get("metadata", {})
        name, version = str(meta.get("name", "")), str(meta.get("version", ""))
        key = canonical(name)
        requirement = None
        if key in asked:
            req = asked[key]
            extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            requirement = f"{req.name}{extras}=={version}"
        entries.append(
            Entry(
                name=name,
                version=version,
                requested=key in asked,
                requirement=requirement,
                top_level=tops.get(key, []),
                hashes=_hashes(item.get("download_info", {})),
            )
        )
    return sorted(entries, key=lambda e: canonical(e.name))


def _hashes(download_info: dict[str, object]) -> dict[str, str]:
    archive = download_info.get("archive_info") if isinstance(download_info, dict) else None
    if not isinstance(archive, dict):
        return {}
    hashes = archive.get("hashes")
    if isinstance(hashes, dict):
        return {str(k): str(v) for k, v in hashes.items()}
    single = archive.get("hash")
    if isinstance(single, str) and "=" in single:
        algorithm, _, value = single.partition("=")
        return {algorithm: value}
    return {}


def _top_level(dist: object) -> list[str]:
    names: set[str] = set()
    for file in getattr(dist, "files", None) or []:
        top = file.parts[0]
        if top.endswith((".dist-info", ".data")) or top in ("..", "__pycache__", "bin"):
            continue
        name = top.split(".")[0] if top.endswith((".py", ".so", ".pyd")) else top
        if name.isidentifier():
            names.add(name)
    return sorted(names)


def _drop_old_trees(trees: Path, keep: set[str]) -> None:
    for child in trees.iterdir():
        if child.name not in keep:
            shutil.rmtree(child, ignore_errors=True)


# --- in the sandbox ----------------------------------------------------------------------


def mounts(
    directory: Path, policy: ImportPolicy | None, *, known: frozenset[str] = frozenset()
) -> tuple[rootfs.Mount, ...]:
    """The read-only binds that make the added packages importable in a sandbox of
    `policy`: the tree at /opt/packages and the system libraries its extension modules
    need (less those in `known`, bound already). None when nothing was added, or the
    policy allows none of the tree's top-level modules.

    Raises:
        ConfigError: the directory, its record or its tree is not trusted.
        HostError: `ldd` fails on the tree's extension modules.
    """
    if not os.path.lexists(directory):
        return ()
    real = check_trusted(directory)
    record = read_record(real)
    if record.tree is None:
        return ()
    if record.python != _python_version():
        _warn_other_python(str(real), record.python)
    if policy is not None and not any(policy.allows(name) for name in record.top_level()):
        return ()
    tree = real / TREES / record.tree
    st = os.lstat(tree)
    reason = (
        untrusted_reason(tree, st, sticky_ok=False)
        if stat.S_ISDIR(st.st_mode)
        else f"{tree} is not a directory"
    )
    if reason is not None:
        raise ConfigError(f"the packages tree is not trusted: {reason}")
    libraries = _libraries(str(tree))
    return (
        rootfs.Mount("ro-bind", GUEST_DIR, str(tree)),
        *(rootfs.Mount("ro-bind", lib, lib) for lib in libraries if lib not in known),
    )


@functools.cache
def _warn_other_python(directory: str, python: str) -> None:
    """Once per directory: pure-Python packages still work, compiled ones fail to import."""
    log.warning(
        "packages.other_python",
        extra={
            "directory": directory,
            "installed_for": python,
            "running": _python_version(),
            "hint": "`codecage packages add NAME` (any added one) reinstalls the set for it",
        },
    )


@functools.cache
def _libraries(tree: str) -> tuple[str, ...]:
    """The host libraries outside the tree that its extension modules link against (a tree
    never changes once committed: a change makes a new one)."""
    root = Path(tree)
    modules = sorted(p for p in root.rglob("*.so*") if p.is_file() and not p.is_symlink())
    if not modules:
        return ()
    found = rootfs.resolve_shared_libraries(modules)
    return tuple(str(lib) for lib in found if root not in lib.parents)
