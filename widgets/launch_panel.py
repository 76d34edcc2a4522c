"""LaunchPanel: live status, progress bars, metric charts, per-rank output, root-cause error and Stop for a launch."""

from __future__ import annotations

import collections
import html
import sys
import threading
import time
from typing import Any

from notebook_accel.launch.doctor import rank_label
from notebook_accel.launch.states import State

from ._base import _badge, _fmt_bytes, _import_ipywidgets, _Panel, _table, _text_table, _Throttle
from ._charts import png_img_tag
from ._metrics_chart import metric_series, metrics_png
from ._nodes import grouped, grouped_table_html, grouped_text_rows, node_groups, nodes_of
from ._progress import _BarRows, bar_label

__all__ = ["LaunchPanel"]

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
_SHOWN_LINES = 500  # lines rendered per tab: the browser redraws the whole text on each update
_KEPT_BARS = 3  # finished bars (leave=True) still shown per rank, newest last, as tqdm.notebook keeps them
# An interactive rank's cell in its status row: one line, cut with an ellipsis past about 30 characters.
_CELL_STYLE = (
    "display:inline-block;max-width:22em;overflow:hidden;text-overflow:ellipsis;white-space:nowrap;"
    "vertical-align:middle"
)
_CHART_SECONDS = 1.0  # the metric chart is redrawn at most this often (matplotlib takes ~0.1 s a chart)


