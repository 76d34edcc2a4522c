"""Live progress bars of a launch in the calling cell, without a panel: one updatable output.

In a Jupyter kernel, ``notebook_launcher`` without ``panel=True`` shows the open bars of the live
ranks (the main process by default) in one output of the cell, redrawn in place at most every
``interval`` seconds through IPython's ``display_id``; a bar that closes leaves this output and its
final line is printed with the rank's other lines.
"""

from __future__ import annotations

import html
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .interfaces import BarSource

__all__ = ["CellBars", "kernel_display", "render_bars_html", "render_bars_text"]


def kernel_display() -> Callable[..., Any] | None:
    """Return IPython's ``display`` when called in a Jupyter kernel, else None.

    Nothing is imported: a kernel has imported IPython (and with it ``IPython.display``) already, and
    outside one the core must not load it.
    """
    ipython = sys.modules.get("IPython")
    # IPython may be half imported by another thread right now (a panel's first view imports ipywidgets,
    # which imports IPython, while a restart asks this): not a kernel's, which imported it long before.
    get_ipython = getattr(ipython, "get_ipython", None)
    shell = get_ipython() if get_ipython is not None else None
    if shell is None or not hasattr(shell, "kernel"):
        return None
    return ipython.display.display


def render_bars_text(bars: list[Any]) -> str:
    """Return one ``[rank N] <tqdm line>`` per bar."""
    return "\n".join(f"[rank {b.rank}] {b.text}" for b in bars)


def render_bars_html(bars: list[Any]) -> str:
    """Return the bars as HTML: a native ``<progress>`` per bar (indeterminate without a total) and tqdm's line."""
    rows = []
    for b in bars:
        value = f' value="{b.n}" max="{b.total}"' if b.total else ""
        rows.append(
            f"<div style='font-family:monospace;white-space:pre'>[rank {b.rank}] "
            f"<progress{value} style='width:14em;vertical-align:middle'></progress> {html.escape(b.text)}</div>"
        )
    return "".join(rows)


class CellBars:
    """Show the open bars of ``handle``'s live ranks in one output of the calling cell."""

    def __init__(self, handle: BarSource, display: Callable[..., Any], interval: float = 0.2) -> None:
        self._display = display  # the kernel's (kernel_display())
        self._handle = handle
        self.interval = interval
        self._lock = threading.Lock()
        self._output: Any = None
        self._last = 0.0
        handle.subscribe_events(self._on_event)
        handle.add_done_callback(lambda _h: self.render())

    def _on_event(self, kind: str, _rank: int, state: Any) -> None:
        if kind != "bar":
            return
        closing = state is None or state.closed
        if not closing and time.monotonic() - self._last < self.interval:
            return  # tqdm sends the next state within its mininterval; a closing bar is always drawn
        self.render()

    def render(self) -> None:
        """Redraw the output with the bars open now (an empty output once none is)."""
        with self._lock:
            self._last = time.monotonic()
            bars = self._handle.bars(live_only=True)
            if self._output is None and not bars:
                return
            bundle = {"text/plain": render_bars_text(bars), "text/html": render_bars_html(bars)}
            if self._output is None:
                self._output = self._display(bundle, raw=True, display_id=True)
            else:
                self._output.update(bundle, raw=True)
