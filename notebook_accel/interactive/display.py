"""What a ``%%ranks`` cell shows: each rank's last expression, equal values shown once.

A plain-Python model with a text form (``repr``) and an HTML form (``_repr_html_``), so a notebook renders
it the way Jupyter renders a cell's value, and tests read it without a kernel. Values are grouped only
when they are equal (``values.same_value``: the same digest, computed on the ranks from the contents,
or ``==`` True on values that came to the kernel): ranks holding equal tensors show one block, labelled
with the ranks that hold it (``[all 2 ranks]`` when every rank of the group does). Ranks whose values
print alike but differ are shown apart, with a line saying so.
"""

from __future__ import annotations

import html as _html
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..launch.output import rank_span
from .group import IdleRankStack
from .values import ValueOnRankError, same_value

__all__ = [
    "CellDisplay",
    "RankValues",
    "StacksView",
    "StatusTable",
    "rank_label",
]


def rank_label(ranks: Sequence[int], world_size: int) -> str:
    """Return the label of a block of output: ``[rank 1]``, ``[ranks 0,2]`` or ``[all 4 ranks]``."""
    if world_size > 1 and len(ranks) > 1 and sorted(ranks) == list(range(world_size)):
        return f"[all {world_size} ranks]"
    return f"[{rank_span(ranks)}]"


@dataclass(frozen=True)
class RankValues:
    """One shown value and the ranks that produced it (several when their values are equal)."""

    ranks: tuple[int, ...]
    text: str
    """The value's repr, as Jupyter would print it."""
    html: str | None = None
    """The value's ``_repr_html_``, where it has one."""


def _and(ranks: Sequence[int]) -> str:
    names = [str(r) for r in ranks]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


class CellDisplay:
    """The last expression of a cell on each rank that ran it, grouped by equal value.

    Built from the ``CellResult`` list of ``Ranks.execute``. Ranks whose cell ended in a statement or
    in ``None`` (``text`` is None) show nothing, as in Jupyter; ``values`` holds every targeted rank's
    value, in rank order. ``notes`` says which ranks print alike but hold different values.
    """

    def __init__(self, results: Iterable[Any], world_size: int) -> None:
        self.results = sorted(results, key=lambda r: r.rank)
        self.world_size = world_size
        self.groups, self.notes = self._group()

    @property
    def values(self) -> list[Any]:
        """Return the value of the last expression on each targeted rank (None after a statement).

        Raises ValueOnRankError when some rank's value stayed there (over the value limit), saying
        how to pull it.
        """
        stayed = [r.rank for r in self.results if r.stayed is not None]
        if stayed:
            on = stayed[0] if len(stayed) == 1 else stayed
            raise ValueOnRankError(
                f"the values of rank(s) {stayed} stayed on the ranks (over the value limit); fetch them with "
                f"ranks.pull('_', on={on}) (%ranks pull _ --on {','.join(map(str, stayed))}): a rank keeps a "
                "cell's last value as _. Or raise the limit: %ranks value-limit 500MB (ranks.value_limit = '500MB')"
            )
        return [r.value for r in self.results]

    def _group(self) -> tuple[list[RankValues], list[str]]:
        members: list[list[Any]] = []  # results with equal values, first one standing for them
        for result in self.results:
            if result.text is None:
                continue
            for group in members:
                if same_value(group[0], result):
                    group.append(result)
                    break
            else:
                members.append([result])
        groups = [RankValues(tuple(r.rank for r in g), g[0].text, g[0].html) for g in members]
        alike: dict[tuple[str, str | None], list[RankValues]] = {}
        for group in groups:
            alike.setdefault((group.text, group.html), []).append(group)
        notes = []
        for same_print in alike.values():
            if len(same_print) > 1:
                ranks = sorted(r for g in same_print for r in g.ranks)
                notes.append(f"ranks {_and(ranks)} print alike but their values differ")
        return groups, notes

    @property
    def empty(self) -> bool:
        """Return True when no rank has a value to show."""
        return not self.groups

    @property
    def all_equal(self) -> bool:
        """Return True when every targeted rank showed the same value (shown once)."""
        return len(self.groups) == 1 and len(self.groups[0].ranks) == len(self.results) > 1

    def label(self, group: RankValues) -> str:
        """Return the label that heads ``group``."""
        return rank_label(group.ranks, self.world_size)

    def __repr__(self) -> str:
        blocks = []
        for group in self.groups:
            label = self.label(group)
            # A one-line value stays beside its label; a longer one starts under it, as Out[] does.
            sep = "\n" if "\n" in group.text else " "
            blocks.append(f"{label}{sep}{group.text}")
        blocks.extend(f"({note})" for note in self.notes)
        return "\n".join(blocks)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # IPython's pretty printer would otherwise show the text form of this object inside Out[].
        printer.text(repr(self))

    def _repr_html_(self) -> str | None:
        if not any(group.html for group in self.groups):
            return None  # the text form is all there is: no need for an HTML copy of it
        parts = ['<div class="notebook-accel-ranks">']
        for group in self.groups:
            body = group.html if group.html is not None else f"<pre>{_html.escape(group.text)}</pre>"
            parts.append(f"<div><b>{_html.escape(self.label(group))}</b></div>{body}")
        parts.extend(f"<div><i>({_html.escape(note)})</i></div>" for note in self.notes)
        parts.append("</div>")
        return "".join(parts)


