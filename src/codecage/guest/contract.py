"""The contract between host and guest: wire version, message kinds, guest paths, caps.

One module that both sides import, so that they cannot drift apart: the guest (the
bootstrap and `codecage.runtime`, inside the sandbox, where this is `codecage.contract`)
and the host (the wire models, the root filesystem, the engine, the tool bridge's
channel), where it is `codecage.guest.contract`. Standard library only, and nothing else
imported at all: the guest imports it on every cold start (a test pins both).

The two channels (docs/tool-bridge.md, and the bootstrap's docstring):

- control (fd 3), JSON lines: guest "ready", host "run", guest "display" (any number,
  within the caps below, as the code makes them), guest "result", guest "end", host "stop";
- tool bridge (fd 4), JSON lines: guest requests `{"v", "id", "op", ...}` (ops
  "call_tool" and "scrub"), host answers `{"v", "id", "ok", "result" | "error"}`, and the
  host's last line `{"v", "closed": why}`.
"""

from __future__ import annotations

from typing import Final

WIRE_VERSION: Final = 1
"""Version of both JSON-lines protocols; each message carries it as "v"."""

# --- the control channel ----------------------------------------------------------------

KIND_READY: Final = "ready"  # guest -> host: the interpreter is up
KIND_RUN: Final = "run"  # host -> guest: the code to run
KIND_RESULT: Final = "result"  # guest -> host: how the code ended
KIND_END: Final = "end"  # guest -> host: the main process's last message
KIND_STOP: Final = "stop"  # host -> guest: the answer to "end" (stop, do not exit)
KIND_DISPLAY: Final = "display"  # guest -> host: one rich output, as the code makes it

STOP_LINE: Final = b'{"v":%d,"kind":"%s"}\n' % (WIRE_VERSION, KIND_STOP.encode())
"""The host's "stop", byte for byte: the guest compares what it reads with it."""

MAX_REQUEST_BYTES: Final = 16 * 1024 * 1024
"""The longest "run" line the guest reads (code, limits, policy)."""
MAX_EVENTS: Final = 50
"""The most events a guest "result" carries."""
MAX_EVENT_DETAIL: Final = 500
"""The longest detail of one guest event, in characters."""
MAX_DISPLAYS: Final = 50
"""The most display outputs of one run (figures, display(obj), the last expression)."""
MAX_DISPLAY_BYTES: Final = 4 * 1024 * 1024
"""The longest "display" line, its MIME bundle as JSON (base64 images included)."""
MAX_DISPLAYS_BYTES: Final = 8 * 1024 * 1024
"""The "display" lines of one run together; past it, outputs are left out (an event)."""

# --- the tool bridge --------------------------------------------------------------------

OP_CALL_TOOL: Final = "call_tool"
OP_SCRUB: Final = "scrub"
BRIDGE_MAX_REQUEST_BYTES: Final = 4 * 1024 * 1024
"""The longest request line: the guest refuses to send one, the host ends the channel."""
BRIDGE_MAX_CLOSED_REASON: Final = 2000
"""The longest reason of the host's `closed` line, in characters."""

# --- file descriptors and paths inside the sandbox --------------------------------------

CONTROL_FD: Final = 3
BRIDGE_FD: Final = 4


def place_fds(moves: list[tuple[int, int]], *, park_at: int) -> None:
    """dup2 each (fd, target) of `moves` to its target number: the sources may be any, even
    each other's targets, hence the detour through `park_at` and the numbers above it.
    Stdio (0-2) is inheritable, the channels are not: user subprocesses never get them.
    The bootstrap and the fork server's guest both place their fds so."""
    import os  # here, not above: loading the contract imports nothing (every cold start)

    parked = []
    for index, (fd, target) in enumerate(moves):
        high = park_at + index
        os.dup2(fd, high, inheritable=False)
        os.close(fd)
        parked.append((high, target))
    for high, target in parked:
        os.dup2(high, target, inheritable=target <= 2)
        os.close(high)


