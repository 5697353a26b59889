"""Hostile file names and file types coming back from a sandbox (issue 25).

Code chooses the names and kinds of what it leaves in /workspace: line breaks, terminal
escapes, C1 and bidi controls, bytes that are not UTF-8, 255-byte names, deep trees, and
links (to host files, up the tree, in loops), hard links, FIFOs and sockets. The host lists
them (`engine.workspace.listing`), keeps and saves them (`kept.py`), reads the ones the
model asks for (`mcp.files.files_back`) and summarises them for the model
(`mcp.reply.summary`). Property: nothing is written outside the destination, no link is
followed, every name is neutralised where it is shown, and nothing raises.

Made in a real sandbox on every backend, and (for breadth) by hypothesis on a host
directory read by the same functions.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp_types import ImageContent, TextContent

from codecage.engine import workspace as workspaces
from codecage.engine.workspace import fds
from codecage.errors import ConfigError
from codecage.mcp import reply
from codecage.mcp.files import files_back
from codecage.models import ExecutionResult, FileInfo

from ._fuzz_host import BACKENDS, BackendSandboxes, backend_sandboxes

# What must never reach a one-line field: C0, DEL, C1, bidi, the Unicode line separators.
UNSAFE_IN_LINE = re.compile(
    r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2028\u2029\u2066-\u2069]"
)
HOST_SECRET = "root:x:0:0"  # noqa: S105 (the first line of any /etc/passwd)

HOSTILE_NAMES: list[bytes] = [
    b"plain.txt",
    b"a\nstatus: ok.txt",
    b"\x1b]52;c;aGFja2Vk\x07clip.txt",
    b"\x1b[2J\x1b[Hclear.txt",
    b"\xc2\x9b2Jc1.txt",
    "bidi\u202egnp.txt".encode(),
    "line\u2028sep.txt".encode(),
    b"\xff\xfe-not-utf8.txt",
    b"\r\x85\t.txt",
    b"-rf",
    b"...",
    b" ",
    b"x" * 255,
    b"a\\x1b",
    b"a\x1b",  # shown the same as the name above
]
LINKS: dict[bytes, str] = {
    b"link-passwd": "/etc/passwd",
    b"link-up": "../../../../../../etc/passwd",
    b"link-root": "/",
    b"loop": "loop",
    b"link-dev-null": "/dev/null",
}

MAKE_FILES = r"""
import os, socket
names = {names!r}
for i, name in enumerate(names):
    with open(name, "wb") as f:
        f.write(b"content %d" % i)
for depth, word in (({depth}, b"deep"), (200, b"too deep")):
    os.makedirs(b"/".join([b"d"] * depth), exist_ok=True)
    with open(b"/".join([b"d"] * depth) + b"/deep\n.txt", "wb") as f:
        f.write(word)
for name, target in {links!r}.items():
    os.symlink(target, name)
os.link(names[0], b"hard")
os.mkfifo(b"fifo\n")
try:
    s = socket.socket(socket.AF_UNIX)
    s.bind("sock")
except OSError:
    pass
