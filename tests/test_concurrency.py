"""Runs happen in parallel threads (the async twin, later the MCP server): they must not
interfere with each other's fds, workspaces or cgroups."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from codecage import Sandbox


def test_parallel_runs_each_get_their_own_result_and_workspace(sandbox: Sandbox) -> None:
    code = (
        "import os\n"
        "before = sorted(os.listdir('.'))\n"
        "open(f'mine-{N}.txt', 'w').write(str(N))\n"
        "print(N)\n"
        "(N, before)"
    )
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(lambda n: sandbox.run(code.replace("N", str(n))), range(12)))
    for n, r in enumerate(results):
        assert r.status == "ok", (n, r.error, r.stderr)
        assert r.stdout == f"{n}\n"
        assert r.return_value == [n, []]  # nobody else's file was visible
        assert [f.path for f in r.files] == [f"mine-{n}.txt"]