GUEST_ROOT_ENV: Final = "CODECAGE_GUEST_ROOT"
"""Set by the Landlock backend only (backends/landlock.py): no namespaces there, so the
guest's paths below live under this host directory, a tree of links to what bwrap would
mount. Read (and removed from the environment) by the guest's copy of this module only:
the host's paths are the sandbox's, whatever its own environment says."""


def _guest_root() -> str:
    if __name__ == "codecage.guest.contract":
        return ""  # the host's copy
    import os

    root = os.environ.pop(GUEST_ROOT_ENV, "")
    return root.rstrip("/") if root.startswith("/") else ""


GUEST_ROOT: Final = _guest_root()
""""" in bwrap's sandbox; the tree's host directory under the Landlock backend."""
GUEST_PREFIX: Final = f"{GUEST_ROOT}/opt/python"  # the interpreter and its stdlib
GUEST_PACKAGE_ROOT: Final = f"{GUEST_ROOT}/opt/codecage"
"""Holds codecage/ (the guest package, importable as `codecage`), servers/ and skills/
(importable as `servers.*`, `skills.*`) and the bootstrap's bytecode."""
GUEST_PACKAGE_DIR: Final = f"{GUEST_PACKAGE_ROOT}/codecage"
GUEST_BOOTSTRAP: Final = f"{GUEST_PACKAGE_DIR}/bootstrap.py"  # what its tracebacks name
GUEST_BOOTSTRAP_PYC: Final = f"{GUEST_PACKAGE_ROOT}/bootstrap.pyc"  # what the guest runs
WORKSPACE_DIR: Final = f"{GUEST_ROOT}/workspace"
SERVERS_DIR: Final = f"{GUEST_ROOT}/servers"
"""Where the generated tool tree (`codecage gen`) is mounted, read-only."""
SKILLS_DIR: Final = f"{GUEST_ROOT}/skills"
"""Where the skills (reusable functions) are mounted, read-only."""
MATPLOTLIB_FONTS_DIR: Final = f"{GUEST_PACKAGE_ROOT}/matplotlib-fonts"
"""matplotlib's font list, built once on the host (`rootfs.matplotlib_font_list`), read-only:
the bootstrap copies it where matplotlib looks, so that no sandbox scans the fonts again."""
GUEST_SITE_PACKAGES: Final = f"{GUEST_ROOT}/opt/site-packages"
"""The host's third-party packages the profile allows, read-only."""
PACKAGES_DIR: Final = f"{GUEST_ROOT}/opt/packages"
"""The packages the operator added (`codecage packages add`), read-only."""

# --- egress (a run allowed network: engine/egress.py, guest/relay.py) ------------------------
EGRESS_DIR: Final = f"{GUEST_ROOT}/run/codecage"
"""The run's egress directory, bound read-only: the proxy's socket and the CA bundle."""
EGRESS_SOCKET: Final = f"{EGRESS_DIR}/egress.sock"
"""The host proxy's Unix socket for this sandbox: the only way out, and who the run is."""
EGRESS_CA_BUNDLE: Final = f"{EGRESS_DIR}/ca-bundle.pem"
"""The system's CAs and the proxy's own (hosts whose credentials the proxy adds)."""
EGRESS_RELAY_PORT: Final = 3128
"""Where the relay listens on the sandbox's own loopback (HTTP_PROXY points there)."""
PROC_MASKED: Final = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/key-users",
    "/proc/latency_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/timer_list",
    "/proc/timer_stats",
)
"""/proc entries that tell about the host or other users, hidden in every sandbox's /proc
behind an empty file or directory (isolation/rootfs.py; guest/template.py for forked ones)."""
TEMPLATE_ARG: Final = "--template-filter-fd"
"""A fork server's template (guest/template.py): the fd of the runs' seccomp filter."""
EGRESS_ARG: Final = "--egress"
"""On the guest's command line: start the relay before anything else runs."""
