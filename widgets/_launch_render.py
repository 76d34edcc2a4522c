"""The launch panel's HTML and text: a ``LaunchSnapshot`` (and the lines shown) drawn as the view shows it.

Used by the widget view (each part in its own widget) and by the static snapshot and ``repr`` of the
panel (all parts at once). Matplotlib is imported only when a chart is drawn (``metrics_png``).
"""

from __future__ import annotations

import html
from typing import Any

from notebook_accel.launch.output import rank_label

from ._base import _badge, _fmt_bytes, _table, _text_table
from ._charts import png_img_tag
from ._launch_model import _STATE_STYLE, LaunchSnapshot
from ._metrics_chart import metrics_png
from ._nodes import grouped, grouped_table_html, grouped_text_rows
from ._progress import bar_label

__all__: list[str] = []

SHOWN_LINES = 500  # lines rendered per tab: the browser redraws the whole text on each update
_HEADERS = ["rank", "pid", "state", "elapsed", "CPU %", "memory", "peak memory", "last line"]
# An interactive rank's cell in its status row: one line, cut with an ellipsis past about 30 characters.
_CELL_STYLE = (
    "display:inline-block;max-width:22em;overflow:hidden;text-overflow:ellipsis;white-space:nowrap;"
    "vertical-align:middle"
)
_NOTE_STYLE = "background:#fcf8e3;border:1px solid #f0ad4e;padding:4px"


def _uses_cuda(rows: list[dict[str, Any]]) -> bool:
    return any(r["cuda_allocated"] is not None for r in rows)


def _headers(rows: list[dict[str, Any]]) -> list[str]:
    headers = list(_HEADERS)
    if any(r["cell"] is not None for r in rows):
        headers[3] = "cell"  # interactive ranks: the cell, in place of the ranks' age
    if _uses_cuda(rows):
        headers.insert(-1, "CUDA allocated / reserved")
    return headers


def _row_cells(row: dict[str, Any], cuda: bool = False) -> list[str]:
    cells = [
        str(row["rank"]),
        str(row["pid"]),
        row["state"],
        f"{row['elapsed']:.1f} s" if row["cell"] is None else row["cell"],
        "-" if row["cpu_percent"] is None else f"{row['cpu_percent']:.0f}",
        _fmt_bytes(row["rss"]),
        _fmt_bytes(row["peak_rss"]),
    ]
    if cuda:
        cells.append(f"{_fmt_bytes(row['cuda_allocated'])} / {_fmt_bytes(row['cuda_reserved'])}")
    return [*cells, row["last_line"][-120:]]


def _row_html(row: dict[str, Any], cuda: bool) -> list[str]:
    # Figures never wrap (a squeezed table read "243.11 / MiB" on two lines); the last line may.
    texts = _row_cells(row, cuda)
    cells = [f"<span style='white-space:nowrap'>{html.escape(c)}</span>" for c in texts[:-1]]
    cells.append(html.escape(texts[-1]))
    cells[2] = _badge(row["state"], _STATE_STYLE.get(row["state"], ""))
    if row["cell"] is not None:  # the cell's first line, cut to the column (all of it on hover)
        cells[3] = (
            f"<code style='{_CELL_STYLE}' title='{html.escape(row['cell'], quote=True)}'>"
            f"{html.escape(row['cell'])}</code>"
        )
    return cells


def status_html(snap: LaunchSnapshot) -> str:
    """Return the status table (a shaded row per node across nodes), the dropped-lines note and the background job."""
    rows = snap.rows
    cuda = _uses_cuda(rows)
    cells_of_rows = [_row_html(row, cuda) for row in rows]
    note = f"<div><i>{html.escape(snap.dropped)}</i></div>" if snap.dropped else ""
    note += f"<div><b>background</b> <code>{html.escape(snap.job)}</code></div>" if snap.job else ""
    if snap.groups:
        parts = grouped(rows, cells_of_rows, snap.groups)
        return grouped_table_html(_headers(rows), parts, cuda, _STATE_STYLE) + note
    return _table(_headers(rows), cells_of_rows, escape=False, wrap_headers=False) + note


