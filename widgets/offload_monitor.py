"""OffloadMonitor: where an offloaded model's weights live, and what each forward pass spends moving them.

For a model streaming its weights to a GPU it also shows the host-to-device bandwidth the copies
achieved beside the pinned bandwidth measured on this machine, and how long the GPU waited for
weights against the rest of the pass.
"""

from __future__ import annotations

import collections
import html
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from notebook_accel import telemetry
from notebook_accel.hooks.offloaded import find_align_hook
from notebook_accel.hooks.streaming import measure_pinned_bandwidth

from ._base import _badge, _fmt_bytes, _import_ipywidgets, _Panel, _table, _text_table, _Throttle
from ._charts import png_img_tag, stacked_bars_png

__all__ = ["OffloadMonitor", "PassStats"]

_STORAGE_STYLE = {"cpu": "warning", "disk": "danger", "meta": ""}


@dataclass
class PassStats:
    """What one forward pass of the model did (times in seconds, sizes in bytes)."""

    index: int
    loads: int = 0
    """Weight loads onto the execution device."""
    prefetched_loads: int = 0
    """Loads the prefetcher had already done in the background."""
    offloads: int = 0
    bytes_moved: int = 0
    """Bytes of all loads and offloads."""
    move_seconds: float = 0.0
    """Time the forward's thread spent moving weights (prefetched loads overlap compute: not counted)."""
    prefetch_seconds: float = 0.0
    wall_seconds: float = 0.0
    modules: set[str] = field(default_factory=set)
    finished: bool = False
    transfer_bytes: int = 0
    """Streaming to a GPU: bytes the copies brought over (reported once the GPU finished them)."""
    transfer_seconds: float = 0.0
    """Streaming: the copies' time on the GPU."""
    wait_seconds: float = 0.0
    """Streaming: how long the GPU's compute stream stood waiting for weights."""

    @property
    def compute_seconds(self) -> float:
        """Return the pass's time neither moving weights (forward's thread) nor waiting for them (GPU)."""
        return max(0.0, self.wall_seconds - self.move_seconds - self.wait_seconds)

    @property
    def achieved_bandwidth(self) -> float | None:
        """Return the streamed copies' host-to-device bytes per second (None when nothing was streamed)."""
        return self.transfer_bytes / self.transfer_seconds if self.transfer_seconds else None


