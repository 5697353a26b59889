"""Issue 17's findings kept fixed: a fault- or hypothesis-driven variant of each one that
involves a sandbox, on every backend (tests/issues/test_17_*.py hold the original
regression tests, on bwrap).

- 1: configuration is never read from a workspace: a run whose workspace holds the config
  in use (or a place searched for one) is refused before anything starts.
- 2: a bridge flood whose answers are never read does not grow the host: it stops reading.
- 4, 5: server and tool names the code chooses (escapes, C1, bidi, line breaks, 1 MiB)
  are recorded neutralised and bounded, and reach no log raw.
- 6: uploads land in the run's bounded workspace: too much is refused before a sandbox
  starts, and code that grows them stops at the quota.
- 10: `scrub` is metered against the run's CPU budget and confirms no configured secret.
- 13: a request nested past the bound is refused (65 levels: an answer; 200k: the
  channel closes) and later calls fail at once.
- 14: allow-list patterns: any names against any patterns (hypothesis, no sandbox needed).
- 15: a lent workspace's mode and owner are restored whatever the code set.
- 16: file names forging summary lines: tests/reliability/test_fuzz_files.py.
Items 3, 7, 8, 9, 11, 12 and 17 are about upstreams, the HTTP server, `gen` and the sweep,
on the host whatever the backend: their variants belong to the interface, fault and
codegen fuzzing (test_fuzz_*.py, test_faults*.py), not here.
"""

from __future__ import annotations

import logging
import os
import random
import re
import resource
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests._bridge_flood import NEXT_CALL, bridge_flood

from codecage import Options, Sandbox
from codecage.bridge.channel import BridgeLimits
from codecage.bridge.tooling import ToolPattern, name_matches
from codecage.errors import CodecageError, ConfigError
from codecage.isolation import identity
from containment._support import fork_and_reap

from ._fuzz_host import BACKENDS, BackendSandboxes, backend_sandboxes

UNSAFE_IN_LINE = re.compile(
    r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2028\u2029\u2066-\u2069]"
)
SECRET_ENV = "CODECAGE_FUZZ_UPSTREAM_TOKEN"  # noqa: S105 (a variable name)
SECRET = "493817"  # noqa: S105 (a short, guessable credential scrub() must not confirm)


@pytest.fixture(scope="module")
def sandboxes() -> Iterator[BackendSandboxes]:
    """Sandboxes whose bridge takes any number of requests (the bounds tested here are
    the buffer's and the CPU budget's: 0.5 s of host CPU per run, less than the runs'
    cpu_seconds, to keep the metering test short), scrubbing with a configured secret."""
    os.environ[SECRET_ENV] = SECRET
    try:
        yield from backend_sandboxes(
            tool_limits=BridgeLimits(max_calls=10**9, host_cpu_seconds=0.5)
        )
    finally:
        del os.environ[SECRET_ENV]


# --- 4, 5, 10 (oracle), 13: one run of bridge abuse per backend -------------------------

EVIL_NAMES = [
    "srv\x1b]52;c;aGFja2Vk\x07",
    "a\n2026-01-01 ERROR forged log line",
    "\u202egnp\u2066\x9b2J",
    "t\r\x85\u2028",
    "x" * (1024 * 1024),
]

BRIDGE_ABUSE = r"""
import os, time
from codecage.runtime import ToolCallError, call_tool_sync, scrub
kinds = []
for server in {names!r}:
    for tool in ("ok", server):
        try:
            call_tool_sync(server, tool, {{"a": 1}})
        except ToolCallError as exc:
            kinds.append(exc.kind)
oracle = scrub("the code is {secret} " + "token={secret}")
shallow = b"[" * 60 + b"]" * 60
os.write(4, b'{{"v":1,"id":7001,"op":"call_tool","server":"s","tool":"t","arguments":{{"a":'
         + shallow + b'}}}}\n')
os.write(4, b'{{"v":1,"id":7002,"op":"call_tool","server":"s","tool":"t","arguments":'
         + b"[" * 200_000 + b"]" * 200_000 + b"}}\n")
"""
BRIDGE_ABUSE_THEN = NEXT_CALL + "[sorted(set(kinds)), oracle, outcome, waited < 10]\n"


