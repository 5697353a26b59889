"""Load drivers shared by `scripts/soak` and tests/reliability/test_load.py.

Every call runs code that prints a token of its own (`soak-` + 16 hex digits). Its answer
is then judged by what came back, never by what the caller expected:

- `served`: a result whose output holds this call's token and no other call's;
- `refused`: a busy/rate refusal that says when to retry (an HTTP `Retry-After` header, or
  a tool error whose text says "retry in N s" / "retry when ...");
- `vague_refusal`: a busy/rate/too-many refusal that does not say when to retry;
- `error`: any other failure (its text is kept, to be printed);
- `hung`: no answer within the bound;
- `lost`: an answer that is not this call's (no token, or another call's);
- `duplicated`: this call's token came back in more than one answer.

The probes read /proc: a server's RSS and open fds, its descendants (kept while it runs, so
that one still alive after it stopped is seen), and the run dirs, mounts and cgroups whose
names carry its pid (`codecage-run-<pid>-...`, cgroup dirs `<pid>-...`, as in conftest.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio
import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult, TextContent

from _proc import Sampling, cmdline  # tests/ is on the path here and in scripts/soak
from codecage import Sandbox
from codecage.engine import workspace as workspaces
from codecage.isolation import cgroups

CODECAGE = str(Path(sys.executable).with_name("codecage"))
Outcome = Literal["served", "refused", "vague_refusal", "error", "hung", "lost", "duplicated"]
OUTCOMES: tuple[Outcome, ...] = (
    "served",
    "refused",
    "vague_refusal",
    "error",
    "hung",
    "lost",
    "duplicated",
)
BAD: frozenset[Outcome] = frozenset({"vague_refusal", "error", "hung", "lost", "duplicated"})
"""Outcomes that make a load phase fail (a `refused` with its retry time is an answer)."""

TOKEN_RE = re.compile(r"soak-[0-9a-f]{16}")
RETRY_RE = re.compile(r"retry (in \d+(\.\d+)? ?s|when )", re.IGNORECASE)
REFUSAL_RE = re.compile(r"busy|rate|too many|try again|retry", re.IGNORECASE)
NO_TOKEN = ("--insecure-no-token",)  # loopback only, and the port is a fresh one
HUNG_BOUND_S = 300.0
"""A call without an answer after this long counts as hung (every queue here drains well
within it: at most 4 runs at once, 32 waiting, each a `print`)."""


# --- calls and their judgement ---------------------------------------------------------------


@dataclass
class Call:
    """One call: its token, and once answered, its outcome, latency and answer's tokens."""

    face: str
    token: str = field(default_factory=lambda: "soak-" + secrets.token_hex(8))
    outcome: Outcome = "lost"
    latency_s: float | None = None
    detail: str = ""
    tokens_seen: list[str] = field(default_factory=list)
    answered: bool = False

    @property
    def code(self) -> str:
        return f"print({self.token!r})"

    def answer(self, text: str, *, ok: bool, started: float) -> None:
        """Judge an answer whose text (all of it) is `text`; `ok`: a result, not an error."""
        self.answered = True
        self.latency_s = time.monotonic() - started
        self.tokens_seen = TOKEN_RE.findall(text)
        if not ok:
            self.refusal(text)
        elif set(self.tokens_seen) == {self.token}:
            self.outcome = "served"
        else:
            self.outcome = "lost"
            self.detail = f"answer carried {self.tokens_seen or 'no token'}: {text[:200]!r}"

    def refusal(self, text: str, retry_after: str | None = None) -> None:
        self.answered = True
        if retry_after is not None or RETRY_RE.search(text):
            self.outcome = "refused"
        elif REFUSAL_RE.search(text):
            self.outcome = "vague_refusal"
        else:
            self.outcome = "error"
        self.detail = text[:300]

    def failed(self, exc: BaseException, started: float) -> None:
        self.answered = True
        self.latency_s = time.monotonic() - started
        self.outcome = "error"
        self.detail = describe(exc)

    def hung(self) -> None:
        self.outcome = "hung"
        self.detail = "no answer within the bound"


