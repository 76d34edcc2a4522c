"""The launch panel's model: every state ``LaunchPanel`` shows, read from the run's read-only view.

Plain Python (neither ipywidgets nor matplotlib is imported), so it can be built and read anywhere:
``LaunchModel(handle).snapshot()`` gives the rows, node groups, state, bars, chart data and texts the
view copies into its widgets; ``lines(rank)`` and ``merged_lines()`` the output it shows.

What it reads of a run are the members of the run's read-only view (``RunView``: ``status()``,
``subscribe``, ``bars``, ``metrics``, the restart facts...), which ``LaunchHandle`` and
``RestartingHandle`` both have. Interactive ranks (``start_ranks``) are read through their ``Ranks``:
their handle, each rank's state between cells, their background jobs. Output lines are kept in
``launch.output.OutputHistory`` stores (bounded in lines and bytes) and shown with the launch's own
prefix (``launch.output.line_prefix``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from notebook_accel.interactive import Ranks, RankState, current
from notebook_accel.launch.doctor import RankStack
from notebook_accel.launch.events import BarState
from notebook_accel.launch.interfaces import RunView
from notebook_accel.launch.output import HISTORY_BYTES, OutputHistory, OutputLine, dropped_note, line_prefix
from notebook_accel.launch.ranks import RankStatus
from notebook_accel.launch.states import State

from ._metrics_chart import metric_series
from ._nodes import node_groups, nodes_of

__all__: list[str] = []

# How each state shows (badge and button style): the one table of it. Keyed by the state's value, so
# a str-valued state enum's members find their style too.
_STATE_STYLE = {
    State.STARTING: "info",
    State.RUNNING: "info",
    State.SUCCEEDED: "success",
    State.FAILED: "danger",
    State.STOPPED: "warning",
    State.IDLE: "success",  # interactive ranks, between cells
    State.DEAD: "danger",
    State.BROKEN: "danger",
}
_KEPT_BARS = 3  # finished bars (leave=True) still shown per rank, newest last, as tqdm.notebook keeps them


@dataclass(frozen=True)
class LaunchSnapshot:
    """Everything the launch panel shows at one moment but the output lines, computed from one ``status()``."""

    title: str
    """"LaunchPanel", or "Interactive ranks" for a panel of ``start_ranks``."""
    processes: int
    state: str
    """The overall state (see ``LaunchModel.state``)."""
    done: bool
    interactive: bool
    rows: list[dict[str, Any]]
    """One per rank, as ``LaunchModel.rows()``."""
    groups: list[dict[str, Any]]
    """One per node of a launch across nodes, as ``LaunchModel.node_groups()`` ([] on one machine)."""
    nodes: dict[int, str]
    """``{rank: node}`` of the ranks that name their node."""
    bars: list[BarState]
    chart: dict[str, tuple[list[float], list[float]]]
    attempt: str
    restarts: list[str]
    dropped: str
    job: str
    error: str
    hang: str
    stacks: dict[int, RankStack]


class LaunchModel:
    """What a launch panel shows, kept up to date from the run's lines, events and end (no widgets).

    ``handle`` is the run's read-only view (``notebook_launcher(..., block=False)``), or interactive
    ``Ranks`` (``start_ranks``); ``ranks=`` names the ranks whose handle ``handle`` is. A subclass
    (the view) redraws in ``_changed()`` and ``_ended()``.
    """

    def __init__(self, handle: Any, max_lines: int = 10_000, *, ranks: Ranks | None = None) -> None:
        if ranks is None and isinstance(handle, Ranks):
            ranks, handle = handle, handle.handle
        if ranks is not None:
            handle = _handle_of_ranks(ranks, handle)
        _check_run_view(handle)
        self.handle = handle
        self._ranks = ranks
        self.max_lines = max_lines
        self._lock = threading.Lock()
        statuses = handle.status()
        self.ranks = [s.rank for s in statuses]
        """The ranks of the run, in ``status()`` order."""
        # Each rank's share of the launch's own byte bound, so that many ranks cannot multiply it.
        self._rank_bytes = max(HISTORY_BYTES // max(1, len(self.ranks)), 1 << 20)
        self.rank_lines = {r: OutputHistory(max_lines, self._rank_bytes) for r in self.ranks}
        """Each rank's newest lines (``OutputHistory``, at most ``max_lines``)."""
        self.all_lines = OutputHistory(max_lines)
        """Every rank's newest lines in arrival order (at most ``max_lines``)."""
        self._filter = ""
        self._last_cells: dict[int, str] = {}
        self._nodes = {s.rank: s.node for s in statuses if s.node}
        self.stacks: dict[int, RankStack] = {}
        """The ranks' stacks from the last ``show_stacks()``: ``{rank: RankStack}``."""
        self.closed = False
        # Every attribute exists before the callbacks are registered: a finished run calls _on_done
        # (and replays its lines into _on_line) at once, from inside these calls.
        self._unsubscribe_events = handle.subscribe_events(self._on_event)
        self._unsubscribe = handle.subscribe(self._on_line)
        handle.add_done_callback(self._on_done)

    # -- what the run sends -------------------------------------------------------------------------
    def _on_line(self, line: OutputLine) -> None:
        with self._lock:
            store = self.rank_lines.get(line.rank)
            if store is None:
                store = self.rank_lines[line.rank] = OutputHistory(self.max_lines, self._rank_bytes)
            store.append(line)
            self.all_lines.append(line)
        self._changed()

    def _on_event(self, _kind: str, _rank: int, _state: object) -> None:
        self._changed()

    def _on_done(self, _handle: object) -> None:
        self._ended()

    def _changed(self, now: bool = False) -> None:
        """Say that what the panel shows changed (``now``: by the user's hand); the view redraws."""

    def _ended(self) -> None:
        """Say that the run ended (every line was delivered before); the view shows the end at once."""

    # -- the user's controls ------------------------------------------------------------------------
    @property
    def filter_text(self) -> str:
        """Return the text the merged tab filters on (case-insensitive substring; "" shows all)."""
        return self._filter

    @filter_text.setter
    def filter_text(self, value: str) -> None:
        self._filter = str(value)
        self._changed(now=True)

    def show_stacks(self) -> dict[int, RankStack]:
        """Return every live rank's current stacks (``handle.stacks()``), kept in ``stacks`` and shown side by side."""
        self.stacks = self.handle.stacks()
        self._changed(now=True)
        return self.stacks

    def stop(self) -> None:
        """Stop every worker of the launch (``handle.stop()``; interactive ranks: ``ranks.stop()``; safe to call twice)."""
        ranks = self._ranks_of_handle()
        if ranks is not None:
            ranks.stop()
        else:
            self.handle.stop()
        self._changed()

    def close(self) -> None:
        """Stop receiving lines and events (the launch itself keeps running)."""
        self.closed = True
        self._unsubscribe()
        self._unsubscribe_events()

    # -- interactive ranks --------------------------------------------------------------------------
    @property
    def ranks_object(self) -> Ranks | None:
        """Return the interactive ranks this panel shows (``start_ranks``), or None for a launch."""
        if self._ranks is None:
            ranks = current()  # start_ranks(..., panel=True) builds its panel from the handle alone
            self._ranks = ranks if ranks is not None and ranks.handle is self.handle else None
        return self._ranks

    def _ranks_of_handle(self) -> Ranks | None:
        """Return the interactive ranks while they still run on this panel's handle (not after a restart)."""
        ranks = self.ranks_object
        return ranks if ranks is not None and ranks.handle is self.handle else None

    def _rank_states(self, done: bool) -> dict[int, RankState] | None:
        """Return ``{rank: RankState}`` of the interactive ranks while they run on this panel's handle, else None."""
        ranks = self._ranks_of_handle()
        if ranks is None or done:
            return None
        return {s.rank: s for s in ranks.status()}

    # -- states -------------------------------------------------------------------------------------
    def _states(self, statuses: list[RankStatus]) -> tuple[str, dict[int, str], dict[int, RankState] | None]:
        """Return the overall state, each rank's state, and the interactive ranks' own states (None for a launch).

        The one place that decides what state the panel shows. A launch: running, then succeeded,
        failed or stopped. Interactive ranks: idle or running (each rank's ``RankState``), broken
        when a rank died, failed the group or hung (``ranks.restart()`` recovers), stopped once
        they ended or were replaced by a restart.
        """
        done, error = self.handle.done, self.handle.error
        seen = {s.state for s in statuses}
        ranks = self.ranks_object
        if ranks is None:
            per_rank = {s.rank: s.state for s in statuses}
            if not done:
                return State.RUNNING, per_rank, None
            if error is not None:
                failed = State.FAILED in seen or State.STOPPED not in seen
                return (State.FAILED if failed else State.STOPPED), per_rank, None
            return (State.STOPPED if State.STOPPED in seen else State.SUCCEEDED), per_rank, None
        mine = self._rank_states(done)
        per_rank = {}
        for s in statuses:
            if mine is not None and s.rank in mine:
                per_rank[s.rank] = mine[s.rank].state
            elif done:  # ranks whose loops returned were stopped
                per_rank[s.rank] = State.STOPPED if s.state in (State.SUCCEEDED, State.STOPPED) else s.state
            else:
                per_rank[s.rank] = s.state
        if ranks.handle is not self.handle:
            return State.STOPPED, per_rank, mine  # restarted: new ranks run on a new handle
        if done:
            # Decided from the handle alone (``ranks.broken`` also reads True while stop() waits for
            # the ranks to end): an error (a rank died, or was killed in a collective), a failed
            # rank or a hang report means the group broke.
            broke = error is not None or State.FAILED in seen or bool(self.hang_text())
            return (State.BROKEN if broke else State.STOPPED), per_rank, mine
        if ranks.broken:
            return State.BROKEN, per_rank, mine
        running = any(s.state == State.RUNNING for s in (mine or {}).values())
        return (State.RUNNING if running else State.IDLE), per_rank, mine

    @property
    def state(self) -> State:
        """Return the overall state: RUNNING, SUCCEEDED, FAILED or STOPPED (interactive ranks: IDLE, RUNNING, BROKEN or STOPPED)."""
        return self._states(self.handle.status())[0]

    # -- rows and groups ----------------------------------------------------------------------------
    def _rows(
        self, statuses: list[RankStatus], states: dict[int, str], mine: dict[int, RankState] | None
    ) -> list[dict[str, Any]]:
        now = time.time()
        interactive = self.ranks_object is not None
        out = []
        for s in statuses:
            own = mine.get(s.rank) if mine is not None else None
            if own is not None and own.cell:
                self._last_cells[s.rank] = own.cell  # still shown once the ranks stopped
            out.append(
                {
                    "rank": s.rank,
                    "node": s.node,
                    "pid": s.pid,
                    "state": states[s.rank],
                    "cell": self._last_cells.get(s.rank, "") if interactive else None,
                    "elapsed": (s.ended_at or now) - s.started_at,
                    "cpu_percent": s.cpu_percent,
                    "rss": s.rss,
                    "peak_rss": s.peak_rss,
                    "cuda_allocated": s.cuda_allocated,
                    "cuda_reserved": s.cuda_reserved,
                    "last_line": s.last_line,
                    "attempt": s.attempt,
                }
            )
        self._nodes = nodes_of(out)
        return out

    def rows(self) -> list[dict[str, Any]]:
        """Return a status row per rank: rank, node, pid, state, cell, elapsed (s), cpu_percent, rss, peak_rss, cuda_*, last_line, attempt.

        Memory figures are bytes; CPU % and memory are None where the run does not report them.
        For interactive ranks, ``state`` is the rank's (idle, running, failed, dead) and ``cell`` the
        short text of the cell it runs, or ran last ("" before the first; None for a launch), shown in
        place of the elapsed time.
        """
        statuses = self.handle.status()
        _, states, mine = self._states(statuses)
        return self._rows(statuses, states, mine)

    def node_groups(self) -> list[dict[str, Any]]:
        """Return one entry per node of a launch across nodes (node, ranks, state, summed figures); [] on one machine."""
        return node_groups(self.rows())

    def _node_map(self) -> dict[int, str]:
        if not self._nodes:
            self._nodes = {s.rank: s.node for s in self.handle.status() if s.node}
        return self._nodes

    # -- bars and charts ----------------------------------------------------------------------------
    def bars(self) -> list[BarState]:
        """Return the bars the panel shows: open bars of the live ranks, then the last finished ones kept."""
        live = self.handle.live_bar_ranks
        by_rank: dict[int, list[BarState]] = {}
        for bar in self.handle.bars():
            if (live is None or bar.rank in live) and (not bar.closed or bar.leave):
                by_rank.setdefault(bar.rank, []).append(bar)
        shown: list[BarState] = []
        for rank in self.ranks:
            mine = by_rank.get(rank, [])
            finished = [b for b in mine if b.closed][-_KEPT_BARS:]
            shown.extend(b for b in mine if not b.closed or b in finished)
        return shown

    def chart_data(self) -> dict[str, tuple[list[float], list[float]]]:
        """Return the metric charts' data: ``{metric: (steps, values)}`` from ``handle.metrics``."""
        return metric_series(self.handle.metrics)

    # -- output lines -------------------------------------------------------------------------------
    def lines(self, rank: int, limit: int | None = None) -> list[str]:
        """Return the output lines of ``rank`` received so far (the newest ``limit`` of them)."""
        if rank not in self.rank_lines:
            raise ValueError(f"Unknown rank {rank}: this launch has ranks {self.ranks}")
        with self._lock:
            kept = self.rank_lines[rank].snapshot()
        return [line.text for line in (kept if limit is None else kept[-limit:])]

    def received(self, rank: int) -> int:
        """Return how many lines ``rank`` sent so far (kept or dropped): a view redraws a tab when it grows."""
        with self._lock:
            store = self.rank_lines.get(rank)
            return 0 if store is None else len(store) + store.dropped_lines

    def merged_lines(self, limit: int | None = None) -> list[str]:
        """Return every rank's lines in arrival order, prefixed ``[rank N]``, filtered by ``filter_text`` (the newest ``limit``)."""
        needle = self._filter.lower()
        with self._lock:
            kept = self.all_lines.snapshot()
        picked = [line for line in kept if not needle or needle in line.text.lower()]
        if limit is not None:
            picked = picked[-limit:]
        nodes = self._node_map()
        return [line_prefix(line, nodes.get(line.rank)) + line.text for line in picked]

    # -- texts --------------------------------------------------------------------------------------
    def attempt_text(self) -> str:
        """Return ``"attempt A/N"`` for a launch with restarts (", restarting" while waiting for the next try), else ""."""
        max_restarts = self.handle.max_restarts
        if not max_restarts:
            return ""
        text = f"attempt {self.handle.attempt}/{max_restarts + 1}"
        return text + (", restarting" if self.handle.restarting else "")

    def restart_lines(self) -> list[str]:
        """Return one line per earlier try that did not succeed: its number, time, root cause and exit code."""
        return [a.line() for a in self.handle.attempts if a.state != State.SUCCEEDED]

    def dropped_text(self) -> str:
        """Return a note when the launch dropped its oldest output lines to bound its memory, else ""."""
        return dropped_note(self.handle.dropped_lines)

    def error_text(self) -> str:
        """Return the root cause (rank, pid, type, message and traceback) of a failed launch, else ""."""
        error = self.handle.error
        if error is None:
            return ""
        root = error.root_cause
        if root is None:
            return str(error)
        more = len(error.failures) - 1
        others = f"\n(+{more} other rank(s) failed after it)" if more else ""
        return f"{root.headline()}\n{root.traceback}".rstrip() + others

    def job_text(self) -> str:
        """Return a line about the interactive ranks' last background job (``job 2 running 3.1 s: ...``), else ""."""
        ranks = self._ranks_of_handle()
        jobs = ranks.jobs if ranks is not None else []
        return jobs[-1].line() if jobs else ""

    def hang_text(self) -> str:
        """Return the launch's suspected-hang report (who waits where, every rank's stacks), else ""."""
        return self.handle.hang_report or ""

    # -- all of it at once --------------------------------------------------------------------------
    def snapshot(self) -> LaunchSnapshot:
        """Return everything the panel shows now but the output lines, from one ``status()`` of the run."""
        statuses = self.handle.status()
        done = self.handle.done
        state, states, mine = self._states(statuses)
        rows = self._rows(statuses, states, mine)
        interactive = self.ranks_object is not None
        return LaunchSnapshot(
            title="Interactive ranks" if interactive else "LaunchPanel",
            processes=self.handle.num_processes,
            state=state,
            done=done,
            interactive=interactive,
            rows=rows,
            groups=node_groups(rows),
            nodes=nodes_of(rows),
            bars=self.bars(),
            chart=self.chart_data(),
            attempt=self.attempt_text(),
            restarts=self.restart_lines(),
            dropped=self.dropped_text(),
            job=self.job_text(),
            error=self.error_text(),
            hang=self.hang_text(),
            stacks=dict(self.stacks),
        )


def _check_run_view(handle: object) -> None:
    """Raise TypeError unless ``handle`` is a run's read-only view (``launch.interfaces.RunView``)."""
    if not isinstance(handle, RunView):
        raise TypeError(
            f"LaunchPanel needs a LaunchHandle (notebook_launcher(..., block=False)) or interactive "
            f"ranks (start_ranks(...)); got {type(handle).__name__}, not a launch.interfaces.RunView"
        )


def _handle_of_ranks(ranks: object, handle: object) -> Any:
    """Return the launch handle of ``ranks`` (the one given, which must be theirs)."""
    if not isinstance(ranks, Ranks):
        raise TypeError(f"ranks= takes interactive ranks (start_ranks(...)); got {type(ranks).__name__}")
    if ranks.handle is None:
        raise ValueError(f"{ranks!r} were never started: start them with start_ranks(...) first")
    if handle is not None and handle is not ranks.handle:
        raise ValueError(
            "ranks= are not the ranks of this handle; pass ranks.handle, or just LaunchPanel(ranks)"
        )
    return ranks.handle
