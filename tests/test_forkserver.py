"""The fork server (engine/forkserver.py, guest/template.py): sandboxes forked from a warm
template are sandboxes like any other, each with namespaces, a workspace, a cgroup and a
filter of its own, judged by the host; nothing of a template outlives its Sandbox.

The containment suite runs on this path too (`bwrap-fork` in tests/containment), and so do
the pool's cross-run tests (tests/containment/test_pool_isolation.py, `forked`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from codecage import Options, Sandbox
from codecage.backends.base import load_backend
from codecage.config import load as load_settings
from codecage.engine import forkserver
from codecage.isolation import seccomp

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def forked() -> Iterator[Sandbox]:
    why_not = forkserver.supported(load_backend("bwrap"))
    if why_not is not None:
        pytest.skip(f"no fork server here: {why_not}")
    with Sandbox(
        backend="bwrap", options=Options(import_policy=False, scrub=False, fork_server=True)
    ) as sb:
        yield sb


def _forked_count(sandbox: Sandbox) -> int:
    templates = sandbox.host.templates
    assert templates is not None
    return templates.forked


def test_a_run_is_forked_and_gives_the_usual_result(forked: Sandbox) -> None:
    before = _forked_count(forked)
    r = forked.run("print('hello'); 6 * 7")
    assert (r.status, r.stdout, r.return_value, r.backend) == ("ok", "hello\n", 42, "bwrap")
    assert r.usage.peak_memory_mb is not None and r.usage.cpu_ms is not None
    # Forked: +1 (and +1 more once the next run's sandbox is forked ahead, prefork's).
    assert before + 1 <= _forked_count(forked) <= before + 2


def test_each_run_gets_namespaces_of_its_own_not_the_templates(forked: Sandbox) -> None:
    # Both alive at once: a namespace's inode number is reused once it is gone.
    code = """
import json, os, time
time.sleep(0.5)
print(json.dumps({n: os.stat("/proc/self/ns/" + n).st_ino
                  for n in ("pid", "mnt", "net", "ipc", "uts")}))
"""
    with ThreadPoolExecutor(2) as pool:
        first, second = (json.loads(r.stdout) for r in pool.map(forked.run, [code, code]))
    assert all(first[n] != second[n] for n in first), (first, second)
    host = {n: os.stat(f"/proc/self/ns/{n}").st_ino for n in first}
    assert all(first[n] != host[n] for n in first)


def test_the_code_has_no_capability_and_runs_under_the_run_filter(forked: Sandbox) -> None:
    code = """
import ctypes, errno, json
status = dict(line.split(":\\t") for line in open("/proc/self/status").read().splitlines()
              if ":\\t" in line)
libc = ctypes.CDLL(None, use_errno=True)
refused = libc.unshare(0x00020000) != 0 and ctypes.get_errno() == errno.EPERM
mount = libc.mount(b"none", b"/tmp", b"tmpfs", 0, None) != 0
# A user namespace needs no capability: only the run's filter answers EPERM (the template's
# allows unshare; bwrap's --disable-userns alone would answer ENOSPC).
userns = libc.unshare(0x10000000) != 0 and ctypes.get_errno() == errno.EPERM
print(json.dumps({k: status[k].strip() for k in ("CapEff", "CapPrm", "CapBnd", "CapAmb",
      "NoNewPrivs", "Seccomp")} | {"unshare_refused": refused, "mount_refused": mount,
      "userns_refused_by_the_filter": userns}))
"""
    got = json.loads(forked.run(code).stdout)
    assert got["CapEff"] == got["CapPrm"] == got["CapBnd"] == got["CapAmb"] == "0" * 16
    assert got["NoNewPrivs"] == "1" and got["Seccomp"] == "2"
    assert got["unshare_refused"] and got["mount_refused"]
    assert got["userns_refused_by_the_filter"]


def test_the_templates_filter_is_the_runs_less_what_making_namespaces_needs() -> None:
    run = set(seccomp.plan().denied_syscalls)
    template = set(seccomp.plan(template=True).denied_syscalls)
    assert run - template == {"unshare", "mount", "move_mount"}
    assert template <= run


def test_proc_is_read_only_and_masked_as_in_a_bwrap_sandbox(forked: Sandbox) -> None:
    code = """
import json, os
masked = {p: (os.listdir(p) if os.path.isdir(p) else open(p).read())
          for p in ("/proc/acpi", "/proc/keys", "/proc/timer_list") if os.path.exists(p)}
