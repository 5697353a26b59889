"""`codecage.ray` on a real Ray cluster on this machine (`ray.cluster_utils.Cluster`: a
head and a worker node, each a raylet of its own with one CPU and a small object store):
the same items and results as `Sandbox.run_many`, one actor per node, and a node removed
mid-batch without an item lost, run twice unsafely or reported twice.

No mock of Ray anywhere: the nodes are real raylets, a removed node's processes are really
killed. The cluster tests are in the long tier (tests/_tiers.py): a cluster takes ~20 s to
start. The test of a missing extra runs in the quick tier and starts no cluster.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from tests._cli import codecage
from tests.conftest import leak_snapshot

from codecage import Options, Sandbox
from codecage.batch import BatchResult
from codecage.bridge import channel as bridge_channel
from codecage.engine import forkserver, guardian
from reliability._load import HttpServer, http_serve
from test_server import TOKEN, server_env

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no internet here; never phone home

NODE: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
"""Each node small: the machine is shared by the whole team."""
SLOW = "import time; time.sleep(15); 'slow'"
"""Long enough that a program handed out with the first (instant) one is still running when
the first is done, however loaded the machine: the node removed then holds one."""


@pytest.fixture(autouse=True, scope="module")
def leak_guard() -> Iterator[None]:
    """conftest's guard without the descriptors: Ray's driver keeps its own (event loops, a
    socket, its log files) after `ray.shutdown()`, by design of its core worker. Processes,
    run directories, cgroups and mounts are still checked: the nodes' sandboxes are not
    this process's children, and the cluster's processes must all be gone."""
    bridge_channel.watcher()  # as conftest's guard: made once per process, kept
    guardian.ensure()
    before = {k: v for k, v in leak_snapshot().items() if k != "fds"}
    yield
    forkserver.stop_all()  # the local Sandbox's templates, as conftest's guard stops them
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = leak_snapshot()
        leaks = {k: after[k] - before[k] for k in before if after[k] - before[k]}
        if not leaks:
            return
        time.sleep(0.1)
    raise AssertionError(f"test_ray left behind: {leaks}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    from codecage import ray as on_ray

    head = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    on_ray.connect(head.address)
    try:
        yield head
    finally:
        import ray

        on_ray.shutdown()
        ray.shutdown()
        head.shutdown()


@pytest.fixture
def worker(cluster: Any) -> Iterator[Any]:
    """A second node, removed after the test if the test did not remove it."""
    node = cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    yield node
    if node in cluster.worker_nodes:
        cluster.remove_node(node)


def _exactly_once(results: list[BatchResult], total: int) -> None:
    """Every item has one outcome, at its index, with one of result and error."""
    assert [r.index for r in results] == list(range(total))
    for r in results:
        assert (r.result is None) != (r.error is None), r


def _named_actor_nodes() -> set[str]:
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return {name.split("-")[2] for name in names if name.startswith("codecage-")}


def test_a_batch_on_two_nodes_gives_what_run_many_gives_on_one_host_in_input_order(
    cluster: Any, worker: Any
) -> None:
    from codecage import ray as on_ray

    programs: list[Any] = [
        {"code": "6 * 7", "id": "a"},
        {"code": "1 / 0", "id": "b"},
        {"code": "while True: pass", "id": "c", "limits": {"timeout": 2}},
        # A file and a directory of the same name: refused when the workspace is written.
        {"code": "1", "id": "d", "files": {"a": "x", "a/b": "y"}},
        *[{"code": f"{n} + 1", "id": n} for n in range(8)],
    ]
    progress: list[tuple[int, int]] = []
    results = on_ray.run_many(
        programs, concurrency=2, on_progress=lambda d, t, r: progress.append((d, t))
    )
    with Sandbox(pool=False) as local:
        expected = local.run_many(programs, concurrency=2)

    _exactly_once(results, len(programs))
    assert [r.id for r in results] == [p["id"] for p in programs]
    assert [r.status for r in results] == [r.status for r in expected]
    assert [r.result and r.result.return_value for r in results] == [
        r.result and r.result.return_value for r in expected
    ]
    assert results[3].error is not None and results[3].error.code == "refused"
    assert progress == [(n, len(programs)) for n in range(1, len(programs) + 1)]
    # One actor on each node (a node id's first 16 characters name its actor).
    import ray

    nodes = {n["NodeID"][:16] for n in ray.nodes() if n["Alive"]}
    assert _named_actor_nodes() >= nodes and len(nodes) == 2


def _remove_after_first(cluster: Any, node: Any) -> Any:
    """An on_progress that removes `node` from the cluster when the first item is done."""

    def on_progress(done: int, total: int, last: BatchResult) -> None:
        if done == 1:
            cluster.remove_node(node)

    return on_progress


def test_a_node_removed_mid_batch_has_its_items_run_elsewhere_when_that_is_safe(
    cluster: Any, worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from codecage import ray as on_ray

    # Two at a time on each node: the instant program and a slow one go to the first
    # node, two slow ones to the second; whichever node is removed holds a slow one.
    programs = ["'first'", *[{"code": SLOW, "id": n} for n in range(5)]]
    with caplog.at_level(logging.INFO, logger="codecage.ray"):
        results = on_ray.run_many(
            programs, concurrency=2, on_progress=_remove_after_first(cluster, worker)
        )
    _exactly_once(results, len(programs))
    assert [r.status for r in results] == ["ok"] * len(programs)
    assert [r.result and r.result.return_value for r in results] == ["first"] + ["slow"] * 5
    reruns = [r for r in caplog.records if r.getMessage() == "ray.item_rerun"]
    assert reruns, "the removed node held a program, which had to run again elsewhere"


def test_a_node_removed_mid_batch_whose_runs_reach_out_gives_node_lost_not_a_second_run(
    cluster: Any, worker: Any
) -> None:
    from codecage import ray as on_ray

    programs = ["'first'", *[{"code": SLOW, "id": n} for n in range(5)]]
    results = on_ray.run_many(
        programs,
        concurrency=2,
        options=Options(allow_hosts=["example.com"]),  # a run with network: not safe twice
        on_progress=_remove_after_first(cluster, worker),
    )
    _exactly_once(results, len(programs))
    lost = [r for r in results if r.error is not None]
    assert lost, "the removed node held a program: it must be reported, not rerun"
    for r in lost:
        assert r.error is not None and r.error.code == "node_lost"
        assert "was lost" in r.error.message and "network" in r.error.message
    assert all(r.status == "ok" for r in results if r.error is None)


def test_a_node_that_does_not_answer_in_time_gives_timed_out_and_the_batch_goes_on(
    cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from codecage import ray as on_ray

    # The driver's deadline is the item's wall timeout plus a margin: a margin of -9 s
    # makes a node that takes 5 s of a 10 s timeout "not answering" after 1 s.
    monkeypatch.setattr(on_ray, "ANSWER_MARGIN_S", -9.0)
    programs = [
        {"code": "import time; time.sleep(5)", "limits": {"timeout": 10}},
        {"code": "'next'", "limits": {"timeout": 10}},
    ]
    results = on_ray.run_many(programs, concurrency=1)
    _exactly_once(results, 2)
    assert results[0].error is not None and results[0].error.code == "timed_out"
    assert results[1].result is not None and results[1].result.return_value == "next"


def test_run_batch_with_ray_writes_the_results_in_input_order(cluster: Any, tmp_path: Path) -> None:
    lines = [json.dumps({"id": n, "code": f"{n} * 2"}) for n in range(6)]
    out = tmp_path / "results.jsonl"
    done = codecage(
        "run-batch",
        "--jsonl",
        "-",
        "--out",
        str(out),
        "--ray",
        cluster.address,
        "--json",
        stdin="\n".join(lines) + "\n",
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(w["index"], w["id"], w["result"]["return_value"]) for w in written] == [
        (n, n, n * 2) for n in range(6)
    ]
    summary = json.loads(done.stderr.strip().splitlines()[-1])
    assert summary["programs"] == 6 and summary["failed"] == 0


def test_without_the_ray_extra_the_cli_and_the_library_say_what_to_install(
    tmp_path: Path,
) -> None:
    """Ray is installed in the test environment; a package named `ray` that fails to import
    as an absent one does (first on PYTHONPATH) is how "not installed" is made here."""
    fake = tmp_path / "ray"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'ray'\", name='ray')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    done = codecage("run-batch", "--jsonl", "-", "--ray", "auto", stdin='{"code": "1"}\n', env=env)
    assert done.returncode == 2, done.stderr
    assert "pip install 'codecage[ray]'" in done.stderr
    library = codecage("-c", "import codecage.ray", command=(sys.executable,), env=env)
    assert library.returncode == 1
    assert "pip install 'codecage[ray]'" in library.stderr


def test_the_example_reward_function_scores_passed_failed_and_looping_completions(
    cluster: Any,
) -> None:
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "examples" / "ray" / "reward.py"
    spec = importlib.util.spec_from_file_location("reward_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    test = "assert add(2, 3) == 5"
    completions = [
        "def add(a, b):\n    return a + b",
        "def add(a, b):\n    return a - b",
        "def add(a, b):\n    while True:\n        pass",
    ]
    assert example.reward(completions, [test] * 3) == [1.0, 0.0, 0.0]


def _ray_start(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """`ray start ARGS --block`: in the foreground, so that SIGTERM stops this node's
    processes and nothing else on the machine (`ray stop` would stop every node here)."""
    command = [str(Path(sys.executable).with_name("ray")), "start", "--block", *args]
    return subprocess.Popen(
        [*command, "--num-cpus=1", f"--object-store-memory={NODE['object_store_memory']}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_cluster_of_ray_start_head_and_worker_runs_a_cli_batch() -> None:
    """Ray 2.60 turns on token authentication by default; this private two-node cluster
    turns it off (RAY_AUTH_MODE=disabled) as a test fixture, not as advice."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    head = _ray_start("--head", f"--port={port}", "--include-dashboard=false", env=env)
    nodes = [head]
    try:
        assert head.stdout is not None
        address = next(
            line.split("--address=")[1].split()[0].strip("'\"")
            for line in head.stdout
            if "ray start --address=" in line
        )
        nodes.append(_ray_start(f"--address={address}", env=env))
        lines = [json.dumps({"id": f"p{n}", "code": f"{n} + 1"}) for n in range(4)]
        done = codecage(
            "run-batch",
            "--jsonl",
            "-",
            "--ray",
            address,
            stdin="\n".join(lines) + "\n",
            env=env,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        written = [json.loads(line) for line in done.stdout.splitlines()]
        assert [(w["id"], w["result"]["return_value"]) for w in written] == [
            (f"p{n}", n + 1) for n in range(4)
        ]
    finally:
        for node in reversed(nodes):
            node.send_signal(signal.SIGTERM)
            try:
                node.wait(60)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()
            if node.stdout is not None:
                node.stdout.close()


def test_batches_from_two_ray_tasks_of_one_job_each_get_their_own_results(cluster: Any) -> None:
    """A pipeline's reward workers are Ray tasks or actors of one job, each a driver of its
    own batches at the same time: their actors must not collide (named per process, not
    per job). A gate holds each task until both are running, so two processes do."""
    import ray

    @ray.remote(num_cpus=0)
    class Gate:
        def __init__(self) -> None:
            self.arrived = 0

        def arrive(self) -> None:
            self.arrived += 1

        def count(self) -> int:
            return self.arrived

    @ray.remote(num_cpus=0)
    def score(gate: Any, n: int) -> tuple[int, list[Any], list[str]]:
        from codecage import ray as on_ray

        # What went wrong on the way (a node that failed to start, one lost) is logged.
        troubles: list[str] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: troubles.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("codecage.ray").addHandler(handler)
        ray.get(gate.arrive.remote())
        deadline = time.monotonic() + 120
        while ray.get(gate.count.remote()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        results = on_ray.run_many([f"{n} * {i}" for i in range(3)], concurrency=1)
        values = [r.result.return_value if r.result else r.error for r in results]
        return os.getpid(), values, troubles

    gate = Gate.remote()  # type: ignore[attr-defined]
    (pid_a, a, trouble_a), (pid_b, b, trouble_b) = ray.get(
        [score.remote(gate, 2), score.remote(gate, 3)], timeout=400
    )
    assert pid_a != pid_b  # two drivers at once, as two reward workers are
    assert (a, b) == ([0, 2, 4], [0, 3, 6])
    assert trouble_a == trouble_b == []  # neither took nor lost the other's actors


# --- codecage serve --http --ray: POST /run_code and execute_code on the cluster ----------


def _alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


@contextlib.contextmanager
def _serving_on_ray(workdir: Path, address: str, *args: str) -> Iterator[HttpServer]:
    """`codecage serve --http --ray ADDRESS ARGS` with a token, until the block ends (then
    Ctrl-C, before the test's node is removed). Its start joins the cluster and starts an
    actor on each node: bounded generously, the machine is shared."""
    argv = ("--host", "127.0.0.1", "--token", TOKEN, "--no-scrub", "--ray", address, *args)
    env = server_env(RAY_USAGE_STATS_ENABLED="0")
    with http_serve(workdir, argv, env, log="serve-ray", bound_s=300) as server:
        yield server


def _post(server: HttpServer, body: dict[str, Any]) -> httpx2.Response:
    return httpx2.post(
        server.url.removesuffix("/mcp") + "/run_code",
        json={"language": "python", **body},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=120,
    )


async def _over_mcp(url: str) -> tuple[Any, Any]:
    """A real MCP client over streamable HTTP: a one-off run that returns a file, and a run
    in a session."""
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=120)) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        one = await client.call_tool(
            "execute_code",
            {"code": "open('a.txt', 'w').write('from a node'); 6 * 7", "return_files": ["a.txt"]},
        )
        opened = await client.call_tool("open_session", {})
        session_id = opened.structured_content["session_id"]
        kept = await client.call_tool("execute_code", {"code": "x = 5", "session_id": session_id})
        again = await client.call_tool("execute_code", {"code": "x * 2", "session_id": session_id})
        await client.call_tool("close_session", {"session_id": session_id})
        assert not kept.is_error, kept
        return one, again


