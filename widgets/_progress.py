"""The launch panel's live progress bars: one stock ipywidgets bar per open bar of the live ranks."""

from __future__ import annotations

import html
import re
from typing import Any

from notebook_accel.launch.output import rank_label

__all__: list[str] = []


# tqdm's default line is "{desc}: {percentage}%|{bar}| {n}/{total} [{elapsed}<{remaining}, {rate}]".
_TEXT_BAR = re.compile(r"%\|[^|]*\| ?")


def bar_text(bar: Any) -> str:
    """Return tqdm's line of ``bar`` without its text bar (``|█████     |``): desc, percentage, counts, times, rate."""
    return _TEXT_BAR.sub("% ", bar.text, count=1)


def bar_label(bar: Any, node: str | None = None) -> str:
    """Return the HTML label beside a graphical bar: rank (and its node, across nodes), and tqdm's line less its text bar."""
    where = rank_label(bar.rank, node)
    return f"<span style='font-family:monospace;white-space:pre'>[{html.escape(where)}] {html.escape(bar_text(bar))}</span>"


class _BarRows:
    """Keeps one ``FloatProgress`` + ``HTML`` row per shown bar, reusing the widgets of bars still open."""

    def __init__(self, widgets: Any) -> None:
        self._w = widgets
        self._rows: dict[tuple[int, int], tuple[Any, Any, Any]] = {}
        self.box = widgets.VBox()

    def update(self, bars: list[Any], nodes: dict[int, str] | None = None) -> None:
        """Show exactly ``bars`` (BarState), in order, labelled with their rank's node from ``nodes``; a bar that left the list loses its row."""
        w = self._w
        keep = {(b.rank, b.id) for b in bars}
        for key in [k for k in self._rows if k not in keep]:
            for widget in self._rows.pop(key):
                widget.close()
        children = []
        for bar in bars:
            key = (bar.rank, bar.id)
            row = self._rows.get(key)
            if row is None:
                progress = w.FloatProgress(min=0.0, max=1.0, layout=w.Layout(width="30%"))
                label = w.HTML()
                row = self._rows[key] = (progress, label, w.HBox([progress, label]))
            progress, label, box = row
            if bar.total:
                progress.max = float(bar.total)
                progress.value = min(float(bar.n), float(bar.total))
                progress.bar_style = "success" if bar.n >= bar.total else "info"
            else:  # no total: a full "info" bar, as tqdm.notebook shows one
                progress.max, progress.value, progress.bar_style = 1.0, 1.0, "info"
            label.value = bar_label(bar, (nodes or {}).get(bar.rank))
            children.append(box)
        if tuple(children) != tuple(self.box.children):
            self.box.children = children
