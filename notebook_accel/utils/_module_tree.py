"""A flat, preorder snapshot of a module tree with sizes, for fast device-map planning.

One walk over ``_parameters`` / ``_modules`` / ``_buffers`` builds parallel lists indexed by node id. Ids are
assigned in preorder, so the subtree of node ``i`` is exactly ``range(i, end[i])``: "is ``j`` inside ``i``"
is two comparisons. Nothing is cached across calls (the model may change between two plans).
"""

from __future__ import annotations

from typing import Union

import torch
from torch import nn

from .sizes import dtype_byte_size

MODULE, PARAM, BUFFER = 0, 1, 2
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

    def tensor_bytes(full: str, tensor: torch.Tensor) -> int:
        if special is not None and full in special:
            return int(tensor.numel() * special[full])
        dt = tensor.dtype
        info = elem.get(dt)
        if info is None:
            info = elem[dt] = (dtype_byte_size(dt), not str(dt).startswith(_NOT_CAST_PREFIXES))
        own, castable = info
        if cap is not None and castable and cap < own:
            own = cap
        return int(tensor.numel() * own)

    def add_tensor(full: str, tensor: torch.Tensor, kind: int, owner: int) -> int:
        nid = len(names)
        names.append(full)
        kinds.append(kind)
        objs.append(tensor)
        parent.append(owner)
        children.append([])
        end.append(nid + 1)
        key = id(tensor)
        first = first_seen.get(key)
        if first is None:
            first_seen[key] = nid
            nbytes = tensor_bytes(full, tensor)
        else:
            # A tied (shared) tensor is stored once: only its first occurrence takes room.
            ties.setdefault(key, [first]).append(nid)
            nbytes = 0
        size.append(nbytes)
        buffer_size.append(nbytes if kind == BUFFER else 0)
        layer.append(nbytes)
        splittable.append(False)
        return nid

    def visit(name: str, module: nn.Module, owner: int) -> int:
        nid = len(names)
        names.append(name)
        kinds.append(MODULE)
        objs.append(module)
        parent.append(owner)
        children.append([])
        end.append(0)
        size.append(0)
        buffer_size.append(0)
        layer.append(0)
        splittable.append(False)
        prefix = f"{name}." if name else ""
        kids: list[int] = []
        has_module_child = False
        for pname, p in module._parameters.items():
            if p is not None:
                kids.append(add_tensor(prefix + pname, p, PARAM, nid))
        for cname, child in module._modules.items():
            if child is not None:
                has_module_child = True
                kids.append(visit(prefix + cname, child, nid))
        for bname, b in module._buffers.items():
            if b is not None:
                kids.append(add_tensor(prefix + bname, b, BUFFER, nid))
        children[nid] = kids
        end[nid] = len(names)
        total = 0
        buffers = 0
        biggest = 0
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

    visit("", model, -1)
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
