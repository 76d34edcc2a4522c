"""Device maps: infer one (``infer_auto_device_map``), explain it (``DeviceMapPlan``), check and clean one.

Planning takes a flat preorder snapshot of the model (``_module_tree``), then one greedy pass of a
:class:`~notebook_accel.utils.device_planning.planner.DevicePlanner` over it. Checking a map against its model is
``utils.placement``'s job (``check_device_map`` is re-exported here).
"""

from __future__ import annotations

import html
import logging
from dataclasses import dataclass, field
from typing import Union

import torch
from torch import nn

from ._module_tree import build_tree
from .device_memory import get_balanced_memory, get_max_memory
from .devices import Device, device_key
from .placement import check_device_map
from .planner import DevicePlanner
from .sizes import convert_file_size_to_int

__all__ = [
    "DEVICE_MAP_STRATEGIES",
    "DeviceMapPlan",
    "check_device_map",
    "check_strategy",
    "clean_device_map",
    "infer_auto_device_map",
    "plan_device_map",
    "resolve_device_map",
    "strategy_memory",
]

logger = logging.getLogger(__name__)

DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
"""The device maps computed from the model and the memory: "auto" and "balanced" spread the GPUs evenly,
"balanced_low_0" keeps GPU 0 light, "sequential" fills the devices in order."""


def check_strategy(strategy: object, name: str = "device_map", alternatives: str = "") -> str:
    """Return ``strategy`` when it is one of ``DEVICE_MAP_STRATEGIES``; raise ValueError naming it otherwise.

    The one check of a device-map strategy string: ``name`` is the argument as the caller knows it and
    ``alternatives`` what else that argument accepts (e.g. "a dict of module name -> device").
    """
    if isinstance(strategy, str) and strategy in DEVICE_MAP_STRATEGIES:
        return strategy
    other = f", or {alternatives}" if alternatives else ""
    raise ValueError(
        f"{name}={strategy!r} is not a device-map strategy: choose one of {list(DEVICE_MAP_STRATEGIES)}{other}"
    )


def _fmt(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} GiB"  # pragma: no cover


@dataclass
class DeviceMapPlan:
    """An inferred device map with the numbers behind it.

    ``device_map`` is what ``infer_auto_device_map`` returns; ``device_bytes`` the weight bytes placed on each
    device; ``reserved`` the bytes kept free on a main device for the largest offloaded layer (on the first
    GPU, at least ``streaming_budget``: the streaming offload's lookahead); ``max_memory`` the budget used;
    ``decisions`` one line per step when ``verbose`` was set.
    """

    device_map: dict[str, Device]
    max_memory: dict[Union[int, str], int]
    device_bytes: dict[Union[int, str], int]
    reserved: dict[Union[int, str], int]
    total_size: int
    largest_layer: tuple[int, str]
    decisions: list[str] = field(default_factory=list)
    streaming_budget: int = 0
    """Bytes the first GPU keeps free for the weights streamed ahead (0: none asked)."""

    @property
    def offloaded_bytes(self) -> int:
        """Bytes placed on "cpu" or "disk" while GPUs were available (0 when there is no GPU)."""
        if not any(isinstance(d, int) or d == "mps" for d in self.max_memory):
            return 0
        return sum(v for d, v in self.device_bytes.items() if d in ("cpu", "disk"))

    def summary(self) -> list[tuple[str, int, int, int | None]]:
        """Return ``(device, placed bytes, reserved bytes, budget or None)`` rows in filling order."""
        rows = []
        for device in self.device_bytes:
            rows.append(
                (
                    str(device),
                    self.device_bytes[device],
                    self.reserved.get(device, 0),
                    self.max_memory.get(device),
                )
            )
        return rows

    def __repr__(self) -> str:
        lines = [f"DeviceMapPlan(total={_fmt(self.total_size)}, largest layer={_fmt(self.largest_layer[0])} "
                 f"{self.largest_layer[1]!r}, {len(self.device_map)} entries)"]  # fmt: skip
        for device, placed, reserved, budget in self.summary():
            cap = "unlimited" if budget is None else _fmt(budget)
            lines.append(f"  {device:>6}: {_fmt(placed):>12} of {cap:>12} (reserved {_fmt(reserved)})")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = []
        for device, placed, reserved, budget in self.summary():
            share = "" if not budget else f"{100 * (placed + reserved) / budget:.0f}%"
            cap = "unlimited" if budget is None else _fmt(budget)
            rows.append(
                f"<tr><td>{html.escape(device)}</td><td>{_fmt(placed)}</td><td>{_fmt(reserved)}</td>"
                f"<td>{cap}</td><td>{share}</td></tr>"
            )
        entries = "".join(
            f"<tr><td><code>{html.escape(name or '(model)')}</code></td><td>{html.escape(str(dev))}</td></tr>"
            for name, dev in list(self.device_map.items())[:50]
        )
        more = len(self.device_map) - 50
        tail = f"<p>… {more} more entries</p>" if more > 0 else ""
        return (
            f"<div><b>Device map</b>: {_fmt(self.total_size)} of weights, largest layer "
            f"<code>{html.escape(self.largest_layer[1])}</code> ({_fmt(self.largest_layer[0])})"
            "<table><tr><th>device</th><th>weights</th><th>reserved</th><th>budget</th><th>used</th></tr>"
            f"{''.join(rows)}</table><table><tr><th>module</th><th>device</th></tr>{entries}</table>{tail}</div>"
        )