def _audit_record(execution_id: str) -> dict[str, Any]:
    """The server's audit record of a run (its store is this test session's: server_env),
    once its writer has put it there."""
    deadline = time.monotonic() + 30
    while True:
        shown = codecage("audit", "show", execution_id, "--json", env=server_env())
        if shown.returncode == 0 or time.monotonic() > deadline:
            assert shown.returncode == 0, shown.stderr
            found: dict[str, Any] = json.loads(shown.stdout)
            return found
        time.sleep(0.5)


def test_serve_with_ray_answers_run_code_and_execute_code_from_the_clusters_nodes(
    cluster: Any, worker: Any, tmp_path: Path
) -> None:
    nodes = _alive_nodes()
    assert len(nodes) == 2
    with _serving_on_ray(tmp_path, cluster.address) as server:
        answers = [_post(server, {"code": f"print({n} * 2)"}) for n in range(4)]
        for n, answer in enumerate(answers):
            assert answer.status_code == 200, answer.text
            found = answer.json()
            assert (found["status"], found["run_result"]["stdout"]) == ("Success", f"{n * 2}\n")
        # Where each ran: round-robin over the nodes, named in SandboxFusion's own field.
        assert {a.json()["executor_pod_name"] for a in answers} == nodes
        # stdin fed to the program, and a file it wrote fetched back from the node.
        fetched = _post(
            server,
            {
                "code": "open('out.txt', 'w').write(input().upper())",
                "stdin": "from stdin\n",
                "fetch_files": ["out.txt"],
            },
        ).json()
        assert fetched["status"] == "Success", fetched
        assert base64.b64decode(fetched["files"]["out.txt"]) == b"FROM STDIN"

        one, in_session = anyio.run(_over_mcp, server.url)
        assert not one.is_error, one
        assert one.structured_content["return_value"] == 42
        assert one.structured_content["node"] in nodes
        # On the server's audit trail, in the caller's name, as a local run would be.
        record = _audit_record(one.structured_content["execution_id"])
        assert (record["caller_kind"], record["status"]) == ("http", "ok"), record
        assert "--- a.txt ---\nfrom a node" in [getattr(b, "text", "") for b in one.content]
        # A session's state lives in one interpreter: it runs on the server's own host.
        assert not in_session.is_error, in_session
        assert in_session.structured_content["return_value"] == 10
        assert in_session.structured_content["node"] is None
        log = server.stderr_path.read_text(encoding="utf-8")
    assert "runs go to the Ray cluster" in log and "2 node(s), 2 at once" in log


