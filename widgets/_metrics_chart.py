"""The launch panel's metric charts: one small line chart per logged metric against step, as a PNG."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._charts import _new_figure, _to_png

__all__: list[str] = []

_MAX_CHARTS = 6  # more metrics than this: the first six (in logging order) are drawn


def metric_series(records: Sequence[dict[str, Any]]) -> dict[str, tuple[list[float], list[float]]]:
    """Return ``{metric: (steps, values)}`` for every numeric metric of ``records`` (``step`` + values)."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    for record in records:
        step = record.get("step")
        for key, value in record.items():
            if key == "step" or isinstance(value, (str, bool)) or not isinstance(value, (int, float)):
                continue
            steps, values = series.setdefault(key, ([], []))
            steps.append(step)
            values.append(float(value))
    return series


def metrics_png(series: dict[str, tuple[list[float], list[float]]], width: float = 9.0) -> bytes:
    """Return a PNG with one line chart per metric (at most six side by side, two rows beyond three)."""
    names = list(series)[:_MAX_CHARTS]
    cols = min(3, max(1, len(names)))
    rows = (len(names) + cols - 1) // cols
    from matplotlib.ticker import MaxNLocator

    fig = _new_figure(width, 2.2 * max(1, rows))
    for i, name in enumerate(names):
        ax = fig.add_subplot(rows, cols, i + 1)
        steps, values = series[name]
        ax.plot(steps, values, marker="." if len(steps) < 50 else None, linewidth=1.2)
        ax.set_title(f"{name}: {values[-1]:.4g}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        if len(set(steps)) == 1:  # one step logged so far: a unit either side, not ticks of +-0.045
            ax.set_xlim(steps[0] - 1, steps[0] + 1)
    # Room below each row for its "step" label, and between charts for the value ticks.
    return _to_png(fig, left=0.07, bottom=0.2 / rows, wspace=0.3, hspace=0.8)
