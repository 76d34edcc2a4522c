"""Hooks that place weights: AlignDevicesHook (inputs and weights on the execution device for the
forward, offloaded after), LayerwiseCastingHook, and the whole-model CpuOffload with its user handle.

AlignDevicesHook carries the offload machinery: the per-tensor "slots" resolved once at
``init_hook``, the load/offload fast path, the tie-aware fetch, telemetry (one flag test when no
one listens) and the hand-off to the prefetcher.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..utils.device_planning.devices import Device, device_label, torch_device
from ..utils.offload import weights_source
from . import events
from .base import ModelHook, remove_hook_from_module

__all__ = ["AlignDevicesHook", "CpuOffload", "LayerwiseCastingHook", "UserCpuOffloadHook"]

_META = torch.device("meta")
_CPU = torch.device("cpu")
# The settings AlignDevicesHook's repr shows, in order (skip_keys follows, quoted).
_REPR_FIELDS = ("execution_device", "offload", "io_same_device", "offload_buffers", "place_submodules")


def _exec_label(device: torch.device | None) -> str:
    """Return the label of a hook's execution device (a hook without one runs where its weights are: the CPU)."""
    return "cpu" if device is None else device_label(device)


def _move(obj: Any, device: torch.device, skip_keys: Any = None, non_blocking: bool = False) -> Any:
    """Return ``obj`` (tensors, nested lists/tuples/dicts, objects with ``.to``) on ``device``."""
    if isinstance(obj, torch.Tensor):
        if obj.device == device:
            return obj
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, (list, tuple)):
        moved = [_move(o, device, skip_keys, non_blocking) for o in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*moved)
        return type(obj)(moved)
    if isinstance(obj, Mapping):
        if isinstance(skip_keys, str):
            skip_keys = [skip_keys]
        items = {
            k: (v if skip_keys is not None and k in skip_keys else _move(v, device, skip_keys, non_blocking))
            for k, v in obj.items()
        }
        try:
            return type(obj)(items)
        except TypeError:
            return items
    to = getattr(obj, "to", None)
    if callable(to) and not isinstance(obj, (type, nn.Module)):
        try:
            return to(device)
        except TypeError:
            return obj
    return obj


def _find_tensor_device(obj: Any) -> torch.device | None:
    if isinstance(obj, torch.Tensor):
        return obj.device
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for o in obj:
            device = _find_tensor_device(o)
            if device is not None:
                return device
    return None


class _Slot:
    """One offloaded tensor: where it lives in the module tree and its meta placeholder."""

    __slots__ = ("module", "attr", "name", "is_param", "requires_grad", "placeholder", "cls", "nbytes")

    def __init__(self, root: nn.Module, name: str, tensor: torch.Tensor, is_param: bool) -> None:
        module_name, _, attr = name.rpartition(".")
        self.module = root.get_submodule(module_name) if module_name else root
        self.attr = attr
        self.name = name
        self.is_param = is_param
        self.requires_grad = tensor.requires_grad
        self.cls = type(tensor) if is_param else None
        meta = tensor.detach().to(_META)
        self.placeholder = self.cls(meta, requires_grad=self.requires_grad) if is_param else meta
        self.nbytes = tensor.numel() * tensor.element_size()

    def install(self, value: torch.Tensor) -> None:
        if self.is_param:
            self.module._parameters[self.attr] = self.cls(value, requires_grad=self.requires_grad)
        else:
            self.module._buffers[self.attr] = value

    def release(self) -> None:
        if self.is_param:
            self.module._parameters[self.attr] = self.placeholder
        else:
            self.module._buffers[self.attr] = self.placeholder


def _named_tensors(module: nn.Module, include_buffers: bool, recurse: bool, persistent_only: bool = True):
    """Yield ``(name, tensor, is_param)`` for the module's parameters (and persistent buffers)."""
    for name, param in module.named_parameters(recurse=recurse, remove_duplicate=False):
        yield name, param, True
    if include_buffers:
        for prefix, sub in module.named_modules() if recurse else [("", module)]:
            for bname, buf in sub._buffers.items():
                if buf is None or (persistent_only and bname in sub._non_persistent_buffers_set):
                    continue
                yield (f"{prefix}.{bname}" if prefix else bname), buf, False