def plan_device_map(
    model: nn.Module,
    max_memory: dict[Union[int, str], Union[int, str]] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: Union[str, torch.dtype, None] = None,
    special_dtypes: dict[str, Union[str, torch.dtype]] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
    *,
    streaming_budget: int | str | None = None,
) -> DeviceMapPlan:
    """Return a :class:`DeviceMapPlan`: ``infer_auto_device_map``'s result plus per-device bytes and reasons."""
    if isinstance(no_split_module_classes, str):
        no_split_module_classes = [no_split_module_classes]
    streaming = _streaming_bytes(streaming_budget)
    budget = get_max_memory(max_memory)
    tree = build_tree(
        model, dtype=dtype, special_dtypes=special_dtypes, no_split_module_classes=no_split_module_classes
    )
    planner = DevicePlanner(tree, budget, offload_buffers, fallback_allocation, verbose, streaming).run()
    planner.warn_buffers_on_gpu()
    planner.log_unfilled()
    # Entries in model order (node ids are preorder), whatever order they were placed in.
    device_map: dict[str, Device] = {
        tree.names[n]: d for n, d in sorted(planner.placed, key=lambda item: item[0])
    }
    if clean_result:
        device_map = clean_device_map(device_map)
    largest = (tree.layer[0], tree.layer_name(0))
    return DeviceMapPlan(
        device_map, budget, planner.device_bytes, planner.reserved, tree.size[0], largest, planner.decisions,
        planner.streaming_budget,
    )  # fmt: skip


def _streaming_bytes(streaming_budget: int | str | None) -> int:
    """Return the streaming budget in bytes (0 for None); raise ValueError naming a bad one."""
    if streaming_budget is None:
        return 0
    try:
        return convert_file_size_to_int(streaming_budget)
    except (TypeError, ValueError):
        raise ValueError(
            f"streaming_budget={streaming_budget!r} is not a size: give the bytes the first GPU keeps free for the "
            "weights streamed ahead (an int >= 0 or text like '1GiB'), or None"
        ) from None


def infer_auto_device_map(
    model: nn.Module,
    max_memory: dict[Union[int, str], Union[int, str]] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: Union[str, torch.dtype, None] = None,
    special_dtypes: dict[str, Union[str, torch.dtype]] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
    *,
    streaming_budget: int | str | None = None,
) -> dict[str, Device]:
    """Return a device map filling GPUs first, then the CPU, then the disk.

    GPUs never exceed their budget; when offloading, the main device keeps room for the largest offloaded
    layer; tied parameters land on one device; ``no_split_module_classes`` are never split. Only shapes and
    dtypes are read, so meta models work. :func:`plan_device_map` returns the same map with its numbers.

    ``streaming_budget`` (keyword-only, not in Accelerate) plans for the streaming offload: the first GPU
    keeps that much free for the offloaded weights it copies ahead (its ``lookahead``), instead of filling
    up with resident modules to the last byte but the largest layer. None (the default) plans as
    Accelerate 1.15 does.

    Args:
        model: The model to place (a meta model works).
        max_memory: Device -> budget in bytes or text like "10GiB" (default: what is available).
        no_split_module_classes: Module classes kept whole on one device.
        dtype: Count floating tensors at this element size.
        special_dtypes: Tensor name -> dtype, overriding ``dtype`` for those tensors.
        verbose: Log each placement decision.
        clean_result: Merge children that share their parent's device into the parent's entry.
        offload_buffers: Count the buffers of offloaded modules as offloaded too.
        fallback_allocation: When the next module does not fit on a still empty device, place there first the
            first later module (in model order) that does, instead of moving on to the next device.
        streaming_budget: Bytes (or text like "1GiB") the first GPU keeps free for the streamed weights.
    """
    return plan_device_map(
        model, max_memory, no_split_module_classes, dtype, special_dtypes, verbose, clean_result, offload_buffers,
        fallback_allocation, streaming_budget=streaming_budget,
    ).device_map  # fmt: skip


