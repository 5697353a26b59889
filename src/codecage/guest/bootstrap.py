"""Guest bootstrap: runs *inside* the sandbox, with the standard library only.

Started by the host as `/opt/python/bin/python3 -I -S -B -X utf8 bootstrap.py --control-fd N
--bridge-fd M` (the tool bridge, moved to fd 4: docs/tool-bridge.md).
It speaks versioned JSON lines over the control socket (fd N, moved to fd 3); the version,
the kinds, the fds, paths and caps are the contract's (contract.py, shared with the host):

    guest -> host  {"v":1,"kind":"ready","pid":...}         the interpreter is up
    host -> guest  {"v":1,"kind":"run","code":...,"filename":...,"limits":{...},...}
    guest -> host  {"v":1,"kind":"display","pid":...,"source":...,"data":{...}}  (0..50)
    guest -> host  {"v":1,"kind":"result","return_value":...,"error":...,"events":[...]}
    guest -> host  {"v":1,"kind":"end","pid":...,"exit_code":...}  then SHUT_WR
    host -> guest  {"v":1,"kind":"stop"}

Then the main process stops itself (SIGSTOP) until the host destroys the sandbox; without
the host's "stop" (or continued), it exits with the program's exit code (see _end_run).
A session's "run" says `"session": true`: after its "end" (no SHUT_WR) the guest waits for
the next "run" in the same interpreter, until the host closes the socket (_serve_session).
Nothing it says is trusted by the host: the host judges the status itself and validates
and bounds this report. This file is an island: it must not import anything from the host
side of codecage (a test checks it); contract.py is the guest's own.
"""

from __future__ import annotations

import _ast
import _signal  # type: ignore[import-not-found]  # no stub; `signal` would build its enums
import _socket
import atexit
import gc
import json
import os
import resource
import sys
import types
from typing import TYPE_CHECKING, Any

# The host runs this file as bytecode compiled to name its source path (see
# rootfs.bootstrap_bytecode), so __file__ is the .pyc's path; frames name the source.
_OWN_FILE = (lambda: None).__code__.co_filename


def _guest_module(name: str) -> types.ModuleType:
    """A module of the guest package, which in the sandbox is `codecage` in the directory
    above this file's source (the interpreter runs with -I: nothing of it is on sys.path,
    and this file runs as a script, so a relative import does not work). The path is put
    back as it was: the code's path is set up later, in _fresh_main_module."""
    # Under the Landlock backend the guest's paths sit under a host directory, named by
    # contract.GUEST_ROOT_ENV (which the contract reads and removes once loaded).
    root = os.environ.get("CODECAGE_GUEST_ROOT", "").rstrip("/")
    sys.path.append(root + os.path.dirname(os.path.dirname(_OWN_FILE)))
    try:
        __import__(f"codecage.{name}")
    finally:
        sys.path.pop()
    return sys.modules[f"codecage.{name}"]


if TYPE_CHECKING or __package__:  # imported on the host, as codecage.guest.bootstrap
    from . import contract
else:
    contract = _guest_module("contract")

EVERY_MODULE = "*"  # an allowed-modules entry: nothing is refused (the standard profile)
MAX_EVENTS = contract.MAX_EVENTS  # kept in _events: the import policy appends too
_STOP_WAIT_S = 0.05  # for the host's "stop", sent as soon as it reads the "end"
_RESULT_NAME = "__codecage_last_value__"

_events: list[dict[str, str]] = []
_displays: Any = None  # codecage.runtime.displays, once installed (_install_displays)


