"""The launch panel's node groups: ranks of a launch across several machines, gathered under their node.

A launch with ``nodes=`` reports each rank's host in ``RankStatus.node``; on one machine it is None and
the panel shows its plain table. The figures of a group are its ranks' summed (CPU % where 100 is one
core, resident and peak memory, CUDA memory), and its state the most telling state among its ranks.
"""

from __future__ import annotations

import html
from typing import Any

from notebook_accel.launch.output import rank_span
from notebook_accel.launch.states import State

from ._base import _badge, _fmt_bytes

__all__: list[str] = []

# A node's state is the first of these that one of its ranks is in: a failure anywhere on the node
# is what the user must see first, then work in progress, then how the rest ended.
_STATE_ORDER = (
    State.FAILED, State.DEAD, State.BROKEN, State.RUNNING, State.STARTING, State.STOPPED, State.IDLE, State.SUCCEEDED,
)  # fmt: skip
_SUMMED = ("cpu_percent", "rss", "peak_rss", "cuda_allocated", "cuda_reserved")


def group_state(states: list[State]) -> State:
    """Return the state a node shows for its ranks' ``states`` (a failure first, then work, then the end)."""
    for state in _STATE_ORDER:
        if state in states:
            return state
    return states[0] if states else State.STARTING


def _summed(rows: list[dict[str, Any]], key: str) -> float | None:
    """Return the sum of ``key`` over ``rows`` that report it (None when none does)."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) if values else None


def node_groups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return one entry per node, in the order its first rank appears: node, ranks, state and summed figures.

    Empty when no row names a node (a launch on one machine): the panel then shows no groups.
    """
    if not any(r.get("node") is not None for r in rows):
        return []
    by_node: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        # A rank whose node is not known yet (still starting) is shown under "?" rather than dropped.
        by_node.setdefault(row.get("node") or "?", []).append(row)
    groups = []
    for node, mine in by_node.items():
        group = {
            "node": node,
            "ranks": [r["rank"] for r in mine],
            "state": group_state([r["state"] for r in mine]),
        }
        group.update({key: _summed(mine, key) for key in _SUMMED})
        groups.append(group)
    return groups


def group_cells(group: dict[str, Any], width: int, cuda: bool) -> list[str]:
    """Return a node's header row as plain cells lined up with the rank rows' columns (``width`` of them)."""
    cells = [
        group["node"],
        rank_span(group["ranks"]),
        group["state"],
        "",
        "-" if group["cpu_percent"] is None else f"{group['cpu_percent']:.0f}",
        _fmt_bytes(group["rss"]),
        _fmt_bytes(group["peak_rss"]),
    ]
    if cuda:
        cells.append(f"{_fmt_bytes(group['cuda_allocated'])} / {_fmt_bytes(group['cuda_reserved'])}")
    cells.append("")
    return cells[:width]


def grouped(rows: list[dict[str, Any]], cells: list[list[str]], groups: list[dict[str, Any]]) -> list[tuple]:
    """Return ``(group, [cells of its ranks])`` per node, the rank rows in their table order."""
    index = {row["rank"]: i for i, row in enumerate(rows)}
    return [(group, [cells[index[r]] for r in group["ranks"]]) for group in groups]


def grouped_table_html(headers: list[str], parts: list[tuple], cuda: bool, style_of: dict[str, str]) -> str:
    """Return the status table with a shaded header row per node (its summed figures) above its ranks' rows.

    ``parts`` is :func:`grouped`'s output with the rank cells already HTML.
    """
    head = "".join(
        f"<th style='text-align:left;padding:2px 8px;white-space:nowrap'>{html.escape(h)}</th>"
        for h in headers
    )
    body = []
    for group, rank_rows in parts:
        cells = [
            f"<span style='white-space:nowrap'>{html.escape(c)}</span>"
            for c in group_cells(group, len(headers), cuda)
        ]
        cells[0] = f"<b>{html.escape(group['node'])}</b>"
        cells[2] = _badge(group["state"], style_of.get(group["state"], ""))
        body.append(
            "<tr style='background:#eef2f7' class='node-group'>"
            + "".join(f"<td style='padding:2px 8px'>{c}</td>" for c in cells)
            + "</tr>"
        )
        for row in rank_rows:
            body.append("<tr>" + "".join(f"<td style='padding:2px 8px'>{c}</td>" for c in row) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def grouped_text_rows(parts: list[tuple], width: int, cuda: bool) -> list[list[str]]:
    """Return the plain-text table's rows: per node, its header row (``[node]``), then its ranks indented."""
    out = []
    for group, rank_rows in parts:
        cells = group_cells(group, width, cuda)
        cells[0] = f"[{group['node']}]"
        out.append(cells)
        out.extend([f"  {row[0]}", *row[1:]] for row in rank_rows)
    return out


def nodes_of(rows: list[dict[str, Any]]) -> dict[int, str]:
    """Return ``{rank: node}`` for the rows that name their node."""
    return {r["rank"]: r["node"] for r in rows if r.get("node") is not None}
