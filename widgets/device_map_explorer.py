"""DeviceMapExplorer: try device budgets, dtypes, no-split classes and strategies; see the device map live.

The panel is a model (``_device_map_model.DeviceMapModel``: the map and everything shown of it, plain
Python) with this thin ipywidgets view: a slider and a text box per device budget, the dtype, strategy
and no-split controls, one stacked bar per device, the usage table, the module tree and the code to paste.
"""

from __future__ import annotations

import html
from typing import Any

from notebook_accel.utils.device_planning.device_map import DEVICE_MAP_STRATEGIES

from ._base import _badge, _fmt_bytes, _import_ipywidgets, _Panel, _table, _text_table
from ._charts import png_img_tag, stacked_bars_png
from ._device_map_inputs import DTYPES
from ._device_map_model import USAGE_HEADERS, DeviceMapModel, device_style

__all__ = ["DeviceMapExplorer"]

_AS_STORED = "as stored"  # the dtype dropdown's value for None (ipywidgets shows a None value blank)
_COLOURS = {"weights": "#337ab7", "reserved": "#f0ad4e", "free": "#dddddd"}


class DeviceMapExplorer(DeviceMapModel, _Panel):
    """Device map of a model for adjustable budgets, dtype, no-split classes and strategy.

    Example::

        from notebook_accel import init_empty_weights
        from notebook_accel.widgets import DeviceMapExplorer
        with init_empty_weights():
            model = MyModel(config)
        ex = DeviceMapExplorer(model, max_memory={0: "10GiB", "cpu": "30GiB"})
        ex.display()                   # sliders per device, bars, module tree with device badges
        ex.set_budget(0, 6.0)          # GiB; the map is recomputed at once, the slider follows
        ex.streaming_budget = "1GiB"   # keep room on GPU 0 for the weights the streaming offload copies ahead
        print(ex.to_code())            # device_map = {...} and max_memory = {...} to paste

    Every change recomputes ``device_map`` with the core's ``infer_auto_device_map`` ("auto" and
    "balanced" first balance the GPUs with ``get_balanced_memory``, "balanced_low_0" keeps GPU 0
    light, "sequential" fills devices in order). The reserve of the first GPU (``usage()``'s
    "reserved") is the room kept for the offloaded layers brought there to run: the largest one, or
    the ``streaming_budget`` (the streaming offload's ``lookahead``) when that is larger.
    """

    def _changed(self) -> None:
        self.refresh()

    # -- rendering ----------------------------------------------------------------------------
    def chart_png(self) -> bytes:
        """Return a PNG with one stacked bar per device: weights, reserved room for the largest layer, free."""
        labels, series, limits = self.chart_series()
        title = f"Device map ({self._strategy})"
        return stacked_bars_png(labels, series, _COLOURS, title, ylabel=self.slider_unit[0], limits=limits)

    def _tree_html(self) -> str:
        rows = []
        for node in self.tree():
            badges = " ".join(_badge(d, device_style(d)) for d in node["devices"])
            indent = "&nbsp;" * 4 * node["depth"]
            rows.append(
                f"<div style='font-family:monospace;font-size:90%'>{indent}{html.escape(node['name'])} "
                f"<span style='color:#888'>{html.escape(node['class'])} {_fmt_bytes(node['bytes'])}</span> {badges}</div>"
            )
        return "".join(rows)

    def _extras_html(self) -> str:
        parts = []
        for tie in self.tie_groups():
            style = "danger" if tie["split"] else "success"
            parts.append(
                f"tied: {html.escape(', '.join(tie['parameters']))} "
                + " ".join(_badge(d, style) for d in tie["devices"])
            )
        missing = self.unmapped()
        if missing:
            parts.append(_badge("unmapped", "danger") + " " + html.escape(", ".join(missing[:20])))
        return "<br>".join(parts) or "no tied parameters; every tensor is mapped"

    def _usage_html(self) -> str:
        # A size keeps its number and unit on one line ("4.00 MiB", not "4.00" over "MiB") beside the chart.
        rows = [[cell.replace(" ", "\xa0") for cell in row] for row in self.usage_rows()]
        return _table(USAGE_HEADERS, rows)

    def _html(self) -> str:
        return "<br>".join(
            [
                f"<b>DeviceMapExplorer</b> — {html.escape(self.summary())}",
                self._usage_html(),
                png_img_tag(self.chart_png(), "device usage"),
                self._extras_html(),
                self._tree_html(),
            ]
        )

    def _text(self) -> str:
        return (
            f"DeviceMapExplorer({type(self.model).__name__}, strategy={self._strategy!r}, dtype={self._dtype!r}, "
            f"{len(self.device_map)} entries)\n" + _text_table(USAGE_HEADERS, self.usage_rows())
        )

    # -- the ipywidgets view ----------------------------------------------------------------------
    def _build_widget(self) -> Any:
        w = _import_ipywidgets()
        budgets = self._budget_widgets(w)
        controls = self._control_widgets(w)
        self._w_chart = w.Image(format="png")
        # Sized from 26em, not from its widest line: the table sits beside the chart in a panel of ~850 px
        # (its long header wrapping) and goes below it only in a narrower one.
        self._w_usage = w.HTML(layout=w.Layout(flex="1 1 26em"))
        self._w_extras = w.HTML()
        self._w_tree = w.HTML(layout=w.Layout(max_height="24em", overflow="auto"))
        self._w_code = w.Textarea(layout=w.Layout(width="100%", height="10em"))
        self._w_timing = w.Label()
        shown = w.HBox([self._w_chart, self._w_usage], layout=w.Layout(flex_flow="row wrap", width="100%"))
        return w.VBox(
            budgets + controls + [shown, self._w_extras, self._w_tree, self._w_code, self._w_timing]
        )

    def _budget_widgets(self, w: Any) -> list[Any]:
        """Return a row per budgeted device: a slider linked to a text box, in ``slider_unit``."""
        self._w_sliders: dict[int | str, Any] = {}
        self._w_texts: dict[int | str, Any] = {}
        # Unit and step are fixed when the view is built (from the model's size then).
        self._w_unit = self.slider_unit
        name, unit = self._w_unit
        top, step = self.slider_range()
        rows = []
        for device, budget in self.max_memory.items():
            slider = w.FloatSlider(
                value=budget / unit,
                min=0.0,
                max=top,
                step=step,
                description=f"{device} ({name})",
                continuous_update=False,
                readout=False,
            )
            text = w.FloatText(value=budget / unit, step=step, layout=w.Layout(width="7em"))
            w.link((slider, "value"), (text, "value"))
            slider.observe(self._on_budget(device), names="value")
            self._w_sliders[device], self._w_texts[device] = slider, text
            rows.append(w.HBox([slider, text]))
        return rows

    def _control_widgets(self, w: Any) -> list[Any]:
        """Return the dtype dropdown, the strategy buttons and the no-split tags, each setting its control."""
        self._w_dtype = w.Dropdown(
            options=[(_AS_STORED, _AS_STORED)] + [(d, d) for d in DTYPES if d],
            value=self._dtype or _AS_STORED,
            description="dtype",
        )
        self._w_dtype.observe(self._on_dtype, names="value")
        self._w_strategy = w.ToggleButtons(
            options=list(DEVICE_MAP_STRATEGIES), value=self._strategy, description="strategy"
        )
        self._w_strategy.observe(self._on_strategy, names="value")
        self._w_no_split = w.TagsInput(
            value=list(self._no_split), allowed_tags=self.class_names, allow_duplicates=False
        )
        self._w_no_split.observe(self._on_no_split, names="value")
        return [self._w_dtype, self._w_strategy, w.HBox([w.Label("no split:"), self._w_no_split])]

    def _on_budget(self, device: int | str):  # noqa: ANN202
        def handler(change: dict) -> None:
            nbytes = round(max(0.0, float(change["new"])) * self._w_unit[1])
            if nbytes != self.max_memory.get(device):
                self._set_budget_bytes(device, nbytes)

        return handler

    # Each control's handler sets the model only for a new value: not when refresh() shows a value set from code.
    def _on_dtype(self, change: dict) -> None:
        dtype = None if change["new"] == _AS_STORED else change["new"]
        if dtype != self._dtype:
            self.dtype = dtype

    def _on_strategy(self, change: dict) -> None:
        if change["new"] != self._strategy:
            self.strategy = change["new"]

    def _on_no_split(self, change: dict) -> None:
        if list(change["new"]) != self._no_split:
            self.no_split_module_classes = list(change["new"])

    def _refresh_widget(self) -> None:
        unit = self._w_unit[1]
        for device, slider in self._w_sliders.items():
            # set_budget() from code moves the slider too; a budget past the end extends it first
            # (a clamped value would come back through the handler as a smaller budget).
            budget = self.max_memory[device]
            if round(slider.value * unit) != budget:
                slider.max = max(slider.max, budget / unit)
                slider.value = budget / unit
        self._w_dtype.value = self._dtype or _AS_STORED
        self._w_strategy.value = self._strategy
        self._w_no_split.value = list(self._no_split)
        self._w_chart.value = self.chart_png()
        self._w_usage.value = self._usage_html()
        self._w_extras.value = self._extras_html()
        self._w_tree.value = self._tree_html()
        self._w_code.value = self.to_code()
        self._w_timing.value = f"map computed in {self.last_compute_seconds * 1000:.1f} ms"
