"""Rich outputs, the notebook way: `display(obj)`, matplotlib figures, the last expression.

Each output is a MIME bundle (text/plain always; image/png, image/jpeg, image/svg+xml,
text/html, text/markdown, application/json when the object has them), sent to the host as
a "display" line on the control socket as soon as it is made:

    {"v":1,"kind":"display","pid":...,"source":"display"|"figure"|"last_expression",
     "data":{"text/plain": "...", "image/png": "<base64>", ...}}

The bundle follows IPython's display protocol by duck typing (IPython is not installed, and
importing it would cost every run): `_repr_mimebundle_`, then `_repr_png_`, `_repr_jpeg_`,
`_repr_svg_`, `_repr_html_`, `_repr_markdown_`, `_repr_json_`; text/plain is a bounded
repr. A pandas DataFrame or Series is a bounded text table and bounded HTML; a matplotlib
figure is a PNG. A `_repr_*_` that raises or returns the wrong type is left out, and so is
anything over the caps (contract.MAX_DISPLAYS outputs, MAX_DISPLAY_BYTES each,
MAX_DISPLAYS_BYTES a run); each time a `display_truncated` event says so and the run goes
on. The host enforces the same caps again: nothing here is trusted.

The bootstrap calls `install` before the code runs: it gives the line sender and the event
note, makes `display` a builtin, and makes matplotlib's default backend ours
(`codecage.runtime.plots`: `plt.show()` shows every open figure). Standard library only at
import; matplotlib and pandas are only used when the code has imported them.
"""

from __future__ import annotations

import _thread
import base64
import builtins
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from ..contract import (
    KIND_DISPLAY,
    MATPLOTLIB_FONTS_DIR,
    MAX_DISPLAY_BYTES,
    MAX_DISPLAYS,
    MAX_DISPLAYS_BYTES,
    WIRE_VERSION,
)

__all__ = ["display"]

PLOT_BACKEND = "module://codecage.runtime.plots"
"""matplotlib's name for our backend (Agg, whose show() turns figures into outputs)."""

Sink = Callable[[bytes], None]  # sends one line on the control socket
Note = Callable[[str], None]  # adds a display_truncated event to the run's result

TEXT_PLAIN_CHARS = 20_000  # of a repr or a table's text
TABLE_ROWS = 60  # a DataFrame shows its head and tail rows within these
TABLE_COLUMNS = 20
_BINARY = ("image/png", "image/jpeg")
_METHODS = (
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("image/svg+xml", "_repr_svg_"),
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("application/json", "_repr_json_"),
)
_MIMES = frozenset({"text/plain", *(mime for mime, _ in _METHODS)})
_RICH_NAMES = ("_repr_mimebundle_", *(name for _, name in _METHODS))
_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, list, tuple, dict, set)
# An object that says it has this has a __getattr__ that answers everything (IPython's
# guard against calling made-up _repr_*_ methods).
_CANARY = "_ipython_canary_method_should_not_exist_"


class _Outbox:
    """The run's outputs so far (count and bytes, for the caps) and where they go."""

    def __init__(self) -> None:
        self.lock = _thread.allocate_lock()  # threads of the code display in turn
        self.sink: Sink | None = None
        self.note: Note | None = None
        self.count = 0
        self.bytes = 0
        self.over_count = False
        self.shown: dict[int, Any] = {}  # figures displayed (id -> figure), not re-shown


_outbox = _Outbox()


def install(sink: Sink, note: Note) -> None:
    """Send outputs with `sink`, say what was left out with `note`; `display` becomes a
    builtin and our matplotlib backend the default. Called by the bootstrap only."""
    _outbox.sink, _outbox.note = sink, note
    builtins.display = display  # type: ignore[attr-defined]  # as in a notebook
    _use_plot_backend()


def new_run() -> None:
    """A session's next run: its caps count afresh (the host counts per run too)."""
    with _outbox.lock:
        _outbox.count = _outbox.bytes = 0
        _outbox.over_count = False
        _outbox.shown.clear()


