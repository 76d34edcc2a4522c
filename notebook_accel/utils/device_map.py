"""Device maps: infer one (``infer_auto_device_map``), explain it (``DeviceMapPlan``), check and clean one.

The planner works on a flat preorder snapshot of the model (``_module_tree``): one walk over the tensors, then
a greedy pass over a stack of entries. The largest remaining layer, which must stay loadable on the main
device, comes from a lazy max-heap instead of rescanning the remaining modules after every step; that is
what keeps a 2,000-module model under a few milliseconds and the cost linear in the module count.
"""

from __future__ import annotations

import heapq
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

__all__ = [
    "DEVICE_MAP_STRATEGIES",
    "DeviceMapPlan",
    "check_device_map",
    "clean_device_map",
    "infer_auto_device_map",
    "plan_device_map",
    "resolve_device_map",
]

logger = logging.getLogger(__name__)

DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
"""The device maps computed from the model and the memory: "auto" and "balanced" spread the GPUs evenly,
"balanced_low_0" keeps GPU 0 light, "sequential" fills the devices in order."""


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
    device; ``reserved`` the bytes kept free on a main device for the largest offloaded layer;
    ``max_memory`` the budget used; ``decisions`` one line per step when ``verbose`` was set.
    """

    device_map: dict[str, Device]
    max_memory: dict[Union[int, str], int]
    device_bytes: dict[Union[int, str], int]
    reserved: dict[Union[int, str], int]
    total_size: int
    largest_layer: tuple[int, str]
    decisions: list[str] = field(default_factory=list)

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
) -> DeviceMapPlan:
    """Return a :class:`DeviceMapPlan`: ``infer_auto_device_map``'s result plus per-device bytes and reasons."""
    if isinstance(no_split_module_classes, str):
        no_split_module_classes = [no_split_module_classes]
    budget = get_max_memory(max_memory)
    devices: list[Union[int, str]] = list(budget)
    if "disk" not in devices:
        devices.append("disk")
    gpus = [d for d in devices if d not in ("cpu", "disk")]
    main_devices = {gpus[0], "cpu"} if gpus else {"cpu"}

    tree = build_tree(
        model, dtype=dtype, special_dtypes=special_dtypes, no_split_module_classes=no_split_module_classes
    )
    names, size, layer, splittable, children = (
        tree.names,
        tree.size,
        tree.layer,
        tree.splittable,
        tree.children,
    )
    decisions: list[str] = []

    def say(message: str) -> None:
        decisions.append(message)
        logger.info(message)

    # The stack's top (end of the list) is the next entry in model order.
    stack: list[int] = list(reversed(children[0]))
    queued = [False] * len(names)
    heap: list[tuple[int, int]] = []
    for node in stack:
        queued[node] = True
        heap.append((-layer[node], node))
    heapq.heapify(heap)

    def enqueue(nodes: list[int]) -> None:
        for node in nodes:
            queued[node] = True
            heapq.heappush(heap, (-layer[node], node))

    def largest_remaining() -> int:
        while heap and not queued[heap[0][1]]:
            heapq.heappop(heap)
        return -heap[0][0] if heap else 0

    def tied_partners(node: int) -> list[int]:
        """Queued entries holding parameters tied to a parameter inside ``node`` (they must go with it)."""
        partners: list[int] = []
        for group in tree.tied_groups:
            inner = [o for o in group if tree.inside(node, o)]
            if not inner or len(inner) == len(group):
                continue
            for occurrence in group:
                if tree.inside(node, occurrence):
                    continue
                holder = occurrence
                while holder != -1 and not queued[holder]:
                    holder = tree.parent[holder]
                if holder > 0 and holder not in partners:
                    partners.append(holder)
        return partners

    placed: list[tuple[int, Union[int, str]]] = []
    device_bytes: dict[Union[int, str], int] = {}
    reserved: dict[Union[int, str], int] = {}
    offloaded_buffers = 0
    index, used = 0, 0
    fallback_done = -1  # one fallback search per device, so a pick that no longer fits cannot loop
    while stack:
        node = stack.pop()
        if not queued[node]:
            continue  # placed earlier together with a tied parameter
        queued[node] = False
        device = devices[index]
        limit = budget.get(device)
        reserve = largest_remaining() if device in main_devices else 0
        room = None if limit is None else limit - reserve
        partners = tied_partners(node) if tree.tied_inside[node] else []
        needed = size[node] + sum(size[p] for p in partners)
        if room is None or used + needed <= room:
            for entry in [node, *partners]:
                queued[entry] = False
                placed.append((entry, device))
                if device in ("cpu", "disk") and gpus and not offload_buffers:
                    offloaded_buffers += tree.buffer_size[entry]
            used += needed
            device_bytes[device] = used
            reserved[device] = max(reserved.get(device, 0), reserve)
            if verbose:
                extra = f" with tied {[names[p] for p in partners]}" if partners else ""
                say(
                    f"{names[node]!r}{extra} ({needed} bytes) -> {device}; {used} of {limit} used, {reserve} reserved"
                )
            continue
        splittable_partner = next((p for p in partners if splittable[p]), None)
        if splittable_partner is not None:
            # Make the tied partner smaller rather than moving the current entry to the next device.
            at = stack.index(splittable_partner)
            stack[at : at + 1] = list(reversed(children[splittable_partner]))
            queued[splittable_partner] = False
            enqueue(children[splittable_partner])
            stack.append(node)
            enqueue([node])
            if verbose:
                say(
                    f"Splitting tied partner {names[splittable_partner]!r} to fit {names[node]!r} on {device}"
                )
            continue
        if splittable[node]:
            stack.extend(reversed(children[node]))
            enqueue(children[node])
            if verbose:
                say(f"{names[node]!r} ({needed} bytes) does not fit on {device}: splitting it")
            continue
        if fallback_allocation and used == 0 and fallback_done != index and room is not None and room > 0:
            fallback_done = index
            found = _fallback_pick(tree, [node, *(n for n in reversed(stack) if queued[n])], room)
            if found is not None:
                new_order, target = found
                stack[:] = list(reversed(new_order))
                for n in range(len(queued)):
                    queued[n] = False
                enqueue(new_order)
                if verbose:
                    say(f"Fallback: {names[target]!r} fits on {device} where {names[node]!r} does not")
                continue
        if verbose:
            say(f"{names[node]!r} ({needed} bytes) cannot be split and does not fit on {device}: next device")
        device_bytes.setdefault(device, used)
        reserved[device] = max(reserved.get(device, 0), reserve)
        index += 1
        used = 0
        if index >= len(devices):
            raise ValueError(
                f"{names[node]!r} ({needed} bytes) does not fit on any device of max_memory {budget}; "
                "raise the budgets or add 'disk' with an offload folder."
            )
        stack.append(node)
        enqueue([node])

    if offloaded_buffers and gpus:
        free = [budget[g] - device_bytes.get(g, 0) for g in gpus if g in budget]
        if not any(f >= offloaded_buffers for f in free):
            logger.warning(
                "The offloaded layers need %d bytes of buffers on the GPU, which does not seem to fit any GPU's "
                "remaining memory; pass offload_buffers=True if you run out of memory.",
                offloaded_buffers,
            )

    placed.sort(key=lambda item: item[0])
    device_map: dict[str, Device] = {names[n]: d for n, d in placed}
    if clean_result:
        device_map = clean_device_map(device_map)
    largest = (layer[0], tree.layer_name(0))
    return DeviceMapPlan(device_map, budget, device_bytes, reserved, size[0], largest, decisions)