def bars_html(snap: LaunchSnapshot) -> str:
    """Return the bars as text labels (the static snapshot has no progress widgets)."""
    return "".join(f"<div>{bar_label(b, snap.nodes.get(b.rank))}</div>" for b in snap.bars)


def chart_html(snap: LaunchSnapshot) -> str:
    """Return the metric charts as an embedded PNG ("" with no metric logged)."""
    return png_img_tag(metrics_png(snap.chart), alt="metrics") if snap.chart else ""


def _note_html(title: str, text: str, style: str = _NOTE_STYLE) -> str:
    if not text:
        return ""
    return (
        f"<div style='{style}'><b>{html.escape(title)}</b>"
        f"<pre style='margin:0;white-space:pre-wrap'>{html.escape(text)}</pre></div>"
    )


def error_html(snap: LaunchSnapshot) -> str:
    """Return the root cause of a failed launch in a red box ("" when none)."""
    return _note_html("Launch failed", snap.error, "background:#f2dede;border:1px solid #d9534f;padding:4px")


def hang_html(snap: LaunchSnapshot) -> str:
    """Return the suspected-hang report in a yellow box ("" when none)."""
    return _note_html("Suspected hang", snap.hang)


def restarts_html(snap: LaunchSnapshot) -> str:
    """Return the attempt and one line per earlier failed try in a yellow box ("" without restarts)."""
    return _note_html(snap.attempt, "\n".join(snap.restarts)) if snap.restarts else ""


def stacks_html(snap: LaunchSnapshot) -> str:
    """Return every rank's stacks side by side, each with its summary ("" before the Stacks button)."""
    if not snap.stacks:
        return ""
    cells = [
        f"<td style='vertical-align:top'><b>rank {rank}</b>: {html.escape(stack.summary())}"
        f"<pre style='margin:0;font-size:11px'>{html.escape(stack.text)}</pre></td>"
        for rank, stack in sorted(snap.stacks.items())
    ]
    return f"<div style='overflow:auto'><table><tr>{''.join(cells)}</tr></table></div>"


def lines_html(lines: list[str]) -> str:
    """Return the newest ``SHOWN_LINES`` of ``lines`` as preformatted HTML."""
    return f"<pre style='margin:0'>{html.escape(chr(10).join(lines[-SHOWN_LINES:]))}</pre>"


def panel_html(snap: LaunchSnapshot, merged: list[str]) -> str:
    """Return the whole panel as static HTML: header, restarts, status, bars, chart, error, hang, stacks, lines."""
    state = _badge(snap.state, _STATE_STYLE.get(snap.state, ""))
    return (
        f"<b>{snap.title}</b> {snap.processes} process(es) {state} {html.escape(snap.attempt)}<br>"
        + restarts_html(snap)
        + status_html(snap)
        + bars_html(snap)
        + chart_html(snap)
        + error_html(snap)
        + hang_html(snap)
        + stacks_html(snap)
        + lines_html(merged)
    )


def panel_text(snap: LaunchSnapshot) -> str:
    """Return the panel as plain text: state and attempt, earlier tries, notes, the status table, the bars."""
    rows = snap.rows
    cuda = _uses_cuda(rows)
    bars = "".join(f"\n[{rank_label(b.rank, snap.nodes.get(b.rank))}] {b.text}" for b in snap.bars)
    headers, cells = _headers(rows), [_row_cells(r, cuda) for r in rows]
    if snap.groups:
        cells = grouped_text_rows(grouped(rows, cells, snap.groups), len(headers), cuda)
    table = _text_table(headers, cells)
    attempt = f", {snap.attempt}" if snap.attempt else ""
    restarts = "".join(f"\n{line}" for line in snap.restarts)
    dropped = f"\n{snap.dropped}" if snap.dropped else ""
    job = f"\nbackground {snap.job}" if snap.job else ""
    return f"LaunchPanel({snap.state}{attempt}){restarts}{dropped}\n{table}{job}{bars}"