@pytest.mark.parametrize("backend", BACKENDS)
def test_names_scrub_and_nesting_abuse_of_the_bridge_are_contained(
    sandboxes: BackendSandboxes, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    code = BRIDGE_ABUSE.format(names=EVIL_NAMES, secret=SECRET) + BRIDGE_ABUSE_THEN
    with caplog.at_level(logging.DEBUG):
        result = sandboxes.get(backend).run(code, limits={"timeout": 60})
    assert result.status == "ok", (result.error, result.stderr)
    kinds, oracle, after, promptly = result.return_value
    assert kinds and "ok" not in kinds  # no upstream: each call refused, none answered
    assert oracle == f"the code is {SECRET} token={SECRET}"  # 10: no [SECRET] confirmed
    assert after != "answered" and promptly  # 13: closed, and the next call fails at once
    assert [e for e in result.events if e.kind == "bridge_closed"]
    for event in result.events:  # 4: every guest-chosen string neutralised and bounded
        assert not UNSAFE_IN_LINE.search(event.detail)
        assert len(event.detail) <= 2000
        for value in (event.data or {}).values():
            assert not (isinstance(value, str) and UNSAFE_IN_LINE.search(value))
    for record in caplog.records:  # 5: nothing raw, nothing unbounded in the host's log
        line = record.getMessage() + " ".join(
            str(v) for k, v in vars(record).items() if k in ("error", "reason", "detail")
        )
        assert "\x1b" not in line and "forged log line\n" not in line
        assert len(line) < 10_000


# --- 2: a flood whose answers are never read ---------------------------------------------

# A scrub request of SIZE bytes of text (the guest's bytes expression).
SCRUB_REQUEST = r"""b'{"v":1,"id":%d,"op":"scrub","text":"' + b"a" * SIZE + b'"}\n'"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bridge_flood_whose_answers_are_never_read_is_stopped_by_the_host(
    sandboxes: BackendSandboxes, backend: str
) -> None:
    """Request size drawn at random (seed in the id): the host stops taking requests once
    1 MiB of answers waits unread, so the code's writes block long before 16 MiB."""
    size = random.Random(backend).choice([100, 4_000, 60_000, 500_000])
    result = sandboxes.get(backend).run(
        bridge_flood(SCRUB_REQUEST.replace("SIZE", str(size)), seconds=1, copies=16),
        limits={"timeout": 60, "cpu_seconds": 60},
    )
    assert result.status == "ok", (result.error, result.stderr)
    assert isinstance(result.return_value, int)
    assert result.return_value < 16 * 1024 * 1024, f"the host took {result.return_value} bytes"
    assert not [e for e in result.events if "host CPU" in e.detail], "stopped by the CPU budget"


# --- 10: scrub metered ------------------------------------------------------------------

SCRUB_LOOP = r"""
import time
from codecage.runtime import ToolCallError, scrub
text = "mail ana@example.com or call 555-123-4567 " * 24_000  # just under 1 MiB
refused, deadline = None, time.monotonic() + 30
while time.monotonic() < deadline:
    try:
        scrub(text)
    except ToolCallError as exc:
        refused = [exc.kind, exc.message]
        break
refused
"""


def _host_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@pytest.mark.parametrize("backend", BACKENDS)
def test_scrub_stops_at_the_runs_cpu_budget(sandboxes: BackendSandboxes, backend: str) -> None:
    sandbox = sandboxes.get(backend)
    before = _host_cpu_s()
    result = sandbox.run(SCRUB_LOOP, limits={"timeout": 60, "cpu_seconds": 30})
    spent = _host_cpu_s() - before
    assert result.status == "ok", (result.error, result.stderr)
    assert result.return_value is not None, f"never refused; {spent:.1f} s of host CPU"
    kind, message = result.return_value
    assert kind == "limit" and "host CPU" in message
    # A budget of 0.5 s: the bridge may pass it by one op; the margin is the rest of the
    # host's work for the run (not a timing bound: CPU seconds counted by the kernel).
    assert spent < 0.5 + 3, f"{spent:.1f} s of host CPU"


# --- 6: uploads within the workspace quota -----------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_uploads_are_held_to_the_workspace_quota(sandboxes: BackendSandboxes, backend: str) -> None:
    sandbox = sandboxes.get(backend)
    limits = {"workspace_mb": 8, "timeout": 60}
    with pytest.raises(CodecageError):  # refused before any sandbox starts
        sandbox.run("1", files={"big.bin": b"x" * (9 * 1024 * 1024)}, limits=limits)
    grow = (
        "import os\nwith open('up.bin', 'ab') as f:\n"
        "    for _ in range(64):\n        f.write(b'y' * (1024 * 1024))\n"
    )
    result = sandbox.run(grow, files={"up.bin": b"x" * (4 * 1024 * 1024)}, limits=limits)
    assert result.status != "ok"
    sizes = [f.size for f in result.files if f.path == "up.bin"]
    assert sizes and sizes[0] <= 9 * 1024 * 1024, sizes


# --- 15: a lent workspace's own mode and owner ------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_lent_workspaces_mode_is_restored_whatever_the_code_sets(
    sandboxes: BackendSandboxes, backend: str, tmp_path: Path
) -> None:
    if backend == "landlock":
        pytest.skip("landlock lends no directory (tests/containment/test_lent.py)")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    workspace.chmod(0o2750)
    mode = random.Random(backend).choice([0o1777, 0o4777, 0o0, 0o6755, 0o777])
    code = f"import os\nos.chmod('.', {mode:#o})\nprint(oct(os.stat('.').st_mode))"
    result = sandboxes.get(backend).run(code, workspace=workspace, limits={"timeout": 60})
    assert result.status in ("ok", "error"), result  # the chmod may itself be refused
    st_now = os.stat(workspace)
    assert stat.S_IMODE(st_now.st_mode) == 0o2750, oct(st_now.st_mode)
    assert (st_now.st_uid, st_now.st_gid) == (os.getuid(), os.getgid())


