"""Output that streams: `on_output` in the engine and the library, the CLI's live output,
and MCP progress and log notifications while a run lasts.

Ordering is checked by events, never by timing: a callback that cancels the run at the
first text proves that text came while the run was going (the program's second line never
comes); a CLI that is still running when its first line is read printed it live.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp_types import LoggingMessageNotificationParams, TextContent

from codecage import Options, Sandbox
from codecage.engine.stream import OutputStream
from codecage.mcp.progress import MAX_LOG_LINES
from codecage.policy.scrub import Scrubber

CODECAGE = str(Path(sys.executable).with_name("codecage"))


class Chunks:
    """What a callback received, in order; `wait_for` blocks (bounded) until a text came."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []
        self.threads: set[str] = set()
        self._changed = threading.Condition()

    def __call__(self, stream: str, text: str) -> None:
        with self._changed:
            self.items.append((stream, text))
            self.threads.add(threading.current_thread().name)
            self._changed.notify_all()

    def text(self, stream: str = "stdout") -> str:
        return "".join(t for s, t in self.items if s == stream)

    def wait_for(self, needle: str, timeout: float = 30) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: needle in self.text(), timeout)


def scrub_text(text: str, cut: bool) -> str:
    return Scrubber().scrub(text, truncated=cut).text


# --- the engine's stream, alone --------------------------------------------------------


def test_a_character_split_across_two_reads_arrives_whole() -> None:
    got = Chunks()
    stream = OutputStream(got, cap_bytes=1024)
    stream.feed("stdout", "é".encode()[:1])
    stream.feed("stdout", "é\n".encode()[1:])
    stream.close()
    assert got.text() == "é\n"
    assert all("\\x" not in t and "\ufffd" not in t for _, t in got.items)


def test_an_invalid_byte_shows_as_an_escape() -> None:
    got = Chunks()
    stream = OutputStream(got, cap_bytes=1024)
    stream.feed("stderr", b"a\xffb\n")
    stream.close()
    assert got.text("stderr") == "a\\xffb\n"


def test_past_the_cap_nothing_more_is_streamed_and_it_is_said_once() -> None:
    got = Chunks()
    stream = OutputStream(got, cap_bytes=1024)
    for _ in range(10):
        stream.feed("stdout", b"x" * 500)
    stream.feed("stderr", b"still streamed\n")
    stream.close()
    out = got.text()
    streamed, _ = out.split("\n[codecage: ")
    assert streamed == "x" * 1024
    assert out.count("max_output_bytes") == 1
    assert out.endswith("the result keeps its tail too]\n")
    assert got.text("stderr") == "still streamed\n"


def test_a_raising_callback_is_called_once_and_not_again() -> None:
    calls: list[str] = []

    def broken(stream: str, text: str) -> None:
        calls.append(text)
        raise RuntimeError("the caller's bug")

    stream = OutputStream(broken, cap_bytes=1024)
    stream.feed("stdout", b"one\n")
    stream.feed("stdout", b"two\n")
    stream.close()
    assert len(calls) == 1


def test_a_callback_still_busy_after_the_run_is_left_behind() -> None:
    release = threading.Event()
    calls: list[str] = []

    def stuck(stream: str, text: str) -> None:
        calls.append(text)
        release.wait(30)

    stream = OutputStream(stuck, cap_bytes=1024, scrub=scrub_text)
    stream.feed("stdout", b"one\n")
    stream.feed("stdout", b"two\n")
    stream.close(drain_s=0.1)  # returns although the callback has not
    release.set()
    assert calls[:1] == ["one\n"]
    assert "two\n" not in calls


def test_scrubbing_waits_for_the_end_of_the_line() -> None:
    got = Chunks()
    stream = OutputStream(got, cap_bytes=4096, scrub=scrub_text)
    stream.feed("stdout", b"mail alice@exa")
    stream.feed("stdout", b"mple.com now\n")
    stream.close()
    assert got.text() == "mail [EMAIL] now\n"


def test_an_unfinished_line_is_flushed_scrubbed_without_waiting_for_the_run_end() -> None:
    got = Chunks()
    stream = OutputStream(got, cap_bytes=4096, scrub=scrub_text)
    stream.feed("stdout", b"progress 50% for bob@example.org")
    try:
        assert got.wait_for("progress 50%")  # flushed by the timer: close() not called yet
    finally:
        stream.close()
    assert "bob@" not in got.text()


# --- the library, with real sandboxes --------------------------------------------------