def main(argv: list[str]) -> int:
    run_filter = _template_filter(argv)  # read first: its fd may be any number
    control = _take_fds(argv)
    _close_other_fds(keep=(contract.CONTROL_FD, contract.BRIDGE_FD))
    _preload(_preload_list(argv))
    _warm_up(pooled="--pooled" in argv or run_filter is not None)
    if run_filter is not None:  # a fork server's template: this returns in each sandbox
        _send(
            control, {"v": contract.WIRE_VERSION, "kind": contract.KIND_READY, "pid": os.getpid()}
        )
        control = _guest_module("template").serve(control, run_filter)
        # A fork: its first compile, json and stream writes copy the template's pages
        # (copy-on-write faults, ~0.1 ms); done here, before "ready", not in the run.
        _warm_up(pooled=False)
    _start_egress_relay(argv)
    _install_displays(control)  # before the request: a warm sandbox has it ready
    _keep_output_on_kill()  # the run's own streams already: done before "ready" too
    main_pid = os.getpid()
    _send(control, {"v": contract.WIRE_VERSION, "kind": contract.KIND_READY, "pid": main_pid})
    request = _receive(control)
    _apply_limits(request["limits"], session=bool(request.get("session")))
    sys.addaudithook(_audit)
    allowed = request.get("allowed_modules")  # None: no policy; with "*": nothing refused
    policy = None
    if allowed is not None and EVERY_MODULE not in allowed:
        policy = _ImportCheck(allowed, _Refusal.of(request))
    _install_import_hook(policy)
    gc.freeze()  # what exists now is ours: the collections at the end skip it
    main_module = _fresh_main_module(str(request["filename"]))
    if request.get("session"):
        return _serve_session(control, main_pid, main_module, request)
    exit_code, report = _run_user_code(request, main_module)
    _finish_like_python()
    _report(control, report, exit_code)
    if os.getpid() == main_pid:
        _end_run(control, main_pid, exit_code)
    return exit_code


def _serve_session(
    control: _socket.socket,
    main_pid: int,
    main_module: types.ModuleType,
    request: dict[str, Any],
) -> int:
    """A session: run one request after another in the same interpreter and `__main__`,
    so that globals, imports and open files persist between runs. Each run ends as a
    single run does ("result", then "end"), but the socket stays open and the guest waits
    for the next "run"; the host's closing the socket (or destroying the sandbox) ends it.
    Nothing of a one-off run's exit work happens between runs (threads keep running,
    atexit waits, globals stay)."""
    alarm = _Alarm()
    while True:
        _remember_source(str(request["filename"]), str(request["code"]))
        armed = alarm.arm(request.get("interrupt_after_s"))
        try:
            exit_code, report = _run_user_code(request, main_module)
        finally:
            if armed:
                alarm.disarm()
        _report(control, report, exit_code)
        if os.getpid() != main_pid:  # a process the code forked: it exits, as in a run
            return exit_code
        _send_end(control, main_pid, exit_code)
        _events.clear()
        try:
            request = _receive(control)
        except SystemExit:  # the host closed the session
            _finish_like_python()
            return 0
        _apply_cpu_limit(request["limits"])
        if _displays is not None:
            _displays.new_run()


class _Alarm:
    """A session's runs interrupted at their timeout, so that the session lives on with its
    state: a real-time interval timer (SIGALRM) whose handler raises KeyboardInterrupt where
    the code is, a blocking call included. No thread (a thread per run would pile up
    against RLIMIT_NPROC; one shared thread costs every run a GIL hand-over). The host
    waits a little longer, then kills the sandbox: code that ignores the interrupt (or sets
    its own SIGALRM timer over ours) ends the session."""

    __slots__ = ()

    def arm(self, after_s: Any) -> bool:
        if not isinstance(after_s, (int, float)) or after_s <= 0:
            return False
        _signal.signal(_signal.SIGALRM, _interrupt)
        _signal.setitimer(_signal.ITIMER_REAL, float(after_s))
        return True

    def disarm(self) -> None:
        _signal.setitimer(_signal.ITIMER_REAL, 0.0)
        _signal.signal(_signal.SIGALRM, _signal.SIG_IGN)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt("the run's timeout passed")


def _remember_source(filename: str, source: str) -> None:
    """A session's runs are named apart (run1.py, run2.py, ...) and their sources kept for
    tracebacks: a function defined by one run and failing in a later one shows its line."""
    import linecache  # sessions only: a one-off cold start does not pay for it

    lines = source.splitlines(True)
    linecache.cache[filename] = (len(source), None, lines, filename)


def _report(control: _socket.socket, report: dict[str, Any], exit_code: int) -> None:
    report["events"] = [  # in the host's bounds: one long detail must not void the report
        {**event, "detail": event["detail"][: contract.MAX_EVENT_DETAIL]}
        for event in _events[:MAX_EVENTS]
    ]
    report["exit_code"] = exit_code
    _send(control, report)


# --- control channel ------------------------------------------------------------------


