"""Hooking a whole model: which of its modules get which device hook.

Three placements, from the most local to the most global:

- :func:`attach_execution_device_hook`: inputs only. Every module holding weights (its own or its
  submodules') that has no hook yet gets an AlignDevicesHook that moves its inputs to the device.
- :func:`attach_align_device_hook`: weights. Every module holding weights of its own gets an
  AlignDevicesHook placing (or, with ``offload``, loading and releasing) exactly those; it is
  chained after a hook already there. An instance of ``preload_module_classes`` that is offloaded
  gets one hook for its whole subtree instead, since its forward may read its children's weights
  without calling them.
- :func:`attach_align_device_hook_on_blocks`: a device map. Each *block* (a name present in the
  per-block ``execution_device`` / ``offload`` mappings) is either kept on its device (one hook
  placing the whole block) or offloaded (weight hooks inside it); the root keeps inputs and
  outputs where the caller had them.

An :class:`_Attacher` carries what every placement shares (skip keys, preload classes, the tied
weights map, the weights map and whether buffers are offloaded), so the walks below pass only
what varies: a module, its qualified name, a device and whether to offload.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..utils.constants import SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING
from ..utils.device_planning.devices import Device
from ..utils.offload import PrefixedDataset
from .align import AlignDevicesHook, LayerwiseCastingHook
from .base import add_hook_to_module

__all__ = [
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_execution_device_hook",
    "attach_layerwise_casting_hooks",
]

logger = logging.getLogger(__name__)

TiedParamsMap = dict[int, dict[torch.device, torch.Tensor]]


def _walk(
    module: nn.Module, name: str = "", stop: Callable[[str, nn.Module], bool] | None = None
) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(qualified name, module)`` in preorder; a module for which ``stop(name, module)`` is true is yielded, not entered."""
    pending = [(name, module)]
    while pending:
        qualified, current = pending.pop()
        yield qualified, current
        if stop is not None and stop(qualified, current):
            continue
        children = [
            (f"{qualified}.{child}" if qualified else child, sub) for child, sub in current.named_children()
        ]
        pending.extend(reversed(children))


def _holds_weights(module: nn.Module) -> bool:
    """Return whether ``module`` or a submodule has a parameter or buffer."""
    return next(module.parameters(), None) is not None or next(module.buffers(), None) is not None


def _has_own_weights(module: nn.Module) -> bool:
    """Return whether ``module`` itself (not a submodule) has a parameter or buffer."""
    return next(module.parameters(recurse=False), None) is not None or any(
        buffer is not None for buffer in module._buffers.values()
    )