class _Trie:
    """One dotted-name component of a device map: its own entry (if any) and what lies below."""

    __slots__ = ("children", "has_value", "value", "devices", "count")

    def __init__(self) -> None:
        self.children: dict[str, _Trie] = {}
        self.has_value = False
        self.value: Device | None = None
        self.devices: set[str] = set()  # distinct devices at and below this node
        self.count = 0  # entries at and below this node

    def summarize(self) -> None:
        if self.has_value:
            self.devices.add(device_key(self.value))
            self.count = 1
        for child in self.children.values():
            child.summarize()
            self.devices |= child.devices
            self.count += child.count

    def keys(self, name: str) -> list[str]:
        out = [name] if self.has_value else []
        for part, child in self.children.items():
            out.extend(child.keys(f"{name}.{part}" if name else part))
        return out


def clean_device_map(device_map: dict[str, Device], module_name: str = "") -> dict[str, Device]:
    """Return ``device_map`` (changed in place) with entries under one prefix merged when they share a device.

    Only prefixes with more than one entry are merged, as in Accelerate; entries keep their first position.
    """
    prefix = f"{module_name}." if module_name else ""
    root = _Trie()
    for key, value in device_map.items():
        if key == module_name:
            rest = ""
        elif key.startswith(prefix):
            rest = key[len(prefix) :]
        else:
            continue
        node = root
        for part in rest.split(".") if rest else ():
            node = node.children.get(part) or node.children.setdefault(part, _Trie())
        node.has_value, node.value = True, value
    root.summarize()

    rename: dict[str, str] = {}
    pending = [(root, module_name)]
    while pending:  # top down: the highest uniform prefix wins
        node, name = pending.pop()
        if len(node.devices) == 1 and node.count > 1:
            for key in node.keys(name):
                rename[key] = name
            continue
        pending.extend((child, f"{name}.{part}" if name else part) for part, child in node.children.items())
    if not rename:
        return device_map
    merged: dict[str, Device] = {}
    for key, value in device_map.items():
        target = rename.get(key, key)
        if target not in merged:
            merged[target] = value
    device_map.clear()
    device_map.update(merged)
    return device_map


def strategy_memory(
    model: nn.Module,
    strategy: str,
    max_memory: dict[Union[int, str], Union[int, str]] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: Union[str, torch.dtype, None] = None,
    special_dtypes: dict[str, Union[str, torch.dtype]] | None = None,
) -> dict[Union[int, str], int]:
    """Return the budget a device-map strategy plans with.

    "sequential" takes ``max_memory`` as given (default: what is available); "auto" and "balanced"
    spread the model evenly over the GPUs; "balanced_low_0" also keeps GPU 0 as empty as possible.
    """
    check_strategy(strategy, name="strategy")
    if strategy == "sequential":
        return get_max_memory(max_memory)
    return get_balanced_memory(
        model,
        max_memory,
        no_split_module_classes,
        dtype,
        special_dtypes,
        low_zero=strategy == "balanced_low_0",
    )


def resolve_device_map(
    model: nn.Module,
    device_map: str,
    max_memory: dict[Union[int, str], Union[int, str]] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: Union[str, torch.dtype, None] = None,
    special_dtypes: dict[str, Union[str, torch.dtype]] | None = None,
    offload_buffers: bool = False,
    streaming_budget: int | str | None = None,
) -> dict[str, Device]:
    """Return the device map the strategy ``device_map`` plans for ``model`` within ``max_memory``.

    "auto" and "balanced" balance the GPUs, "balanced_low_0" keeps GPU 0 light, "sequential" fills devices in
    order (see ``strategy_memory``); any other value raises ValueError (``check_strategy``).
    """
    check_strategy(device_map)
    budget = strategy_memory(model, device_map, max_memory, no_split_module_classes, dtype, special_dtypes)
    return infer_auto_device_map(
        model, budget, no_split_module_classes, dtype, special_dtypes, offload_buffers=offload_buffers,
        streaming_budget=streaming_budget,
    )  # fmt: skip