def _take_fds(argv: list[str]) -> _socket.socket:
    """Move the control socket to fd 3 and the tool bridge to fd 4 (the host's numbers
    may be any, even each other's targets: hence the detour through high numbers)."""
    if "--fds-from" in argv:  # a backend that cannot pass fds (gVisor) hands them over
        control, bridge = _receive_fds(argv[argv.index("--fds-from") + 1])
    else:
        control = int(argv[argv.index("--control-fd") + 1])
        bridge = int(argv[argv.index("--bridge-fd") + 1]) if "--bridge-fd" in argv else -1
    moves = [(control, contract.CONTROL_FD)]
    moves += [(bridge, contract.BRIDGE_FD)] if bridge >= 0 else []
    contract.place_fds(moves, park_at=200)  # not inheritable: user subprocesses never get them
    # _socket, not socket: the wrapper module (enums, selectors) costs ~1 MB in every idle
    # warm sandbox, and the control channel needs none of it.
    return _socket.socket(fileno=contract.CONTROL_FD)


def _template_filter(argv: list[str]) -> bytes | None:
    """A template (guest/template.py) is given the runs' seccomp filter in a memfd."""
    if contract.TEMPLATE_ARG not in argv:
        return None
    fd = int(argv[argv.index(contract.TEMPLATE_ARG) + 1])
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _receive_fds(path: str) -> tuple[int, int]:
    """The control socket and the tool bridge, received by SCM_RIGHTS over the Unix socket
    at `path` (the host accepts one connection, sends both, and removes the socket)."""
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.connect(path)
        size = _socket.CMSG_SPACE(2 * 4)
        _, ancillary, _, _ = sock.recvmsg(16, size, _socket.MSG_CMSG_CLOEXEC)
    finally:
        sock.close()
    fds = [
        int.from_bytes(data[i : i + 4], sys.byteorder, signed=True)
        for level, kind, data in ancillary
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS
        for i in range(0, len(data) - len(data) % 4, 4)
    ]
    if len(fds) != 2:
        raise SystemExit(f"codecage: expected 2 channels from {path}, got {len(fds)}")
    return fds[0], fds[1]


def _preload_list(argv: list[str]) -> list[str]:
    if "--preload" not in argv:
        return []
    return [m for m in argv[argv.index("--preload") + 1].split(",") if m]


def _preload(modules: list[str]) -> None:
    """Import the profile's heavy modules before the request comes (a warm sandbox).

    Run by trusted code before any user code and before the import policy, and only for
    modules the profile allows anyway. What imports print goes nowhere: it is not the
    user's output. A module that fails here fails again, visibly, when the code imports it.
    """
    if not modules:
        return
    if any(name.partition(".")[0] == "matplotlib" for name in modules):
        _guest_module("runtime.displays").seed_font_list()
    _add_added_packages()
    if os.path.isdir(SITE_PACKAGES) and SITE_PACKAGES not in sys.path:
        sys.path.append(SITE_PACKAGES)
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        for name in modules:
            try:
                __import__(name)
            except Exception:  # noqa: S112 - reported when the user's code imports it
                continue
        _flush_std_streams()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


def _warm_up(*, pooled: bool) -> None:
    """Take the first-call costs of the run's path (the compiler, json) before the request
    comes. A pooled sandbox also imports what errors and odd return values need, which a
    cold one imports only when it needs them. Pure: nothing of it remains."""
    _compile("_ = [1]\n_\n", "<warm-up>")
    json.loads(
        json.dumps({"v": contract.WIRE_VERSION, "kind": "warm-up", "data": [1.5, None, "x"]})
    )
    if pooled:
        import reprlib
        import traceback

        traceback.format_exception_only(ValueError, ValueError("warm-up"))
        reprlib.repr(object())
        gc.collect()  # what the imports left over, before the sandbox idles