def describe(exc: BaseException) -> str:
    """An exception and, for a group, its leaves: what actually went wrong."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(e) for e in exc.exceptions)[:300]
    return f"{type(exc).__name__}: {exc}"[:300]


def mark_duplicates(calls: list[Call]) -> None:
    """A token found in more than one answer: each call whose token it is was answered twice."""
    seen = Counter(t for c in calls for t in set(c.tokens_seen))
    for call in calls:
        if seen[call.token] > 1:
            call.outcome = "duplicated"
            call.detail = f"its token came back in {seen[call.token]} answers"


def text_of(result: CallToolResult) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, TextContent))


def judge_tool_result(call: Call, result: CallToolResult, started: float) -> None:
    status = (result.structured_content or {}).get("status")
    ok = not result.is_error and status == "ok"
    call.answer(text_of(result) or str(result.structured_content), ok=ok, started=started)
    if not result.is_error and status != "ok":  # ran but not ok: an error, say how
        call.outcome = "error"
        call.detail = f"status {status}: {call.detail}"


# --- /proc probes ----------------------------------------------------------------------------


def rss_kb(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text(encoding="utf-8").splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def fd_targets() -> dict[int, str]:
    """This process's open fds and what each points at."""
    found: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return found


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat: with the pid, names one process (pids are reused)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def children(pid: int) -> set[int]:
    kids: set[int] = set()
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                kids.update(int(p) for p in (task / "children").read_text().split())
    return kids


