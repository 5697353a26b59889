"""What every backend provides, and the name -> implementation table."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol

from codecage.errors import ConfigError, HostError
from codecage.isolation.rootfs import Mount
from codecage.models import LayerStatus


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """Everything a backend needs to start one sandbox; fds are the host's, still open."""

    mounts: tuple[Mount, ...]
    env: dict[str, str]
    guest_argv: tuple[str, ...]
    seccomp_fd: int
    info_fd: int  # the backend writes {"child-pid": N} here once namespaces exist
    block_fd: int  # the sandbox waits for one byte here before starting the guest
    control_fd: int  # the guest's end of the control socket
    bridge_fd: int  # the guest's end of the tool bridge (docs/tool-bridge.md)
    network: bool = False


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    argv: list[str]
    pass_fds: tuple[int, ...]


class Backend(Protocol):
    name: str

    def probe(self) -> list[LayerStatus]:
        """The layers this backend really provides on this host."""
        ...

    def launch_plan(self, spec: LaunchSpec) -> LaunchPlan:
        """The command line that starts one sandbox as described by `spec`."""
        ...


BACKENDS: dict[str, str] = {
    "bwrap": "codecage.backends.bwrap:BwrapBackend",
}
"""Name -> "module:Class". `auto` picks the first available, strongest first."""

AUTO_ORDER = ("bwrap",)


def load_backend(name: str) -> Backend:
    """Instantiate the backend called `name` ("auto" picks the strongest available).

    Raises:
        ConfigError: no backend has that name.
        HostError: no backend can run on this host.
    """
    if name == "auto":
        errors: list[str] = []
        for candidate in AUTO_ORDER:
            try:
                return load_backend(candidate)
            except HostError as exc:
                errors.append(f"{candidate}: {exc}")
        raise HostError(
            "no isolation backend is available here: " + "; ".join(errors),
            hint="install bubblewrap (Debian: apt-get install bubblewrap)",
        )
    if name not in BACKENDS:
        raise ConfigError(
            f"unknown backend {name!r}",
            hint=f"choose one of: auto, {', '.join(BACKENDS)}",
        )
    module_name, class_name = BACKENDS[name].split(":")
    backend: Backend = getattr(importlib.import_module(module_name), class_name)()
    return backend


def available_backends() -> dict[str, bool]:
    """Each known backend, and whether it can be loaded on this host."""
    found: dict[str, bool] = {}
    for name in BACKENDS:
        try:
            load_backend(name)
        except HostError:
            found[name] = False
        else:
            found[name] = True
    return found
