"""LaunchPanel: live status, progress bars, metric charts, per-rank output, root-cause error and Stop for a launch.

The panel is a model (``_launch_model.LaunchModel``: every state it shows, plain Python) with this
thin ipywidgets view: it builds the widgets and copies the model's ``snapshot()`` and lines into
them, drawn by ``_launch_render``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from notebook_accel.interactive import Ranks
from notebook_accel.launch.output import rank_label

from . import _launch_render as render
from ._base import _import_ipywidgets, _Panel, _Throttle
from ._launch_model import _STATE_STYLE, LaunchModel, LaunchSnapshot
from ._metrics_chart import metrics_png
from ._progress import _BarRows

__all__ = ["LaunchPanel"]

_CHART_SECONDS = 1.0  # the metric chart is redrawn at most this often (matplotlib takes ~0.1 s a chart)


class LaunchPanel(LaunchModel, _Panel):
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

    ``handle`` is the run's read-only view: a ``LaunchHandle`` or ``RestartingHandle`` (``status()``,
    ``done``, ``error``, ``subscribe()``, ``subscribe_events()``, ``bars()``, ``metrics``,
    ``add_done_callback()``, ``stop()``...). Lines arrive on the handle's background thread; the view
    is updated at most ``1 / interval`` times a second from a timer thread. ``snapshot()`` gives all
    the panel shows at once, without a view.

    The panel shows the workers' tqdm bars (those of ``handle.live_bar_ranks``) as progress bars,
    and one chart per metric logged through ``NotebookTracker`` (``chart_data()``), redrawn at most
    once a second. The status rows show each rank's CPU %, resident and peak memory (and CUDA memory
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
        self, handle: Any, max_lines: int = 10_000, interval: float = 0.2, *, ranks: Ranks | None = None
    ) -> None:
        self._throttle = _Throttle(self._update_view, interval, defer=True)
        # Serialises view updates: the final state pushed at the end must not be overwritten by a
        # throttled refresh that read the state just before the launch ended.
        self._view_lock = threading.RLock()
        # Elapsed time and CPU% change without new lines: tick once a second while running.
        self._ticking = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="notebook_accel-launch-panel", daemon=True)
        self._chart_key: tuple = ()
        self._chart_at = 0.0
        self._drawn: dict[int, int] = {}  # rank -> lines it had sent when its tab was last drawn
        # The model registers its callbacks last: a finished launch calls _ended at once, from there.
        super().__init__(handle, max_lines, ranks=ranks)
        self._ticker.start()  # returns at once when the launch is already done

    # -- what the model says ------------------------------------------------------------------------
    def _changed(self, now: bool = False) -> None:
        if now:
            self.refresh()
        else:
            self._throttle()

    def _ended(self) -> None:
        self._ticking.set()
        # The view shows the end at once, not after the throttle's delay. Even a closed panel greys
        # out its Stop button: one left enabled would suggest the launch still runs.
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

    def close(self) -> None:
        """Stop receiving lines and updating the view (the launch itself keeps running)."""
        super().close()
        self._ticking.set()
        self._throttle.cancel()

    def _update_view(self) -> None:
        if not self.closed:
            self.refresh()

    # -- the static snapshot and text ---------------------------------------------------------------
    def _status_html(self) -> str:
        return render.status_html(self.snapshot())

    def _bars_html(self) -> str:
        return render.bars_html(self.snapshot())

    def _html(self) -> str:
        return render.panel_html(self.snapshot(), self.merged_lines(render.SHOWN_LINES))

    def _text(self) -> str:
        return render.panel_text(self.snapshot())

    # -- the widgets --------------------------------------------------------------------------------
    def _build_widget(self) -> Any:
        w = _import_ipywidgets()
        self._w_state = w.Button(disabled=True, layout=w.Layout(width="auto"))
        self._w_stop = w.Button(description="Stop", button_style="danger", icon="stop")
        self._w_stop.on_click(lambda _b: self.stop())
        self._w_stacks_button = w.Button(
            description="Stacks", icon="search", tooltip="every rank's Python stacks now"
        )
        self._w_stacks_button.on_click(lambda _b: self.show_stacks())
        self._w_stacks, self._w_hang, self._w_restarts = w.HTML(), w.HTML(), w.HTML()
        self._w_status, self._w_error = w.HTML(), w.HTML()
        self._w_bars = _BarRows(w)
        self._w_chart = w.Image(format="png", layout=w.Layout(display="none", max_width="100%"))
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
        self._w_tabs.titles = ["all ranks"] + [rank_label(r, nodes.get(r)) for r in self.ranks]
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

    def _set_controls(self, state: str, done: bool, attempt: str) -> None:
        self._w_state.description = f"{state} ({attempt})" if attempt else state
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
            self._set_controls(self.state, True, self.attempt_text())

    def _refresh_widget(self) -> None:
        with self._view_lock:
            snap = self.snapshot()
            self._set_controls(snap.state, snap.done, snap.attempt)
            self._w_status.value = render.status_html(snap)
            self._w_bars.update(snap.bars, snap.nodes)
            self._refresh_chart(snap)
            self._w_error.value = render.error_html(snap)
            self._w_hang.value = render.hang_html(snap)
            self._w_restarts.value = render.restarts_html(snap)
            self._w_stacks.value = render.stacks_html(snap)
            self._refresh_lines()

    def _refresh_lines(self) -> None:
        # A rank's tab is drawn again only when that rank sent lines since: at a hundred ranks most
        # tabs stand still between two updates.
        for rank, out in self._w_rank_out.items():
            received = self.received(rank)
            if self._drawn.get(rank) != received:
                self._drawn[rank] = received
                out.value = render.lines_html(self.lines(rank, render.SHOWN_LINES))
        self._w_merged.value = render.lines_html(self.merged_lines(render.SHOWN_LINES))

    def _refresh_chart(self, snap: LaunchSnapshot) -> None:
        series = snap.chart
        key = tuple((name, len(steps)) for name, (steps, _) in series.items())
        now = time.monotonic()
        if key == self._chart_key or (not snap.done and now - self._chart_at < _CHART_SECONDS):
            return  # nothing new, or drawn less than a second ago (the next tick draws it)
        self._chart_key, self._chart_at = key, now
        self._w_chart.value = metrics_png(series) if series else b""
        self._w_chart.layout.display = "" if series else "none"