def descendants(pid: int) -> dict[int, str]:
    """Every process below `pid`, with its start time."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        for kid in children(todo.pop()):
            if kid not in found and (started := start_time(kid)) is not None:
                found[kid] = started
                todo.append(kid)
    return found


def leftovers(pid: int) -> list[str]:
    """The run dirs and cgroups that a codecage process `pid` made, as paths."""
    found = [str(p) for p in workspaces.private_parent().glob(f"codecage-run-{pid}-*")]
    support = cgroups.detect()
    if support is not None:
        for parent in support.parents.values():
            found += [str(d) for d in parent.glob(f"{pid}-*")]
    return found


def named_leftovers(pid: int) -> dict[str, list[str]]:
    """The run dirs, mounts and cgroups whose names carry `pid` (a codecage process's own)."""
    own = f"{pid}-"
    run_dirs = [p.name for p in workspaces.private_parent().glob(f"codecage-run-{own}*")]
    mountinfo = Path("/proc/self/mountinfo").read_text(encoding="utf-8").splitlines()
    mounts = [line.split()[4] for line in mountinfo if f"codecage-run-{own}" in line]
    groups: list[str] = []
    support = cgroups.detect()
    for parent in support.parents.values() if support else []:
        if parent.is_dir():
            groups += [str(d) for d in parent.iterdir() if d.is_dir() and d.name.startswith(own)]
    found = {"run_dirs": run_dirs, "mounts": mounts, "cgroups": groups}
    return {key: value for key, value in found.items() if value}


@dataclass
class Usage:
    """A process's RSS (KiB) and open fds: before the load, the peak during it, after it."""

    rss_kb: dict[str, int | None] = field(default_factory=dict)
    fds: dict[str, int | None] = field(default_factory=dict)

    def take(self, pid: int, when: str) -> None:
        self.rss_kb[when] = rss_kb(pid)
        self.fds[when] = open_fds(pid)

    def peak(self, pid: int) -> None:
        for key, value in (("rss_kb", rss_kb(pid)), ("fds", open_fds(pid))):
            table = getattr(self, key)
            if value is not None and (table.get("peak") or 0) < value:
                table["peak"] = value


class Watch(Sampling):
    """Samples a process (every `interval` s, on a thread) while a block runs, and once
    more at its end: the usage's peak, and its descendants, so that one that outlives the
    process is found afterwards."""

    def __init__(self, pid: int, usage: Usage, interval: float = 0.2) -> None:
        super().__init__(interval)
        self.pid = pid
        self.usage = usage
        self.seen: dict[int, str] = {}

    def sample(self) -> None:
        self.usage.peak(self.pid)
        self.seen.update(descendants(self.pid))

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.sample()

    def survivors(self) -> list[str]:
        """Descendants seen while it ran that are still alive (the same process: same start)."""
        return [
            f"{pid}: {cmdline(pid)}"
            for pid, started in self.seen.items()
            if pid != self.pid and start_time(pid) == started and not _zombie_of_ours(pid)
        ]


def _zombie_of_ours(pid: int) -> bool:
    """A zombie whose parent is this process is ours to reap, not the server's leftover."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()
    except OSError:
        return True
    return stat[0] == "Z" and int(stat[1]) == os.getpid()


def leftovers_after(pid: int, watch: Watch, grace_s: float = 10.0) -> dict[str, list[str]]:
    """What a stopped server left on the host once nothing more goes within `grace_s`."""
    deadline = time.monotonic() + grace_s
    while True:
        left = named_leftovers(pid)
        if survivors := watch.survivors():
            left["processes"] = survivors
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


# --- a phase's report ------------------------------------------------------------------------


@dataclass
class Phase:
    """One face driven with `calls`: the calls, the process watched and what it left."""

    name: str
    calls: list[Call]
    elapsed_s: float = 0.0
    usage: Usage = field(default_factory=Usage)
    leftovers: dict[str, list[str]] = field(default_factory=dict)
    trend: list[tuple[int | None, int | None]] = field(default_factory=list)
    """The watched process's (RSS KiB, fds) after each round: growth shows here."""

    def counts(self) -> dict[str, int]:
        counted = Counter(c.outcome for c in self.calls)
        return {o: counted.get(o, 0) for o in OUTCOMES}

    def latencies_ms(self) -> dict[str, float | None]:
        served = sorted(
            c.latency_s * 1000 for c in self.calls if c.outcome == "served" and c.latency_s
        )
        if not served:
            return {"p50": None, "p99": None, "max": None}
        p99 = served[min(len(served) - 1, int(len(served) * 0.99))]
        return {"p50": statistics.median(served), "p99": p99, "max": served[-1]}

    def problems(self) -> list[str]:
        """What makes this phase fail: a bad outcome's first details, or what was left."""
        found = [f"{c.outcome}: {c.detail}" for c in self.calls if c.outcome in BAD]
        found += [f"left behind {key}: {value}" for key, value in self.leftovers.items()]
        return found

    def report(self) -> dict[str, Any]:
        return {
            "phase": self.name,
            "calls": len(self.calls),
            "counts": self.counts(),
            "latency_ms": self.latencies_ms(),
            "elapsed_s": round(self.elapsed_s, 2),
            "rss_kb": self.usage.rss_kb,
            "fds": self.usage.fds,
            "leftovers": self.leftovers,
            "trend_rss_kb_fds": self.trend,
            "problems": self.problems()[:20],
        }


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def ticker(name: str, calls: list[Call], every_s: float = 5.0) -> None:
    """Progress on stderr while a phase runs (cancelled when it ends)."""
    while True:
        await anyio.sleep(every_s)
        done = Counter(c.outcome for c in calls if c.answered or c.outcome == "hung")
        progress(f"  {name}: {sum(done.values())}/{len(calls)} answered {dict(done)}")


# --- the HTTP server and its many clients ----------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def child_env(workdir: Path) -> dict[str, str]:
    """This process's environment without CODECAGE_* settings, with config and state dirs of
    its own (no user's config read, no state written outside `workdir`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODECAGE_")}
    for name in ("XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME"):
        (workdir / name.lower()).mkdir(exist_ok=True)
        env[name] = str(workdir / name.lower())
    return env


@dataclass
class HttpServer:
    url: str
    proc: subprocess.Popen[bytes]
    stderr_path: Path


@contextlib.contextmanager
def serving_http(workdir: Path, *args: str) -> Iterator[HttpServer]:
    """`codecage serve --http --insecure-no-token ARGS` on a free loopback port, until the
    block ends; then Ctrl-C (SIGKILL after 10 s) and reaped."""
    argv = ("--host", "127.0.0.1", *NO_TOKEN, *args)
    with http_serve(workdir, argv, child_env(workdir), log="serve-http") as server:
        yield server


@contextlib.contextmanager
def http_serve(
    workdir: Path,
    args: Sequence[str],
    env: dict[str, str],
    log: str,
    bound_s: float = 60,
    sig: signal.Signals = signal.SIGINT,
) -> Iterator[HttpServer]:
    """`codecage serve --http --port P ARGS` (P a free loopback port) in `workdir` with
    `env`, its stderr in workdir/LOG-P.log, once it accepts connections (within `bound_s`);
    when the block ends, stopped (`stop` with `sig`)."""
    port = free_port()
    stderr_path = workdir / f"{log}-{port}.log"
    with stderr_path.open("wb") as stderr:
        proc = subprocess.Popen(
            [CODECAGE, "serve", "--http", "--port", str(port), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            cwd=workdir,
            env=env,
            start_new_session=True,
        )
        server = HttpServer(f"http://127.0.0.1:{port}/mcp", proc, stderr_path)
        try:
            _wait_listening(server, port, bound_s)
            yield server
        finally:
            stop(proc, sig)


def _wait_listening(server: HttpServer, port: int, bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            log = server.stderr_path.read_text(encoding="utf-8", errors="replace")
            raise RuntimeError(f"codecage serve --http exited {server.proc.returncode}: {log}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.1)
    raise RuntimeError(f"codecage serve --http did not accept connections within {bound_s} s")


def stop(proc: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGINT) -> None:
    """`sig` to the server's process group, then SIGKILL if it lingers past 10 s; always
    reaped. (Ctrl-C by default: a server stopped so leaves no run dirs behind.)"""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def http_call(url: str, call: Call, bound_s: float) -> None:
    """One real MCP SDK client of its own (its own connection): connect, call, judge."""
    refusals: list[httpx2.Response] = []

    async def on_response(response: httpx2.Response) -> None:
        if response.status_code >= 400:
            refusals.append(response)

    started = time.monotonic()
    try:
        with anyio.fail_after(bound_s):
            async with (
                httpx2.AsyncClient(
                    timeout=httpx2.Timeout(bound_s), event_hooks={"response": [on_response]}
                ) as http,
                Client(streamable_http_client(url, http_client=http)) as client,
            ):
                result = await client.call_tool("execute_code", {"code": call.code})
    except TimeoutError:
        call.hung()
        return
    except Exception as exc:  # every failure is counted and shown
        if refusals:  # an HTTP refusal, which the SDK turns into an exception
            last = refusals[-1]
            call.latency_s = time.monotonic() - started
            call.refusal(
                f"HTTP {last.status_code}: {describe(exc)}", last.headers.get("retry-after")
            )
        else:
            call.failed(exc, started)
        return
    judge_tool_result(call, result, started)


async def drive_http(url: str, calls: list[Call], concurrency: int, bound_s: float) -> None:
    """`calls` through `url`, `concurrency` of them in flight at once (each its own client)."""
    limiter = anyio.Semaphore(concurrency)

    async def one(call: Call) -> None:
        async with limiter:
            await http_call(url, call, bound_s)

    async with anyio.create_task_group() as group:
        group.start_soon(ticker, "http", calls)
        async with anyio.create_task_group() as callers:
            for call in calls:
                callers.start_soon(one, call)
        group.cancel_scope.cancel()


async def warm_up_http(url: str) -> None:
    """One call first, so that `before` is a server that has served (pool warm)."""
    warm = Call("warm-up")
    await http_call(url, warm, HUNG_BOUND_S)
    if warm.outcome != "served":
        raise RuntimeError(f"the server's first call failed: {warm.outcome} {warm.detail}")


class HttpLoad:
    """One `serve --http` for a whole run: warmed and measured at start, driven in bursts
    (`burst`), measured after each; stopped and checked for leftovers at the end (`close`)."""

    def __init__(self, workdir: Path, concurrency: int, *args: str) -> None:
        self.phase = Phase("http", [])
        self.concurrency = concurrency
        self._stack = contextlib.ExitStack()
        with self._stack as stack:  # a server that fails its first call is stopped
            self.server = stack.enter_context(serving_http(workdir, *args))
            self.pid = self.server.proc.pid
            anyio.run(warm_up_http, self.server.url)
            self.phase.usage.take(self.pid, "before")
            self.watch = stack.enter_context(Watch(self.pid, self.phase.usage))
            self._stack = stack.pop_all()

    def burst(self, calls: int) -> list[Call]:
        """`calls` new calls, `concurrency` in flight at once; the server's usage after."""
        batch = [Call("http") for _ in range(calls)]
        self.phase.calls.extend(batch)
        started = time.monotonic()
        anyio.run(drive_http, self.server.url, batch, self.concurrency, HUNG_BOUND_S)
        self.phase.elapsed_s += time.monotonic() - started
        settle(self.pid)
        self.phase.usage.take(self.pid, "after")
        self.phase.trend.append((self.phase.usage.rss_kb["after"], self.phase.usage.fds["after"]))
        return batch

    def close(self) -> Phase:
        self._stack.close()
        mark_duplicates(self.phase.calls)
        self.phase.leftovers = leftovers_after(self.pid, self.watch)
        return self.phase


def settle(pid: int, bound_s: float = 10.0) -> None:
    """Wait until the fd count stops falling (a pool refills, connections close) or `bound_s`."""
    deadline = time.monotonic() + bound_s
    last = open_fds(pid)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = open_fds(pid)
        if now == last:
            return
        last = now


# --- stdio sessions --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def stdio_session(
    workdir: Path, spawning: anyio.Lock, *args: str
) -> AsyncIterator[tuple[Client, int]]:
    """An SDK stdio client of its own `codecage serve ARGS`, and the server's pid: this
    process's new child (`spawning` held meanwhile, so that two sessions starting side by
    side each find their own)."""
    env = child_env(workdir)
    params = StdioServerParameters(
        command=CODECAGE, args=["serve", *args], cwd=str(workdir), env=env
    )
    log = workdir / f"serve-stdio-{secrets.token_hex(4)}.log"
    async with contextlib.AsyncExitStack() as stack:
        errlog = stack.enter_context(log.open("w", encoding="utf-8"))
        async with spawning:
            before = children(os.getpid())
            client = Client(stdio_client(params, errlog=errlog), read_timeout_seconds=None)
            await stack.enter_async_context(client)
            new = [p for p in children(os.getpid()) - before if "serve" in cmdline(p)]
        if len(new) != 1:
            raise RuntimeError(f"cannot tell the stdio server among {new}")
        yield client, new[0]


