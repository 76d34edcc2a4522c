"""A flat, preorder snapshot of a module tree with sizes, for fast device-map planning.

One walk over ``_parameters`` / ``_modules`` / ``_buffers`` builds parallel lists indexed by node id. Ids are
assigned in preorder, so the subtree of node ``i`` is exactly ``range(i, end[i])``: "is ``j`` inside ``i``"
is two comparisons. Nothing is cached across calls (the model may change between two plans).
"""

from __future__ import annotations

import gc
from typing import Union

import torch
from torch import nn

from .sizes import dtype_byte_size

MODULE, PARAM, BUFFER = 0, 1, 2
_NO_CHILDREN: list[int] = []  # shared by every tensor node (never mutated)
_NOT_CAST_PREFIXES = ("torch.uint", "torch.int", "torch.bool")


class ModuleTree:
    """Parallel lists describing every module, parameter and buffer of a model (node 0 is the model)."""

    __slots__ = (
        "names", "kinds", "objs", "parent", "children", "end", "size", "buffer_size", "layer", "splittable",
        "tied_groups", "tied_inside",
    )  # fmt: skip

    def __init__(self) -> None:
        self.names: list[str] = []
        self.kinds: list[int] = []
        self.objs: list[Union[nn.Module, torch.Tensor]] = []
        self.parent: list[int] = []
        self.children: list[list[int]] = []
        self.end: list[int] = []
        self.size: list[int] = []
        self.buffer_size: list[int] = []
        # Largest "layer" (leaf module, no-split module or bare tensor) inside the subtree.
        self.layer: list[int] = []
        self.splittable: list[bool] = []
        # Node ids of every occurrence of one shared Parameter (first occurrence first).
        self.tied_groups: list[list[int]] = []
        # True where the subtree holds at least one tied occurrence.
        self.tied_inside: list[bool] = []

    def inside(self, node: int, other: int) -> bool:
        """Return whether ``other`` is ``node`` or lies in its subtree."""
        return node <= other < self.end[node]

    def layer_name(self, node: int) -> str:
        """Return the name of one largest layer inside ``node`` (for explanations only)."""
        target = self.layer[node]
        while self.splittable[node]:
            node = next(c for c in self.children[node] if self.layer[c] == target)
        return self.names[node]