class OffloadMonitor(_Panel):
    """Live view of an offloaded/dispatched model: weight placement and per-pass loads, bytes, move vs compute time.

    Example::

        from notebook_accel import cpu_offload
        from notebook_accel.widgets import OffloadMonitor
        model = cpu_offload(model, execution_device="cuda:0")
        mon = OffloadMonitor(model)
        mon.display()           # updates live (at most ~10 times a second) while forwards run
        model(x)
        mon.passes[-1].bytes_moved, mon.passes[-1].move_seconds
        mon.reset(); mon.close()

    It subscribes to the hooks' telemetry (``notebook_accel.telemetry.subscribe``) and marks pass
    boundaries with a forward pre-hook/hook on the model itself; ``close()`` removes both.

    ``pinned_bandwidth`` (bytes/s) is what the achieved bandwidth is shown against; by default it is
    measured once (a 256 MiB pinned copy) when the model streams its weights to a GPU, else None.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_passes: int = 200,
        interval: float = 0.1,
        pinned_bandwidth: float | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"OffloadMonitor needs a torch.nn.Module, got {type(model).__name__}")
        if max_passes < 1:
            raise ValueError(f"max_passes must be >= 1, got {max_passes}")
        self.model = model
        self.max_passes = max_passes
        self._lock = threading.Lock()
        self.passes: collections.deque[PassStats] = collections.deque(maxlen=max_passes)
        self.module_totals: dict[str, dict[str, float]] = {}
        self._current: PassStats | None = None
        self._depth = 0
        self._started = 0.0
        self._count = 0
        self.placement: dict[str, dict] = telemetry.weight_placement(model)
        if pinned_bandwidth is None:
            device = _streamed_device(model)
            pinned_bandwidth = measure_pinned_bandwidth(device) if device is not None else None
        self.pinned_bandwidth = pinned_bandwidth
        """Host-to-device bytes/s from pinned memory on this machine (None: not streaming to a GPU)."""
        self._throttle = _Throttle(self._update_view, interval)
        self._subscription = telemetry.subscribe(self._on_event)
        self._handles = [
            model.register_forward_pre_hook(self._on_pass_start),
            model.register_forward_hook(self._on_pass_end, always_call=True),
        ]
        self.closed = False
        self._chart_throttle = _Throttle(self._draw_chart, 1.0)

    # -- recording ----------------------------------------------------------------------------
    def _open_pass(self) -> PassStats:
        self._count += 1
        self._current = PassStats(index=self._count)
        self.passes.append(self._current)
        return self._current

    def _on_pass_start(self, module: torch.nn.Module, args: Any) -> None:
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self._open_pass()
                self._started = time.perf_counter()

    def _on_pass_end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        with self._lock:
            self._depth = max(0, self._depth - 1)
            if self._depth or self._current is None:
                return
            self._current.wall_seconds = time.perf_counter() - self._started
            self._current.finished = True
            self._current = None
        self._throttle()

    def _on_event(self, event: Any) -> None:
        with self._lock:
            current = self._current or self._open_pass()  # events outside a model call: their own pass
            if event.kind in ("load", "offload"):
                if event.kind == "load":
                    current.loads += 1
                    current.prefetched_loads += int(event.prefetched)
                else:
                    current.offloads += 1
                current.bytes_moved += event.nbytes
                if event.prefetched:
                    current.prefetch_seconds += event.seconds
                else:
                    current.move_seconds += event.seconds
                totals = self.module_totals.setdefault(event.module, {"loads": 0, "bytes": 0, "seconds": 0.0})
                totals["loads"] += event.kind == "load"
                totals["bytes"] += event.nbytes
                totals["seconds"] += event.seconds
            elif event.kind == "transfer":
                current.transfer_bytes += event.nbytes
                current.transfer_seconds += event.seconds
            elif event.kind == "wait":
                current.wait_seconds += event.seconds
            current.modules.add(event.module)

    def _placement(self) -> dict[str, dict]:
        return telemetry.weight_placement(self.model)

    def reset(self) -> None:
        """Forget every recorded pass and total; re-read the weight placement."""
        with self._lock:
            self.passes.clear()
            self.module_totals.clear()
            self._current = None
            self._count = 0
        self.placement = self._placement()
        self.refresh()

    def close(self) -> None:
        """Unsubscribe from telemetry and remove the pass hooks (idempotent)."""
        self._subscription.close()
        for handle in self._handles:
            handle.remove()
        self._throttle.cancel()
        self._chart_throttle.cancel()
        self.closed = True

    # -- summaries ----------------------------------------------------------------------------
    def storage_summary(self) -> dict[str, dict[str, int]]:
        """Return ``{storage: {"modules": n, "nbytes": bytes}}`` over the weight placement."""
        out: dict[str, dict[str, int]] = {}
        for info in self.placement.values():
            entry = out.setdefault(info["storage"], {"modules": 0, "nbytes": 0})
            entry["modules"] += 1
            entry["nbytes"] += info["nbytes"]
        return out

    def finished_passes(self) -> list[PassStats]:
        """Return the completed passes, oldest first."""
        with self._lock:
            return [p for p in self.passes if p.finished]

    def bandwidth_summary(self) -> dict[str, float | None]:
        """Return, over the finished passes, the streamed copies' bytes/s and the GPU's share of time waiting.

        ``{"achieved": bytes/s or None, "pinned": bytes/s or None, "of_pinned": achieved / pinned or None,
        "waiting": seconds, "computing": seconds}``.
        """
        done = self.finished_passes()
        moved = sum(p.transfer_bytes for p in done)
        seconds = sum(p.transfer_seconds for p in done)
        achieved = moved / seconds if seconds else None
        pinned = self.pinned_bandwidth
        return {
            "achieved": achieved,
            "pinned": pinned,
            "of_pinned": achieved / pinned if achieved and pinned else None,
            "waiting": sum(p.wait_seconds for p in done),
            "computing": sum(p.compute_seconds for p in done),
        }

    def _pass_rows(self, last: int = 10) -> list[list[str]]:
        return [
            [
                str(p.index),
                str(p.loads),
                str(p.prefetched_loads),
                _fmt_bytes(p.bytes_moved),
                f"{p.move_seconds * 1000:.1f}",
                f"{p.wait_seconds * 1000:.1f}",
                f"{p.compute_seconds * 1000:.1f}",
                f"{p.wall_seconds * 1000:.1f}",
                "-" if p.achieved_bandwidth is None else f"{p.achieved_bandwidth / 1e9:.1f}",
            ]
            for p in self.finished_passes()[-last:]
        ]

    _PASS_HEADERS = [
        "pass", "loads", "prefetched", "bytes moved", "moving ms", "waiting ms", "computing ms", "total ms",
        "H2D GB/s",
    ]  # fmt: skip

    def _bandwidth_text(self) -> str:
        """Return one line: achieved vs pinned host-to-device bandwidth and the GPU's waiting time ("" if not streaming)."""
        summary = self.bandwidth_summary()
        if summary["achieved"] is None and summary["pinned"] is None:
            return ""
        achieved = "-" if summary["achieved"] is None else f"{summary['achieved'] / 1e9:.1f}"
        pinned = "-" if summary["pinned"] is None else f"{summary['pinned'] / 1e9:.1f}"
        share = "" if summary["of_pinned"] is None else f" ({100 * summary['of_pinned']:.0f}%)"
        return (
            f"host-to-device {achieved} GB/s{share} of {pinned} GB/s pinned; GPU waiting for weights "
            f"{summary['waiting'] * 1000:.1f} ms, computing {summary['computing'] * 1000:.1f} ms"
        )

    def _placement_rows(self) -> list[list[str]]:
        rows = []
        for name, info in self.placement.items():
            totals = self.module_totals.get(name, {})
            rows.append(
                [
                    name or "(model)",
                    str(info["execution_device"]),
                    info["storage"],
                    _fmt_bytes(info["nbytes"]),
                    str(int(totals.get("loads", 0))),
                    _fmt_bytes(totals.get("bytes", 0)),
                ]
            )
        return rows

    _PLACEMENT_HEADERS = ["module", "runs on", "weights in", "size", "loads", "bytes moved"]

    def chart_png(self, last: int = 30) -> bytes:
        """Return a PNG with one stacked bar per recent pass: milliseconds moving weights vs computing."""
        done = self.finished_passes()[-last:]
        labels = [str(p.index) for p in done] or ["-"]
        series = {
            "moving": [p.move_seconds * 1000 for p in done] or [0.0],
            "waiting": [p.wait_seconds * 1000 for p in done] or [0.0],
            "computing": [p.compute_seconds * 1000 for p in done] or [0.0],
        }
        colours = {"moving": "#d9534f", "waiting": "#f0ad4e", "computing": "#5cb85c"}
        return stacked_bars_png(
            labels, series, colours, "Forward passes: moving, waiting for weights, computing", ylabel="ms"
        )

    def _summary_html(self) -> str:
        badges = " ".join(
            _badge(
                f"{storage}: {v['modules']} modules, {_fmt_bytes(v['nbytes'])}",
                _STORAGE_STYLE.get(storage, "success"),
            )
            for storage, v in self.storage_summary().items()
        )
        line = self._bandwidth_text()
        extra = f"<br>{html.escape(line)}" if line else ""
        return f"<b>OffloadMonitor</b> — {html.escape(type(self.model).__name__)} {badges}{extra}"

    def _html(self) -> str:
        done = bool(self.finished_passes())
        return "<br>".join(
            [
                self._summary_html(),
                _table(self._PASS_HEADERS, self._pass_rows()) if done else "no forward pass yet",
                png_img_tag(self.chart_png(), "time per pass") if done else "",
                _table(self._PLACEMENT_HEADERS, self._placement_rows()[:200]),
            ]
        )

    def _text(self) -> str:
        summary = ", ".join(
            f"{s}: {v['modules']} modules {_fmt_bytes(v['nbytes'])}"
            for s, v in self.storage_summary().items()
        )
        done = self.finished_passes()
        text = f"OffloadMonitor({type(self.model).__name__}; {summary}; {len(done)} passes)"
        line = self._bandwidth_text()
        if line:
            text += "\n" + line
        if done:
            text += "\n" + _text_table(self._PASS_HEADERS, self._pass_rows())
        return text

    def _build_widget(self) -> Any:
        w = _import_ipywidgets()
        self._w_summary = w.HTML()
        self._w_passes = w.HTML()
        self._w_placement = w.HTML(layout=w.Layout(max_height="20em", overflow="auto"))
        self._w_reset = w.Button(description="Reset", icon="refresh")
        self._w_reset.on_click(lambda _b: self.reset())
        self._w_status = w.Label()
        self._w_chart = w.Image(format="png")
        return w.VBox(
            [
                w.HBox([self._w_summary, self._w_reset]),
                self._w_status,
                w.HBox([self._w_passes, self._w_chart]),
                self._w_placement,
            ]
        )

    def _refresh_widget(self) -> None:
        done = self.finished_passes()
        self._w_summary.value = self._summary_html()
        self._w_passes.value = (
            _table(self._PASS_HEADERS, self._pass_rows()) if done else "no forward pass yet"
        )
        self._w_placement.value = _table(self._PLACEMENT_HEADERS, self._placement_rows()[:200])
        # The chart costs tens of ms to draw: at most once a second (the last state still gets
        # drawn, by the throttle's trailing call), and at once after a reset.
        if done:
            self._chart_throttle()
        else:
            self._chart_throttle.flush()
        if done:
            moved = sum(p.move_seconds for p in done)
            wall = sum(p.wall_seconds for p in done) or 1e-12
            self._w_status.value = f"{len(done)} passes; {100 * moved / wall:.0f}% of the time moving weights"
        else:
            self._w_status.value = "waiting for a forward pass"

    def _draw_chart(self) -> None:
        if self._widget is not None and not self.closed:
            self._w_chart.value = self.chart_png()

    def _update_view(self) -> None:
        # Re-read the placement here, throttled, rather than walking the model after every pass.
        if not self.closed:
            self.placement = self._placement()
            self.refresh()


def _streamed_device(model: torch.nn.Module) -> torch.device | None:
    """Return the GPU ``model``'s offloaded weights stream to (None when they do not)."""
    for module in model.modules():
        hook = find_align_hook(module)
        prefetcher = getattr(hook, "_prefetcher", None) if hook is not None else None
        streamer = getattr(prefetcher, "streamer", None) if prefetcher is not None else None
        if streamer is not None and streamer.device.type == "cuda":
            return streamer.device
    return None