_R = TypeVar("_R")


async def judged(call: Call, run: Awaitable[_R], judge: Callable[[Call, _R, float], None]) -> None:
    """`run` awaited for `call`, then judged; a TimeoutError counts as hung, any other
    failure as failed."""
    started = time.monotonic()
    try:
        result = await run
    except TimeoutError:
        call.hung()
        return
    except Exception as exc:  # every failure is counted and shown
        call.failed(exc, started)
        return
    judge(call, result, started)


async def stdio_call(client: Client, call: Call, bound_s: float) -> None:
    async def bounded() -> CallToolResult:
        with anyio.fail_after(bound_s):
            return await client.call_tool("execute_code", {"code": call.code})

    await judged(call, bounded(), judge_tool_result)


async def drive_stdio(
    workdir: Path, phase: Phase, sessions: int, bound_s: float, args: tuple[str, ...] = ()
) -> list[Watch]:
    """`sessions` stdio servers side by side, each with its share of the calls in flight at
    once on its one session. The servers' watches are returned (after they stopped)."""
    shares = [phase.calls[i::sessions] for i in range(sessions)]
    watches: list[Watch] = []
    spawning = anyio.Lock()

    async def session(share: list[Call]) -> None:
        async with stdio_session(workdir, spawning, *args) as (client, pid):
            usage = Usage()
            usage.take(pid, "before")
            watch = Watch(pid, usage)
            watches.append(watch)
            with watch:
                async with anyio.create_task_group() as group:
                    for call in share:
                        group.start_soon(stdio_call, client, call, bound_s)
            usage.take(pid, "after")
            merge_usage(phase.usage, usage)

    async with anyio.create_task_group() as group:
        group.start_soon(ticker, "stdio", phase.calls)
        async with anyio.create_task_group() as sessions_group:
            for share in shares:
                sessions_group.start_soon(session, share)
        group.cancel_scope.cancel()
    return watches


