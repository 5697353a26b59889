"""`codecage session open | run | list | close`: the CLI as a client of a real
`codecage serve --http --token T` (a subprocess on a free loopback port), each command a
real `codecage` process, as a user types them one after another."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests._cli import codecage

from test_server import TOKEN, HttpServer, free_port, serving_http

SESSION_ID = re.compile(r"ses_[A-Za-z0-9_-]+")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    with serving_http(tmp_path_factory.mktemp("serve-session"), "--token", TOKEN) as running:
        yield running


def cli_env(**extra: str) -> dict[str, str]:
    """This environment without any CODECAGE_* setting, plus `extra`."""
    return {k: v for k, v in os.environ.items() if not k.startswith("CODECAGE_")} | extra


def session(
    server: HttpServer, *args: str, token: str | None = TOKEN, stdin: str | None = None
) -> tuple[int, str, str]:
    """`codecage session ARGS` against `server`, its URL and token given by environment."""
    env = cli_env(CODECAGE_SERVER=server.url, **({"CODECAGE_TOKEN": token} if token else {}))
    done = codecage("session", *args, env=env, stdin=stdin)
    return done.returncode, done.stdout, done.stderr


def opened(server: HttpServer, *args: str) -> str:
    code, out, err = session(server, "open", *args)
    assert code == 0, err
    assert SESSION_ID.fullmatch(out.strip()), out  # the id alone on stdout: ID=$(...)
    return out.strip()


def test_a_session_keeps_state_from_one_command_to_the_next_until_it_is_closed(
    server: HttpServer,
) -> None:
    sid = opened(server)

    code, out, err = session(server, "run", sid, "--code", "x = 42")
    assert code == 0, err
    assert "codecage: ok" in err

    code, out, err = session(server, "run", sid, "--code", "x + 1")
    assert code == 0, err
    assert "43" in out
    assert f"session {sid}" in err  # the summary names the session

    code, out, err = session(server, "run", sid, "--code", "x * 2", "--json")
    assert code == 0, err
    result = json.loads(out)  # one JSON object, nothing else
    assert result["return_value"] == 84
    assert result["session_id"] == sid
    assert "84" in result["text"]

    code, out, err = session(server, "list")
    assert code == 0, err
    assert sid in out
    code, out, err = session(server, "list", "--json")
    listed = json.loads(out)["sessions"]
    assert [s["runs"] for s in listed if s["session_id"] == sid] == [3]

    code, out, err = session(server, "close", sid)
    assert code == 0, err

    code, out, err = session(server, "run", sid, "--code", "x")
    assert code == 1
    assert f"Error: session {sid} has ended" in err
    assert "codecage session open" in err  # what to do, in the CLI's words
    assert "Traceback" not in err
    code, out, err = session(server, "list")
    assert sid not in out


def test_code_that_fails_exits_1_with_its_traceback_and_the_session_goes_on(
    server: HttpServer,
) -> None:
    sid = opened(server)
    code, out, err = session(server, "run", sid, "--code", "y = 1\ndef f(:\n    pass")
    assert code == 1
    assert "SyntaxError" in out
    assert "codecage: error" in err
    code, out, err = session(server, "run", sid, "-", stdin="z = 5\n1 / 0")
    assert code == 1
    assert "ZeroDivisionError" in out
    code, out, err = session(server, "run", sid, "--code", "z")  # defined before the error
    assert code == 0, err
    assert "5" in out
    session(server, "close", sid)


def test_no_code_or_two_ways_of_giving_it_is_a_usage_error(server: HttpServer) -> None:
    for args in ([], ["--code", "1", "-"]):
        code, out, err = session(server, "run", "ses_whatever", *args)
        assert code == 2
        assert "give the code exactly one way" in err
        assert out == ""


def test_input_files_stay_in_the_session_workspace_for_later_runs(
    server: HttpServer, tmp_path: Path
) -> None:
    (tmp_path / "sales.csv").write_text("region,total\nnorth,3\nsouth,4\n", encoding="utf-8")
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)))
    sid = opened(server)
    code, out, err = session(
        server,
        "run",
        sid,
        "--in",
        str(tmp_path / "sales.csv"),
        "--in",
        f"{tmp_path / 'blob.bin'}:raw.bin",
        "--code",
        "pass",
    )
    assert code == 0, err
    read = "import csv, pathlib\n"
    read += "rows = list(csv.DictReader(open('sales.csv')))\n"
    read += "sum(int(r['total']) for r in rows), pathlib.Path('raw.bin').read_bytes() == "
    read += "bytes(range(256))"
    code, out, err = session(server, "run", sid, "--code", read, "--json")
    assert code == 0, err
    assert json.loads(out)["return_value"] == [7, True]
    session(server, "close", sid)


def test_an_unknown_session_is_an_error_that_says_how_to_get_one(server: HttpServer) -> None:
    code, out, err = session(server, "run", "ses_nosuchsession", "--code", "1")
    assert code == 1
    assert "no session ses_nosuchsession is open" in err
    assert "codecage session open" in err
    assert "Traceback" not in err
    code, out, err = session(server, "close", "ses_nosuchsession", "--json")
    assert code == 1
    assert json.loads(out)["error"]["type"] == "SessionError"


def test_sessions_belong_to_the_token_not_to_one_command(server: HttpServer) -> None:
    # Same server, same token: every command is a new connection and sees the session.
    sid = opened(server)
    env = cli_env()
    done = codecage("session", "list", "--server", server.url, "--token", TOKEN, "--json", env=env)
    assert sid in [s["session_id"] for s in json.loads(done.stdout)["sessions"]]
    session(server, "close", sid)


@pytest.mark.parametrize("token", ["wrong", None], ids=["wrong", "missing"])
def test_a_wrong_or_missing_token_is_refused_with_a_hint_naming_the_flag(
    server: HttpServer, token: str | None
) -> None:
    code, out, err = session(server, "open", token=token)
    assert code == 2
    assert out == ""
    assert "(HTTP 401)" in err
    assert "--token" in err
    assert "Traceback" not in err


def test_no_server_listening_is_a_clear_error_naming_how_to_start_one() -> None:
    url = f"http://127.0.0.1:{free_port()}/mcp"  # nothing listens there
    for args in (["open"], ["list", "--json"], ["run", "ses_x", "--code", "1"]):
        done = codecage("session", *args, "--server", url, "--token", TOKEN, env=cli_env())
        assert done.returncode == 1
        assert f"no codecage server answers at {url}" in done.stderr
        assert "codecage serve --http" in done.stderr
        assert "--server" in done.stderr
        assert "Traceback" not in done.stderr
        if "--json" in args:  # the error as one JSON object
            assert "codecage serve --http" in json.loads(done.stdout)["error"]["hint"]


def test_a_server_url_that_is_no_url_is_a_usage_error() -> None:
    done = codecage("session", "list", "--server", "localhost:8000", env=cli_env())
    assert done.returncode == 2
    assert "is not an http:// or https:// URL" in done.stderr


def test_a_host_outside_what_the_server_permits_is_refused_in_the_cli_s_words(
    server: HttpServer,
) -> None:
    code, out, err = session(server, "open", "--allow-host", "elsewhere.test")
    assert code != 0 and out == ""
    assert "--allow-host" in err and "allow_hosts" not in err, err
    assert "elsewhere.test" in err