@pytest.fixture(scope="module")
def scrubbing() -> Iterator[Sandbox]:
    """A Sandbox that scrubs results (the session's `sandbox` does not)."""
    with Sandbox(pool=False, options=Options(import_policy=False, scrub=True)) as sandbox:
        yield sandbox


def test_the_first_text_arrives_while_the_run_is_still_going(sandbox: Sandbox) -> None:
    cancel = threading.Event()
    got = Chunks()

    def on_output(stream: str, text: str) -> None:
        got(stream, text)
        if "first" in text:
            cancel.set()  # only a chunk seen mid-run can stop the second line

    code = "import time\nprint('first')\ntime.sleep(2)\nprint('second')\n"
    result = sandbox.run(code, cancel=cancel, on_output=on_output)
    assert got.items[0] == ("stdout", "first\n")
    assert result.status == "killed"
    assert "second" not in result.stdout
    assert got.threads == {"codecage-output"}


def test_every_chunk_is_delivered_before_run_returns(sandbox: Sandbox) -> None:
    got = Chunks()
    code = "import sys\nfor i in range(200):\n    print(i)\nprint('oops', file=sys.stderr)"
    result = sandbox.run(code, on_output=got)
    assert got.text() == result.stdout == "".join(f"{i}\n" for i in range(200))
    assert got.text("stderr") == "oops\n"


def test_a_character_written_in_two_halves_is_streamed_whole(sandbox: Sandbox) -> None:
    got = Chunks()
    code = (
        "import sys, time\n"
        "sys.stdout.buffer.write(b'\\xc3'); sys.stdout.buffer.flush()\n"
        "time.sleep(0.3)\n"
        "sys.stdout.buffer.write(b'\\xa9\\n'); sys.stdout.buffer.flush()\n"
    )
    result = sandbox.run(code, on_output=got)
    assert result.status == "ok"
    assert got.text() == "é\n"
    assert all("\\x" not in t for _, t in got.items)


def test_streaming_stops_at_the_output_cap(sandbox: Sandbox) -> None:
    got = Chunks()
    result = sandbox.run(
        "print('x' * 5000)\nprint('y' * 5000)",
        limits={"max_output_bytes": 1024},
        on_output=got,
    )
    assert result.stdout_truncated
    streamed, marker = got.text().split("\n[codecage: ")
    # What is streamed is the head the result keeps (half the cap), no more.
    assert streamed == "x" * 512
    assert result.stdout.startswith(streamed)
    assert "max_output_bytes" in marker


def test_a_raising_callback_does_not_break_the_run(sandbox: Sandbox) -> None:
    calls: list[str] = []

    def broken(stream: str, text: str) -> None:
        calls.append(text)
        raise ValueError("the caller's bug")

    code = "import time\nprint('a', flush=True)\ntime.sleep(0.3)\nprint('b')\n'done'"
    result = sandbox.run(code, on_output=broken)
    assert result.status == "ok"
    assert result.return_value == "done"
    assert result.stdout == "a\nb\n"
    assert calls == ["a\n"]


def test_an_email_printed_in_two_halves_is_scrubbed_in_the_stream(scrubbing: Sandbox) -> None:
    got = Chunks()
    code = (
        "import time\n"
        "print('contact: alice.smith@exa', end='', flush=True)\n"
        "time.sleep(0.2)\n"
        "print('mple.com, thanks')\n"
    )
    result = scrubbing.run(code, on_output=got)
    assert "alice" not in got.text()
    assert "[EMAIL]" in got.text()
    assert "alice" not in result.stdout


def test_arun_awaits_a_coroutine_handler_on_the_callers_loop(sandbox: Sandbox) -> None:
    seen: list[tuple[str, bool]] = []

    async def main() -> Any:
        loop_thread = threading.get_ident()

        async def on_output(stream: str, text: str) -> None:
            await asyncio.sleep(0)
            seen.append((text, threading.get_ident() == loop_thread))

        return await sandbox.arun("for i in range(3):\n    print(i)", on_output=on_output)

    result = asyncio.run(main())
    assert result.status == "ok"
    assert "".join(text for text, _ in seen) == "0\n1\n2\n"
    assert all(on_loop for _, on_loop in seen)


# --- the CLI ----------------------------------------------------------------------------


