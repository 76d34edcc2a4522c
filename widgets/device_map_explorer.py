"""DeviceMapExplorer: try device budgets, dtypes, no-split classes and strategies; see the device map live."""

from __future__ import annotations

import difflib
import html
import time
from collections.abc import Mapping
from typing import Any

import torch

from notebook_accel.utils.device_planning.device_map import (
    DEVICE_MAP_STRATEGIES,
    check_strategy,
    plan_device_map,
    strategy_memory,
)
from notebook_accel.utils.device_planning.sizes import compute_module_sizes
from notebook_accel.utils.device_planning.tied_params import find_tied_parameters

from ._base import _badge, _fmt_bytes, _import_ipywidgets, _Panel, _size_literal, _table, _text_table
from ._charts import png_img_tag, stacked_bars_png
from ._device_map_inputs import DTYPES, check_dtype, check_max_memory, check_streaming_budget, device_order
from ._machine import MachineInfo, machine_info
from ._modules import suggest_no_split_classes

__all__ = ["DeviceMapExplorer"]

STRATEGIES = DEVICE_MAP_STRATEGIES  # the one list, from notebook_accel.utils.device_planning.device_map
_AS_STORED = "as stored"  # the dtype dropdown's value for None (ipywidgets shows a None value blank)
_GIB = 1024**3
_MIB = 1024**2
_SLIDER_STEPS = 200  # positions along a budget slider