def _close_other_fds(keep: tuple[int, ...]) -> None:
    """Only stdin, stdout, stderr, the control socket and the tool bridge stay open."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the fd of the listdir itself is already gone


def _send(control: _socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message, ensure_ascii=True, allow_nan=False) + "\n"
    try:
        control.sendall(data.encode("ascii"))
    except OSError:
        pass  # the host stopped listening (e.g. timeout); nothing to do


def _end_run(control: _socket.socket, pid: int, exit_code: int) -> None:
    """Tell the host the run is over; stop when it answers "stop", else return (and exit).

    The "end" line is formatted here from two ints, without the json module, which the code
    may have changed (then its result is garbled, but the end is not); the newline before it
    ends a line the code may have left unfinished on the socket. A process the code forked
    also reports, but sends no "end" and leaves the socket open.

    Stopped, not exited: nothing of the code runs after this, as after an exit (daemon
    threads included), but the teardown of the namespaces that an exit sets off (1-2 ms of
    CPU) waits until the host destroys the sandbox, instead of taking a CPU from the host
    while it answers its caller. Only the host's answer makes the guest stop: should the
    host not have heard the end (the code closed, replaced or flooded the socket), an exit
    is what it sees. Continued (SIGCONT), the process exits as before.
    """
    try:
        control.sendall(_end_line(pid, exit_code))
        control.shutdown(_socket.SHUT_WR)
        control.settimeout(_STOP_WAIT_S)
        answer = control.recv(64)
    except OSError:  # the socket is gone, or no answer in time (TimeoutError)
        return
    if answer == contract.STOP_LINE:
        os.kill(pid, _signal.SIGSTOP)


def _end_line(pid: int, exit_code: int) -> bytes:
    return b'\n{"v":%d,"kind":"%s","pid":%d,"exit_code":%d}\n' % (
        contract.WIRE_VERSION,
        contract.KIND_END.encode(),
        pid,
        exit_code,
    )


def _send_end(control: _socket.socket, pid: int, exit_code: int) -> None:
    """A session run's "end": the host reads the run as over, the socket stays open."""
    try:
        control.sendall(_end_line(pid, exit_code))
    except OSError:
        pass  # the host is gone: the next receive ends the session


_egress = False  # the run may reach allowed hosts through the relay (contract.EGRESS_ARG)
_LOCAL_FAMILIES = (_socket.AF_UNIX, -1)
_EGRESS_FAMILIES = (*_LOCAL_FAMILIES, _socket.AF_INET, _socket.AF_INET6)


def _start_egress_relay(argv: list[str]) -> None:
    """A run allowed egress: the relay to the host proxy listens on 127.0.0.1 before the
    code runs (guest/relay.py). Without the flag the sandbox has no network at all."""
    global _egress
    if contract.EGRESS_ARG not in argv:
        return
    _guest_module("relay").start(contract.EGRESS_RELAY_PORT, contract.EGRESS_SOCKET)
    _egress = True


def _install_displays(control: _socket.socket) -> None:
    """Rich outputs (`display`, figures, the last expression) go out as "display" lines as
    the code makes them; what the caps leave out becomes a display_truncated event."""
    global _displays

    def send(line: bytes) -> None:
        try:
            control.sendall(line)
        except OSError:
            pass  # the host stopped listening (e.g. timeout); nothing to do

    def note(detail: str) -> None:
        if len(_events) < MAX_EVENTS:
            _events.append({"kind": "display_truncated", "detail": detail})

    try:
        module = _guest_module("runtime.displays")
        module.install(send, note)
    except Exception:
        return
    _displays = module


def _show_displays(value: Any, *, ended: bool) -> None:
    """The last expression's rich form (when the code ended normally), then the figures
    still open, as a notebook shows them after a cell."""
    if _displays is None:
        return
    if ended:
        _displays.show_last_expression(value)
    _displays.show_open_figures()


def _receive(control: _socket.socket) -> dict[str, Any]:
    buf = bytearray()
    while b"\n" not in buf:
        chunk = control.recv(1 << 16)
        if not chunk:
            raise SystemExit(70)  # host went away before sending a request
        buf += chunk
        if len(buf) > contract.MAX_REQUEST_BYTES:
            raise SystemExit(70)
    request: dict[str, Any] = json.loads(buf[: buf.index(b"\n")])
    if request.get("v") != contract.WIRE_VERSION or request.get("kind") != contract.KIND_RUN:
        raise SystemExit(70)
    return request


# --- limits and policy ---------------------------------------------------------------------


def _apply_limits(limits: dict[str, Any], *, session: bool = False) -> None:
    """Lower the rlimits before any user code runs; without CAP_SYS_RESOURCE they stay down.

    A session's first run sets them for the whole session: the hard CPU limit is the
    session's CPU budget, and each run lowers the soft one to its own (`_apply_cpu_limit`).
    """
    # On top of what this process used before the request (a warm sandbox's start-up).
    used = _cpu_used()
    cpu = int(limits["cpu_seconds"]) + used
    hard = cpu + 1
    if session and limits.get("session_cpu_seconds") is not None:
        hard = int(limits["session_cpu_seconds"]) + used
    # Soft limit sends SIGXCPU (kills: Python does not handle it); hard limit SIGKILL after.
    resource.setrlimit(resource.RLIMIT_CPU, (min(cpu, hard), hard))
    nofile = int(limits["max_open_files"])
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    fsize = int(limits["max_file_size_bytes"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if limits.get("max_processes") is not None:
        nproc = int(limits["max_processes"])
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if limits.get("address_space_bytes") is not None:
        address_space = int(limits["address_space_bytes"])
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))