def _set_on_device(root: nn.Module, name: str, device: torch.device, tied_params_map: dict | None) -> None:
    """Move one tensor of ``root`` to ``device`` in place (sharing tied copies through ``tied_params_map``)."""
    module_name, _, attr = name.rpartition(".")
    module = root.get_submodule(module_name) if module_name else root
    is_param = attr in module._parameters
    tensor = module._parameters[attr] if is_param else module._buffers[attr]
    if tensor is None or tensor.device == device:
        return
    if tensor.device.type == "meta":
        raise ValueError(
            f"{name!r} of {type(root).__name__} is on the meta device (it has no data) and cannot be moved to "
            f"{device}: load its weights first (load_checkpoint_and_dispatch / load_checkpoint_in_model) or "
            "offload it with a state_dict / offload_dir."
        )
    ptr = tensor.data_ptr()
    if tied_params_map is not None and ptr in tied_params_map and device in tied_params_map[ptr]:
        moved = tied_params_map[ptr][device]
    else:
        moved = tensor.detach().to(device)
        if tied_params_map is not None and ptr in tied_params_map:
            tied_params_map[ptr][device] = moved
    if is_param:
        module._parameters[attr] = type(tensor)(moved, requires_grad=tensor.requires_grad)
    else:
        module._buffers[attr] = moved