class DeviceMapExplorer(_Panel):
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

    def __init__(
        self,
        model: torch.nn.Module,
        max_memory: Mapping[int | str, int | str] | None = None,
        dtype: str | torch.dtype | None = None,
        no_split_module_classes: list[str] | None = None,
        strategy: str = "auto",
        machine: MachineInfo | None = None,
        tree_depth: int = 3,
        streaming_budget: int | str | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"DeviceMapExplorer needs a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.machine = machine if machine is not None else machine_info()
        self.suggested_no_split = suggest_no_split_classes(model)
        self.class_names = sorted(
            {type(m).__name__ for m in model.modules() if next(m.children(), None) is not None}
        )
        self._no_split = self._check_no_split(
            self.suggested_no_split if no_split_module_classes is None else no_split_module_classes
        )
        self._dtype = check_dtype(dtype)
        self._strategy = self._check_strategy(strategy)
        self._streaming_budget = check_streaming_budget(streaming_budget)
        self.max_memory: dict[int | str, int] = check_max_memory(
            max_memory if max_memory is not None else self._machine_budgets()
        )
        self.tree_depth = tree_depth
        self._sizes_cache: dict[Any, dict[str, int]] = {}
        self.tied_parameters: list[list[str]] = []
        self.device_map: dict[str, int | str] = {}
        self.effective_max_memory: dict[int | str, int] = {}
        self.last_compute_seconds = 0.0
        self.plan: Any = None
        self.tied_parameters = [sorted(group) for group in find_tied_parameters(model)]
        self.recompute()

    # -- validation -------------------------------------------------------------------------
    def _machine_budgets(self) -> dict[int | str, int]:
        budgets: dict[int | str, int] = {}
        for gpu in self.machine.gpus:
            if gpu.free is not None:
                budgets[gpu.index] = int(gpu.free * 0.9)
        budgets["cpu"] = int(self.machine.ram_available * 0.9)
        return budgets

    def _check_strategy(self, strategy: str) -> str:
        return check_strategy(strategy, name="strategy")

    def _check_no_split(self, classes: list[str]) -> list[str]:
        if isinstance(classes, str):
            raise TypeError(
                f"no_split_module_classes must be a list of class names, got the string {classes!r}"
            )
        classes = list(classes)
        known = {type(m).__name__ for m in self.model.modules()}
        unknown = [c for c in classes if c not in known]
        if unknown:
            hints = {c: difflib.get_close_matches(c, sorted(known), n=3) for c in unknown}
            raise ValueError(
                f"no_split_module_classes {unknown} are not classes of this model (closest: {hints})"
            )
        return classes

    # -- controls (each change recomputes) ----------------------------------------------------
    @property
    def strategy(self) -> str:
        """Return the strategy: "auto", "balanced", "balanced_low_0" or "sequential"."""
        return self._strategy

    @strategy.setter
    def strategy(self, value: str) -> None:
        self._strategy = self._check_strategy(value)
        self._changed()

    @property
    def dtype(self) -> str | None:
        """Return the dtype weights are sized in (None: as stored)."""
        return self._dtype

    @dtype.setter
    def dtype(self, value: str | torch.dtype | None) -> None:
        self._dtype = check_dtype(value)
        self._changed()

    @property
    def streaming_budget(self) -> int:
        """Return the bytes the first GPU keeps free for the weights streamed ahead (0: only the largest layer)."""
        return self._streaming_budget

    @streaming_budget.setter
    def streaming_budget(self, value: int | str | None) -> None:
        self._streaming_budget = check_streaming_budget(value)
        self._changed()

    @property
    def no_split_module_classes(self) -> list[str]:
        """Return the class names never split across devices."""
        return list(self._no_split)

    @no_split_module_classes.setter
    def no_split_module_classes(self, value: list[str]) -> None:
        self._no_split = self._check_no_split(value)
        self._changed()

    def set_budget(self, device: int | str, gib: float) -> None:
        """Set ``device``'s budget to ``gib`` GiB (``8 / 1024`` is 8 MiB) and recompute the map."""
        if device not in self.max_memory:
            raise ValueError(f"Unknown device {device!r}: this explorer budgets {list(self.max_memory)}")
        if gib < 0:
            raise ValueError(f"Budget for {device!r} must be >= 0 GiB, got {gib}")
        self._set_budget_bytes(device, round(gib * _GIB))

    def _set_budget_bytes(self, device: int | str, nbytes: int) -> None:
        self.max_memory[device] = int(nbytes)
        self._changed()

    @property
    def slider_unit(self) -> tuple[str, int]:
        """Return the budget sliders' unit as ``(name, bytes)``: MiB for a model under 1 GiB, else GiB.

        A GiB slider cannot set a budget between the layers of a model of a few MiB.
        """
        return ("MiB", _MIB) if self._stored_size() < _GIB else ("GiB", _GIB)

    def _stored_size(self) -> int:
        # The size as stored, not for the current dtype: the unit stays the same when the dtype changes.
        return self._sizes_for(None)[""]

    def slider_range(self) -> tuple[float, float]:
        """Return ``(max, step)`` of the budget sliders, in ``slider_unit``.

        The max leaves room to double the largest budget or hold the whole model; the step is
        1/200 of it, fine enough to move one layer of the model at a time.
        """
        unit = self.slider_unit[1]
        top = max(2 * max(self.max_memory.values()), int(self._stored_size() * 1.2), unit) / unit
        return top, top / _SLIDER_STEPS

    def _changed(self) -> None:
        self.recompute()
        self.refresh()

    # -- computation ------------------------------------------------------------------------
    def sizes(self) -> dict[str, int]:
        """Return the module sizes (bytes, ``""`` = whole model) for the current dtype (cached)."""
        return self._sizes_for(self._dtype)

    def _sizes_for(self, dtype: str | None) -> dict[str, int]:
        if dtype not in self._sizes_cache:
            self._sizes_cache[dtype] = dict(compute_module_sizes(self.model, dtype=dtype))
        return self._sizes_cache[dtype]

    def recompute(self) -> None:
        """Recompute ``plan`` / ``device_map`` (and ``effective_max_memory``) for the current controls."""
        start = time.perf_counter()
        max_memory = strategy_memory(
            self.model,
            self._strategy,
            dict(self.max_memory),
            no_split_module_classes=self._no_split,
            dtype=self._dtype,
        )
        self.effective_max_memory = dict(max_memory)
        self.plan = plan_device_map(
            self.model,
            max_memory=max_memory,
            no_split_module_classes=self._no_split,
            dtype=self._dtype,
            streaming_budget=self._streaming_budget or None,
        )
        self.device_map = dict(self.plan.device_map)
        self.last_compute_seconds = time.perf_counter() - start

    def device_of(self, name: str) -> int | str | None:
        """Return the device ``name`` (module or tensor) is mapped to, or None when unmapped."""
        probe = name
        while True:
            if probe in self.device_map:
                return self.device_map[probe]
            if not probe:
                return None
            probe = probe.rpartition(".")[0]

    def devices(self) -> list[int | str]:
        """Return every budgeted or used device, GPUs first, then cpu, then disk."""
        devs = set(self.max_memory) | set(self.device_map.values())
        return sorted(devs, key=device_order)

    def largest_layer(self) -> tuple[int, str]:
        """Return ``(bytes, name)`` of the largest layer for the current dtype and no-split classes."""
        return self.plan.largest_layer

    def usage(self) -> dict[int | str, dict[str, int]]:
        """Return per device ``{"weights", "reserved", "free", "budget"}`` in bytes.

        ``reserved`` is the room kept on a main device for the largest offloaded layer (the hooks
        bring an offloaded layer there to run it), on the first GPU at least the streaming budget;
        ``free`` is what remains of the budget. The disk has no budget (``budget`` 0, ``free`` 0).
        """
        out = {}
        for device in self.devices():
            weights = self.plan.device_bytes.get(device, 0)
            reserved = self.plan.reserved.get(device, 0)
            budget = self.effective_max_memory.get(device)
            free = max(0, budget - weights - reserved) if budget is not None else 0
            out[device] = {"weights": weights, "reserved": reserved, "free": free, "budget": budget or 0}
        return out

    def unmapped(self) -> list[str]:
        """Return the parameter/buffer names that no device_map entry covers."""
        names = [n for n, _ in self.model.named_parameters()] + [n for n, _ in self.model.named_buffers()]
        return [n for n in names if self.device_of(n) is None]

    def tie_groups(self) -> list[dict[str, Any]]:
        """Return the tied-parameter groups with the devices their members are mapped to."""
        out = []
        for group in self.tied_parameters:
            devices = sorted({str(self.device_of(n)) for n in group})
            out.append({"parameters": group, "devices": devices, "split": len(devices) > 1})
        return out

    def tree(self) -> list[dict[str, Any]]:
        """Return the module tree to ``tree_depth``: name, class, depth, bytes, device(s) of each node."""
        sizes = self.sizes()
        keys_under: dict[str, set] = {}
        for key, device in self.device_map.items():
            parts = key.split(".") if key else []
            for i in range(len(parts) + 1):
                keys_under.setdefault(".".join(parts[:i]), set()).add(str(device))
        rows = []
        for name, module in self.model.named_modules():
            depth = 0 if not name else name.count(".") + 1
            if depth > self.tree_depth:
                continue
            own = self.device_of(name)
            devices = sorted(keys_under.get(name, set()) | ({str(own)} if own is not None else set()))
            rows.append(
                {
                    "name": name or "(model)",
                    "class": type(module).__name__,
                    "depth": depth,
                    "bytes": sizes.get(name, 0),
                    "devices": devices or ["unmapped"],
                }
            )
        return rows

    def to_code(self) -> str:
        """Return Python source defining ``max_memory`` and ``device_map`` as computed now."""
        mm = ", ".join(f"{k!r}: {_size_literal(v)!r}" for k, v in self.max_memory.items())
        lines = ["max_memory = {" + mm + "}"]
        if self._streaming_budget:
            lines.append(
                f"lookahead = {_size_literal(self._streaming_budget)!r}  # streaming_budget / lookahead"
            )
        lines.append("device_map = {")
        lines += [f"    {k!r}: {v!r}," for k, v in self.device_map.items()]
        lines.append("}")
        return "\n".join(lines)

    # -- rendering ----------------------------------------------------------------------------
    def _style_of(self, device: str) -> str:
        if device == "disk":
            return "danger"
        if device == "cpu":
            return "warning"
        if device == "unmapped":
            return ""
        return "success" if device.isdigit() or device.startswith(("cuda", "xpu", "npu", "mps")) else "info"

    def chart_png(self) -> bytes:
        """Return a PNG with one stacked bar per device: weights, reserved room for the largest layer, free."""
        usage = self.usage()
        name, unit = self.slider_unit
        labels = [str(d) for d in usage]
        series = {k: [u[k] / unit for u in usage.values()] for k in ("weights", "reserved", "free")}
        colours = {"weights": "#337ab7", "reserved": "#f0ad4e", "free": "#dddddd"}
        # The balanced strategies lower the GPUs' budgets; the dashed line is the budget the user set.
        limits = [self.max_memory[d] / unit if d in self.max_memory else None for d in usage]
        return stacked_bars_png(
            labels, series, colours, f"Device map ({self._strategy})", ylabel=name, limits=limits
        )

    def _tree_html(self) -> str:
        rows = []
        for node in self.tree():
            badges = " ".join(_badge(d, self._style_of(d)) for d in node["devices"])
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

    def _usage_rows(self) -> list[list[str]]:
        return [
            [
                str(d),
                _fmt_bytes(u["budget"]),
                _fmt_bytes(u["weights"]),
                _fmt_bytes(u["reserved"]),
                _fmt_bytes(u["free"]),
            ]
            for d, u in self.usage().items()
        ]

    _USAGE_HEADERS = ["device", "budget", "weights", "reserved (largest layer / lookahead)", "free"]

    def _html(self) -> str:
        return "<br>".join(
            [
                f"<b>DeviceMapExplorer</b> — {html.escape(type(self.model).__name__)}, strategy {self._strategy}, "
                f"dtype {self._dtype or 'as stored'}, no split {html.escape(str(self._no_split))}"
                + (
                    f", streaming lookahead {_fmt_bytes(self._streaming_budget)}"
                    if self._streaming_budget
                    else ""
                ),
                _table(self._USAGE_HEADERS, self._usage_rows()),
                png_img_tag(self.chart_png(), "device usage"),
                self._extras_html(),
                self._tree_html(),
            ]
        )

    def _text(self) -> str:
        return (
            f"DeviceMapExplorer({type(self.model).__name__}, strategy={self._strategy!r}, dtype={self._dtype!r}, "
            f"{len(self.device_map)} entries)\n" + _text_table(self._USAGE_HEADERS, self._usage_rows())
        )

    def _build_widget(self) -> Any:
        w = _import_ipywidgets()
        self._w_sliders: dict[int | str, Any] = {}
        self._w_texts: dict[int | str, Any] = {}
        rows = []
        # Unit and step are fixed when the view is built (from the model's size then).
        self._w_unit = self.slider_unit
        name, unit = self._w_unit
        top, step = self.slider_range()
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
        self._w_dtype = w.Dropdown(
            options=[(_AS_STORED, _AS_STORED)] + [(d, d) for d in DTYPES if d],
            value=self._dtype or _AS_STORED,
            description="dtype",
        )
        self._w_dtype.observe(self._on_dtype, names="value")
        self._w_strategy = w.ToggleButtons(
            options=list(STRATEGIES), value=self._strategy, description="strategy"
        )
        self._w_strategy.observe(lambda c: setattr(self, "strategy", c["new"]), names="value")
        self._w_no_split = w.TagsInput(
            value=list(self._no_split), allowed_tags=self.class_names, allow_duplicates=False
        )
        self._w_no_split.observe(
            lambda c: setattr(self, "no_split_module_classes", list(c["new"])), names="value"
        )
        self._w_chart = w.Image(format="png")
        self._w_usage = w.HTML()
        self._w_extras = w.HTML()
        self._w_tree = w.HTML(layout=w.Layout(max_height="24em", overflow="auto"))
        self._w_code = w.Textarea(layout=w.Layout(width="100%", height="10em"))
        self._w_timing = w.Label()
        return w.VBox(
            rows
            + [
                self._w_dtype,
                self._w_strategy,
                w.HBox([w.Label("no split:"), self._w_no_split]),
                w.HBox([self._w_chart, self._w_usage]),
                self._w_extras,
                self._w_tree,
                self._w_code,
                self._w_timing,
            ]
        )

    def _on_budget(self, device: int | str):  # noqa: ANN202
        def handler(change: dict) -> None:
            nbytes = round(max(0.0, float(change["new"])) * self._w_unit[1])
            if nbytes != self.max_memory.get(device):
                self._set_budget_bytes(device, nbytes)

        return handler

    def _on_dtype(self, change: dict) -> None:
        dtype = None if change["new"] == _AS_STORED else change["new"]
        if dtype != self._dtype:  # not when refresh() shows a dtype set from code
            self.dtype = dtype

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
        self._w_chart.value = self.chart_png()
        self._w_usage.value = _table(self._USAGE_HEADERS, self._usage_rows())
        self._w_extras.value = self._extras_html()
        self._w_tree.value = self._tree_html()
        self._w_code.value = self.to_code()
        self._w_timing.value = f"map computed in {self.last_compute_seconds * 1000:.1f} ms"