def display(*objs: Any) -> None:
    """Show each object as a rich output of the run (as IPython's `display`): a figure as
    a PNG, a DataFrame as a table, an object with `_repr_html_`, `_repr_png_`, ... in those
    forms, anything else as its repr. Outside codecage's sandbox, prints its text."""
    for obj in objs:
        emit(obj, "display")


def emit(obj: Any, source: str) -> None:
    """One output of `obj`, made by `source` ("display", "figure", "last_expression")."""
    problems: list[str] = []
    data = bundle(obj, problems)
    if _is_figure(obj):
        _outbox.shown[id(obj)] = obj
    _send(data, source, problems)


def has_rich_form(value: Any) -> bool:
    """Whether the last expression's value is worth an output: a figure, a pandas table,
    or an object whose class has a `_repr_*_` method. Cheap for plain values."""
    if isinstance(value, (*_PLAIN_TYPES, type)):
        return False
    try:
        kind = type(value)
        return (
            _is_figure(value)
            or _pandas_kind(value) is not None
            or any(hasattr(kind, name) for name in _RICH_NAMES)
        )
    except Exception:  # a hostile class: no output rather than a broken run
        return False


def show_last_expression(value: Any) -> None:
    """The run's last expression as an output, when it has a rich form. Never raises."""
    try:
        if value is not None and has_rich_form(value):
            emit(value, "last_expression")
            if _is_figure(value):
                _close(value)  # shown: not again with the figures left open
    except Exception as exc:
        _note(f"the last expression's output was left out: {_why(exc)}")