print("made")
"""


@pytest.fixture(scope="module")
def sandboxes() -> Iterator[BackendSandboxes]:
    yield from backend_sandboxes()


def _content_of(result: ExecutionResult, info: FileInfo) -> bytes:
    return result.read_file(info.path)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hostile_names_and_kinds_from_a_sandbox_come_back_neutralised_and_contained(
    sandboxes: BackendSandboxes, backend: str, tmp_path: Path
) -> None:
    asked = ["link-passwd", "link-up", "../../etc/passwd", "/etc/passwd", "fifo\\n", "loop"]
    seen: dict[str, object] = {}

    def on_files(workdir: Path, files: list[FileInfo]) -> None:
        # What `execute_code` does while the workspace exists: every listed name asked for
        # as listed, and names that lead out of it.
        blocks, _ = files_back(workdir, files, [f.path for f in files] + asked, None)
        seen["blocks"] = blocks

    code = MAKE_FILES.format(names=HOSTILE_NAMES, links=LINKS, depth=fds.MAX_DEPTH - 1)
    result = sandboxes.get(backend).run(code, on_files=on_files, limits={"timeout": 60})
    assert result.status == "ok", result
    listed = {f.path for f in result.files}
    # Only regular files are listed: the links, the FIFO and the socket are not; past
    # the depth bound nothing is, and the result says the listing is incomplete.
    assert len(result.files) == len(HOSTILE_NAMES) + 2  # and the hard link, the deep file
    assert [e for e in result.events if e.kind == "files_truncated"]
    assert not any(UNSAFE_IN_LINE.search(path) for path in listed)
    assert not {"link-passwd", "link-up", "link-root", "loop", "sock"} & listed
    # Each listed file reads back as what the code wrote (the two names shown alike
    # are refused, not guessed).
    contents = []
    for info in result.files:
        try:
            contents.append(_content_of(result, info))
        except ConfigError as exc:
            assert "2 files" in str(exc) or "a\\x1b" in info.path, exc
    assert b"content 0" in contents and b"deep" in contents and b"too deep" not in contents
    for name in ("link-passwd", "link-up", "loop", "../etc/passwd"):
        with pytest.raises(ConfigError):
            result.read_file(name)
    # What the model reads: every name one line, nothing of the host behind a link.
    blocks = seen["blocks"]
    assert isinstance(blocks, list)
    texts = [b.text for b in blocks if isinstance(b, TextContent)]
    assert not [b for b in blocks if isinstance(b, ImageContent)]
    assert all(HOST_SECRET not in text for text in texts)
    assert all(not UNSAFE_IN_LINE.search(text.split("\n", 1)[0]) for text in texts)
    summary = reply.summary(result)
    assert [line for line in summary.splitlines() if line.startswith("status:")] == [
        line for line in summary.splitlines() if line.startswith("status: ok")
    ][:1]
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", summary)
    _saved_only_inside(result, tmp_path)


def _saved_only_inside(result: ExecutionResult, tmp_path: Path) -> None:
    """`save_files` writes each kept file under the destination, as a regular file; a
    link planted in the destination under a file's name is not followed."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "plain.txt").symlink_to(victim)
    with pytest.raises(ConfigError):
        result.save_files(dest, partial=True)  # plain.txt exists (as a link): refused
    try:
        saved = result.save_files(dest, overwrite=True, partial=True)
    except ConfigError as exc:  # refusing the link is as good as replacing it
        assert "link" in str(exc) or "plain.txt" in str(exc), exc
        saved = []
    assert victim.read_bytes() == b"untouched"
    root = dest.resolve()
    for path in saved:
        assert path.resolve().is_relative_to(root)
        assert stat.S_ISREG(os.lstat(path).st_mode)
    outside = {p for p in tmp_path.iterdir()} - {dest, victim}
    assert not outside, outside


# --- breadth: any names, on a host directory read by the same functions -------------------

names = st.binary(min_size=1, max_size=255).filter(
    lambda n: b"/" not in n and b"\x00" not in n and n not in (b".", b"..")
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(picked=st.lists(names, min_size=1, max_size=8, unique=True))
def test_any_file_names_are_listed_on_one_line_and_read_back_by_their_real_names(
    tmp_path_factory: pytest.TempPathFactory, picked: list[bytes]
) -> None:
    workdir = tmp_path_factory.mktemp("names")
    for i, name in enumerate(picked):
        with open(os.path.join(os.fsencode(workdir), name), "wb") as handle:
            handle.write(b"%d" % i)
    files, truncated = workspaces.list_files(workdir)
    assert not truncated and len(files) == len(picked)
    assert not any(UNSAFE_IN_LINE.search(f.path) for f in files)
    shown = [f.path for f in files]
    blocks, _ = files_back(workdir, files, shown, None)
    texts = [b.text for b in blocks if isinstance(b, TextContent)]
    assert len(texts) == len(shown)
    for text in texts:
        head = text.split("\n", 1)[0]
        assert not UNSAFE_IN_LINE.search(head)
    unique = [f for f in files if shown.count(f.path) == 1]
    for info in unique:
        data = workspaces.read_file(workdir, info.raw_path(), max_bytes=64)
        assert data == b"%d" % picked.index(os.fsencode(info.raw_path()))