class LaunchPanel(_Panel):
    """Live panel of a launch: status and resource use per rank, progress bars, metric charts, output tabs, Stop.

    Example::

        from notebook_accel import notebook_launcher
        from notebook_accel.widgets import LaunchPanel
        handle = notebook_launcher(train, (config,), num_processes=2, block=False)
        panel = LaunchPanel(handle)
        panel.display()          # or notebook_launcher(..., panel=True)
        panel.filter_text = "loss"
        panel.merged_lines()     # ["[rank 0] loss 0.31", ...]
        panel.stop()             # handle.stop(): SIGINT, then SIGTERM, then SIGKILL

    ``handle`` is a ``LaunchHandle`` (``num_processes``, ``status()``, ``done``, ``error``,
    ``subscribe()``, ``add_done_callback()``, ``stop()``). Lines arrive on the handle's background
    thread; the view is updated at most ``1 / interval`` times a second from a timer thread.

    With a handle that sends events (``subscribe_events``, ``bars``, ``metrics``), the panel also
    shows the workers' tqdm bars (those of ``handle.live_bar_ranks``) as progress bars, and one
    chart per metric logged through ``NotebookTracker`` (``chart_data()``), redrawn at most once a
    second. The status rows show each rank's CPU %, resident and peak memory (and CUDA memory
    when a rank uses CUDA), as ``handle.status()`` reports them.

    Given interactive ranks (``LaunchPanel(ranks)`` for ``ranks = start_ranks(...)``, or
    ``LaunchPanel(ranks.handle, ranks=ranks)``; ``start_ranks(..., panel=True)`` shows one), the panel
    shows the ranks between cells too: each rank's state from ``ranks.status()`` (idle, running,
    failed: its last command raised, dead) and the ``cell`` it runs (or ran last); the overall state
    is idle, running, broken (``ranks.restart()`` recovers) or stopped; Stop calls ``ranks.stop()``.
    A panel of ranks' handle built without ``ranks=`` finds them when they are the current ranks
    (``notebook_accel.interactive.current()``).

    With a handle that restarts (``notebook_launcher(..., max_restarts=k)``), the header shows
    ``attempt_text()`` ("attempt 2/3") and the panel lists ``restart_lines()``, one per earlier try
    that failed (its root cause, exit code and time); lines of a later try are shown as
    ``[rank N, attempt A]``.

    With a launch across several machines (``nodes=``: each ``RankStatus`` names its ``node``), the
    status table shows a row per node (its ranks' state, summed CPU %, memory and CUDA memory) above
    that node's ranks (``node_groups()``), and bars, output lines and tabs name the node:
    ``[gpu-a rank 2]``. On one machine nothing changes.
    """

    def __init__(
        self, handle: Any, max_lines: int = 10_000, interval: float = 0.2, *, ranks: Any = None
    ) -> None:
        if ranks is None and _is_ranks(handle):
            ranks, handle = handle, handle.handle
        if ranks is not None:
            handle = _handle_of_ranks(ranks, handle)
        for attr in ("status", "subscribe", "add_done_callback", "stop", "done", "error"):
            if not hasattr(handle, attr):
                raise TypeError(
                    f"LaunchPanel needs a LaunchHandle (notebook_launcher(..., block=False)) or interactive "
                    f"ranks (start_ranks(...)); {type(handle).__name__} has no {attr!r}"
                )
        self.handle = handle
        self._ranks = ranks
        self._last_cells: dict[int, str] = {}
        self.max_lines = max_lines
        self._lock = threading.Lock()
        self.ranks = [s.rank for s in handle.status()]
        self.rank_lines: dict[int, collections.deque] = {
            r: collections.deque(maxlen=max_lines) for r in self.ranks
        }
        self.all_lines: collections.deque = collections.deque(maxlen=max_lines)
        self._filter = ""
        self.closed = False
        self._throttle = _Throttle(self._update_view, interval, defer=True)
        # Serialises view updates: the final state pushed by _on_done must not be overwritten by a
        # throttled refresh that read the state just before the launch ended.
        self._view_lock = threading.RLock()
        # Elapsed time and CPU% change without new lines: tick once a second while running.
        self._ticking = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="notebook_accel-launch-panel", daemon=True)
        # Every attribute exists before the callbacks are registered: a finished handle calls
        # _on_done (and replays its lines into _on_line) at once, from inside these calls.
        self._chart_key: tuple = ()
        self._chart_at = 0.0
        self.stacks: dict[int, Any] = {}
        self._nodes: dict[int, str] = {}  # rank -> host of a launch across nodes (empty on one machine)
        """The ranks' stacks from the last ``show_stacks()`` ("Stacks" button): ``{rank: RankStack}``."""
        self._unsubscribe_events = (
            handle.subscribe_events(self._on_event) if hasattr(handle, "subscribe_events") else (lambda: None)
        )
        self._unsubscribe = handle.subscribe(self._on_line)
        handle.add_done_callback(self._on_done)
        self._ticker.start()  # returns at once when the launch is already done

    # -- model ----------------------------------------------------------------------------------
    def _on_line(self, line: Any) -> None:
        with self._lock:
            self.rank_lines.setdefault(line.rank, collections.deque(maxlen=self.max_lines)).append(line)
            self.all_lines.append(line)
        self._throttle()

    def _on_event(self, _kind: str, _rank: int, _state: Any) -> None:
        self._throttle()

    def _on_done(self, _handle: Any) -> None:
        self._ticking.set()
        # The view shows the end at once, not after the throttle's delay (every line was delivered
        # before the handle became done). Even a closed panel greys out its Stop button: one left
        # enabled would suggest the launch still runs.
        if self.closed:
            self._show_final_controls()
        else:
            self._throttle.flush()
        # The saved notebook's static snapshot should show how the launch ended, not "running".
        self._update_snapshot()

    def _tick(self) -> None:
        # Ends as soon as the launch is done or the panel closed (the event is set), not a second later.
        while not self._ticking.wait(1.0):
            self._throttle()

    @property
    def filter_text(self) -> str:
        """Return the text the merged tab filters on (case-insensitive substring; "" shows all)."""
        return self._filter

    @filter_text.setter
    def filter_text(self, value: str) -> None:
        self._filter = str(value)
        self.refresh()

    @property
    def ranks_object(self) -> Any:
        """Return the interactive ranks this panel shows (``start_ranks``), or None for a launch."""
        if self._ranks is None:
            self._ranks = _current_ranks_of(self.handle)
        return self._ranks

    def _rank_states(self) -> dict[int, Any] | None:
        """Return ``{rank: RankState}`` of the interactive ranks while they run on this panel's handle, else None."""
        ranks = self.ranks_object
        if ranks is None or ranks.handle is not self.handle or self.handle.done:
            return None
        return {s.rank: s for s in ranks.status()}

    @property
    def state(self) -> State:
        """Return the overall state: RUNNING, SUCCEEDED, FAILED or STOPPED (interactive ranks: IDLE, RUNNING, BROKEN or STOPPED)."""
        ranks = self.ranks_object
        if ranks is not None:
            return self._ranks_state(ranks)
        if not self.handle.done:
            return State.RUNNING
        states = {s.state for s in self.handle.status()}
        if self.handle.error is not None:
            return State.FAILED if State.FAILED in states or State.STOPPED not in states else State.STOPPED
        return State.STOPPED if State.STOPPED in states else State.SUCCEEDED

    def _ranks_state(self, ranks: Any) -> State:
        if ranks.handle is not self.handle:
            return State.STOPPED  # restarted: new ranks run on a new handle
        if self.handle.done:
            # Decided from the handle alone (``ranks.broken`` also reads True while stop() waits for
            # the ranks to end): ranks whose loops returned were stopped; an error (a rank died, or
            # was killed in a collective) or a hang report means the group broke.
            failed = any(s.state == State.FAILED for s in self.handle.status())
            broke = self.handle.error is not None or failed or bool(self.hang_text())
            return State.BROKEN if broke else State.STOPPED
        if ranks.broken:
            return State.BROKEN
        states = self._rank_states() or {}
        return State.RUNNING if any(s.state == State.RUNNING for s in states.values()) else State.IDLE

    def rows(self) -> list[dict[str, Any]]:
        """Return a status row per rank: rank, pid, state, elapsed (s), cpu_percent, rss, peak_rss, cuda_*, last_line.

        Memory figures are bytes; CPU % and memory are None where the handle does not report them.
        For interactive ranks, ``state`` is the rank's (idle, running, failed, dead) and ``cell`` the
        short text of the cell it runs, or ran last ("" before the first; None for a launch), shown in
        place of the elapsed time.
        """
        now = time.time()
        ranks = self._rank_states()
        interactive = self.ranks_object is not None
        out = []
        for s in self.handle.status():
            mine = ranks.get(s.rank) if ranks is not None else None
            if mine is not None and mine.cell:
                self._last_cells[s.rank] = mine.cell  # still shown once the ranks stopped
            state = s.state
            if mine is not None:
                state = mine.state
            elif interactive and self.handle.done:
                state = State.STOPPED if s.state in (State.SUCCEEDED, State.STOPPED) else s.state
            out.append(
                {
                    "rank": s.rank,
                    "node": getattr(s, "node", None),
                    "pid": s.pid,
                    "state": state,
                    "cell": self._last_cells.get(s.rank, "") if interactive else None,
                    "elapsed": (s.ended_at or now) - s.started_at,
                    "cpu_percent": getattr(s, "cpu_percent", None),
                    "rss": getattr(s, "rss", None),
                    "peak_rss": getattr(s, "peak_rss", None),
                    "cuda_allocated": getattr(s, "cuda_allocated", None),
                    "cuda_reserved": getattr(s, "cuda_reserved", None),
                    "last_line": s.last_line,
                    "attempt": getattr(s, "attempt", 1),
                }
            )
        self._nodes = nodes_of(out)
        return out

    def node_groups(self) -> list[dict[str, Any]]:
        """Return one entry per node of a launch across nodes (node, ranks, state, summed figures); [] on one machine."""
        return node_groups(self.rows())

    def _node_map(self) -> dict[int, str]:
        if not self._nodes:
            self._nodes = {s.rank: s.node for s in self.handle.status() if getattr(s, "node", None)}
        return self._nodes

    def bars(self) -> list[Any]:
        """Return the bars the panel shows: open bars of the live ranks, then the last finished ones kept."""
        if not hasattr(self.handle, "bars"):
            return []
        live = getattr(self.handle, "live_bar_ranks", None)
        shown: list[Any] = []
        for rank in self.ranks:
            if live is not None and rank not in live:
                continue
            mine = [b for b in self.handle.bars(rank) if not b.closed or b.leave]
            finished = [b for b in mine if b.closed][-_KEPT_BARS:]
            shown.extend(b for b in mine if not b.closed or b in finished)
        return shown

    def chart_data(self) -> dict[str, tuple[list[float], list[float]]]:
        """Return the metric charts' data: ``{metric: (steps, values)}`` from ``handle.metrics``."""
        return metric_series(getattr(self.handle, "metrics", None) or [])

    def lines(self, rank: int) -> list[str]:
        """Return the output lines of ``rank`` received so far."""
        if rank not in self.rank_lines:
            raise ValueError(f"Unknown rank {rank}: this launch has ranks {self.ranks}")
        with self._lock:
            return [line.text for line in self.rank_lines[rank]]

    def merged_lines(self) -> list[str]:
        """Return every rank's lines in arrival order, prefixed ``[rank N]``, filtered by ``filter_text``."""
        needle = self._filter.lower()
        with self._lock:
            lines = list(self.all_lines)
        nodes = self._node_map()
        return [
            _line_prefix(line, nodes.get(line.rank)) + line.text
            for line in lines
            if not needle or needle in line.text.lower()
        ]

    def attempt_text(self) -> str:
        """Return ``"attempt A/N"`` for a launch with restarts (", restarting" while waiting for the next try), else ""."""
        max_restarts = getattr(self.handle, "max_restarts", 0)
        if not max_restarts:
            return ""
        text = f"attempt {self.handle.attempt}/{max_restarts + 1}"
        return text + (", restarting" if getattr(self.handle, "restarting", False) else "")

    def dropped_text(self) -> str:
        """Return a note when the launch dropped its oldest output lines to bound its memory, else ""."""
        dropped = getattr(self.handle, "dropped_lines", 0)
        return f"{dropped} older output line(s) dropped (log_dir= keeps them all)" if dropped else ""

    def restart_lines(self) -> list[str]:
        """Return one line per earlier try that did not succeed: its number, time, root cause and exit code."""
        return [a.line() for a in getattr(self.handle, "attempts", []) if a.state != State.SUCCEEDED]

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

    def show_stacks(self) -> dict[int, Any]:
        """Return every live rank's current stacks (``handle.stacks()``), kept in ``stacks`` and shown side by side."""
        self.stacks = self.handle.stacks() if hasattr(self.handle, "stacks") else {}
        self.refresh()
        return self.stacks

    def job_text(self) -> str:
        """Return a line about the interactive ranks' last background job (``job 2 running 3.1 s: ...``), else ""."""
        ranks = self.ranks_object
        jobs = getattr(ranks, "jobs", None) if ranks is not None and ranks.handle is self.handle else None
        return jobs[-1].line() if jobs else ""

    def hang_text(self) -> str:
        """Return the launch's hang report (who waits where, each rank's position and stacks), else ""."""
        return getattr(self.handle, "hang_report", None) or ""

    def _stacks_html(self) -> str:
        if not self.stacks:
            return ""
        cells = [
            f"<td style='vertical-align:top'><b>{html.escape(rank_label(rank, stack.node))}</b>: "
            f"{html.escape(stack.summary())}"
            f"<pre style='margin:0;font-size:11px'>{html.escape(stack.text)}</pre></td>"
            for rank, stack in sorted(self.stacks.items())
        ]
        return f"<div style='overflow:auto'><table><tr>{''.join(cells)}</tr></table></div>"

    def _restarts_html(self) -> str:
        lines = self.restart_lines()
        if not lines:
            return ""
        return (
            "<div style='background:#fcf8e3;border:1px solid #f0ad4e;padding:4px'>"
            f"<b>{html.escape(self.attempt_text())}</b>"
            f"<pre style='margin:0;white-space:pre-wrap'>{html.escape(chr(10).join(lines))}</pre></div>"
        )

    def _hang_html(self) -> str:
        text = self.hang_text()
        if not text:
            return ""
        return (
            "<div style='background:#fcf8e3;border:1px solid #f0ad4e;padding:4px'><b>Hang report</b>"
            f"<pre style='margin:0;white-space:pre-wrap'>{html.escape(text)}</pre></div>"
        )

    def stop(self) -> None:
        """Stop every worker of the launch (``handle.stop()``; interactive ranks: ``ranks.stop()``; safe to call twice)."""
        ranks = self.ranks_object
        if ranks is not None and ranks.handle is self.handle:
            ranks.stop()
        else:
            self.handle.stop()
        self._throttle()

    def close(self) -> None:
        """Stop receiving lines and updating the view (the launch itself keeps running)."""
        self.closed = True
        self._ticking.set()
        self._unsubscribe()
        self._unsubscribe_events()
        self._throttle.cancel()

    # -- rendering ------------------------------------------------------------------------------
    _HEADERS = ["rank", "pid", "state", "elapsed", "CPU %", "memory", "peak memory", "last line"]

    @staticmethod
    def _uses_cuda(rows: list[dict[str, Any]]) -> bool:
        return any(r["cuda_allocated"] is not None for r in rows)

    def _headers(self, rows: list[dict[str, Any]]) -> list[str]:
        headers = list(self._HEADERS)
        if any(r["cell"] is not None for r in rows):
            headers[3] = "cell"  # interactive ranks: the cell, in place of the ranks' age
        if self._uses_cuda(rows):
            headers.insert(-1, "CUDA allocated / reserved")
        return headers

    def _row_cells(self, row: dict[str, Any], cuda: bool = False) -> list[str]:
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

    def _status_html(self) -> str:
        rows = self.rows()
        cuda = self._uses_cuda(rows)
        cells_of_rows = []
        for row in rows:
            # Figures never wrap (a squeezed table read "243.11 / MiB" on two lines); the last line may.
            texts = self._row_cells(row, cuda)
            cells = [f"<span style='white-space:nowrap'>{html.escape(c)}</span>" for c in texts[:-1]]
            cells.append(html.escape(texts[-1]))
            cells[2] = _badge(row["state"], _STATE_STYLE.get(row["state"], ""))
            if row["cell"] is not None:  # the cell's first line, cut to the column (all of it on hover)
                cells[3] = (
                    f"<code style='{_CELL_STYLE}' title='{html.escape(row['cell'], quote=True)}'>"
                    f"{html.escape(row['cell'])}</code>"
                )
            cells_of_rows.append(cells)
        dropped = self.dropped_text()
        note = f"<div><i>{html.escape(dropped)}</i></div>" if dropped else ""
        job = self.job_text()
        note += f"<div><b>background</b> <code>{html.escape(job)}</code></div>" if job else ""
        groups = node_groups(rows)
        if groups:
            parts = grouped(rows, cells_of_rows, groups)
            return grouped_table_html(self._headers(rows), parts, cuda, _STATE_STYLE) + note
        return _table(self._headers(rows), cells_of_rows, escape=False, wrap_headers=False) + note

    def _bars_html(self) -> str:
        bars = self.bars()
        nodes = self._node_map()
        return "".join(f"<div>{bar_label(b, nodes.get(b.rank))}</div>" for b in bars)

    def _chart_html(self) -> str:
        series = self.chart_data()
        return png_img_tag(metrics_png(series), alt="metrics") if series else ""

    def _error_html(self) -> str:
        text = self.error_text()
        if not text:
            return ""
        return (
            "<div style='background:#f2dede;border:1px solid #d9534f;padding:4px'><b>Launch failed</b>"
            f"<pre style='margin:0;white-space:pre-wrap'>{html.escape(text)}</pre></div>"
        )

    @staticmethod
    def _pre(lines: list[str]) -> str:
        return f"<pre style='margin:0'>{html.escape(chr(10).join(lines[-_SHOWN_LINES:]))}</pre>"

    def _html(self) -> str:
        state = self.state
        attempt = html.escape(self.attempt_text())
        return (
            f"<b>{'Interactive ranks' if self.ranks_object is not None else 'LaunchPanel'}</b> "
            f"{self.handle.num_processes if hasattr(self.handle, 'num_processes') else len(self.ranks)}"
            f" process(es) {_badge(state, _STATE_STYLE.get(state, ''))} {attempt}<br>"
            + self._restarts_html()
            + self._status_html()
            + self._bars_html()
            + self._chart_html()
            + self._error_html()
            + self._hang_html()
            + self._stacks_html()
            + self._pre(self.merged_lines())
        )

    def _text(self) -> str:
        rows = self.rows()
        cuda = self._uses_cuda(rows)
        nodes = self._node_map()
        bars = "".join(f"\n[{_where(b.rank, nodes)}] {b.text}" for b in self.bars())
        headers, cells = self._headers(rows), [self._row_cells(r, cuda) for r in rows]
        groups = node_groups(rows)
        if groups:
            cells = grouped_text_rows(grouped(rows, cells, groups), len(headers), cuda)
        table = _text_table(headers, cells)
        attempt = f", {self.attempt_text()}" if self.attempt_text() else ""
        restarts = "".join(f"\n{line}" for line in self.restart_lines())
        dropped = f"\n{self.dropped_text()}" if self.dropped_text() else ""
        job = f"\nbackground {self.job_text()}" if self.job_text() else ""
        return f"LaunchPanel({self.state}{attempt}){restarts}{dropped}\n{table}{job}{bars}"

    def _build_widget(self) -> Any:
        w = _import_ipywidgets()
        self._w_state = w.Button(disabled=True, layout=w.Layout(width="auto"))
        self._w_stop = w.Button(description="Stop", button_style="danger", icon="stop")
        self._w_stop.on_click(lambda _b: self.stop())
        self._w_stacks_button = w.Button(
            description="Stacks", icon="search", tooltip="every rank's Python stacks now"
        )
        self._w_stacks_button.on_click(lambda _b: self.show_stacks())
        self._w_stacks = w.HTML()
        self._w_hang = w.HTML()
        self._w_restarts = w.HTML()
        self._w_status = w.HTML()
        self._w_bars = _BarRows(w)
        self._w_chart = w.Image(format="png", layout=w.Layout(display="none", max_width="100%"))
        self._w_error = w.HTML()
        self._w_rank_out = {
            r: w.HTML(layout=w.Layout(max_height="24em", overflow="auto")) for r in self.ranks
        }
        self._w_filter = w.Text(placeholder="filter lines", description="filter", continuous_update=True)
        self._w_filter.observe(lambda c: setattr(self, "filter_text", c["new"]), names="value")
        self._w_merged = w.HTML(layout=w.Layout(max_height="24em", overflow="auto"))
        self._w_tabs = w.Tab(
            children=[w.VBox([self._w_filter, self._w_merged])] + [self._w_rank_out[r] for r in self.ranks]
        )
        nodes = self._node_map()
        self._w_tabs.titles = ["all ranks"] + [_where(r, nodes) for r in self.ranks]
        return w.VBox(
            [
                w.HBox([self._w_state, self._w_stop, self._w_stacks_button]),
                self._w_restarts,
                self._w_status,
                self._w_hang,
                self._w_stacks,
                self._w_bars.box,
                self._w_chart,
                self._w_error,
                self._w_tabs,
            ]
        )

    def _set_controls(self, state: State, done: bool) -> None:
        attempt = self.attempt_text()
        self._w_state.description = f"{state} ({attempt})" if attempt else str(state)
        self._w_state.button_style = _STATE_STYLE.get(state, "")
        self._w_stop.disabled = done
        self._w_stacks_button.disabled = done
        # Once the launch ended the Stop button is greyed out and says how it ended.
        self._w_stop.button_style = "" if done else "danger"
        ranks = self.ranks_object is not None
        what = "ranks" if ranks else "launch"
        self._w_stop.tooltip = (
            f"{what} {state}" if done else ("stop the ranks" if ranks else "stop every worker")
        )

    def _show_final_controls(self) -> None:
        if self._widget is None:
            return
        with self._view_lock:
            self._set_controls(self.state, True)

    def _refresh_widget(self) -> None:
        with self._view_lock:
            self._refresh_widget_locked()

    def _refresh_widget_locked(self) -> None:
        done = self.handle.done
        self._set_controls(self.state, done)
        self._w_status.value = self._status_html()
        self._w_bars.update(self.bars(), self._node_map())
        self._refresh_chart(done)
        self._w_error.value = self._error_html()
        self._w_hang.value = self._hang_html()
        self._w_restarts.value = self._restarts_html()
        self._w_stacks.value = self._stacks_html()
        for rank, out in self._w_rank_out.items():
            out.value = self._pre(self.lines(rank))
        self._w_merged.value = self._pre(self.merged_lines())

    def _refresh_chart(self, done: bool) -> None:
        series = self.chart_data()
        key = tuple((name, len(steps)) for name, (steps, _) in series.items())
        now = time.monotonic()
        if key == self._chart_key or (not done and now - self._chart_at < _CHART_SECONDS):
            return  # nothing new, or drawn less than a second ago (the next tick draws it)
        self._chart_key, self._chart_at = key, now
        self._w_chart.value = metrics_png(series) if series else b""
        self._w_chart.layout.display = "" if series else "none"

    def _update_view(self) -> None:
        if not self.closed:
            self.refresh()