def _cpu_used() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return int(usage.ru_utime + usage.ru_stime + 0.999)


def _apply_cpu_limit(limits: dict[str, Any]) -> None:
    """A later run of a session: its own CPU seconds from now on, within the session's
    budget (the hard limit, which only goes down)."""
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(limits["cpu_seconds"]) + _cpu_used()
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _audit(event: str, args: tuple[Any, ...]) -> None:
    """Note attempts the kernel will refuse, so the result can explain a failure.

    Informational only: the seccomp filter and the empty network namespace refuse these
    whether or not this hook runs.
    """
    if event == "socket.__new__" and len(_events) < MAX_EVENTS:
        family = args[1] if len(args) > 1 else None
        allowed = _EGRESS_FAMILIES if _egress else _LOCAL_FAMILIES
        if family not in allowed:
            name = _family_name(family)
            _events.append(
                {
                    "kind": "network_denied",
                    "detail": f"socket({name}) attempted: the sandbox has no network",
                }
            )


def _family_name(family: Any) -> str:
    socket_module = sys.modules.get("socket")  # the code that makes a socket imported it
    try:
        return str(socket_module.AddressFamily(int(family)).name)  # type: ignore[union-attr]
    except (AttributeError, TypeError, ValueError):
        return str(family)


_TRUSTED_PREFIXES = (
    f"{contract.GUEST_PREFIX}/",
    f"{contract.GUEST_PACKAGE_ROOT}/",
    f"{contract.GUEST_SITE_PACKAGES}/",
    f"{contract.PACKAGES_DIR}/",
    "<frozen ",
)
SITE_PACKAGES = contract.GUEST_SITE_PACKAGES
# The packages the operator added (`codecage packages add`, codecage.packages), read-only;
# bound only when the profile allows one of them.
PACKAGES_DIR = contract.PACKAGES_DIR
# Import names whose distribution is named otherwise, for the operator's command in the
# ModuleNotFoundError (codecage.packages maps `packages add sklearn` with the same table).
DISTRIBUTIONS = {
    "sklearn": "scikit-learn",
    "skimage": "scikit-image",
    "cv2": "opencv-python-headless",
    "PIL": "pillow",
    "yaml": "pyyaml",
    "bs4": "beautifulsoup4",
    "dateutil": "python-dateutil",
    "docx": "python-docx",
    "pptx": "python-pptx",
    "dotenv": "python-dotenv",
    "jwt": "pyjwt",
    "Crypto": "pycryptodome",
    "fitz": "pymupdf",
    "attr": "attrs",
    "serial": "pyserial",
    "usb": "pyusb",
    "magic": "python-magic",
    "Levenshtein": "levenshtein",
}


def _add_added_packages() -> None:
    """The operator's packages go before the host's: a version the operator pinned there
    wins, and the tree was resolved as a whole (against the host's versions)."""
    if os.path.isdir(PACKAGES_DIR) and PACKAGES_DIR not in sys.path:
        at = sys.path.index(SITE_PACKAGES) if SITE_PACKAGES in sys.path else len(sys.path)
        sys.path.insert(at, PACKAGES_DIR)


def _install_import_hook(policy: _ImportCheck | None) -> None:
    """One wrapper of `__import__`, for imports made *by the user's code* (those made by
    library code, the stdlib and allowed packages, go through untouched, so an allowed
    module keeps its own internal imports):

    - the import policy, when the profile refuses anything: what it does not allow is
      refused before any lookup, by the rule `validate` applies too (guest/imports.py);
    - a missing module explained: the code's own `import X` of a missing top-level name
      says it is not installed here and how the operator adds it, so an agent knows it
      cannot install it itself (no network, read-only packages) and need not try. Modules
      of the standard library keep their plain error.

    Policy and comfort, not a boundary: see the docs.
    """
    import builtins

    original_import = builtins.__import__

    def user_import(
        name: str,
        globals: Any = None,
        locals: Any = None,
        fromlist: Any = (),
        level: int = 0,
    ) -> Any:
        # Whose import it is, asked only when it matters (a frame lookup per import
        # otherwise): before a policy check, or when a module is missing.
        by_user = False
        if policy is not None and level == 0:
            by_user = _imported_by_user_code()
            if by_user:
                policy.check(name, fromlist)
        try:
            return original_import(name, globals, locals, fromlist, level)
        except ModuleNotFoundError as exc:
            missing = exc.name
            if (
                level != 0
                or not (by_user or (policy is None and _imported_by_user_code()))
                or not isinstance(missing, str)
                or missing != name.partition(".")[0]
                or missing in sys.stdlib_module_names
            ):
                raise
            raise ModuleNotFoundError(_missing_message(missing), name=missing) from None

    builtins.__import__ = user_import


