"""codecage's matplotlib backend (`module://codecage.runtime.plots`): Agg, whose `show()`
turns every open figure into a PNG display output and closes it, as a notebook's inline
backend does. `savefig` works as with Agg. Made the default by `displays.install` before
the code runs; imported by matplotlib itself, at the first figure."""

from __future__ import annotations

from typing import Any

from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg

from .displays import show_open_figures

FigureCanvas = FigureCanvasAgg
FigureManager = FigureManagerBase


def show(*args: Any, **kwargs: Any) -> None:
    """`plt.show()`: each open figure as an output, then closed (`block` means nothing
    here: nothing waits for a window)."""
    show_open_figures()
