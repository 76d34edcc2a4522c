"""The device-map explorer's model: the device map of a model for the budgets, dtype, no-split classes and strategy set.

Plain Python and torch (neither ipywidgets nor matplotlib is imported): ``DeviceMapModel`` checks the
controls, recomputes the map with the core's planner on every change and answers what the view shows:
per-device usage (weights, the reserve of the first GPU for the largest layer or the streaming budget,
free), the module tree with each node's devices, tied groups, unmapped tensors, the code to paste and
the chart's data. ``device_map_explorer.DeviceMapExplorer`` is its view.
"""

from __future__ import annotations

import difflib
import time
from collections.abc import Mapping
from typing import Any

import torch

from notebook_accel.utils.device_planning.device_map import check_strategy, plan_device_map, strategy_memory
from notebook_accel.utils.device_planning.sizes import compute_module_sizes
from notebook_accel.utils.device_planning.tied_params import find_tied_parameters

from ._base import _fmt_bytes, _size_literal
from ._device_map_inputs import check_dtype, check_max_memory, check_streaming_budget, device_order
from ._machine import MachineInfo, machine_info
from ._modules import suggest_no_split_classes

__all__: list[str] = []

USAGE_HEADERS = ["device", "budget", "weights", "reserved (largest layer / lookahead)", "free"]
USAGE_PARTS = ("weights", "reserved", "free")  # the stacked parts of a device's bar, bottom up
_GIB = 1024**3
_MIB = 1024**2
_SLIDER_STEPS = 200  # positions along a budget slider
_ACCELERATORS = ("cuda", "xpu", "npu", "mps")


def device_style(device: str) -> str:
    """Return the status style a device (as text) shows in: GPUs success, cpu warning, disk danger."""
    if device == "disk":
        return "danger"
    if device == "cpu":
        return "warning"
    if device == "unmapped":
        return ""
    return "success" if device.isdigit() or device.startswith(_ACCELERATORS) else "info"


class DeviceMapModel:
    """The device map of a model for adjustable budgets, dtype, no-split classes, strategy and streaming budget.

    The arguments are ``DeviceMapExplorer``'s; every control change recomputes the map, then calls
    ``_changed()``, where a subclass (the view) redraws.
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
        self._strategy = check_strategy(strategy, name="strategy")
        self._streaming_budget = check_streaming_budget(streaming_budget)
        self.max_memory: dict[int | str, int] = check_max_memory(
            max_memory if max_memory is not None else self._machine_budgets()
        )
        self.tree_depth = tree_depth
        self._sizes_cache: dict[Any, dict[str, int]] = {}
        self.tied_parameters: list[list[str]] = [sorted(group) for group in find_tied_parameters(model)]
        self.device_map: dict[str, int | str] = {}
        self.effective_max_memory: dict[int | str, int] = {}
        self.last_compute_seconds = 0.0
        self.plan: Any = None
        self.recompute()

    # -- validation -------------------------------------------------------------------------
    def _machine_budgets(self) -> dict[int | str, int]:
        """Return 90% of each GPU's free memory and of the available RAM: the budgets when none are given."""
        budgets: dict[int | str, int] = {}
        for gpu in self.machine.gpus:
            if gpu.free is not None:
                budgets[gpu.index] = int(gpu.free * 0.9)
        budgets["cpu"] = int(self.machine.ram_available * 0.9)
        return budgets

    def _check_no_split(self, classes: list[str]) -> list[str]:
        """Return ``classes`` as a list; raise naming the ones this model lacks, with the closest names."""
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
        self._strategy = check_strategy(value, name="strategy")
        self._replan()

    @property
    def dtype(self) -> str | None:
        """Return the dtype weights are sized in (None: as stored)."""
        return self._dtype

    @dtype.setter
    def dtype(self, value: str | torch.dtype | None) -> None:
        self._dtype = check_dtype(value)
        self._replan()

    @property
    def streaming_budget(self) -> int:
        """Return the bytes the first GPU keeps free for the weights streamed ahead (0: only the largest layer)."""
        return self._streaming_budget

    @streaming_budget.setter
    def streaming_budget(self, value: int | str | None) -> None:
        self._streaming_budget = check_streaming_budget(value)
        self._replan()

    @property
    def no_split_module_classes(self) -> list[str]:
        """Return the class names never split across devices."""
        return list(self._no_split)

    @no_split_module_classes.setter
    def no_split_module_classes(self, value: list[str]) -> None:
        self._no_split = self._check_no_split(value)
        self._replan()

    def set_budget(self, device: int | str, gib: float) -> None:
        """Set ``device``'s budget to ``gib`` GiB (``8 / 1024`` is 8 MiB) and recompute the map."""
        if device not in self.max_memory:
            raise ValueError(f"Unknown device {device!r}: this explorer budgets {list(self.max_memory)}")
        if gib < 0:
            raise ValueError(f"Budget for {device!r} must be >= 0 GiB, got {gib}")
        self._set_budget_bytes(device, round(gib * _GIB))

    def _set_budget_bytes(self, device: int | str, nbytes: int) -> None:
        self.max_memory[device] = int(nbytes)
        self._replan()

    def _replan(self) -> None:
        self.recompute()
        self._changed()

    def _changed(self) -> None:
        """Say that the map changed (a control moved); the view redraws."""

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

    # -- what the view shows ----------------------------------------------------------------
    def usage_rows(self) -> list[list[str]]:
        """Return the usage table's rows (``USAGE_HEADERS``): device, budget, weights, reserved, free, as text."""
        return [
            [str(d)] + [_fmt_bytes(u[k]) for k in ("budget", "weights", "reserved", "free")]
            for d, u in self.usage().items()
        ]

    def summary(self) -> str:
        """Return one line on the controls: the model's class, strategy, dtype, no-split classes, lookahead."""
        line = (
            f"{type(self.model).__name__}, strategy {self._strategy}, dtype {self._dtype or 'as stored'}, "
            f"no split {self._no_split}"
        )
        if self._streaming_budget:
            line += f", streaming lookahead {_fmt_bytes(self._streaming_budget)}"
        return line

    def chart_series(self) -> tuple[list[str], dict[str, list[float]], list[float | None]]:
        """Return the bar chart's data in ``slider_unit``: devices, ``{weights|reserved|free: value per device}``
        and the budget the user set per device (None for the disk).

        The balanced strategies lower the GPUs' budgets below the ones set: the bars stack up to the
        budget planned with, the limits show the budget set.
        """
        usage = self.usage()
        unit = self.slider_unit[1]
        series = {k: [u[k] / unit for u in usage.values()] for k in USAGE_PARTS}
        limits = [self.max_memory[d] / unit if d in self.max_memory else None for d in usage]
        return [str(d) for d in usage], series, limits