class _ImportCheck:
    """The profile's import policy: refuses, through `refusal`, what `modules` do not allow."""

    __slots__ = ("modules", "refusal", "refused")

    def __init__(self, allowed: list[str], refusal: _Refusal) -> None:
        rule = _guest_module("imports")  # guest/imports.py, validate's rule too
        self.refused = rule.refused
        self.modules = frozenset(allowed) | rule.ALWAYS_ALLOWED
        self.refusal = refusal

    def check(self, name: str, fromlist: Any) -> None:
        dotted = self.refused(name, fromlist, 0, self.modules)
        if dotted is not None:
            self.refusal.refuse(dotted)


# The packages of codecage's `data` extra (pyproject.toml): the data_science profile's.
DATA_EXTRA = frozenset({"numpy", "pandas", "scipy", "matplotlib", "mpl_toolkits"})


def _missing_message(name: str) -> str:
    distribution = DISTRIBUTIONS.get(name, name)
    how = f"with `codecage packages add {distribution}`"
    if name in DATA_EXTRA:
        how = (
            "by installing codecage with its data extra (`pip install 'codecage[data]'`: "
            f"numpy, pandas, scipy, matplotlib), or {how}"
        )
    return (
        f"No module named {name!r}. It is not installed on this host; the operator can add "
        f"it {how}. Code in the sandbox cannot install packages (no network, read-only "
        "package directories): use what is installed, or ask the operator"
    )


def _add_guest_package() -> None:
    # codecage.imports, codecage.runtime, servers.*, skills.*
    if contract.GUEST_PACKAGE_ROOT not in sys.path:
        sys.path.append(contract.GUEST_PACKAGE_ROOT)


def _imported_by_user_code() -> bool:
    filename = sys._getframe(2).f_code.co_filename
    return not filename.startswith(_TRUSTED_PREFIXES)


class _Refusal:
    """How an import refusal reads: in the terms of the face that made the call, and never
    suggesting to allow a module that is not there (it would fail a turn later)."""

    __slots__ = ("face", "installed", "profile", "wider_profile")

    def __init__(
        self, profile: str, face: str, installed: frozenset[str], wider_profile: str | None
    ) -> None:
        self.profile = profile
        self.face = face
        self.installed = installed
        self.wider_profile = wider_profile

    @classmethod
    def of(cls, request: dict[str, Any]) -> _Refusal:
        wider = request.get("wider_profile")
        return cls(
            profile=str(request.get("profile", "")),
            face=str(request.get("face", "library")),
            installed=frozenset(str(m) for m in request.get("installed_packages") or ()),
            wider_profile=str(wider) if wider else None,
        )

    def refuse(self, dotted: str) -> None:
        if len(_events) < MAX_EVENTS:
            _events.append(
                {"kind": "import_blocked", "detail": f"{dotted} (profile {self.profile})"}
            )
        top = dotted.split(".")[0]
        if not self._available(top):
            raise ModuleNotFoundError(
                f"No module named {top!r}: it is not installed on this host, so no profile "
                f"makes it importable (the profile {self.profile!r} does not allow it either)",
                name=dotted,
            )
        raise ImportError(
            f"import of {dotted!r} is not allowed by the profile {self.profile!r}; "
            f"to allow it, {self._how(top)}",
            name=dotted,
        )

    def _available(self, top: str) -> bool:
        if top in self.installed:
            return True
        if top not in sys.stdlib_module_names:
            return False
        try:  # e.g. tkinter is a stdlib name but not built into every Python
            import importlib.util

            return importlib.util.find_spec(top) is not None
        except Exception:  # the code may have broken the import system: say it is there
            return True

    def _how(self, top: str) -> str:
        wider = self.wider_profile
        if self.face == "cli":
            return f"pass --allow-import {top}" + (f" or --profile {wider}" if wider else "")
        if self.face == "mcp":
            return (
                f"pass allowed_imports=[{top!r}]"
                + (f" or profile={wider!r}" if wider else "")
                + " to execute_code"
            )
        return (
            f"pass allowed_imports=[{top!r}]"
            + (f" or profile={wider!r}" if wider else "")
            + " to Sandbox()"
        )