def merge_usage(total: Usage, one: Usage) -> None:
    """Several servers: the largest value of each (before, peak, after)."""
    for key in ("rss_kb", "fds"):
        mine, theirs = getattr(total, key), getattr(one, key)
        for when, value in theirs.items():
            if value is not None and (mine.get(when) or 0) < value:
                mine[when] = value


def stdio_burst(workdir: Path, phase: Phase, calls: int, sessions: int, *args: str) -> list[Call]:
    """`calls` more over `sessions` fresh stdio servers; what each left is added to `phase`."""
    batch = [Call("stdio") for _ in range(calls)]
    phase.calls.extend(batch)
    started = time.monotonic()
    one = Phase(phase.name, batch, usage=phase.usage)
    watches = anyio.run(drive_stdio, workdir, one, sessions, HUNG_BOUND_S, args)
    phase.elapsed_s += time.monotonic() - started
    mark_duplicates(phase.calls)
    for watch in watches:
        for key, value in leftovers_after(watch.pid, watch).items():
            phase.leftovers.setdefault(key, []).extend(value)
    return batch


# --- the library: threads and asyncio --------------------------------------------------------


def library_call(sandbox: Sandbox, call: Call) -> None:
    started = time.monotonic()
    try:
        result = sandbox.run(call.code)
    except Exception as exc:  # every failure is counted and shown
        call.failed(exc, started)
        return
    judge_library_result(call, result, started)


def judge_library_result(call: Call, result: Any, started: float) -> None:
    call.answer(result.stdout + result.stderr, ok=result.status == "ok", started=started)
    if result.status != "ok":
        call.outcome = "error"
        call.detail = f"status {result.status}: {result.error}"