def _line_prefix(line: Any, node: str | None = None) -> str:
    """Return ``[rank N] `` (``!`` after N for stderr; ``[node rank N]`` across nodes), with ``, attempt A`` for a restarted try."""
    bang = "!" if line.stream == "stderr" else ""
    attempt = getattr(line, "attempt", 1)
    where = _where(line.rank, {line.rank: node} if node else {})
    return f"[{where}{bang}] " if attempt == 1 else f"[{where}{bang}, attempt {attempt}] "


def _where(rank: int, nodes: dict[int, str]) -> str:
    """Return ``rank N``, or ``HOST rank N`` for a rank of a launch across nodes."""
    node = nodes.get(rank)
    return f"{node} rank {rank}" if node else f"rank {rank}"


def _is_ranks(obj: Any) -> bool:
    """Return True for interactive ranks (``start_ranks``): a ``handle`` and ``status()``, but not a handle itself."""
    return hasattr(obj, "handle") and hasattr(obj, "status") and not hasattr(obj, "subscribe")


def _handle_of_ranks(ranks: Any, handle: Any) -> Any:
    """Return the launch handle of ``ranks`` (the one given, which must be theirs)."""
    if not _is_ranks(ranks):
        raise TypeError(f"ranks= takes interactive ranks (start_ranks(...)); got {type(ranks).__name__}")
    if ranks.handle is None:
        raise ValueError(f"{ranks!r} were never started: start them with start_ranks(...) first")
    if handle is not None and handle is not ranks.handle:
        raise ValueError(
            "ranks= are not the ranks of this handle; pass ranks.handle, or just LaunchPanel(ranks)"
        )
    return ranks.handle


def _current_ranks_of(handle: Any) -> Any:
    """Return the current interactive ranks when ``handle`` is theirs (their panel=True panel), else None."""
    session = sys.modules.get("notebook_accel.interactive.session")  # never imported: no ranks exist
    if session is None:
        return None
    ranks = session.current()
    return ranks if ranks is not None and ranks.handle is handle else None