# --- running the code ---------------------------------------------------------------------


def _run_user_code(
    request: dict[str, Any], main_module: types.ModuleType
) -> tuple[int, dict[str, Any]]:
    filename = str(request["filename"])
    source = str(request["code"])
    max_value_bytes = int(request["return_value_max_bytes"])
    report: dict[str, Any] = {
        "v": contract.WIRE_VERSION,
        "kind": contract.KIND_RESULT,
        "return_value": None,
    }
    _keep_output_on_kill()
    # The source has no file in the sandbox: linecache (tracebacks, inspect) asks this.
    setattr(main_module, "__loader__", _SourceLoader(source))  # noqa: B010 - not its type
    exit_code = 0
    value, ended = None, False
    try:
        code = _compile(source, filename)
        value = _execute(code, main_module.__dict__)
        report["return_value"] = _encode_return_value(value, max_value_bytes)
        ended = True
    except SystemExit as exc:
        exit_code = _exit_code_of(exc)
    except BaseException as exc:  # the user's exception, reported as data
        report["error"] = _describe_exception(exc, filename, source)
        exit_code = 1
    finally:
        _show_displays(value, ended=ended)
        _flush_std_streams()
    # A process the code forked also ends up here; the pid tells the host which report is
    # the main process's (the one whose exit it observes).
    report["pid"] = os.getpid()
    return exit_code, report


def _keep_output_on_kill() -> None:
    """Line-buffer stdout (stderr already is): a run killed by its timeout, its memory or
    CPU limit, or ended by os._exit never gets to flush, and what it printed before must
    reach the host anyway. One write per line, as in a terminal; a line not yet ended when
    the kill comes is still lost."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "line_buffering", False) is True:
            continue  # already (a session's earlier run, or a warm sandbox before "ready")
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(line_buffering=True)
            except (ValueError, OSError):  # replaced by the code earlier, or closed
                continue


def _fresh_main_module(filename: str) -> types.ModuleType:
    module = types.ModuleType("__main__")
    module.__file__ = f"{contract.WORKSPACE_DIR}/{filename}"
    module.__builtins__ = __builtins__  # type: ignore[attr-defined]
    sys.modules["__main__"] = module
    sys.argv = [filename]
    sys.path.insert(0, contract.WORKSPACE_DIR)
    _add_guest_package()
    # The profile's third-party packages, read-only (already on the path when preloaded).
    _add_added_packages()
    if os.path.isdir(SITE_PACKAGES) and SITE_PACKAGES not in sys.path:
        sys.path.append(SITE_PACKAGES)
    return module


def _compile(source: str, filename: str) -> types.CodeType:
    """Compile with top-level await allowed; the last expression's value is kept.

    Uses the C `_ast` types, not the `ast` module: importing `ast` (with contextlib and
    enum) costs ~10 ms of every cold start.
    """
    tree: Any = compile(source, filename, "exec", _ast.PyCF_ONLY_AST, dont_inherit=True)
    if tree.body and isinstance(tree.body[-1], _ast.Expr):
        last = tree.body[-1]
        target = _located(_ast.Name(_RESULT_NAME, _ast.Store()), last)
        tree.body[-1] = _located(_ast.Assign(targets=[target], value=last.value), last)
    flags = _ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    code: types.CodeType = compile(tree, filename, "exec", flags=flags, dont_inherit=True)
    return code


def _located(node: Any, like: Any) -> Any:
    """`ast.copy_location`, for the two new nodes only (fix_missing_locations would walk the
    whole tree, ~0.2 ms)."""
    for name in ("lineno", "col_offset", "end_lineno", "end_col_offset"):
        setattr(node, name, getattr(like, name))
    return node


def _execute(code: types.CodeType, namespace: dict[str, Any]) -> Any:
    result = eval(code, namespace)  # noqa: S307 - running the agent's code is the job
    if isinstance(result, types.CoroutineType):  # the code used top-level await
        import asyncio

        asyncio.run(result)
    return namespace.pop(_RESULT_NAME, None)


_PLAIN_ARRAY_MAX_ITEMS = 10_000  # a bigger array comes back as its (bounded) repr


def _encode_return_value(value: Any, max_bytes: int) -> Any:
    if value is None:
        return None
    value = _plain(value)
    try:
        encoded = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        encoded = None
    if encoded is not None and len(encoded) <= max_bytes:
        return value
    text = _bounded_repr(value, max_bytes)
    if encoded is not None or len(text) >= max_bytes:
        _events.append(
            {
                "kind": "return_value_truncated",
                "detail": f"the return value was larger than {max_bytes} bytes; "
                "write big results to a file in /workspace instead",
            }
        )
    return text


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python number or bool it holds (`np.int64(8)` -> 8), a small
    numpy array as nested lists: what the code meant, not its repr. Anything else as is."""
    if getattr(type(value), "__module__", None) != "numpy":
        return value
    try:
        if getattr(value, "ndim", None) == 0:
            return value.item()
        if getattr(value, "size", _PLAIN_ARRAY_MAX_ITEMS + 1) <= _PLAIN_ARRAY_MAX_ITEMS:
            return value.tolist()
    except Exception:  # the code's object: its repr is the fallback
        return value
    return value