class AlignDevicesHook(ModelHook):
    """Put inputs and weights on ``execution_device`` for the forward; with ``offload``, release them after.

    Offloaded weights are read from ``weights_map`` (default: a CPU copy of the module's own
    weights made at ``init_hook``). On the CPU, a weights-map tensor with the right dtype is used
    in place, memory-mapped files included: no copy. When hooks are removed (``detach_hook``) the
    weights are put back on their original device, or, for weights whose original device is
    ``meta``, materialised from the weights map on the device where they are stored (memory-mapped
    on the CPU for disk), so the model still runs without hooks.

    Extras (keyword-only): ``module_name`` (used in telemetry events) and ``zero_copy`` (False
    forces a private copy at each load, the way Accelerate loads disk weights; for benchmarks).
    """

    no_grad = False

    def __init__(
        self,
        execution_device: int | str | torch.device | None = None,
        offload: bool = False,
        io_same_device: bool = False,
        weights_map: Mapping | None = None,
        offload_buffers: bool = False,
        place_submodules: bool = False,
        skip_keys: str | list[str] | None = None,
        tied_params_map: dict[int, dict[torch.device, torch.Tensor]] | None = None,
        *,
        module_name: str = "",
        zero_copy: bool = True,
    ) -> None:
        self.execution_device = execution_device
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.tied_params_map = tied_params_map
        self.module_name = module_name
        self.zero_copy = zero_copy
        self.input_device: torch.device | None = None
        self.original_devices: dict[str, torch.device] = {}
        self._slots: list[_Slot] = []
        self._loaded = False
        self._tied_added: list[tuple[int, torch.device]] = []
        self._prefetcher = None
        self._sources: dict[str, str] = {}
        self._t_forward = 0.0

    # execution_device is mutable (align_module_device overrides it): keep the parsed form beside it.
    @property
    def execution_device(self) -> Any:
        return self._execution_device

    @execution_device.setter
    def execution_device(self, value: Any) -> None:
        self._device = None if value is None else torch_device(value)
        self._label = _exec_label(self._device)  # spelled once: telemetry events carry it
        self._execution_device = value

    def __repr__(self) -> str:
        shown = [f"{name}={getattr(self, name)}" for name in _REPR_FIELDS]
        return f"AlignDevicesHook({', '.join(shown)}, skip_keys={self.skip_keys!r})"

    # -- hook protocol -------------------------------------------------------------------------
    def init_hook(self, module: nn.Module) -> nn.Module:
        device = self._device
        if not self.offload:
            if device is not None:
                for name, _, _ in _named_tensors(module, True, self.place_submodules, persistent_only=False):
                    _set_on_device(module, name, device, self.tied_params_map)
            return module
        tensors = list(_named_tensors(module, self.offload_buffers, self.place_submodules))
        self.original_devices = {name: t.device for name, t, _ in tensors}
        if self.weights_map is None:
            self.weights_map = {name: t.detach().to(_CPU) for name, t, _ in tensors}
        missing = [name for name, _, _ in tensors if name not in self.weights_map]
        if missing:
            raise ValueError(
                f"The weights map of {self.module_name or type(module).__name__!r} lacks {missing}: pass a "
                "weights_map/state_dict holding every offloaded parameter (names relative to the module)."
            )
        self._slots = [_Slot(module, name, t, is_param) for name, t, is_param in tensors]
        self._sources = {s.name: weights_source(self.weights_map, s.name) for s in self._slots}
        for slot in self._slots:
            slot.release()
        self._loaded = False
        if device is not None:
            # Buffers that are not offloaded (all of them, or the non-persistent ones) live on the device.
            for name, _, _ in _named_tensors(module, True, self.place_submodules, persistent_only=False):
                if name not in self.original_devices:
                    _set_on_device(module, name, device, None)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if events._ACTIVE:
            self._t_forward = time.perf_counter()
        if self.io_same_device:
            self.input_device = _find_tensor_device([args, kwargs])
        if self.offload:
            self._load(module)
        device = self._device
        if device is not None:
            if args:
                args = _move(args, device, self.skip_keys)
            if kwargs:
                kwargs = _move(kwargs, device, self.skip_keys)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.offload:
            self._offload(module, output)
        if self.io_same_device and self.input_device is not None:
            output = _move(output, self.input_device, self.skip_keys)
        if events._ACTIVE and self._t_forward:
            now = time.perf_counter()
            events.emit(
                events.HookEvent(
                    "forward",
                    self.module_name,
                    self._label,
                    self._label,
                    sum(s.nbytes for s in self._slots),
                    now - self._t_forward,
                    now,
                )
            )
            self._t_forward = 0.0
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        if self._prefetcher is not None:
            self._prefetcher.unregister(self)
        if self.offload and self._slots:
            for slot in self._slots:
                original = self.original_devices.get(slot.name, _CPU)
                value = self.weights_map[slot.name]
                if original.type != "meta":
                    value = value.to(original)
                slot.install(value)
            self._slots = []
            self._loaded = False
        return module

    # -- loading -------------------------------------------------------------------------------
    @property
    def _needs_copy(self) -> bool:
        """Return whether a load copies (then the prefetcher copies ahead; otherwise it faults pages in).

        Weights maps hold CPU tensors (in memory or memory-mapped): on a CPU execution device they
        are used in place unless ``zero_copy`` is off.
        """
        if not self.zero_copy:
            return True
        device = self._device
        if device is not None and device.type != "cpu":
            return True
        return any(not source.startswith("cpu") and source != "disk" for source in self._sources.values())

    def _fetch(self) -> list[torch.Tensor]:
        """Return the slot tensors on the execution device (runs in the prefetch thread too).

        The synchronous path: a hook streamed to a GPU gets its weights from the streamer instead.
        """
        device = self._device
        weights_map = self.weights_map
        tied = self.tied_params_map
        values = []
        for slot in self._slots:
            value = weights_map[slot.name]
            want = slot.placeholder.dtype
            if value.dtype != want and value.is_floating_point() and want.is_floating_point:
                value = value.to(want)
            if device is not None and value.device != device:
                ptr = value.data_ptr()
                if tied is not None and ptr in tied:
                    per_device = tied[ptr]
                    moved = per_device.get(device)
                    if moved is None:
                        moved = per_device[device] = value.to(device)
                        self._tied_added.append((ptr, device))
                    value = moved
                else:
                    value = value.to(device)
            elif not self.zero_copy:
                value = value.clone()
            values.append(value)
        return values

    def _touch(self) -> None:
        """Fault in the pages of memory-mapped weights (zero-copy path): one read per 4 KiB page."""
        for slot in self._slots:
            if self._sources.get(slot.name) != "disk":
                continue
            value = self.weights_map[slot.name]
            if value.numel():
                step = max(1, 4096 // value.element_size())
                value.reshape(-1)[::step].sum()

    def _load(self, module: nn.Module) -> None:
        if self._loaded:
            return
        active = events._ACTIVE
        t0 = time.perf_counter() if active else 0.0
        values = None
        prefetched = False
        prefetcher = self._prefetcher
        if prefetcher is not None:
            hits = prefetcher.hits
            values = prefetcher.take(self)
            prefetched = prefetcher.hits > hits
        if not isinstance(values, list):  # nothing prefetched, or only the pages (zero copy)
            values = self._fetch()
        for slot, value in zip(self._slots, values):
            slot.install(value)
        self._loaded = True
        if prefetcher is not None:
            prefetcher.schedule_after(self)
        if active:
            now = time.perf_counter()
            self._emit_per_source("load", now - t0, now, prefetched)

    def _offload(self, module: nn.Module, output: Any = None) -> None:
        """Release the weights (placeholders back in place); ``output`` is the forward's, for the streamer."""
        if not self._loaded:
            return
        active = events._ACTIVE
        t0 = time.perf_counter() if active else 0.0
        for slot in self._slots:
            slot.release()
        if self._tied_added:
            for ptr, device in self._tied_added:
                self.tied_params_map.get(ptr, {}).pop(device, None)
            self._tied_added = []
        self._loaded = False
        if self._prefetcher is not None:
            self._prefetcher.released(self, output)
        if active:
            now = time.perf_counter()
            self._emit_per_source("offload", now - t0, now, False)

    def _emit_per_source(self, kind: str, seconds: float, now: float, prefetched: bool) -> None:
        by_source: dict[str, int] = {}
        for slot in self._slots:
            source = self._sources.get(slot.name, "cpu")
            by_source[source] = by_source.get(source, 0) + slot.nbytes
        device = self._label
        for source, nbytes in by_source.items():
            events.emit(
                events.HookEvent(kind, self.module_name, device, source, nbytes, seconds, now, prefetched)
            )

    def _storage_of(self, module: nn.Module, name: str, tensor: torch.Tensor) -> tuple[str, int]:
        """Return ``(storage, nbytes)`` of tensor ``name`` of ``module`` (for weight_placement)."""
        nbytes = tensor.numel() * tensor.element_size()
        for slot in self._slots:
            if slot.module is module and slot.attr == name:
                return self._sources.get(slot.name, "cpu"), nbytes
        return device_label(tensor.device), nbytes


class LayerwiseCastingHook(ModelHook):
    """Keep a module's weights in ``storage_dtype`` and cast them to ``compute_dtype`` for each forward."""

    _is_stateful = False

    def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool) -> None:
        for label, dtype in (("storage_dtype", storage_dtype), ("compute_dtype", compute_dtype)):
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"LayerwiseCastingHook {label} must be a torch.dtype, got {dtype!r}")
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        self.non_blocking = non_blocking

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        module.to(dtype=self.compute_dtype, non_blocking=self.non_blocking)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return output


