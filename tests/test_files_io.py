"""Files in and out everywhere (issue 21 item 3): `result.read_file` / `save_files` in the
library, `--in` / `--out` in the CLI, binary `return_files` as embedded resources over MCP,
and the operator's read-only data directory at /data (bwrap and gVisor)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from mcp import Client
from mcp_types import BlobResourceContents, EmbeddedResource, TextContent
from tests._anyio import anyio_backend  # noqa: F401 - a fixture
from tests._cli import codecage, serve_configured

from codecage import Options, Sandbox
from codecage.errors import ConfigError
from codecage.models import ExecutionResult

pytestmark = pytest.mark.timeout(180)

_WRITES = """
import os
os.makedirs("out", exist_ok=True)
open("out/report.csv", "w").write("a,b\\n1,2\\n")
open("blob.bin", "wb").write(bytes(range(256)) * 4)
os.symlink("/etc/passwd", "link")
"""


@pytest.fixture(scope="module")
def lib() -> Iterator[Sandbox]:
    with Sandbox(pool=False, options=Options(scrub=False)) as sb:
        yield sb


@pytest.fixture(scope="module")
def written(lib: Sandbox) -> ExecutionResult:
    result = lib.run(_WRITES)
    assert result.status == "ok", result.error
    return result


# --- library --------------------------------------------------------------------------------


def test_read_file_gives_the_bytes_the_code_wrote_after_the_workspace_is_gone(
    written: ExecutionResult,
) -> None:
    assert written.read_file("out/report.csv") == b"a,b\n1,2\n"
    assert written.read_file("blob.bin") == bytes(range(256)) * 4


@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("../etc/passwd", "'..'"),
        ("/etc/passwd", "absolute"),
        ("out/\x00x", "NUL"),
        ("", "empty"),
        ("nope.txt", "no file"),
        ("link", "no file"),  # a symlink is not listed, nor kept: never followed
    ],
)
def test_read_file_refuses_bad_or_unknown_paths_clearly(
    written: ExecutionResult, path: str, said: str
) -> None:
    with pytest.raises(ConfigError, match=said) as caught:
        written.read_file(path)
    assert caught.value.hint


def test_the_kept_bytes_stay_out_of_the_json(written: ExecutionResult) -> None:
    dumped = written.model_dump_json()
    assert "_kept" not in dumped
    assert base64.b64encode(bytes(range(256))).decode() not in dumped
    again = ExecutionResult.model_validate_json(dumped)
    with pytest.raises(ConfigError, match="holds no files"):
        again.read_file("out/report.csv")


def test_a_file_over_keep_files_mb_is_listed_not_kept_and_says_what_to_do(lib: Sandbox) -> None:
    result = lib.run(
        "open('big.bin', 'wb').write(b'x' * (2 * 2**20)); open('small', 'w').write('s')",
        keep_files_mb=1,
    )
    assert "big.bin" in [f.path for f in result.files]
    assert result.read_file("small") == b"s"
    with pytest.raises(ConfigError, match="not kept") as caught:
        result.read_file("big.bin")
    assert "keep_files_mb" in caught.value.hint


def test_save_files_writes_them_and_refuses_to_overwrite_unless_asked(
    written: ExecutionResult, tmp_path: Path
) -> None:
    target = tmp_path / "new" / "dir"
    paths = written.save_files(target)
    assert sorted(p.relative_to(target).as_posix() for p in paths) == ["blob.bin", "out/report.csv"]
    assert (target / "out" / "report.csv").read_bytes() == b"a,b\n1,2\n"
    assert not (target / "link").exists()
    with pytest.raises(ConfigError, match="exists already"):
        written.save_files(target)
    (target / "blob.bin").write_bytes(b"old")
    written.save_files(target, overwrite=True)
    assert (target / "blob.bin").read_bytes() == bytes(range(256)) * 4


def test_save_files_never_writes_through_a_symlink_in_the_destination(
    written: ExecutionResult, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "out").symlink_to(victim)  # a directory on the way is a link
    with pytest.raises(ConfigError, match="never followed"):
        written.save_files(dest, partial=True)
    assert list(victim.iterdir()) == []
    linked = tmp_path / "linked"
    linked.symlink_to(victim)  # the destination itself is a link
    with pytest.raises(ConfigError, match="symlink"):
        written.save_files(linked)
    assert list(victim.iterdir()) == []


def test_save_files_with_overwrite_replaces_a_link_not_its_target(
    written: ExecutionResult, tmp_path: Path
) -> None:
    target = tmp_path / "target.txt"
    target.write_text("keep me", encoding="utf-8")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "blob.bin").symlink_to(target)
    written.save_files(dest, overwrite=True)
    assert target.read_text(encoding="utf-8") == "keep me"
    assert not (dest / "blob.bin").is_symlink()


def test_a_callers_on_files_is_called_too(lib: Sandbox) -> None:
    seen: list[str] = []
    result = lib.run(
        "open('x.txt', 'w').write('x')",
        on_files=lambda _ws, files: seen.extend(f.path for f in files),
    )
    assert seen == ["x.txt"]
    assert result.read_file("x.txt") == b"x"


# --- CLI ------------------------------------------------------------------------------------


def test_cli_in_puts_host_files_in_the_workspace_and_out_writes_them_back(
    tmp_path: Path,
) -> None:
    (tmp_path / "sales.csv").write_text("n\n1\n2\n", encoding="utf-8")
    out = tmp_path / "results"
    ran = codecage(
        "run",
        "--in",
        "sales.csv",
        "--in",
        "sales.csv:input/copy.csv",
        "--out",
        str(out),
        "--code",
        "n = sum(int(x) for x in open('input/copy.csv').read().split()[1:]);"
        "open('total.txt', 'w').write(str(n)); n",
        cwd=tmp_path,
    )
    assert ran.returncode == 0, ran.stderr
    assert (out / "total.txt").read_text(encoding="utf-8") == "3"
    assert (out / "input" / "copy.csv").read_text(encoding="utf-8") == "n\n1\n2\n"
    assert f"saved {out / 'total.txt'}" in ran.stderr


def test_cli_out_with_json_prints_only_the_result_object(tmp_path: Path) -> None:
    out = tmp_path / "o"
    ran = codecage("run", "--out", str(out), "--json", "--code", "open('a', 'w').write('1')")
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["files"][0]["path"] == "a"
    assert (out / "a").read_text(encoding="utf-8") == "1"


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("missing.csv", "No such file"),
        (".", "not a regular file"),
        ("data.csv:../up.csv", "'..'"),
        ("data.csv:/abs.csv", "absolute"),
    ],
)
def test_cli_in_refuses_bad_inputs_with_exit_2(tmp_path: Path, spec: str, said: str) -> None:
    (tmp_path / "data.csv").write_text("x", encoding="utf-8")
    ran = codecage("run", "--in", spec, "--code", "1", cwd=tmp_path)
    assert ran.returncode == 2
    assert said in ran.stderr and "Hint:" in ran.stderr


def test_cli_in_over_the_workspace_size_is_refused(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(b"x" * (2 * 2**20))
    ran = codecage("run", "--workspace-mb", "1", "--in", "big", "--code", "1", cwd=tmp_path)
    assert ran.returncode == 2
    assert "--workspace-mb" in ran.stderr


def test_cli_in_with_workspace_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x", encoding="utf-8")
    ws = tmp_path / "ws"
    ws.mkdir()
    ran = codecage("run", "--in", "f", "--workspace", str(ws), "--code", "1", cwd=tmp_path)
    assert ran.returncode == 2
    assert "--in and --workspace" in ran.stderr


# --- the data directory ---------------------------------------------------------------------

_READS_DATA = """
out = {"hello": open("/data/hello.txt").read()}
for name in ("shadow", "up"):
    try:
        out[name] = open("/data/" + name).read()
    except OSError as exc:
        out[name] = type(exc).__name__