def _slow_posts(server: HttpServer, count: int) -> tuple[list[httpx2.Response], list[Any]]:
    """`count` slow programs posted at once, each on a thread of its own (joined by the
    caller); and the threads."""
    import threading

    answers: list[httpx2.Response] = []
    threads = [
        threading.Thread(
            target=lambda: answers.append(_post(server, {"code": SLOW_PRINT, "run_timeout": 60}))
        )
        for _ in range(count)
    ]
    for thread in threads:
        thread.start()
    return answers, threads


SLOW_PRINT = "import time; time.sleep(15); print('slow')"


def _first_refusal(answers: list[httpx2.Response]) -> httpx2.Response:
    """The first answer that is not a 200, once one comes (three slow programs posted at
    once to a cluster that runs two: one is refused while the two run)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        refused = [a for a in list(answers) if a.status_code != 200]
        if refused:
            return refused[0]
        time.sleep(0.1)
    raise AssertionError(f"no run was refused: {[a.text for a in answers]}")


def test_serve_with_ray_refuses_a_run_over_the_clusters_capacity_with_503_and_retry_after(
    cluster: Any, worker: Any, tmp_path: Path
) -> None:
    # Two nodes of one CPU: the cluster runs 2 at once. --max-concurrent 3 lets a third
    # past the server's own queue to the cluster, which refuses it rather than queue it.
    args = ("--max-concurrent", "3")
    with _serving_on_ray(tmp_path, cluster.address, *args) as server:
        answers, threads = _slow_posts(server, 3)
        refused = _first_refusal(answers)
        busy = _post(server, {"code": "print('fourth')"})  # refused too while the two run
        for thread in threads:
            thread.join(120)
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1"
    assert "every node of the Ray cluster is running as many runs as it may" in refused.text
    assert (busy.status_code, busy.headers["retry-after"]) == (503, "1"), busy.text
    ran = [a.json()["run_result"]["stdout"] for a in answers if a.status_code == 200]
    assert ran == ["slow\n", "slow\n"]


def test_serve_with_ray_reports_node_lost_for_a_run_with_network_whose_node_went_away(
    cluster: Any, worker: Any, tmp_path: Path
) -> None:
    # With a host every run may reach, a run that may have started is never run twice.
    # --max-concurrent 3: a quick program reaches the full cluster (and is refused).
    args = ("--allow-host", "example.com", "--max-concurrent", "3")
    with _serving_on_ray(tmp_path, cluster.address, *args) as server:
        answers, threads = _slow_posts(server, 3)
        _first_refusal(answers)  # the two others are on their nodes now, one on each
        cluster.remove_node(worker)
        for thread in threads:
            thread.join(180)
        after = _post(server, {"code": "print('after')"})
    found = sorted((a.json() for a in answers if a.status_code == 200), key=lambda f: f["status"])
    assert [f["status"] for f in found] == ["SandboxError", "Success"], found
    assert found[0]["message"].startswith("node_lost: its node"), found[0]
    assert "network" in found[0]["message"]
    assert after.json()["run_result"]["stdout"] == "after\n"  # the node left goes on


def test_serve_with_ray_at_an_address_where_nothing_listens_says_so_at_start(
    tmp_path: Path,
) -> None:
    """No cluster is started: the refusal comes before Ray is asked (which would retry
    for minutes)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    done = codecage(
        "serve",
        "--http",
        "--insecure-no-token",
        "--ray",
        f"127.0.0.1:{port}",
        env=server_env(RAY_USAGE_STATS_ENABLED="0"),
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert f"cannot join the Ray cluster at '127.0.0.1:{port}'" in done.stderr
    assert "ray start --head" in done.stderr


def test_serve_with_ray_and_upstream_tools_is_refused_at_start_with_the_way_out(
    tmp_path: Path,
) -> None:
    """Refused before the cluster is asked (its address here has nothing behind it): a
    node has no way back to this host's tool bridge."""
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"memory": {"command": "/nonexistent"}}}))
    (tmp_path / "servers").mkdir()
    done = codecage(
        "serve",
        "--http",
        "--insecure-no-token",
        *("--mcp-config", str(config), "--servers-dir", str(tmp_path / "servers")),
        *("--ray", "127.0.0.1:1"),
        env=server_env(RAY_USAGE_STATS_ENABLED="0"),
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "cannot call this host's upstream MCP tools" in done.stderr
    assert "serve without --ray to give the code tools" in done.stderr


def test_serve_with_ray_runs_a_run_without_network_again_when_its_node_went_away(
    cluster: Any, worker: Any, tmp_path: Path
) -> None:
    # No network: the run held by the removed node could not reach outside its sandbox,
    # so it runs again on the node left, once that node has room (it was admitted).
    with _serving_on_ray(tmp_path, cluster.address, "--max-concurrent", "3") as server:
        answers, threads = _slow_posts(server, 3)
        refused = _first_refusal(answers)  # the two others are on their nodes, one on each
        cluster.remove_node(worker)
        for thread in threads:
            thread.join(180)
        log = server.stderr_path
    assert refused.status_code == 503, refused.text
    ran = [a.json() for a in answers if a.status_code == 200]
    assert [(f["status"], f["run_result"]["stdout"]) for f in ran] == [("Success", "slow\n")] * 2
    assert {f["executor_pod_name"] for f in ran} == {cluster.head_node.node_id}
    assert "ray.node_lost" in log.read_text(encoding="utf-8")