def show_open_figures() -> None:
    """Every open pyplot figure as an output, then closed: at `plt.show()` and at the end
    of the run. A figure displayed already and unchanged since is only closed. Never
    raises."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    try:
        numbers = list(pyplot.get_fignums())
    except Exception as exc:
        _note(f"the open figures were left out: {_why(exc)}")
        return
    for number in numbers:
        try:
            figure = pyplot.figure(number)
            displayed = _outbox.shown.get(id(figure)) is figure
            if figure.stale or not displayed:
                emit(figure, "figure")
            _close(figure)
        except Exception as exc:
            _note(f"figure {number} was left out: {_why(exc)}")


# --- the bundle ----------------------------------------------------------------------------


def bundle(obj: Any, problems: list[str]) -> dict[str, Any]:
    """The MIME bundle of `obj` (text/plain always); what could not be made goes to
    `problems`."""
    data: dict[str, Any] = {}
    if _is_figure(obj):
        _put(data, "image/png", _call(lambda: _figure_png(obj), "image/png", problems), problems)
    elif _pandas_kind(obj) is not None:
        data.update(_table(obj, problems))
    elif not isinstance(obj, type) and not _claims_everything(obj):
        _from_methods(obj, data, problems)
    plain = data.get("text/plain")
    data["text/plain"] = plain[:TEXT_PLAIN_CHARS] if isinstance(plain, str) else _plain(obj)
    return data


def _from_methods(obj: Any, data: dict[str, Any], problems: list[str]) -> None:
    make_bundle = _method(obj, "_repr_mimebundle_")
    if make_bundle is not None:
        found = _call(
            lambda: make_bundle(include=None, exclude=None), "_repr_mimebundle_", problems
        )
        if isinstance(found, tuple) and found:
            found = found[0]  # (data, metadata)
        if isinstance(found, dict):
            for mime, value in found.items():
                if mime in _MIMES:
                    _put(data, mime, value, problems)
    for mime, name in _METHODS:
        if mime in data:
            continue
        method = _method(obj, name)
        if method is not None:
            _put(data, mime, _call(method, f"{mime} ({name})", problems), problems)


def _put(data: dict[str, Any], mime: str, value: Any, problems: list[str]) -> None:
    """`value` as the content of `mime` in `data`, or a problem when it cannot be."""
    if isinstance(value, tuple) and len(value) == 2:
        value = value[0]  # (content, metadata), as IPython allows
    if value is None:
        return
    if mime in _BINARY and isinstance(value, bytes | bytearray):
        if len(value) * 4 // 3 > MAX_DISPLAY_BYTES:
            problems.append(_too_big(mime, len(value)))
            return
        value = base64.b64encode(value).decode("ascii")
    if mime == "application/json":
        if not isinstance(value, dict | list):
            problems.append(f"{mime} left out: _repr_json_ returned {type(value).__name__}")
            return
    elif not isinstance(value, str):
        problems.append(f"{mime} left out: expected text, got {type(value).__name__}")
        return
    data[mime] = value


def _method(obj: Any, name: str) -> Callable[..., Any] | None:
    try:
        method = getattr(obj, name, None)
    except Exception:
        return None
    return method if callable(method) else None


def _call(make: Callable[[], Any], what: str, problems: list[str]) -> Any:
    try:
        return make()
    except Exception as exc:  # the object's own code: its failure leaves out one form
        problems.append(f"{what} left out: it raised {_why(exc)}")
        return None


def _claims_everything(obj: Any) -> bool:
    try:
        return getattr(obj, _CANARY, None) is not None
    except Exception:
        return True


def _plain(obj: Any) -> str:
    from ..reprs import bounded_repr  # not on the common path

    return bounded_repr(obj, TEXT_PLAIN_CHARS, max_items=100)


# --- pandas and matplotlib (only when the code imported them) ------------------------------


def _pandas_kind(obj: Any) -> str | None:
    pandas = sys.modules.get("pandas")
    if pandas is None:
        return None
    if isinstance(obj, pandas.DataFrame):
        return "DataFrame"
    if isinstance(obj, pandas.Series):
        return "Series"
    return None


def _table(obj: Any, problems: list[str]) -> dict[str, Any]:
    """A bounded text table and bounded HTML (head and tail rows, outer columns)."""
    frame = obj if _pandas_kind(obj) == "DataFrame" else obj.to_frame()
    data: dict[str, Any] = {}
    text = _call(
        lambda: frame.to_string(max_rows=TABLE_ROWS, max_cols=TABLE_COLUMNS),
        "text/plain",
        problems,
    )
    if isinstance(text, str):
        data["text/plain"] = text[:TEXT_PLAIN_CHARS]
    html = _call(
        lambda: frame.to_html(max_rows=TABLE_ROWS, max_cols=TABLE_COLUMNS), "text/html", problems
    )
    _put(data, "text/html", html, problems)
    return data


def _is_figure(obj: Any) -> bool:
    figure = sys.modules.get("matplotlib.figure")
    return figure is not None and isinstance(obj, figure.Figure)


def _figure_png(figure: Any) -> bytes:
    import io

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _close(figure: Any) -> None:
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close(figure)


def _use_plot_backend() -> None:
    """Our backend as matplotlib's default: now if matplotlib is loaded (a warm sandbox
    preloads pyplot), else once the code imports it. Not through MPLBACKEND: the code's
    own subprocesses inherit the environment and cannot import codecage."""
    matplotlib = sys.modules.get("matplotlib")
    if matplotlib is None:
        if not any(isinstance(f, _BackendOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _BackendOnImport())
        return
    _set_backend(matplotlib)


def _set_backend(matplotlib: Any) -> None:
    try:
        params = matplotlib.rcParams
        current = params._get("backend") if hasattr(params, "_get") else params["backend"]
        if str(current).lower() != "agg":
            return  # the code chose another backend (MPLBACKEND, matplotlib.use)
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is not None and getattr(pyplot, "_backend_mod", None) is not None:
            pyplot.switch_backend(PLOT_BACKEND)
        else:
            params["backend"] = PLOT_BACKEND
    except Exception:
        pass


def seed_font_list() -> None:
    """Put matplotlib's font list, built once on the host (contract.MATPLOTLIB_FONTS_DIR),
    where matplotlib looks for it ($MPLCONFIGDIR, in this sandbox's /tmp), just before
    matplotlib is first imported: without it, every sandbox scans the fonts again. Not
    sooner: /tmp starts empty. Anything that fails leaves matplotlib to build its own."""
    target = os.environ.get("MPLCONFIGDIR")
    try:
        names = os.listdir(MATPLOTLIB_FONTS_DIR)
    except OSError:
        return
    if not target:
        return
    try:
        os.makedirs(target, mode=0o700, exist_ok=True)
        for name in names:
            with open(f"{MATPLOTLIB_FONTS_DIR}/{name}", "rb") as source:
                data = source.read()
            with open(f"{target}/{name}", "xb") as copy:
                copy.write(data)
    except OSError:
        pass


class _BackendOnImport:
    """A meta path finder that only watches for the first `import matplotlib`: it lets the
    usual finder find it, and sets our backend once the module has run."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "matplotlib":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        seed_font_list()
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _set_backend(module)

        loader.exec_module = exec_module
        return spec


# --- sending, within the caps --------------------------------------------------------------


def _send(data: dict[str, Any], source: str, problems: list[str]) -> None:
    outbox = _outbox
    with outbox.lock:
        number = outbox.count + 1
        for problem in problems:
            _note(f"display output {number} ({source}): {problem}")
        if outbox.count >= MAX_DISPLAYS:
            if not outbox.over_count:
                outbox.over_count = True
                _note(
                    f"display outputs past {MAX_DISPLAYS} were left out: show fewer, or "
                    "save the rest to files in /workspace"
                )
            return
        room = min(MAX_DISPLAY_BYTES, MAX_DISPLAYS_BYTES - outbox.bytes)
        line = _line(data, source, room, number)
        if line is None:
            return
        outbox.count += 1
        outbox.bytes += len(line)
        if outbox.sink is None:  # not in codecage's sandbox: the text will do
            print(data.get("text/plain", ""))
        else:
            outbox.sink(line)


def _line(data: dict[str, Any], source: str, room: int, number: int) -> bytes | None:
    """The "display" line within `room` bytes: the largest forms left out until it fits
    (text/plain last); None when even text/plain does not."""
    encoded: dict[str, str] = {}
    for mime, value in data.items():
        if isinstance(value, str) and len(value) > MAX_DISPLAY_BYTES:
            _note(f"display output {number}: {_too_big(mime, len(value))}")
            continue
        try:
            encoded[mime] = json.dumps(value, ensure_ascii=True, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            _note(f"display output {number}: {mime} left out: not JSON ({_why(exc)})")
    head = (
        f'{{"v":{WIRE_VERSION},"kind":"{KIND_DISPLAY}","pid":{os.getpid()},'
        f'"source":{json.dumps(source)},"data":{{'
    )
    while True:
        body = ",".join(f"{json.dumps(mime)}:{text}" for mime, text in encoded.items())
        line = (head + body + "}}\n").encode("ascii")
        if len(line) <= room and "text/plain" in encoded:
            return line
        rich = [mime for mime in encoded if mime != "text/plain"]
        if not rich:
            _note(
                f"display output {number} was left out: the run's display outputs passed "
                f"{MAX_DISPLAYS_BYTES:,} bytes together; show fewer or smaller ones"
            )
            return None
        largest = max(rich, key=lambda mime: len(encoded[mime]))
        size = len(encoded.pop(largest))
        why = (
            _too_big(largest, size)
            if size > MAX_DISPLAY_BYTES
            else f"{largest} left out ({size:,} bytes): the run's display outputs passed "
            f"{MAX_DISPLAYS_BYTES:,} bytes together"
        )
        _note(f"display output {number}: {why}")


def _too_big(mime: str, size: int) -> str:
    return (
        f"{mime} left out: {size:,} bytes is over the {MAX_DISPLAY_BYTES:,} an output may "
        "have; make it smaller, or save it to a file in /workspace"
    )


def _note(detail: str) -> None:
    if _outbox.note is not None:
        _outbox.note(detail)


def _why(exc: BaseException) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"[:200]
    except Exception:
        return type(exc).__name__