try:
    open("/data/new.txt", "w")
    out["write"] = "written"
except OSError as exc:
    out["write"] = type(exc).__name__
out
"""


@pytest.fixture(scope="module")
def data_dir() -> Iterator[Path]:
    # Not under pytest's 0700 temp dir: the sandbox's host id must be able to read it.
    root = Path(tempfile.mkdtemp(prefix="codecage-test-data-", dir="/var/tmp"))
    root.chmod(0o755)
    (root / "hello.txt").write_text("hello data", encoding="utf-8")
    (root / "hello.txt").chmod(0o644)
    (root / "shadow").symlink_to("/etc/shadow")
    (root / "up").symlink_to("../../../../../../../../etc/shadow")
    yield root
    shutil.rmtree(root)


def _gvisor_usable() -> bool:
    return shutil.which("runsc") is not None and os.geteuid() == 0


@pytest.mark.parametrize(
    "backend",
    [
        "bwrap",
        pytest.param(
            "gvisor",
            marks=[
                pytest.mark.gvisor,
                pytest.mark.skipif(not _gvisor_usable(), reason="the gVisor backend needs root"),
            ],
        ),
    ],
)
def test_the_data_dir_is_readable_not_writable_and_its_links_stay_inside(
    data_dir: Path, backend: str
) -> None:
    with Sandbox(
        pool=False, backend=backend, data_dir=data_dir, options=Options(scrub=False)
    ) as sb:
        result = sb.run(_READS_DATA)
        assert sb.info().data_dir == str(data_dir)
    assert result.status == "ok", result.error
    value = result.return_value
    assert value["hello"] == "hello data"
    assert value["write"] in ("OSError", "PermissionError")  # EROFS / EBADF
    for name in ("shadow", "up"):  # the sandbox's /etc has no shadow: never the host's
        assert value[name] in ("FileNotFoundError", "PermissionError"), value
    assert not (data_dir / "new.txt").exists()


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("relative/dir", "not an absolute path"),
        ("/", "is /"),
        ("/no/such/dir", "does not exist"),
        ("/etc/hostname", "not a directory"),
        ("/run", "overlaps codecage's own"),
    ],
)
def test_a_bad_data_dir_is_refused_clearly(given: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said) as caught:
        Sandbox(pool=False, data_dir=given)
    assert "data_dir" in caught.value.hint


# --- MCP ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> AsyncIterator[Client]:
    workdir = tmp_path_factory.mktemp("serve-files")
    async with serve_configured(workdir, None, "--no-pool", "--data", str(data_dir)) as client:
        yield client


@pytest.mark.anyio
async def test_mcp_returns_binary_files_as_embedded_resources_and_text_inline(
    server: Client,
) -> None:
    reply = await server.call_tool(
        "execute_code",
        {
            "code": "open('t.bin', 'wb').write(bytes(range(256)));"
            "open('notes.txt', 'w').write('hello notes')",
            "return_files": ["t.bin", "notes.txt"],
        },
    )
    resources = [b for b in reply.content if isinstance(b, EmbeddedResource)]
    assert len(resources) == 1
    blob = resources[0].resource
    assert isinstance(blob, BlobResourceContents)
    assert blob.uri == "file:///workspace/t.bin"
    assert base64.b64decode(blob.blob) == bytes(range(256))
    assert blob.mime_type
    texts = [b.text for b in reply.content if isinstance(b, TextContent)]
    assert any("hello notes" in t for t in texts)


@pytest.mark.anyio
async def test_mcp_drops_the_largest_binary_file_to_fit_the_reply(server: Client) -> None:
    reply = await server.call_tool(
        "execute_code",
        {
            "code": "import os; open('big.bin', 'wb').write(os.urandom(400_000));"
            "open('small.bin', 'wb').write(b'\\x00\\x01')",
            "return_files": ["big.bin", "small.bin"],
        },
    )
    uris = [
        b.resource.uri
        for b in reply.content
        if isinstance(b, EmbeddedResource) and isinstance(b.resource, BlobResourceContents)
    ]
    assert uris == ["file:///workspace/small.bin"]
    events = (reply.structured_content or {})["events"]
    assert events[0]["kind"] == "reply_trimmed" and "big.bin" in events[0]["detail"]


@pytest.mark.anyio
async def test_serve_data_is_readable_not_writable_and_info_says_so(server: Client) -> None:
    reply = await server.call_tool("execute_code", {"code": _READS_DATA})
    value = (reply.structured_content or {})["return_value"]
    assert value["hello"] == "hello data"
    assert value["write"] != "written"
    info = await server.call_tool("get_sandbox_info", {})
    assert (info.structured_content or {})["data"] == "/data"
    detail = await server.call_tool("get_sandbox_info", {"detail": True})
    assert (detail.structured_content or {})["detail"]["data_dir"] == "/data"


def test_a_data_dir_the_sandbox_cannot_read_is_refused_before_any_run(tmp_path: Path) -> None:
    hidden = tmp_path / "hidden"  # under pytest's 0700 directory
    hidden.mkdir()
    if os.geteuid() != 0:
        pytest.skip("the sandbox runs as the caller's own id, which can read it")
    with pytest.raises(ConfigError, match="cannot be read by the sandbox"):
        Sandbox(pool=False, data_dir=hidden)


def test_a_config_file_does_not_make_every_data_dir_overlap(data_dir: Path, tmp_path: Path) -> None:
    """The directories above the config file (/ among them) are not codecage's state: a data
    directory elsewhere is fine; one holding the config file is refused."""
    config = tmp_path / "config.toml"
    config.write_text("[limits]\ntimeout = 20\n", encoding="utf-8")
    with Sandbox(pool=False, data_dir=data_dir, config=config) as sb:
        assert sb.run("print(open('/data/hello.txt').read())").stdout == "hello data\n"
    with pytest.raises(ConfigError, match="overlaps"):
        Sandbox(pool=False, data_dir=tmp_path, config=config)