@dataclass(frozen=True)
class _Attacher:
    """What all hooks attached over one model share; its methods attach them to one subtree."""

    skip_keys: str | list[str] | None = None
    preload_module_classes: tuple[str, ...] = ()
    tied_params_map: TiedParamsMap | None = None
    weights_map: Mapping | None = None
    offload_buffers: bool = False

    def preloads(self, name: str, module: nn.Module) -> bool:
        """Return whether ``module`` loads its whole subtree's weights at once (a preload class)."""
        return type(module).__name__ in self.preload_module_classes

    def align(
        self, module: nn.Module, device: Device, name: str = "", append: bool = False, **options: Any
    ) -> None:
        """Add to ``module`` an AlignDevicesHook onto ``device`` that knows this model's skip keys and tied weights."""
        hook = AlignDevicesHook(
            execution_device=device,
            skip_keys=self.skip_keys,
            tied_params_map=self.tied_params_map,
            module_name=name,
            **options,
        )
        add_hook_to_module(module, hook, append=append)

    def execution_hooks(self, module: nn.Module, device: Device, stop_at_preload: bool = True) -> None:
        """Hook every module under ``module`` holding weights and no hook yet to move its inputs to ``device``."""
        stop = self.preloads if stop_at_preload else None
        for _, current in _walk(module, stop=stop):
            if "_hf_hook" not in current.__dict__ and _holds_weights(current):
                self.align(current, device)

    def weight_hooks(self, module: nn.Module, name: str, device: Device, offload: bool) -> None:
        """Chain a hook placing (or offloading) its own weights onto every module under ``module`` that has some."""
        whole_subtree = self.preloads if offload else None
        for qualified, current in _walk(module, name, stop=whole_subtree):
            preload = whole_subtree is not None and whole_subtree(qualified, current)
            if not (preload or _has_own_weights(current)):
                continue
            self.align(
                current,
                device,
                qualified,
                append=True,
                offload=offload,
                weights_map=self._weights_under(qualified),
                offload_buffers=self.offload_buffers,
                place_submodules=preload,
            )

    def _weights_under(self, name: str) -> Mapping | None:
        """Return the weights map seen from module ``name`` (keys relative to it)."""
        if self.weights_map is None:
            return None
        return PrefixedDataset(self.weights_map, f"{name}." if name else "")

    def kept_block(self, block: nn.Module, name: str, device: Device, *, io_same_device: bool) -> None:
        """Place the whole ``block`` on ``device`` with one hook; inner modules only move their inputs."""
        self.align(
            block,
            device,
            name,
            io_same_device=io_same_device,
            offload_buffers=self.offload_buffers,
            place_submodules=True,
        )
        # Nothing inside a kept block is offloaded, so preload classes do not matter here.
        self.execution_hooks(block, device, stop_at_preload=False)

    def offloaded_block(self, block: nn.Module, name: str, device: Device, *, io_same_device: bool) -> None:
        """Offload ``block``'s weights module by module; the block itself moves inputs if it owns no weights."""
        self.weight_hooks(block, name, device, offload=True)
        if "_hf_hook" not in block.__dict__:
            self.align(block, device, name, io_same_device=io_same_device)
        self.execution_hooks(block, device)


def attach_execution_device_hook(
    module: nn.Module,
    execution_device: int | str | torch.device,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: TiedParamsMap | None = None,
) -> None:
    """Attach an ``AlignDevicesHook(execution_device)`` to every submodule with weights and no hook yet.

    The walk does not enter instances of ``preload_module_classes``.
    """
    attacher = _Attacher(skip_keys, tuple(preload_module_classes or ()), tied_params_map)
    attacher.execution_hooks(module, execution_device)


def attach_align_device_hook(
    module: nn.Module,
    execution_device: torch.device | None = None,
    offload: bool = False,
    weights_map: Mapping | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: TiedParamsMap | None = None,
) -> None:
    """Attach an AlignDevicesHook to every submodule with own parameters/buffers (recursively).

    With ``offload``, instances of ``preload_module_classes`` get one hook that loads all their
    weights, submodules included, at the start of their forward.
    """
    attacher = _Attacher(
        skip_keys, tuple(preload_module_classes or ()), tied_params_map, weights_map, offload_buffers
    )
    attacher.weight_hooks(module, module_name, execution_device, offload)


def _per_block(execution_device: Any, offload: Any) -> tuple[dict[str, tuple[Any, bool]], dict[str, Any]]:
    """Return ``({block: (device, offloaded)}, {name: device})`` from the two per-block arguments.

    A single value stands for every name of the other mapping; a block is a name both give.
    """
    devices = dict(execution_device) if isinstance(execution_device, Mapping) else None
    flags = dict(offload) if isinstance(offload, Mapping) else None
    if devices is None:
        devices = dict.fromkeys(flags, execution_device)
    if flags is None:
        flags = dict.fromkeys(devices, offload)
    blocks = {name: (device, bool(flags[name])) for name, device in devices.items() if name in flags}
    return blocks, devices