# --- 1: configuration never read from a workspace ----------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("place", ["file", "directory-above"])
def test_a_run_whose_workspace_holds_the_config_in_use_is_refused(
    sandboxes: BackendSandboxes, backend: str, place: str, tmp_path: Path
) -> None:
    sandboxes.get(backend)  # skipped where the backend is not here
    tmp_path.chmod(0o700)
    project = tmp_path / "project"
    (project / "conf").mkdir(parents=True)
    path = project / "conf" / "config.toml"
    path.write_text("[limits]\ntimeout = 5\n")
    path.chmod(0o600)
    name = "bwrap" if backend == "bwrap-fork" else backend
    with Sandbox(
        config=path,
        backend=name,
        options=Options(import_policy=False, allow_degraded=backend == "landlock"),
    ) as sandbox:
        lent = project / "conf" if place == "file" else project
        with pytest.raises(ConfigError, match="workspace"):
            sandbox.run("open('conf/config.toml', 'w').write('x')", workspace=lent)
    assert path.read_text() == "[limits]\ntimeout = 5\n"


# --- 14: allow-list patterns, any names ----------------------------------------------------

plain = st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True)
hostile = st.text(min_size=1, max_size=20) | st.sampled_from(
    ["read_/../admin_delete", "read_\nx", "read_x\n", "evil.echo", "*", "read_\x1b", ".."]
)


@settings(max_examples=200, deadline=None)
@given(server=plain | hostile, tool=plain | hostile, prefix=plain)
def test_a_wildcard_grants_only_plain_names_and_never_crosses_the_dot(
    server: str, tool: str, prefix: str
) -> None:
    pattern = ToolPattern.parse(f"{prefix}.{prefix}*")
    granted = pattern.matches(server, tool)
    if granted:
        assert server == prefix and tool.startswith(prefix)
        assert re.fullmatch(r"[A-Za-z0-9_.-]+", tool), tool
    assert not name_matches(tool, "read_*") or ("/" not in tool and "\n" not in tool)
    evil = ToolPattern.parse(f"{prefix}.*")
    assert not evil.matches(f"{prefix}.echo", tool), "a server named with a dot"


# --- found here: the Landlock fallback's process limit is the host uid's ------------------

FORK_FOUR = "import os\n" + fork_and_reap(4) + "len(pids)\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: processes of another uid")
@pytest.mark.parametrize("backend", ["bwrap", "landlock"])
def test_processes_of_the_sandbox_uid_elsewhere_do_not_count_against_a_run(
    sandboxes: BackendSandboxes, backend: str, tmp_path: Path
) -> None:
    """Found by this suite on the Landlock fallback (no user namespace): max_processes was
    also RLIMIT_NPROC, which the kernel counts over every process of the sandbox's host uid,
    so 40 of them elsewhere made a run that forks 4 fail with EAGAIN (and the backend's
    self-test fail on a busy machine). Under a pids cgroup the rlimit is dropped now."""
    sandboxes.get(backend)  # skipped where the backend is not here
    # A uid of its own, so the sleepers slow no other sandbox; the default gid, as the
    # staged interpreter's root is open to one gid at a time (isolation/staging.py).
    uid, gid = 2_000_000_000 + 4242, identity.DEFAULT_ID
    tmp_path.chmod(0o700)
    path = tmp_path / "config.toml"
    path.write_text(f"[sandbox]\nuid = {uid}\ngid = {gid}\n")
    path.chmod(0o600)
    limits = {"max_processes": 16, "timeout": 60}
    with Sandbox(
        config=path, backend=backend, options=Options(import_policy=False, allow_degraded=True)
    ) as box:
        assert box.run("1").status == "ok"  # started (and self-tested) before the sleepers
        sleepers = [
            subprocess.Popen(["sleep", "60"], user=uid, group=gid, cwd="/") for _ in range(40)
        ]
        try:
            result = box.run(FORK_FOUR, limits=limits)
        finally:
            for sleeper in sleepers:
                sleeper.kill()
                sleeper.wait()
    assert result.status == "ok", (result.error, result.stderr)
    assert result.return_value == 4