def _size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "-"
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


class StatusTable:
    """``Ranks.status()`` as a table: rank, pid, state, the cell it runs, CPU % and memory (and node, across nodes)."""

    columns = ("rank", "pid", "state", "cell", "cpu %", "memory")

    def __init__(self, rows: Iterable[Any]) -> None:
        self.rows = list(rows)
        # Ranks on several machines: a first column names each rank's node (none on one machine).
        self._nodes = any(getattr(row, "node", None) for row in self.rows)
        if self._nodes:
            self.columns = ("node", *StatusTable.columns)

    def cells(self) -> list[tuple[str, ...]]:
        """Return the table's rows as text, one tuple per rank."""
        out = []
        for row in self.rows:
            cpu = getattr(row, "cpu_percent", None)
            cell = getattr(row, "cell", None)
            cell_text = "-" if cell in (None, "") else str(cell).strip().splitlines()[0][:40]
            node = (str(getattr(row, "node", None) or "-"),) if self._nodes else ()
            out.append(
                (
                    *node,
                    str(row.rank),
                    "-" if row.pid is None else str(row.pid),
                    str(row.state),
                    cell_text,
                    "-" if cpu is None else f"{cpu:.0f}",
                    _size(getattr(row, "rss", None)),
                )
            )
        return out

    def __repr__(self) -> str:
        rows = [self.columns, *self.cells()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self.columns))]
        return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{c}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{_html.escape(v)}</td>" for v in row) + "</tr>" for row in self.cells()
        )
        return f"<table><tr>{head}</tr>{body}</table>"


class StacksView:
    """``Ranks.stacks()`` as text: per rank where it is, then its threads with each frame's source line.

    A rank waiting for its next command shows only that: its stacks would be the rank loop's own frames.
    """

    def __init__(self, stacks: dict[int, Any]) -> None:
        self.stacks = dict(sorted(stacks.items()))

    def __repr__(self) -> str:
        blocks = []
        for rank, stack in self.stacks.items():
            where = stack.summary() if hasattr(stack, "summary") else ""
            head = f"[rank {rank}] {where}".rstrip()
            if isinstance(stack, IdleRankStack):
                blocks.append(head)
                continue
            text = getattr(stack, "text", None) or str(stack)
            blocks.append(f"{head}\n{text.rstrip()}")
        return "\n\n".join(blocks)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))
