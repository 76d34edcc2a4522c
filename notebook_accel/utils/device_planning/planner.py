"""The greedy device-map planner behind ``infer_auto_device_map`` / ``plan_device_map``.

It works on the flat preorder snapshot of the model (``_module_tree``): a stack of entries in model
order, each placed whole on the current device if it fits, split into its children if it may be,
or else the planner moves on to the next device (GPUs in order, then the CPU, then the disk). On a
main device (the first GPU, and the CPU) room is kept for the largest layer still to place, since
an offloaded layer is loaded there to run (with a streaming budget, the first GPU keeps at least that
budget free instead, for the weights the streaming offload copies ahead); that largest layer comes from a lazy max-heap instead of
a rescan after every step, which keeps a 2,000-module model under a few milliseconds and the cost
linear in the module count. Tied parameters travel with the entry that holds their first
occurrence.
"""

from __future__ import annotations

import heapq
import logging
import warnings
from typing import Union

from ._module_tree import ModuleTree

__all__ = ["DevicePlanner"]

logger = logging.getLogger(__name__)

DeviceKey = Union[int, str]
_NO_PARTNERS: list[int] = []  # shared, never mutated


class DevicePlanner:
    """One planning pass over a :class:`ModuleTree` for a budget; :meth:`run` it once, then read its results.

    Results: ``placed`` (node, device) pairs, ``device_bytes`` (bytes placed per device, in
    filling order), ``reserved`` (room kept per main device), ``decisions`` (one line per step
    when ``verbose``) and ``offloaded_buffers`` (buffer bytes of entries offloaded while GPUs exist).
    """

    def __init__(
        self,
        tree: ModuleTree,
        budget: dict[DeviceKey, int],
        offload_buffers: bool = False,
        fallback_allocation: bool = False,
        verbose: bool = False,
        streaming_budget: int = 0,
    ) -> None:
        self.tree = tree
        self.budget = budget
        self.devices: list[DeviceKey] = list(budget) if "disk" in budget else [*budget, "disk"]
        self.gpus = [d for d in self.devices if d not in ("cpu", "disk")]
        self.main_devices = {self.gpus[0], "cpu"} if self.gpus else {"cpu"}
        # The device offloaded weights stream to keeps at least this much free (0: only the largest layer).
        self.streaming_budget = streaming_budget if self.gpus else 0
        self.stream_device = self.gpus[0] if self.streaming_budget else None
        # Buffers of offloaded entries stay on the GPU unless offload_buffers: count them to warn.
        self.count_buffers = bool(self.gpus) and not offload_buffers
        self.fallback_allocation = fallback_allocation
        self.verbose = verbose
        self.decisions: list[str] = []
        self.placed: list[tuple[int, DeviceKey]] = []
        self.device_bytes: dict[DeviceKey, int] = {}
        self.reserved: dict[DeviceKey, int] = {}
        self.offloaded_buffers = 0
        # Devices left empty because the first entry tried there did not fit: bytes that entry needed.
        self.unfilled: dict[DeviceKey, int] = {}
        self.index = 0  # the device being filled
        self.used = 0  # bytes placed on it so far
        self.fallback_done = -1  # one fallback search per device, so a pick that no longer fits cannot loop
        # The stack's top (end of the list) is the next entry in model order; ``queued`` marks the
        # entries still to place, and the heap holds (-largest layer, node) for them (lazily pruned).
        self.stack: list[int] = list(reversed(tree.children[0]))
        self.queued = [False] * len(tree.names)
        self.heap: list[tuple[int, int]] = []
        for node in self.stack:
            self.queued[node] = True
            self.heap.append((-tree.layer[node], node))
        heapq.heapify(self.heap)
        self.largest_layer = -self.heap[0][0] if self.heap else 0  # of the whole model, before any placement

    def run(self) -> DevicePlanner:
        """Place every entry; return self. Raises ``ValueError`` when something fits on no device."""
        stack, queued, size, tied_inside = self.stack, self.queued, self.tree.size, self.tree.tied_inside
        budget, devices, main_devices, placed = self.budget, self.devices, self.main_devices, self.placed
        buffer_size = self.tree.buffer_size
        stream_device, streaming_budget = self.stream_device, self.streaming_budget
        while stack:
            node = stack.pop()
            if not queued[node]:
                continue  # placed earlier together with a tied parameter
            queued[node] = False
            device = devices[self.index]
            limit = budget.get(device)
            reserve = self._largest_remaining() if device in main_devices else 0
            if device == stream_device and reserve < streaming_budget:
                reserve = streaming_budget
            room = None if limit is None else limit - reserve
            partners = self._tied_partners(node) if tied_inside[node] else _NO_PARTNERS
            needed = size[node]
            for partner in partners:
                needed += size[partner]
            if room is not None and self.used + needed > room:
                if not self._make_room(node, partners, device, needed, room):
                    self._next_device(node, device, needed, reserve)
                continue
            offloaded = self.count_buffers and device in ("cpu", "disk")
            for entry in (node, *partners) if partners else (node,):
                queued[entry] = False
                placed.append((entry, device))
                if offloaded:
                    self.offloaded_buffers += buffer_size[entry]
            self.used += needed
            self.device_bytes[device] = self.used
            self.reserved[device] = max(self.reserved.get(device, 0), reserve)
            if self.verbose:
                self._say_placed(node, partners, device, needed, limit, reserve)
        return self

    # -- the queue of entries still to place ---------------------------------------------------------
    def _enqueue(self, nodes: list[int]) -> None:
        layer, queued, heap = self.tree.layer, self.queued, self.heap
        for node in nodes:
            queued[node] = True
            heapq.heappush(heap, (-layer[node], node))

    def _largest_remaining(self) -> int:
        """Return the largest layer among the entries still to place (0 when none is left)."""
        heap, queued = self.heap, self.queued
        while heap and not queued[heap[0][1]]:
            heapq.heappop(heap)
        return -heap[0][0] if heap else 0

    def _tied_partners(self, node: int) -> list[int]:
        """Return the queued entries holding parameters tied to a parameter inside ``node`` (they go with it)."""
        tree, queued = self.tree, self.queued
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

    # -- when an entry does not fit ------------------------------------------------------------------
    def _make_room(self, node: int, partners: list[int], device: DeviceKey, needed: int, room: int) -> bool:
        """Split a tied partner, split the entry or (``fallback_allocation``) pick a smaller one; return whether done."""
        tree, stack = self.tree, self.stack
        names, children = tree.names, tree.children
        partner = next((p for p in partners if tree.splittable[p]), None)
        if partner is not None:
            # Make the tied partner smaller rather than moving the current entry to the next device.
            at = stack.index(partner)
            stack[at : at + 1] = list(reversed(children[partner]))
            self.queued[partner] = False
            self._enqueue(children[partner])
            stack.append(node)
            self._enqueue([node])
            if self.verbose:
                self._say(f"Splitting tied partner {names[partner]!r} to fit {names[node]!r} on {device}")
            return True
        if tree.splittable[node]:
            stack.extend(reversed(children[node]))
            self._enqueue(children[node])
            if self.verbose:
                self._say(f"{names[node]!r} ({needed} bytes) does not fit on {device}: splitting it")
            return True
        return self._fallback(node, device, room)

    def _fallback(self, node: int, device: DeviceKey, room: int) -> bool:
        """On an empty device, place first the first entry (in model order, opening modules) that fits in ``room``."""
        if not (
            self.fallback_allocation and self.used == 0 and self.fallback_done != self.index and room > 0
        ):
            return False
        self.fallback_done = self.index
        queued = self.queued
        found = _fallback_pick(self.tree, [node, *(n for n in reversed(self.stack) if queued[n])], room)
        if found is None:
            return False
        new_order, target = found
        self.stack[:] = list(reversed(new_order))
        queued[:] = [False] * len(queued)
        self._enqueue(new_order)
        if self.verbose:
            names = self.tree.names
            self._say(f"Fallback: {names[target]!r} fits on {device} where {names[node]!r} does not")
        return True

    def _next_device(self, node: int, device: DeviceKey, needed: int, reserve: int) -> None:
        """Close ``device`` and retry ``node`` on the next one; raise ``ValueError`` after the last device."""
        name = self.tree.names[node]
        if self.verbose:
            self._say(f"{name!r} ({needed} bytes) cannot be split and does not fit on {device}: next device")
        if self.used == 0 and device != "disk":
            self.unfilled.setdefault(device, needed + reserve)
        self.device_bytes.setdefault(device, self.used)
        self.reserved[device] = max(self.reserved.get(device, 0), reserve)
        self.index += 1
        self.used = 0
        if self.index >= len(self.devices):
            raise ValueError(
                f"{name!r} ({needed} bytes) does not fit on any device of max_memory {self.budget}; "
                "raise the budgets or add 'disk' with an offload folder."
            )
        self.stack.append(node)
        self._enqueue([node])

    # -- explanations --------------------------------------------------------------------------------
    def _say(self, message: str) -> None:
        """Record one decision (callers test ``verbose`` first: the message costs a format)."""
        self.decisions.append(message)
        logger.info(message)

    def _say_placed(
        self, node: int, partners: list[int], device: DeviceKey, needed: int, limit: int | None, reserve: int
    ) -> None:
        names = self.tree.names
        extra = f" with tied {[names[p] for p in partners]}" if partners else ""
        self._say(
            f"{names[node]!r}{extra} ({needed} bytes) -> {device}; {self.used} of {limit} used, {reserve} reserved"
        )

    def log_unfilled(self) -> None:
        """Log (INFO, 1.15's text) the devices that got nothing, each with the bytes its first entry needed."""
        if not self.unfilled:
            return
        lines = "".join(
            f"\n  - {device}: {needed} bytes required" for device, needed in self.unfilled.items()
        )
        logger.info(
            "Based on the current allocation process, no modules could be assigned to the following devices due "
            f"to insufficient memory:{lines}\nThese minimum requirements are specific to this allocation attempt "
            "and may vary. Consider increasing the available memory for these devices to at least the specified "
            "minimum, or adjusting the model config."
        )

    def warn_buffers_on_gpu(self) -> None:
        """Warn when the offloaded entries' buffers (kept on the GPU) fit no GPU's remaining memory.

        A GPU's remaining memory is its budget less what was placed on it and, on the main (first) GPU
        only, less the room kept for the model's largest layer, as Accelerate 1.15 counts it; the warning
        is a ``UserWarning`` with its text.
        """
        if not (self.offloaded_buffers and self.gpus):
            return
        free = [
            self.budget[g]
            - self.device_bytes.get(g, 0)
            - (self.largest_layer if g in self.main_devices else 0)
            for g in self.gpus
            if g in self.budget
        ]
        if not any(f >= self.offloaded_buffers for f in free):
            warnings.warn(
                f"Current model requires {self.offloaded_buffers} bytes of buffer for offloaded layers, which "
                "seems does not fit any GPU's remaining memory. If you are experiencing a OOM later, please "
                "consider using offload_buffers=True.",
                stacklevel=4,
            )


def _fallback_pick(tree: ModuleTree, order: list[int], room: int) -> tuple[list[int], int] | None:
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
