"""Rich results, the notebook way: display outputs made in real sandboxes (figures at
`plt.show()` and at the end, `display(obj)`, the last expression), their caps enforced by
the guest and again by the host, their text scrubbed, and how each face shows them
(the MCP reply over a real stdio client, the CLI's lines, `displays.save`)."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest
from mcp_types import ImageContent, TextContent
from tests._cli import codecage, serve_stdio

from codecage import Options, Sandbox, displays
from codecage.errors import ConfigError
from codecage.guest import contract
from codecage.models import DisplayOutput, ExecutionResult

pytestmark = pytest.mark.timeout(120)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SHOW = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()\n"


def _png(display: DisplayOutput) -> bytes:
    return base64.b64decode(display.data["image/png"], validate=True)


def _events(result: ExecutionResult, kind: str) -> list[str]:
    return [e.detail for e in result.events if e.kind == kind]


def ran(sandbox: Sandbox, code: str, **run: Any) -> ExecutionResult:
    """The result of a run of `code` that must succeed (its error is shown when it did not)."""
    r = sandbox.run(code, **run)
    assert r.ok, r.error
    return r


def test_plt_show_gives_one_png_display(sandbox: Sandbox) -> None:
    r = ran(sandbox, SHOW + "import matplotlib\nprint(matplotlib.get_backend())")
    assert r.stdout.strip() == "module://codecage.runtime.plots"
    (figure,) = r.displays
    assert (figure.index, figure.source) == (0, "figure")
    assert _png(figure).startswith(PNG_MAGIC)
    assert displays.png_size(_png(figure)) == (640, 480)
    assert r.files == []  # no savefig needed


def test_a_figure_left_open_is_captured_at_the_end_and_savefig_still_works(
    sandbox: Sandbox,
) -> None:
    code = (
        "import matplotlib.pyplot as plt\n"
        "plt.figure(figsize=(4, 3), dpi=50)\nplt.bar(['a', 'b'], [1, 2])\n"
        "plt.savefig('chart.png')\n"
    )
    r = ran(sandbox, code)
    (figure,) = r.displays
    assert figure.source == "figure"
    assert displays.png_size(_png(figure)) == (200, 150)
    assert [f.path for f in r.files] == ["chart.png"]


def test_display_of_a_dataframe_gives_a_bounded_table_and_html(sandbox: Sandbox) -> None:
    code = (
        "import pandas as pd\n"
        "df = pd.DataFrame({'n': range(1000), 'sq': [i * i for i in range(1000)]})\n"
        "display(df)\nprint('after')\n"
    )
    r = ran(sandbox, code)
    (table,) = r.displays
    assert table.source == "display"
    assert set(table.data) == {"text/plain", "text/html"}
    assert "999" in table.data["text/plain"] and "500 " not in table.data["text/plain"]
    assert table.data["text/html"].startswith("<table")
    assert table.data["text/html"].count("<tr") < 70  # head and tail rows only
    assert r.stdout == "after\n"


def test_display_follows_the_ipython_protocol_by_duck_typing(sandbox: Sandbox) -> None:
    code = (
        "from codecage.runtime import display as shown\n"
        "class Note:\n"
        "    def _repr_markdown_(self): return '**bold** note'\n"
        "    def __repr__(self): return 'Note()'\n"
        "class Bundle:\n"
        "    def _repr_mimebundle_(self, include=None, exclude=None):\n"
        "        return {'application/json': {'a': 1}, 'text/plain': 'B', 'x/y': 'no'}\n"
        "shown(Note(), Bundle())\ndisplay(type)\n"
    )
    r = ran(sandbox, code)
    note, bundle, klass = r.displays
    assert note.data == {"text/markdown": "**bold** note", "text/plain": "Note()"}
    assert bundle.data == {"application/json": {"a": 1}, "text/plain": "B"}
    assert klass.data == {"text/plain": "<class 'type'>"}
    assert [d.index for d in r.displays] == [0, 1, 2]


def test_the_last_expression_dataframe_is_a_display_and_its_return_value_unchanged(
    sandbox: Sandbox,
) -> None:
    r = ran(sandbox, "import pandas as pd\npd.DataFrame({'a': [1, 2]})")
    (last,) = r.displays
    assert last.source == "last_expression"
    assert "text/html" in last.data and "a" in last.data["text/plain"]
    assert isinstance(r.return_value, str) and "a" in r.return_value  # its repr, as before
    plain = sandbox.run("{'x': [1, 2]}")
    assert plain.return_value == {"x": [1, 2]} and plain.displays == []


def test_a_hostile_repr_html_is_left_out_and_the_run_goes_on(sandbox: Sandbox) -> None:
    code = (
        "class Raises:\n"
        "    def _repr_html_(self): raise ValueError('boom')\n"
        "    def __repr__(self): return 'Raises()'\n"
        "class Huge:\n"
        "    def _repr_html_(self): return 'x' * (50 * 1024 * 1024)\n"
        "    def _repr_png_(self): return b'\\x89PNG\\r\\n\\x1a\\n' + bytes(50 * 1024 * 1024)\n"
        "display(Raises(), Huge())\nprint('still here')\n"
    )
    r = ran(sandbox, code, limits={"memory_mb": 1024})
    assert r.stdout == "still here\n"
    raises, huge = r.displays
    assert raises.data == {"text/plain": "Raises()"}
    assert set(huge.data) == {"text/plain"}
    notes = _events(r, "display_truncated")
    assert any("text/html" in n and "ValueError" in n for n in notes), notes
    assert any("text/html" in n and "over the" in n for n in notes), notes
    assert any("image/png" in n and "over the" in n for n in notes), notes


def test_sixty_displays_are_capped_at_fifty_with_an_event(sandbox: Sandbox) -> None:
    r = ran(sandbox, "for i in range(60):\n    display(i)\n")
    assert len(r.displays) == contract.MAX_DISPLAYS == 50
    assert [d.data["text/plain"] for d in r.displays] == [str(i) for i in range(50)]
    (note,) = _events(r, "display_truncated")
    assert "past 50" in note


def test_forged_display_lines_on_the_control_socket_are_bounded_by_the_host(
    sandbox: Sandbox,
) -> None:
    """The code can write to fd 3 as the bootstrap does, with its pid: the host still
    refuses a line over the per-output bound unparsed, and more than 50 outputs."""
    code = (
        "import json, os\n"
        "def forge(text):\n"
        "    line = {'v': 1, 'kind': 'display', 'pid': os.getpid(), 'source': 'display',"
        " 'data': {'text/plain': text}}\n"
        "    os.write(3, (json.dumps(line) + '\\n').encode())\n"
        "forge('x' * (5 * 1024 * 1024))\n"
        "for i in range(70):\n    forge(str(i))\n"
        "print('done')\n"
    )
    r = ran(sandbox, code)
    assert r.stdout == "done\n"
    assert len(r.displays) == contract.MAX_DISPLAYS
    assert all(len(d.data["text/plain"]) < 10 for d in r.displays)
    (note,) = _events(r, "display_truncated")
    assert "21 display output(s)" in note and "an output may have" in note


def test_a_forged_image_that_is_not_one_is_refused(sandbox: Sandbox) -> None:
    code = (
        "import json, os\n"
        "line = {'v': 1, 'kind': 'display', 'pid': os.getpid(), 'source': 'figure',"
        " 'data': {'text/plain': 'x', 'image/png': 'PHN2Zz4='}}\n"
        "os.write(3, (json.dumps(line) + '\\n').encode())\n"
    )
    r = ran(sandbox, code)
    assert r.displays == []
    assert _events(r, "guest_report_invalid")


def test_a_forked_process_displays_are_not_the_runs(sandbox: Sandbox) -> None:
    code = "import os\npid = os.fork()\nif pid == 0:\n    display('child')\n    os._exit(0)\n"
    code += "os.waitpid(pid, 0)\ndisplay('parent')\n"
    r = ran(sandbox, code)
    assert [d.data["text/plain"] for d in r.displays] == ["'parent'"]


def test_display_text_is_scrubbed_and_images_are_not() -> None:
    with Sandbox(pool=False, options=Options(import_policy=False)) as scrubbing:
        code = (
            "class Contact:\n"
            "    def _repr_html_(self): return '<b>alice@example.com</b>'\n"
            "    def __repr__(self): return 'Contact(alice@example.com)'\n"
            "display(Contact())\n" + SHOW
        )
        r = scrubbing.run(code)
    assert r.ok, r.error
    contact, figure = r.displays
    assert contact.data == {"text/html": "<b>[EMAIL]</b>", "text/plain": "Contact([EMAIL])"}
    assert r.redactions.get("email") == 2
    assert _png(figure).startswith(PNG_MAGIC)
    assert "alice@example.com" not in r.model_dump_json()


def test_the_curated_data_science_profile_lets_figures_and_tables_through() -> None:
    with Sandbox(profile="data_science", pool=False) as curated:
        r = curated.run(SHOW + "import pandas as pd\npd.Series([1, 2], name='s')")
    assert r.ok, r.error
    figure, series = r.displays
    assert _png(figure).startswith(PNG_MAGIC)
    assert series.source == "last_expression" and "text/html" in series.data


def test_a_warm_sandbox_with_pyplot_preloaded_uses_our_backend() -> None:
    with Sandbox(profile="data_science", allowed_imports=["sys"], pool=True) as warm:
        assert warm.warm(60)
        r = warm.run(
            "import sys\npreloaded = 'matplotlib.pyplot' in sys.modules\n" + SHOW + "preloaded"
        )
    assert r.ok, r.error
    assert r.return_value is True  # a warm sandbox: pyplot imported before the request
    (figure,) = r.displays
    assert _png(figure).startswith(PNG_MAGIC)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_the_mcp_reply_has_an_image_for_plt_show_and_a_table_as_text(
    tmp_path: Path,
) -> None:
    code = SHOW + "import pandas as pd\npd.DataFrame({'city': ['Oslo', 'Lima'], 'n': [3, 4]})"
    async with serve_stdio(tmp_path) as client:
        result = await client.call_tool("execute_code", {"code": code})
    assert not result.is_error
    text, *rest = result.content
    assert isinstance(text, TextContent)
    images = [b for b in rest if isinstance(b, ImageContent)]
    assert len(images) == 1 and images[0].mime_type == "image/png"
    assert base64.b64decode(images[0].data).startswith(PNG_MAGIC)
    assert "[figure 1: image/png 640x480" in text.text
    assert "Oslo" in text.text and "<table" not in text.text  # plain text, not HTML
    structured = result.structured_content
    assert structured is not None
    figure, table = structured["displays"]
    assert figure["image"] == "image/png" and figure["left_out"]["image/png"] > 1000
    assert table["in_text"] == "text/plain" and "text/html" in table["left_out"]
    assert "iVBOR" not in json.dumps(structured)  # no base64 in the structured content


def test_the_cli_prints_a_line_per_figure_and_the_text_of_a_display(tmp_path: Path) -> None:
    code = SHOW + "display('\\x1b[31mred')\n"
    done = codecage("run", "--code", code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "figure 1: image/png 640x480" in done.stderr
    assert "display 2:\n'\\x1b[31mred'" in done.stderr  # neutralised, not an escape
    assert "\x1b[31m" not in done.stderr
    as_json = codecage("run", "--code", SHOW, "--json", cwd=tmp_path)
    assert json.loads(as_json.stdout)["displays"][0]["source"] == "figure"


# --- displays.save ------------------------------------------------------------------------


def _outputs() -> list[DisplayOutput]:
    png = base64.b64encode(PNG_MAGIC + b"\x00\x00\x00\rIHDR" + bytes(8)).decode()
    return [
        DisplayOutput(index=0, source="figure", data={"text/plain": "<F>", "image/png": png}),
        DisplayOutput(index=1, source="display", data={"text/plain": "t", "text/html": "<b>t</b>"}),
        DisplayOutput(index=2, source="last_expression", data={"text/plain": "42"}),
    ]


def test_save_writes_each_form_as_a_file(tmp_path: Path) -> None:
    saved = displays.save(_outputs(), tmp_path / "out")
    assert [p.name for p in saved] == ["figure-1.png", "display-2.html", "display-3.txt"]
    assert saved[0].read_bytes().startswith(PNG_MAGIC)
    assert saved[1].read_text() == "<b>t</b>"
    assert saved[2].read_text() == "42"


def test_save_never_overwrites_and_writes_nothing_then(tmp_path: Path) -> None:
    (tmp_path / "display-2.html").write_text("mine")
    with pytest.raises(ConfigError, match=r"display-2\.html"):
        displays.save(_outputs(), tmp_path)
    assert (tmp_path / "display-2.html").read_text() == "mine"
    assert not (tmp_path / "figure-1.png").exists()


def test_save_follows_no_link(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(ConfigError, match="link"):
        displays.save(_outputs(), tmp_path / "link")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(target / "victim", out / "figure-1.png")  # a dangling link in the way
    with pytest.raises(ConfigError, match=r"figure-1\.png"):
        displays.save(_outputs(), out)
    assert list(target.iterdir()) == []


def test_matplotlib_finds_its_font_list_ready_and_does_not_scan_the_fonts_again() -> None:
    """The font list built once on the host is put in $MPLCONFIGDIR when the code first
    imports matplotlib (not before: /tmp starts empty), and matplotlib uses it as it is
    (without it, every sandbox scans the fonts and writes a list of its own)."""
    code = (
        "import os\n"
        "folder = os.environ['MPLCONFIGDIR']\n"
        "empty_before = not os.path.exists(folder)\n"
        "import matplotlib.pyplot as plt\n"
        "from codecage.contract import MATPLOTLIB_FONTS_DIR\n"
        "[name] = os.listdir(MATPLOTLIB_FONTS_DIR)\n"
        "built = open(os.path.join(MATPLOTLIB_FONTS_DIR, name), 'rb').read()\n"
        "used = open(os.path.join(folder, name), 'rb').read()\n"
        "(empty_before, built == used)"
    )
    result = Sandbox(pool=False).run(code)
    assert result.status == "ok", result
    assert result.return_value == [True, True]