def _fallback_pick(tree, order: list[int], room: int) -> tuple[list[int], int] | None:
    """Breadth-first search, in model order, for an entry fitting in ``room``; return the new order and it."""
    frontier = list(order)
    parent_of: dict[int, int] = {}
    target = None
    for candidate in frontier:  # the list grows while we walk it: breadth-first
        if tree.size[candidate] <= room and not tree.tied_inside[candidate]:
            target = candidate
            break
        if tree.splittable[candidate]:
            for child in tree.children[candidate]:
                parent_of[child] = candidate
                frontier.append(child)
    if target is None:
        return None
    path = [target]
    while path[-1] in parent_of:
        path.append(parent_of[path[-1]])
    # Open every ancestor of the target, top down, then take the target out and put it first.
    for ancestor in reversed(path[1:]):
        at = order.index(ancestor)
        order[at : at + 1] = tree.children[ancestor]
    order.remove(target)
    return [target, *order], target


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
) -> dict[str, Device]:
    """Return a device map filling GPUs first, then the CPU, then the disk.

    GPUs never exceed their budget; when offloading, the main device keeps room for the largest offloaded
    layer; tied parameters land on one device; ``no_split_module_classes`` are never split. Only shapes and
    dtypes are read, so meta models work. :func:`plan_device_map` returns the same map with its numbers.
    """
    return plan_device_map(
        model, max_memory, no_split_module_classes, dtype, special_dtypes, verbose, clean_result, offload_buffers,
        fallback_allocation,
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


def resolve_device_map(
    model: nn.Module,
    device_map: Union[str, dict[str, Device], int, torch.device, None],
    max_memory: dict[Union[int, str], Union[int, str]] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: Union[str, torch.dtype, None] = None,
    special_dtypes: dict[str, Union[str, torch.dtype]] | None = None,
    offload_buffers: bool = False,
) -> dict[str, Device] | None:
    """Return a concrete, checked device map for what ``load_checkpoint_and_dispatch`` accepts.

    "auto" and "balanced" balance the GPUs, "balanced_low_0" keeps GPU 0 light, "sequential" fills devices in
    order; a single device ("cpu", "disk", 0, "cuda:1", torch.device) maps the whole model; a dict is checked.
    """
    if device_map is None:
        return None
    if isinstance(device_map, dict):
        check_device_map(model, device_map)
        return device_map
    if isinstance(device_map, str) and device_map in DEVICE_MAP_STRATEGIES:
        if device_map != "sequential":
            max_memory = get_balanced_memory(
                model,
                max_memory,
                no_split_module_classes,
                dtype,
                special_dtypes,
                low_zero=device_map == "balanced_low_0",
            )
        return infer_auto_device_map(
            model, max_memory, no_split_module_classes, dtype, special_dtypes, offload_buffers=offload_buffers
        )
    try:
        device = device_key(device_map)
    except ValueError:
        raise ValueError(
            f"device_map={device_map!r} is not understood: pass a dict of module name -> device, one of "
            f"{', '.join(repr(s) for s in DEVICE_MAP_STRATEGIES)}, or a single device such as 'cpu', 'disk' or 0."
        ) from None
    return {"": device}