try:
    open("/proc/sys/kernel/hostname", "w").write("x")
    wrote = True
except OSError:
    wrote = False
print(json.dumps({"masked": masked, "wrote": wrote}))
"""
    got = json.loads(forked.run(code).stdout)
    assert not got["wrote"]
    assert got["masked"] and all(v in ([], "") for v in got["masked"].values()), got


def test_files_in_and_out_go_through_the_runs_own_workspace(forked: Sandbox) -> None:
    r = forked.run(
        "import pathlib; t = pathlib.Path('in.txt').read_text(); "
        "pathlib.Path('out.txt').write_text(t.upper()); t",
        files={"in.txt": "abc"},
    )
    assert r.status == "ok" and r.return_value == "abc"
    assert {f.path for f in r.files} == {"in.txt", "out.txt"}
    assert r.read_file("out.txt") == b"ABC"
    assert forked.run("import os; sorted(os.listdir('.'))").return_value == []


def test_the_host_judges_a_forked_run_limits_and_killed(forked: Sandbox) -> None:
    assert forked.run("while True: pass", limits={"timeout": 1}).status == "timeout"
    bomb = "b = []\nwhile True: b.append(bytearray(8 * 2**20))"
    assert forked.run(bomb, limits={"memory_mb": 64}).status == "memory_limit"
    killed = forked.run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert killed.status == "killed" and killed.signal == "SIGKILL"
    forks = "import os\nfor _ in range(40):\n    os.fork() or os._exit(0)\n"
    assert forked.run(forks, limits={"max_processes": 4}).status == "error"


def test_a_dead_template_is_replaced(forked: Sandbox) -> None:
    templates = forked.host.templates
    assert templates is not None
    forked.run("1")
    for template in list(templates._templates.values()):
        template.sandbox.proc.kill()
    assert forked.run("2").return_value == 2


def _recycling(max_runs: int) -> Sandbox:
    settings = load_settings(None)
    pool = settings.pool.model_copy(update={"template_max_runs": max_runs})
    sb = Sandbox(
        backend="bwrap",
        options=Options(
            config=dataclasses.replace(settings, pool=pool),
            import_policy=False,
            scrub=False,
            fork_server=True,
        ),
    )
    if sb.host.templates is None:
        sb.close()
        pytest.skip(f"no fork server here: {sb.host.fork_server_off}")
    return sb


def test_a_template_is_replaced_after_max_runs_and_its_forks_stop_sharing_its_seed() -> None:
    """Forks share the template's memory layout and hash seed: after `template_max_runs`
    a new template (a new seed) serves, started in the background, and the worn one is
    stopped once nothing forked from it is left. A run of the old template still under
    way when it is retired finishes as usual."""
    code = "import os, sys; [hash('codecage'), id(sys), os.getppid()]"
    with _recycling(2) as sb, ThreadPoolExecutor(1) as background:
        templates = sb.host.templates
        assert templates is not None
        first = sb.run(code).return_value
        old = [t.sandbox.proc for t in templates._templates.values()]
        slow = background.submit(sb.run, "import time; time.sleep(2); 'slow'")
        seen = [first]
        for _ in range(200):  # the replacement starts in the background: runs go on meanwhile
            r = sb.run(code)
            assert r.status == "ok", r.stderr
            seen.append(r.return_value)
            if r.return_value[0] != first[0]:
                break
        assert seen[-1][0] != first[0], "no new template (no new hash seed) after 200 runs"
        assert slow.result().return_value == "slow"
        assert all(s[0] == first[0] for s in seen[:2])  # max_runs forks of the first
        # Every run was forked (the sandboxes forked ahead for the next run, prefork's,
        # count too: one per run at most, beside the one that is idle now).
        assert len(seen) + 1 <= templates.forked <= 2 * (len(seen) + 1) + 1
        deadline = time.monotonic() + 60
        while any(p.poll() is None for p in old):
            assert time.monotonic() < deadline, "the retired template was never stopped"
            time.sleep(0.05)
        assert sb.run("1").return_value == 1


def test_close_stops_the_templates() -> None:
    with Sandbox(backend="bwrap", options=Options(import_policy=False, fork_server=True)) as sb:
        if sb.host.templates is None:
            pytest.skip(f"no fork server here: {sb.host.fork_server_off}")
        sb.run("1")
        processes = [t.sandbox.proc for t in sb.host.templates._templates.values()]
        assert processes
    assert all(p.poll() is not None for p in processes)
    assert sb.host.templates._templates == {}


def test_info_says_whether_sandboxes_are_forked(forked: Sandbox) -> None:
    forked.run("1")
    pool = forked.info().pool
    assert pool is not None and pool.fork_server is not None
    assert pool.fork_server.enabled and pool.fork_server.forked >= 1
    assert pool.fork_server.templates and pool.fork_server.templates[0].rss_mb
    with Sandbox(backend="bwrap", options=Options(fork_server=False)) as off:
        state = off.info().pool
        assert state is not None and state.fork_server is not None
        assert not state.fork_server.enabled and "turned off" in (state.fork_server.why_not or "")


# --- prefork: the defaults are warm -----------------------------------------------------


def _prefork(**pool: object) -> Sandbox:
    """A Sandbox as `Sandbox()` makes it (no pool asked for), its [pool] table changed."""
    settings = load_settings(None)
    config = dataclasses.replace(settings, pool=settings.pool.model_copy(update=pool))
    sb = Sandbox(backend="bwrap", options=Options(config=config, fork_server=True))
    if sb.host.templates is None:
        sb.close()
        pytest.skip(f"no fork server here: {sb.host.fork_server_off}")
    return sb


def _wait_for_spares(sandbox: Sandbox, count: int) -> None:
    templates = sandbox.host.templates
    assert templates is not None
    deadline = time.monotonic() + 30
    while templates.spares() != count:
        assert time.monotonic() < deadline, f"not {count} sandboxes forked ahead in 30 s"
        time.sleep(0.01)


def test_the_defaults_fork_the_next_sandbox_after_a_run_and_the_next_run_takes_it() -> None:
    with _prefork() as sb:
        assert sb.host.pool is None  # no pool: the defaults
        state = sb.info().pool
        assert state is not None and state.fork_server is not None
        assert state.fork_server.prefork and state.fork_server.spares == 0  # none before a run
        first = sb.run("open('/workspace/left', 'w').write('x'); import os; os.getpid()")
        _wait_for_spares(sb, 1)
        second = sb.run("import os; [os.listdir('/workspace'), os.listdir('/tmp'), 6 * 7]")
        assert (first.status, second.status) == ("ok", "ok")
        assert second.return_value == [[], [], 42]  # single-use: nothing of the first run
        assert second.execution_id != first.execution_id
        state = sb.info().pool
        assert state is not None and state.fork_server is not None
        assert state.fork_server.spares_taken == 1
        _wait_for_spares(sb, 1)  # and the one after it: one per kind, no more
        assert sb.host.templates is not None and sb.host.templates.spares() == 1


def test_a_sandbox_forked_ahead_takes_the_runs_own_limits() -> None:
    # Forked ahead with the default limits' cgroup; the run asks for less memory.
    with _prefork() as sb:
        sb.run("1")
        _wait_for_spares(sb, 1)
        r = sb.run("b = bytearray(400 * 2**20); len(b)", limits={"memory_mb": 128})
        assert r.status == "memory_limit", (r.status, r.stderr)
        templates = sb.host.templates
        assert templates is not None and templates.spares_taken == 1


def test_close_destroys_the_sandbox_forked_ahead_and_the_used_ones() -> None:
    sb = _prefork()
    sb.run("1")
    _wait_for_spares(sb, 1)
    templates = sb.host.templates
    assert templates is not None
    spare = next(iter(templates._spares.values()))
    sb.run("1")  # takes it; its sandbox waits for the keeper
    sb.close()
    assert spare.proc.poll() is not None
    assert not spare.workspace.path.exists()
    assert templates.spares() == 0
    # The module's leak guard checks that no process, run dir, fd or cgroup is left.


@pytest.mark.parametrize("how", ["setting", "pool_false"])
def test_prefork_off_forks_each_sandbox_when_its_run_asks(how: str) -> None:
    if how == "setting":
        sb = _prefork(prefork=False)
    else:
        sb = Sandbox(backend="bwrap", pool=False, options=Options(fork_server=True))
    with sb:
        if sb.host.templates is None:
            pytest.skip(f"no fork server here: {sb.host.fork_server_off}")
        assert not sb.host.templates.prefork
        for _ in range(3):
            assert sb.run("1").return_value == 1
        time.sleep(0.2)  # a spare would be forked by now (5 ms after the run, ~20 ms each)
        assert sb.host.templates.spares() == 0 and sb.host.templates.spares_taken == 0