def _burst(phase: Phase, kind: str, calls: int, drive: Callable[[list[Call]], None]) -> list[Call]:
    """`calls` more calls of `kind` in `phase`, all made by `drive(batch)` under a Watch of
    this process: the phase's time, usage and trend taken around them."""
    batch = [Call(kind) for _ in range(calls)]
    phase.calls.extend(batch)
    pid = os.getpid()
    started = time.monotonic()
    phase.usage.rss_kb.setdefault("before", rss_kb(pid))
    phase.usage.fds.setdefault("before", open_fds(pid))
    with Watch(pid, phase.usage):
        drive(batch)
    phase.elapsed_s += time.monotonic() - started
    phase.usage.take(pid, "after")
    phase.trend.append((phase.usage.rss_kb["after"], phase.usage.fds["after"]))
    mark_duplicates(phase.calls)
    return batch


def threads_burst(sandbox: Sandbox, phase: Phase, calls: int, threads: int) -> list[Call]:
    """`calls` more runs of one Sandbox from `threads` threads at once."""

    def drive(batch: list[Call]) -> None:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            futures = {pool.submit(library_call, sandbox, c): c for c in batch}
            deadline = time.monotonic() + HUNG_BOUND_S
            for future, call in futures.items():
                try:
                    future.result(timeout=max(0.0, deadline - time.monotonic()))
                except concurrent.futures.TimeoutError:
                    call.hung()

    return _burst(phase, "threads", calls, drive)


async def _drive_async(sandbox: Sandbox, calls: list[Call], bound_s: float) -> None:
    async def one(call: Call) -> None:
        run = asyncio.wait_for(sandbox.arun(call.code), bound_s)
        await judged(call, run, judge_library_result)

    await asyncio.gather(*(one(c) for c in calls))


def asyncio_burst(sandbox: Sandbox, phase: Phase, calls: int) -> list[Call]:
    """`calls` more `Sandbox.arun` tasks at once on a new asyncio loop."""

    def drive(batch: list[Call]) -> None:
        asyncio.run(_drive_async(sandbox, batch, HUNG_BOUND_S))

    return _burst(phase, "asyncio", calls, drive)


# --- the summary -----------------------------------------------------------------------------


def table(reports: list[dict[str, Any]]) -> str:
    """The readable summary: one line per phase."""
    head = ["phase", "calls", *OUTCOMES, "p50 ms", "p99 ms", "rss MiB b/pk/a", "fds b/pk/a", "left"]
    rows = [head]
    for r in reports:
        lat = r["latency_ms"]
        rows.append(
            [
                r["phase"],
                str(r["calls"]),
                *(str(r["counts"][o]) for o in OUTCOMES),
                _num(lat["p50"]),
                _num(lat["p99"]),
                "/".join(_num(_mib(r["rss_kb"].get(w))) for w in ("before", "peak", "after")),
                "/".join(_num(r["fds"].get(w)) for w in ("before", "peak", "after")),
                str(sum(len(v) for v in r["leftovers"].values())),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )


def _mib(kb: int | None) -> float | None:
    return None if kb is None else kb / 1024


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.0f}"


@contextlib.contextmanager
def library_checked(into: dict[str, list[str]], grace_s: float = 10.0) -> Iterator[Sandbox]:
    """One Sandbox for the block, closed afterwards; what this process was then left with
    (processes, run dirs, mounts, cgroups, fds), against a snapshot taken before it, is put
    `into` (its guardian is started first: it lives as long as the process does)."""
    from codecage.bridge import channel as bridge_channel
    from codecage.engine import forkserver, guardian

    bridge_channel.watcher()  # made once per process and kept (as conftest's leak_guard)
    guardian.ensure()
    kids_before = descendants(os.getpid())
    fds_before = fd_targets()
    sandbox = Sandbox()
    try:
        yield sandbox
    finally:
        sandbox.close()
        forkserver.stop_all()
    deadline = time.monotonic() + grace_s
    while True:
        left = named_leftovers(os.getpid())
        extra = [p for p, s in descendants(os.getpid()).items() if kids_before.get(p) != s]
        if extra := [p for p in extra if not _zombie_of_ours(p)]:
            left["processes"] = [f"{p}: {cmdline(p)}" for p in extra]
        if new_fds := sorted(fd_targets().items() - fds_before.items()):
            left["fds"] = [f"{fd} -> {target}" for fd, target in new_fds]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    into.update(left)