def test_the_cli_prints_the_output_live_and_only_once(tmp_path: Path) -> None:
    """The program waits for a file that the test writes only once it has read the first
    line: printed at the end instead, the run would time out without its second line."""
    code = (
        "import os, time\n"
        "print('first')\n"
        "while not os.path.exists('/workspace/go'):\n"
        "    time.sleep(0.05)\n"
        "print('second')\n"
    )
    command = [CODECAGE, "run", "--no-scrub", "--timeout", "60", "--workspace", str(tmp_path)]
    with subprocess.Popen(
        [*command, "--code", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        (tmp_path / "go").write_text("")
        rest, errors = proc.communicate(timeout=120)
    assert first == "first\n"
    assert rest == "second\n"  # and not "first" a second time
    assert proc.returncode == 0, errors
    assert "codecage: ok" in errors


def test_the_cli_neutralises_live_output_for_a_terminal_unless_raw() -> None:
    code = "print('red\\x1b[31m')"
    shown = subprocess.run(
        [CODECAGE, "run", "--code", code], capture_output=True, text=True, timeout=120
    )
    raw = subprocess.run(
        [CODECAGE, "run", "--raw", "--code", code], capture_output=True, text=True, timeout=120
    )
    assert shown.stdout == "red\\x1b[31m\n"
    assert raw.stdout == "red\x1b[31m\n"


def test_the_cli_json_mode_prints_one_object_and_nothing_live() -> None:
    done = subprocess.run(
        [CODECAGE, "run", "--json", "--code", "print('first')"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    data = json.loads(done.stdout)  # exactly one object: anything live would break this
    assert data["stdout"] == "first\n"


# --- MCP --------------------------------------------------------------------------------


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def serve_params(workdir: Path) -> StdioServerParameters:
    env = {k: v for k, v in os.environ.items() if k == "PYTHONPATH"}
    return StdioServerParameters(command=CODECAGE, args=["serve"], cwd=str(workdir), env=env)


async def call_with_notifications(
    workdir: Path, code: str, *, progress: bool
) -> tuple[str, list[tuple[float, str | None]], list[str]]:
    """Run `code` with execute_code over stdio; the reply's text, the progress
    notifications (progress, message) and the log messages' data received meanwhile."""
    progressed: list[tuple[float, str | None]] = []
    logged: list[str] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progressed.append((value, message))

    async def on_log(params: LoggingMessageNotificationParams) -> None:
        assert params.level == "info"
        logged.append(str(params.data))

    with (workdir / "stderr.log").open("w", encoding="utf-8") as errlog:
        async with Client(
            stdio_client(serve_params(workdir), errlog=errlog),
            logging_callback=on_log,
            log_level="info",
            read_timeout_seconds=60,
        ) as client:
            result = await client.call_tool(
                "execute_code",
                {"code": code},
                progress_callback=on_progress if progress else None,
            )
    text = "\n".join(b.text for b in result.content if isinstance(b, TextContent))
    return text, progressed, logged


SLOW_PRINTER = (
    "import time\n"
    "for i in range(5):\n"
    "    print(f'step {i} of bob@example.com')\n"
    "    time.sleep(0.5)\n"
)


@pytest.mark.anyio
async def test_mcp_sends_progress_and_log_messages_during_a_long_run(tmp_path: Path) -> None:
    text, progressed, logged = await call_with_notifications(tmp_path, SLOW_PRINTER, progress=True)
    assert "step 4 of [EMAIL]" in text  # the reply as before
    assert progressed, "no progress notification during a 2.5 s run"
    values = [value for value, _ in progressed]
    assert values == sorted(values) and values[0] >= 1
    messages = [m for _, m in progressed if m]
    assert messages and all(m.startswith("step ") for m in messages)
    lines = "\n".join(logged).splitlines()
    assert "step 0 of [EMAIL]" in lines
    assert not any("bob@" in m for m in [*messages, *lines])


@pytest.mark.anyio
async def test_mcp_sends_nothing_while_running_when_no_progress_was_asked(tmp_path: Path) -> None:
    text, progressed, logged = await call_with_notifications(tmp_path, SLOW_PRINTER, progress=False)
    assert "step 4" in text
    assert progressed == [] and logged == []


@pytest.mark.anyio
async def test_a_chatty_program_does_not_flood_the_client(tmp_path: Path) -> None:
    code = "import time\nfor i in range(30000):\n    print(i)\n    if i % 1000 == 0:\n"
    code += "        time.sleep(0.1)"
    _, _, logged = await call_with_notifications(tmp_path, code, progress=True)
    assert logged
    assert all(len(m.splitlines()) <= MAX_LOG_LINES + 1 for m in logged)
    assert any("not sent" in m for m in logged)