def _default_execution_device() -> torch.device:
    """Return MPS if available, else GPU 0 if there is one, else the CPU (without initialising CUDA)."""
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    if torch.cuda.device_count() > 0:
        return torch.device("cuda", 0)
    return torch.device("cpu")


class CpuOffload(ModelHook):
    """Move a whole model to ``execution_device`` at its forward; it stays there until offloaded again.

    With ``prev_module_hook`` (a :class:`UserCpuOffloadHook`), that previous model is offloaded to
    the CPU just before this one runs.
    """

    def __init__(
        self, execution_device: Device | None = None, prev_module_hook: UserCpuOffloadHook | None = None
    ) -> None:
        self.prev_module_hook = prev_module_hook
        if execution_device is None:
            self.execution_device = _default_execution_device()
        else:
            self.execution_device = torch_device(execution_device)

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to("cpu")

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.prev_module_hook is not None:
            self.prev_module_hook.offload()
        module.to(self.execution_device)
        return _move(args, self.execution_device), _move(kwargs, self.execution_device)


class UserCpuOffloadHook:
    """Handle returned by ``cpu_offload_with_hook``: ``offload()`` sends the model back to the CPU, ``remove()`` unhooks it."""

    def __init__(self, model: nn.Module, hook: ModelHook) -> None:
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        """Move the model back to the CPU (it returns to the execution device at its next forward)."""
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        """Detach the hook from the model; the model stays where it is."""
        remove_hook_from_module(self.model)
