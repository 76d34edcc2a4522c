"""Matplotlib charts rendered off-screen to PNG bytes (no pyplot state, no GUI backend)."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence

__all__: list[str] = []

_GIB = 1024**3


def _new_figure(width: float, height: float):  # noqa: ANN202 - matplotlib types are imported lazily
    # matplotlib.figure.Figure with an explicit Agg canvas: never touches pyplot's global backend,
    # so drawing a chart cannot open a window or change the user's inline backend.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=90)
    FigureCanvasAgg(fig)
    return fig


def _to_png(fig, **margins: float) -> bytes:  # noqa: ANN001
    buf = io.BytesIO()
    # Fixed margins rather than tight_layout (a second layout pass), and light PNG compression: the
    # panels redraw on every control change, where encoding time matters more than a few KiB.
    fig.subplots_adjust(**{"left": 0.12, "right": 0.98, "top": 0.88, "bottom": 0.14, **margins})
    fig.savefig(buf, format="png", pil_kwargs={"compress_level": 1})
    return buf.getvalue()


def stacked_bars_png(
    labels: Sequence[str],
    series: dict[str, Sequence[float]],
    colours: dict[str, str],
    title: str,
    ylabel: str = "GiB",
    limits: Sequence[float | None] | None = None,
) -> bytes:
    """Return a PNG of one stacked bar per label; ``series`` maps a segment name to a value per label.

    ``limits`` draws a dashed line per bar (a device budget / the machine's memory) where not None.
    """
    fig = _new_figure(max(4.0, 1.1 * len(labels) + 2.0), 3.0)
    ax = fig.add_subplot(1, 1, 1)
    bottoms = [0.0] * len(labels)
    xs = list(range(len(labels)))
    for name, values in series.items():
        ax.bar(xs, values, bottom=bottoms, label=name, color=colours.get(name), width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    if limits is not None:
        label = "budget set"
        for x, limit in zip(xs, limits):
            if limit is not None:
                ax.hlines(
                    limit, x - 0.4, x + 0.4, colors="black", linestyles="dashed", linewidth=1, label=label
                )
                label = None  # one legend entry for all the budget lines
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    return _to_png(fig)


def grouped_bars_png(
    labels: Sequence[str],
    series: dict[str, Sequence[float]],
    title: str,
    ylabel: str = "GiB",
    hlines: dict[str, float] | None = None,
) -> bytes:
    """Return a PNG of grouped bars (one group per label, one bar per series) with labelled horizontal lines."""
    fig = _new_figure(max(4.5, 1.3 * len(labels) + 2.0), 3.0)
    ax = fig.add_subplot(1, 1, 1)
    n = max(1, len(series))
    width = 0.8 / n
    for i, (name, values) in enumerate(series.items()):
        xs = [x - 0.4 + width * (i + 0.5) for x in range(len(labels))]
        ax.bar(xs, values, width=width, label=name)
    for j, (name, value) in enumerate((hlines or {}).items()):
        ax.axhline(value, linestyle=("--", ":", "-.")[j % 3], color="black", linewidth=1, label=name)
    ax.set_xticks(list(range(len(labels))))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    return _to_png(fig)


def png_img_tag(png: bytes, alt: str = "chart") -> str:
    """Return an ``<img>`` tag embedding ``png`` as base64 (for static HTML snapshots)."""
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{alt}" src="data:image/png;base64,{data}"/>'