def _bounded_repr(value: Any, max_bytes: int) -> str:
    # guest/reprs.py: not on the common path, so a cold start does not pay for it
    return str(_guest_module("reprs").bounded_repr(value, max_bytes, max_items=1000))


def _exit_code_of(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return int.__and__(exc.code, 0xFF)  # a plain int, whatever int subclass it was
    print(exc.code, file=sys.stderr)
    return 1


def _describe_exception(exc: BaseException, filename: str, source: str) -> dict[str, str]:
    try:
        message = str(exc)
    except Exception:
        message = "<str() of the exception failed>"
    try:
        text = _format_traceback(exc, filename, source)
    except Exception:  # e.g. the code broke the import system: still report the error
        text = f"{type(exc).__name__}: {message}\n"
    return {"type": type(exc).__name__, "message": message, "traceback": text}


class _SourceLoader:
    """Gives linecache the code's source, for the tracebacks and `inspect` of the code."""

    def __init__(self, source: str) -> None:
        self._source = source

    def get_source(self, name: str) -> str:
        return self._source


def _format_traceback(exc: BaseException, filename: str, source: str) -> str:
    # Not on the common path: a cold start does not pay for importing these (~8 ms).
    import linecache
    import traceback

    source_lines = source.splitlines(True)
    linecache.cache[filename] = (len(source), None, source_lines, filename)
    frames = traceback.extract_tb(exc.__traceback__)
    # Drop the bootstrap's own frames: the traceback starts at the user's code, and the
    # import policy's frames (between the user's import and the ImportError) are ours too.
    while frames and frames[0].filename != filename:
        frames.pop(0)
    frames = traceback.StackSummary.from_list(
        [frame for frame in frames if frame.filename != _OWN_FILE]
    )
    lines = ["Traceback (most recent call last):\n"]
    lines += traceback.format_list(frames)
    lines += traceback.format_exception_only(type(exc), exc)
    if frames == [] and isinstance(exc, SyntaxError):
        lines = traceback.format_exception_only(type(exc), exc)
    return "".join(lines)


def _finish_like_python() -> None:
    """What a normal interpreter exit does for the user's code, without tearing down every
    module (that costs 5-50 ms, more than the rest of a warm run): wait for non-daemon
    threads, run atexit handlers, drop the program's globals so that its objects are
    finalized (open files flushed and closed, __del__ run), collect the cycles among them,
    and flush the standard streams. The process then ends with os._exit.
    """
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()
        atexit._run_exitfuncs()
        main_module = sys.modules.get("__main__")
        if main_module is not None:
            main_module.__dict__.clear()
        gc.collect()
    except BaseException:  # e.g. KeyboardInterrupt in a handler: the report still goes out
        pass
    finally:
        _flush_std_streams()


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass


if __name__ == "__main__":
    # _finish_like_python did the user's exit work (threads, atexit, finalizers, flushing);
    # one that hangs is cut by the host's wall timer.
    os._exit(main(sys.argv))