def attach_align_device_hook_on_blocks(
    module: nn.Module,
    execution_device: torch.device | dict[str, torch.device] | None = None,
    offload: bool | dict[str, bool] = False,
    weights_map: Mapping | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: TiedParamsMap | None = None,
) -> None:
    """Attach AlignDevicesHooks per block, with ``execution_device`` / ``offload`` given per block name.

    A block kept on its device gets one hook placing all its weights (``place_submodules``); an
    offloaded block gets a hook per submodule with weights (see :func:`attach_align_device_hook`).
    With a single device and a single flag, ``module`` is the one block and keeps the caller's
    input/output devices. Otherwise the model (``""``) keeps them, block or not.
    """
    attacher = _Attacher(
        skip_keys, tuple(preload_module_classes or ()), tied_params_map, weights_map, offload_buffers
    )
    if not isinstance(execution_device, Mapping) and not isinstance(offload, Mapping):
        if offload:
            attacher.weight_hooks(module, module_name, execution_device, offload=True)
        else:  # one hook placing every weight, inputs and outputs back where they came from
            attacher.align(module, execution_device, module_name, io_same_device=True, place_submodules=True)
        return
    blocks, devices = _per_block(execution_device, offload)
    for name, current in _walk(module, module_name):
        if name in blocks:
            device, offloaded = blocks[name]
            place = attacher.offloaded_block if offloaded else attacher.kept_block
            place(current, name, device, io_same_device=name == "")
        elif name == "":
            attacher.align(current, devices.get(""), io_same_device=True)


_CASTABLE_LAYERS = SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING


def attach_layerwise_casting_hooks(
    module: nn.Module,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    skip_modules_pattern: str | tuple[str, ...] | None = None,
    skip_modules_classes: tuple[type[nn.Module], ...] | None = None,
    non_blocking: bool = False,
) -> None:
    """Store weights in ``storage_dtype`` and compute in ``compute_dtype``, per layer; return nothing.

    Every Linear/Conv layer (``module`` itself when it is one) gets a :class:`LayerwiseCastingHook`, except
    those whose qualified name matches one of ``skip_modules_pattern`` (regular expressions) or whose class
    is in ``skip_modules_classes``; other modules (norms, embeddings, a model's own parameters) keep their
    dtype, as in Accelerate 1.15.
    """
    if isinstance(skip_modules_pattern, str):
        skip_modules_pattern = (skip_modules_pattern,)
    rule = _CastingSkips(
        tuple(re.compile(p) for p in skip_modules_pattern or ()), tuple(skip_modules_classes or ())
    )
    if isinstance(module, _CASTABLE_LAYERS):
        if not (rule.classes and isinstance(module, rule.classes)):
            add_hook_to_module(module, LayerwiseCastingHook(storage_dtype, compute_dtype, non_blocking))
        return
    for name, current in _walk(module, stop=rule.stops_at):
        if name and isinstance(current, _CASTABLE_LAYERS) and not rule.skips(name, current):
            add_hook_to_module(current, LayerwiseCastingHook(storage_dtype, compute_dtype, non_blocking))


@dataclass(frozen=True)
class _CastingSkips:
    """Which modules layerwise casting leaves alone, and where its walk stops."""

    patterns: tuple[re.Pattern, ...]
    classes: tuple[type[nn.Module], ...]

    def skips(self, name: str, module: nn.Module) -> bool:
        """Return whether ``module`` (qualified ``name``) and everything below it keep their dtype."""
        skipped = bool(self.classes) and isinstance(module, self.classes)
        skipped = skipped or any(pattern.search(name) for pattern in self.patterns)
        if skipped:
            logger.debug("layerwise casting: skipping %r", name)
        return skipped

    def stops_at(self, name: str, module: nn.Module) -> bool:
        """Return whether the walk ends at ``module``: a skipped module or a castable layer (cast as a whole)."""
        if not name:  # the model itself is never cast as a whole here, nor skipped
            return False
        return isinstance(module, _CASTABLE_LAYERS) or self.skips(name, module)
