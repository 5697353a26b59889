"""SandboxFusion's `POST /run_code` on a real `codecage serve --http`, over real HTTP.

The requests and the expected responses are SandboxFusion's own public examples, quoted from
its documentation (github.com/bytedance/SandboxFusion, docs/docs/docs/...) and its pydantic
models (sandbox/server/sandbox_api.py, sandbox/runners/types.py); the timings differ, and
where codecage differs on purpose the test says so.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest

from test_server import TOKEN, HttpServer, serving_http

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    # --no-scrub: an RL pipeline compares the program's output with the expected one, and
    # redaction would change it (docs/mcp.md says so).
    workdir = tmp_path_factory.mktemp("run-code")
    with serving_http(workdir, "--host", "127.0.0.1", "--token", TOKEN, "--no-scrub") as s:
        yield s


def url(server: HttpServer) -> str:
    return server.url.removesuffix("/mcp") + "/run_code"


def post(server: HttpServer, body: Any, headers: dict[str, str] | None = None) -> httpx2.Response:
    return httpx2.post(
        url(server),
        content=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(AUTH if headers is None else headers)},
        timeout=60,
    )


def ran(server: HttpServer, body: dict[str, Any]) -> dict[str, Any]:
    response = post(server, body)
    assert response.status_code == 200, response.text
    found: dict[str, Any] = response.json()
    return found


def test_hello_world_gets_the_documented_response(server: HttpServer) -> None:
    # docs/docs/docs/get-started.mdx:
    #   curl '<host>/run_code' -H 'Content-Type: application/json' \
    #     --data-raw '{"code": "print(\"Hello, world!\")", "language": "python"}'
    # Sample output:
    #   {"status": "Success", "message": "", "compile_result": null,
    #    "run_result": {"status": "Finished", "execution_time": 0.016735315322875977,
    #                   "return_code": 0, "stdout": "Hello, world!\n", "stderr": ""},
    #    "executor_pod_name": null, "files": {}}
    found = ran(server, {"code": 'print("Hello, world!")', "language": "python"})
    execution_time = found["run_result"].pop("execution_time")
    assert isinstance(execution_time, float) and execution_time >= 0
    assert found == {
        "status": "Success",
        "message": "",
        "compile_result": None,
        "run_result": {
            "status": "Finished",
            "return_code": 0,
            "stdout": "Hello, world!\n",
            "stderr": "",
        },
        "executor_pod_name": None,
        "files": {},
    }


def test_a_program_past_run_timeout_is_time_limit_exceeded(server: HttpServer) -> None:
    # SandboxFusion (sandbox/runners/base.py): past run_timeout the command is
    # CommandRunResult(status=TimeLimitExceeded) with no return code, and parse_run_status
    # makes the response "Failed" with an empty message.
    found = ran(
        server,
        {
            "code": 'print("started", flush=True)\nwhile True: pass',
            "language": "python",
            "run_timeout": 1,
        },
    )
    assert found["status"] == "Failed"
    assert found["message"] == ""
    assert found["run_result"]["status"] == "TimeLimitExceeded"
    assert found["run_result"]["return_code"] is None
    assert found["run_result"]["stdout"] == "started\n"


def test_a_runtime_error_is_finished_with_its_return_code_and_traceback(
    server: HttpServer,
) -> None:
    # As `python file.py`: the traceback on stderr, return code 1; a non-zero return
    # code makes the response "Failed" (parse_run_status).
    found = ran(server, {"code": "def f():\n    1 / 0\nf()\n", "language": "python"})
    assert found["status"] == "Failed"
    run = found["run_result"]
    assert (run["status"], run["return_code"]) == ("Finished", 1)
    assert run["stderr"].startswith("Traceback (most recent call last):\n")
    assert "ZeroDivisionError: division by zero" in run["stderr"]
    exited = ran(server, {"code": "import sys\nsys.exit(3)", "language": "python"})
    assert (exited["status"], exited["run_result"]["return_code"]) == ("Failed", 3)


def test_stdin_is_fed_to_the_program_as_verl_sends_it(server: HttpServer) -> None:
    # verl's sandbox_fusion utility (verl/utils/reward_score/sandbox_fusion/utils.py) posts
    # {"compile_timeout", "run_timeout", "code", "stdin", "language", "files": {},
    # "fetch_files": []} and compares run_result.stdout with the expected output.
    code = (
        "import subprocess, sys\n"
        "a, b = map(int, input().split())\n"
        "print(a + b)\n"
        "print(sys.stdin.read().strip().upper())\n"
        "if __name__ == '__main__':\n"
        "    print('main', __file__)\n"
    )
    body = {
        "compile_timeout": 10,
        "run_timeout": 10,
        "code": code,
        "stdin": "2 40\nrest of input\n",
        "language": "python",
        "files": {},
        "fetch_files": [],
    }
    found = ran(server, body)
    assert found["status"] == "Success", found
    assert found["run_result"]["stdout"] == "42\nREST OF INPUT\nmain /workspace/main.py\n"
    failing = ran(server, {**body, "code": "input()\nraise ValueError('bad')"})
    stderr = failing["run_result"]["stderr"]
    # Only the program's frames: none of the launcher that puts stdin in place.
    assert stderr.startswith('Traceback (most recent call last):\n  File "/workspace/main.py"')
    assert "runpy" not in stderr
    assert stderr.endswith("ValueError: bad\n")


def test_without_stdin_the_program_reads_end_of_file(server: HttpServer) -> None:
    # SandboxFusion closes the pipe at once when `stdin` is null: input() meets EOF.
    found = ran(server, {"code": "input()", "language": "python"})
    assert found["status"] == "Failed"
    assert "EOFError" in found["run_result"]["stderr"]


def test_files_uploaded_and_fetched_as_in_the_documentation(server: HttpServer) -> None:
    # docs/docs/docs/how-to/run-code/upload-download-files.mdx, "Upload": code
    # 'print(open("flag.txt").read())' with files {"flag.txt": base64 of the file}; the
    # output shown is "secret flag\n" (the file held "secret flag").
    flag = base64.b64encode(b"secret flag").decode()
    found = ran(
        server,
        {
            "code": 'print(open("flag.txt").read())',
            "language": "python",
            "files": {"flag.txt": flag},
        },
    )
    assert (found["status"], found["run_result"]["stdout"]) == ("Success", "secret flag\n")
    # "Download": code 'open("flag.txt", "w").write("this is a secret")' with
    # fetch_files ["flag.txt"] gives "files": {"flag.txt": "dGhpcyBpcyBhIHNlY3JldA=="}.
    found = ran(
        server,
        {
            "code": 'open("flag.txt", "w").write("this is a secret")',
            "language": "python",
            "fetch_files": ["flag.txt", "never-written.txt"],
        },
    )
    assert found["status"] == "Success"
    # A file the program did not write is left out, as SandboxFusion does.
    assert found["files"] == {"flag.txt": "dGhpcyBpcyBhIHNlY3JldA=="}


def test_an_upload_outside_the_working_directory_is_refused(server: HttpServer) -> None:
    found = ran(
        server,
        {"code": "1", "language": "python", "files": {"../escape.txt": "eA=="}},
    )
    assert found["status"] == "SandboxError"
    assert "../escape.txt" in found["message"] and found["run_result"] is None
    bad = ran(server, {"code": "1", "language": "python", "files": {"a.txt": "not base64!"}})
    assert (bad["status"], "not valid base64" in bad["message"]) == ("SandboxError", True)


def test_an_unsupported_language_gets_sandbox_fusions_error_shape(server: HttpServer) -> None:
    # The C++ example of get-started.mdx: SandboxFusion compiles and runs it; codecage runs
    # Python only and says so in SandboxFusion's error shape.
    code = '#include <iostream>\nint main() { std::cout << "Hello, world!" << std::endl; }\n'
    found = ran(server, {"code": code, "language": "cpp"})
    assert found["status"] == "SandboxError"
    assert 'language "cpp" is not supported' in found["message"]
    assert found["run_result"] is None and found["files"] == {}


def test_limits_over_the_servers_maximums_are_refused_in_the_requests_terms(
    server: HttpServer,
) -> None:
    found = ran(server, {"code": "1", "language": "python", "run_timeout": 121})
    assert found["status"] == "SandboxError"
    assert "run_timeout=121 is above this server's maximum of 120 s" in found["message"]
    found = ran(server, {"code": "1", "language": "python", "memory_limit_MB": 999_999})
    assert "memory_limit_MB=999999 is above" in found["message"]


def test_a_program_over_memory_limit_mb_fails_with_its_signal(server: HttpServer) -> None:
    code = "x = bytearray(400 * 2**20)\nprint('survived')"
    found = ran(server, {"code": code, "language": "python", "memory_limit_MB": 64})
    assert found["status"] == "Failed"
    assert found["run_result"]["status"] == "Finished"
    assert found["run_result"]["return_code"] not in (0, None)
    assert found["run_result"]["stdout"] == ""


def test_a_malformed_request_gets_fastapis_422(server: HttpServer) -> None:
    response = post(server, {"language": "python"})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "code"]


def test_without_the_token_run_code_is_refused_with_401(server: HttpServer) -> None:
    body = {"code": 'print("Hello, world!")', "language": "python"}
    assert post(server, body, headers={}).status_code == 401
    assert post(server, body, headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_an_oversized_body_or_stdin_is_refused(server: HttpServer) -> None:
    code = "print(1)\n# " + "x" * (33 * 1024 * 1024)
    assert post(server, {"code": code, "language": "python"}).status_code == 413
    stdin = "x" * (16 * 1024 * 1024 + 1)
    response = post(server, {"code": "1", "language": "python", "stdin": stdin})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "stdin"]
