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
    builder = _TreeBuilder(dtype, special_dtypes, no_split_module_classes)
    # The walk allocates many small objects; generational GC passes over a large heap of module objects
    # would make it superlinear, and nothing here creates reference cycles.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        builder.visit("", model, -1, root=True)
    finally:
        if gc_was_enabled:
            gc.enable()
    return builder.finish()


class _TreeBuilder:
    """Fills one :class:`ModuleTree` during a preorder walk; sizes follow ``compute_module_sizes``' rules.

    A tensor is counted once, at its first occurrence; later occurrences (tied or shared tensors) add
    no bytes and are recorded as a tied group.
    """

    __slots__ = (
        "tree", "no_split", "cap", "special", "elem", "first_seen", "ties", "_names", "_accounting", "_appends",
    )  # fmt: skip

    def __init__(
        self,
        dtype: Union[str, torch.dtype, None],
        special_dtypes: dict | None,
        no_split_module_classes: list[str] | None,
    ) -> None:
        self.tree = ModuleTree()
        self.no_split = frozenset(no_split_module_classes or ())
        self.cap = None if dtype is None else dtype_byte_size(dtype)
        self.special = {k: dtype_byte_size(v) for k, v in special_dtypes.items()} if special_dtypes else None
        # dtype -> (element size, whether a requested dtype applies: integer and bool tensors are never cast)
        self.elem: dict[torch.dtype, tuple[float, bool]] = {}
        self.first_seen: dict[int, int] = {}
        self.ties: dict[int, list[int]] = {}
        tree = self.tree
        self._names = tree.names
        # add_layer reads these for every layer of the model: one attribute read instead of five.
        self._accounting = (self.first_seen, self.ties, self.special, self.cap, self.elem)
        # Bound appends of the parallel lists, in new_node's order: one attribute read per node, not ten.
        self._appends = tuple(
            getattr(tree, column).append
            for column in (
                "names", "kinds", "objs", "parent", "children", "end", "size", "buffer_size", "layer", "splittable"
            )
        )  # fmt: skip

    def _element(self, dt: torch.dtype) -> tuple[float, bool]:
        info = self.elem.get(dt)
        if info is None:
            info = self.elem[dt] = (dtype_byte_size(dt), not str(dt).startswith(_NOT_CAST_PREFIXES))
        return info

    def tensor_bytes(self, owner_name: str, leaf: str, tensor: torch.Tensor) -> int:
        """Return the bytes ``tensor`` (``leaf`` of module ``owner_name``) counts for."""
        if self.special is not None:
            full = f"{owner_name}.{leaf}" if owner_name else leaf
            if full in self.special:
                return int(tensor.numel() * self.special[full])
        own, castable = self._element(tensor.dtype)
        if self.cap is not None and castable and self.cap < own:
            own = self.cap
        return int(tensor.numel() * own)

    def new_node(
        self,
        name: str,
        obj: object,
        kind: int,
        owner: int,
        kids: list[int],
        nbytes: int = 0,
        nbuffers: int = 0,
    ) -> int:
        """Append a node (``nbytes`` of which ``nbuffers`` in buffers; its largest layer is itself); return its id."""
        names, kinds, objs, parent, children, end, size, buffer_size, layer, splittable = self._appends
        nid = len(self._names)
        names(name)
        kinds(kind)
        objs(obj)
        parent(owner)
        children(kids)
        end(nid + 1)
        size(nbytes)
        buffer_size(nbuffers)
        layer(nbytes)
        splittable(False)
        return nid

    def add_tensor(self, owner_name: str, leaf: str, tensor: torch.Tensor, kind: int, owner: int) -> int:
        """Add a parameter or buffer node; 0 bytes when the tensor was already seen (tied or shared)."""
        tree = self.tree
        nid = self.new_node(f"{owner_name}.{leaf}" if owner_name else leaf, tensor, kind, owner, _NO_CHILDREN)
        first = self.first_seen.get(id(tensor))
        if first is not None:
            self.ties.setdefault(id(tensor), [first]).append(nid)
            return nid
        self.first_seen[id(tensor)] = nid
        nbytes = self.tensor_bytes(owner_name, leaf, tensor)
        tree.size[nid] = tree.layer[nid] = nbytes
        if kind == BUFFER:
            tree.buffer_size[nid] = nbytes
        return nid

    def add_layer(self, name: str, module: nn.Module, owner: int) -> int:
        """One node for a module that is never split: its whole subtree is summed without nodes of its own."""
        nid = len(self._names)  # the node is appended once its bytes are summed
        first_seen, ties, special, cap, elem = self._accounting
        total = buffers = 0
        pending = [(name, module)]
        # Hot loop (every tensor of most models goes through here): add_tensor()'s accounting inlined.
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
                        nbytes = self.tensor_bytes(mname, leaf, t)
                    else:
                        info = elem.get(t.dtype) or self._element(t.dtype)
                        own = cap if cap is not None and info[1] and cap < info[0] else info[0]
                        nbytes = int(t.numel() * own)
                    total += nbytes
                    if store:
                        buffers += nbytes
            for cname, child in m._modules.items():
                if child is not None:
                    pending.append((f"{mname}.{cname}" if special is not None else mname, child))
        return self.new_node(name, module, MODULE, owner, _NO_CHILDREN, total, buffers)

    def visit(self, name: str, module: nn.Module, owner: int, root: bool = False) -> int:
        """Add ``module`` (a layer node, or a node with its tensors and children) under ``owner``; return its id."""
        has_module_child = any(c is not None for c in module._modules.values())
        splits = has_module_child and type(module).__name__ not in self.no_split
        if not root and not splits:
            return self.add_layer(name, module, owner)
        nid = self.new_node(name, module, MODULE, owner, [])
        kids: list[int] = []
        add_tensor, visit, keep = (
            self.add_tensor,
            self.visit,
            kids.append,
        )  # bound once: wide modules loop here
        for leaf, p in module._parameters.items():
            if p is not None:
                keep(add_tensor(name, leaf, p, PARAM, nid))
        for cname, child in module._modules.items():
            if child is not None:
                keep(visit(f"{name}.{cname}" if name else cname, child, nid))
        for leaf, b in module._buffers.items():
            if b is not None:
                keep(add_tensor(name, leaf, b, BUFFER, nid))
        self._close(nid, kids, splits)
        return nid

    def _close(self, nid: int, kids: list[int], splittable: bool) -> None:
        """Set a module node's children, subtree end and sums once its subtree is built."""
        tree = self.tree
        size, buffer_size, layer = tree.size, tree.buffer_size, tree.layer
        tree.children[nid] = kids
        tree.end[nid] = len(tree.names)
        total = buffers = biggest = 0
        for k in kids:
            total += size[k]
            buffers += buffer_size[k]
            if layer[k] > biggest:
                biggest = layer[k]
        size[nid] = total
        buffer_size[nid] = buffers
        tree.splittable[nid] = splittable
        layer[nid] = biggest if splittable else total

    def finish(self) -> ModuleTree:
        """Return the tree with its tied groups, and ``tied_inside`` marked up from every tied occurrence."""
        tree = self.tree
        tree.tied_groups = list(self.ties.values())
        inside = [False] * len(tree.names)
        for group in tree.tied_groups:
            for occurrence in group:
                node = occurrence
                while node != -1 and not inside[node]:
                    inside[node] = True
                    node = tree.parent[node]
        tree.tied_inside = inside
        return tree