def build_tree(
    model: nn.Module,
    dtype: Union[str, torch.dtype, None] = None,
    special_dtypes: dict | None = None,
    no_split_module_classes: list[str] | None = None,
) -> ModuleTree:
    """Return the :class:`ModuleTree` of ``model`` with sizes following ``compute_module_sizes``' rules."""
    tree = ModuleTree()
    names, kinds, objs, parent, children, end = (
        tree.names,
        tree.kinds,
        tree.objs,
        tree.parent,
        tree.children,
        tree.end,
    )
    size, buffer_size, layer, splittable = tree.size, tree.buffer_size, tree.layer, tree.splittable
    no_split = frozenset(no_split_module_classes or ())
    cap = None if dtype is None else dtype_byte_size(dtype)
    special = {k: dtype_byte_size(v) for k, v in special_dtypes.items()} if special_dtypes else None
    # dtype -> (element size, whether a requested dtype applies: integer and bool tensors are never cast)
    elem: dict[torch.dtype, tuple[float, bool]] = {}
    first_seen: dict[int, int] = {}
    ties: dict[int, list[int]] = {}

    def tensor_bytes(owner_name: str, leaf: str, tensor: torch.Tensor) -> int:
        if special is not None:
            full = f"{owner_name}.{leaf}" if owner_name else leaf
            if full in special:
                return int(tensor.numel() * special[full])
        dt = tensor.dtype
        info = elem.get(dt)
        if info is None:
            info = elem[dt] = (dtype_byte_size(dt), not str(dt).startswith(_NOT_CAST_PREFIXES))
        own, castable = info
        if cap is not None and castable and cap < own:
            own = cap
        return int(tensor.numel() * own)

    def new_node(name: str, obj, kind: int, owner: int, kids: list[int], nbytes: int, nbuffers: int) -> int:
        nid = len(names)
        names.append(name)
        kinds.append(kind)
        objs.append(obj)
        parent.append(owner)
        children.append(kids)
        end.append(nid + 1)
        size.append(nbytes)
        buffer_size.append(nbuffers)
        layer.append(nbytes)
        splittable.append(False)
        return nid

    def account(tensor: torch.Tensor, occurrence: int, owner_name: str, leaf: str) -> int:
        """Bytes ``tensor`` adds at ``occurrence``: 0 when it was already seen (a tied/shared tensor)."""
        key = id(tensor)
        first = first_seen.get(key)
        if first is None:
            first_seen[key] = occurrence
            return tensor_bytes(owner_name, leaf, tensor)
        ties.setdefault(key, [first]).append(occurrence)
        return 0

    def add_tensor(owner_name: str, leaf: str, tensor: torch.Tensor, kind: int, owner: int) -> int:
        full = f"{owner_name}.{leaf}" if owner_name else leaf
        nid = new_node(full, tensor, kind, owner, _NO_CHILDREN, 0, 0)
        nbytes = account(tensor, nid, owner_name, leaf)
        size[nid] = layer[nid] = nbytes
        if kind == BUFFER:
            buffer_size[nid] = nbytes
        return nid

    def add_layer(name: str, module: nn.Module, owner: int) -> int:
        """One node for a module that is never split: its whole subtree is summed without nodes of its own."""
        nid = new_node(name, module, MODULE, owner, _NO_CHILDREN, 0, 0)
        total = buffers = 0
        pending = [(name, module)]
        # Hot loop (every tensor of most models goes through here): account() and tensor_bytes() inlined.
        while pending:
            mname, m = pending.pop()
            for group, store in ((m._parameters, False), (m._buffers, True)):
                for leaf, t in group.items():
                    if t is None:
                        continue
                    key = id(t)
                    first = first_seen.get(key)
                    if first is not None:
                        ties.setdefault(key, [first]).append(nid)
                        continue
                    first_seen[key] = nid
                    if special is not None:
                        nbytes = tensor_bytes(mname, leaf, t)
                    else:
                        dt = t.dtype
                        info = elem.get(dt)
                        if info is None:
                            info = elem[dt] = (
                                dtype_byte_size(dt),
                                not str(dt).startswith(_NOT_CAST_PREFIXES),
                            )
                        own = cap if cap is not None and info[1] and cap < info[0] else info[0]
                        nbytes = int(t.numel() * own)
                    total += nbytes
                    if store:
                        buffers += nbytes
            for cname, child in m._modules.items():
                if child is not None:
                    pending.append((f"{mname}.{cname}" if special is not None else mname, child))
        size[nid] = layer[nid] = total
        buffer_size[nid] = buffers
        return nid

    def visit(name: str, module: nn.Module, owner: int, root: bool = False) -> int:
        has_module_child = any(c is not None for c in module._modules.values())
        if not root and (not has_module_child or type(module).__name__ in no_split):
            return add_layer(name, module, owner)
        nid = new_node(name, module, MODULE, owner, [], 0, 0)
        kids: list[int] = []
        for leaf, p in module._parameters.items():
            if p is not None:
                kids.append(add_tensor(name, leaf, p, PARAM, nid))
        for cname, child in module._modules.items():
            if child is not None:
                kids.append(visit(f"{name}.{cname}" if name else cname, child, nid))
        for leaf, b in module._buffers.items():
            if b is not None:
                kids.append(add_tensor(name, leaf, b, BUFFER, nid))
        children[nid] = kids
        end[nid] = len(names)
        total = buffers = biggest = 0
        for k in kids:
            total += size[k]
            buffers += buffer_size[k]
            if layer[k] > biggest:
                biggest = layer[k]
        size[nid] = total
        buffer_size[nid] = buffers
        split = has_module_child and type(module).__name__ not in no_split
        splittable[nid] = split
        layer[nid] = biggest if split else total
        return nid

    # The walk allocates many small objects; generational GC passes over a large heap of module objects
    # would make it superlinear, and nothing here creates reference cycles.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        visit("", model, -1, root=True)
    finally:
        if gc_was_enabled:
            gc.enable()
    tree.tied_groups = list(ties.values())
    inside = [False] * len(names)
    for group in tree.tied_groups:
        for occurrence in group:
            node = occurrence
            while node != -1 and not inside[node]:
                inside[node] = True
                node = parent[node]
    tree.tied_inside = inside
    return tree
