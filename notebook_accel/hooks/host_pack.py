"""Offloaded weights laid out for streaming to a GPU: one packed, pinned host block per unit, and its device layout.

A *unit* is what one copy brings to the device: the weights of one group of offloading hooks (the
modules of one device-map block, or one module). :func:`pack_unit` decides, once, where each of its
tensors sits in the unit's device buffer (offsets aligned to 256 bytes, a tensor shared by two
modules of the unit placed once) and where its bytes come from:

- weights held in CPU memory are packed into one host block per unit, *pinned* (page-locked) by a
  :class:`HostPinner`, so that the whole unit is one asynchronous host-to-device copy at the bus's
  pinned speed. When the weights map belongs to the library (``cpu_offload`` without a
  ``state_dict``, ``dispatch_model`` / ``load_checkpoint_and_dispatch``), its entries are replaced
  by views of the packed block, so the weights are held once, not twice;
- weights on disk (memory-mapped offload files, a safetensors checkpoint) stay there: at each load
  their pages are read into a pinned staging buffer, then copied to the device (``staged`` spans);
- when the host cannot pin a block (locked-memory limit, not enough RAM) or ``pin_memory`` caps
  it, the block stays in pageable memory and goes through the staging buffer too, with one warning
  saying how much was pinned and how to change it. Nothing fails for lack of pinned memory.

Pinning uses ``cudaHostRegister`` on an anonymous memory map of exactly the block's size: torch's
pinned allocator rounds every block up to a power of two, which could nearly double the host
memory a model needs. Tests pass their own ``register`` function to run all this on a CPU.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..utils.device_planning.device_memory import available_cpu_memory
from ..utils.device_planning.sizes import convert_file_size_to_int
from ..utils.offload import OffloadedWeightsLoader, PrefixedDataset

if TYPE_CHECKING:
    from .align import AlignDevicesHook, _Slot

__all__ = [
    "ALIGNMENT",
    "HostPinner",
    "StreamUnit",
    "cuda_register",
    "cuda_unregister",
    "pack_unit",
    "pin_limit",
]

logger = logging.getLogger(__name__)

ALIGNMENT = 256
"""Byte alignment of every tensor in a unit's buffer (any dtype's view is then aligned)."""

HOST_RESERVE = 2 * 2**30
"""Host memory left available when pinning: a block that would leave less stays pageable."""

# register(pointer, nbytes) -> None when the range is now page-locked, else the error's text.
Register = Callable[[int, int], "str | None"]
Unregister = Callable[[int], None]


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def pin_limit(pin_memory: bool | int | str) -> int | None:
    """Return the bytes ``pin_memory`` allows to pin: None for no limit (True), 0 (False), or the size given."""
    if pin_memory is True:
        return None
    if pin_memory is False or pin_memory is None:
        return 0
    if isinstance(pin_memory, int) and pin_memory < 0:
        raise ValueError(f"pin_memory={pin_memory!r} is negative; give True, False or a size >= 0")
    try:
        limit = convert_file_size_to_int(pin_memory)
    except (ValueError, TypeError):
        raise ValueError(
            f"pin_memory={pin_memory!r} is not True, False or a size (bytes, or text like '8GiB')"
        ) from None
    return limit


def cuda_register(pointer: int, nbytes: int) -> str | None:
    """Page-lock ``nbytes`` at ``pointer`` for CUDA (``cudaHostRegister``); return None, or the error's text."""
    cudart = torch.cuda.cudart()
    status = cudart.cudaHostRegister(pointer, nbytes, 0)
    code = int(getattr(status, "value", status))
    if code == 0:
        return None
    _clear_last_cuda_error()
    try:
        return f"cudaHostRegister error {code}: {cudart.cudaGetErrorString(status)}"
    except (TypeError, RuntimeError):
        return f"cudaHostRegister error {code}"


def _clear_last_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a refused registration.

    The runtime keeps a failed call's error until someone reads it, and torch's next kernel-launch
    check would report it as that kernel's failure. The runtime torch loaded is found in this
    process's memory map (Linux); elsewhere nothing is done.
    """
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
    except OSError:
        return
    for path in paths:
        try:
            ctypes.CDLL(path).cudaGetLastError()
        except (OSError, AttributeError):
            continue


def cuda_unregister(pointer: int) -> None:
    """Undo :func:`cuda_register` for the range starting at ``pointer``."""
    torch.cuda.cudart().cudaHostUnregister(pointer)


class _Block:
    """Host memory of exactly ``nbytes``: an anonymous map, page-locked while this object lives if ``pinned``."""

    def __init__(self, nbytes: int) -> None:
        self._map = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)[:nbytes]
        self.pinned = False

    def pin(self, register: Register, unregister: Unregister) -> str | None:
        """Page-lock the block; return None, or why it could not be."""
        pointer = self.bytes.data_ptr()
        error = register(pointer, self.bytes.numel())
        if error is None:
            self.pinned = True
            # Unlocked before the map can go: the tensors viewing it keep the map, not this object.
            weakref.finalize(self, unregister, pointer)
        return error


@dataclass
class HostPinner:
    """Pins host blocks up to ``limit`` bytes (None: no limit); warns once when the host refuses.

    ``register`` / ``unregister`` default to CUDA's ``cudaHostRegister`` / ``cudaHostUnregister``;
    ``available`` (default: the host memory available, cgroup limit included) is asked before each block: a block that would
    leave less than ``HOST_RESERVE`` bytes of host memory available is not pinned (page-locked memory
    cannot be swapped out or reclaimed, and the rest of the machine needs some).
    """

    limit: int | None = None
    register: Register | None = None
    unregister: Unregister | None = None
    available: Callable[[], int] | None = None
    pinned_bytes: int = 0
    pageable_bytes: int = 0
    refused: str | None = None
    """What the host answered the first time it refused to pin (None: it never did)."""

    def block(self, nbytes: int) -> _Block:
        """Return a host block of ``nbytes``, pinned when the limit and the host allow it."""
        block = _Block(nbytes)
        if nbytes == 0:
            return block
        within = self.limit is None or self.pinned_bytes + nbytes <= self.limit
        if within and self.refused is None:
            left = (self.available or available_cpu_memory)() - nbytes
            if left < HOST_RESERVE:
                error = f"it would leave {max(left, 0) / 2**20:.0f} MiB of host memory available"
            else:
                error = block.pin(self.register or cuda_register, self.unregister or cuda_unregister)
            if error is None:
                self.pinned_bytes += nbytes
                return block
            self.refused = error
            warnings.warn(self.refusal_message(nbytes), ResourceWarning, stacklevel=5)
        self.pageable_bytes += nbytes
        return block

    def refusal_message(self, nbytes: int) -> str:
        """Return the warning shown when pinning ``nbytes`` more was refused."""
        return (
            f"Could not pin {nbytes / 2**20:.0f} MiB more of offloaded weights in host memory ({self.refused}); "
            f"{self.pinned_bytes / 2**20:.0f} MiB are pinned. The rest stays in pageable memory and is copied "
            "through a pinned staging buffer, slower (pageable host-to-device copies run at about a third of the "
            "pinned speed). Free host memory or raise the locked-memory limit (ulimit -l), or pass "
            "pin_memory='<size>' to pin only part of the weights, or pin_memory=False to pin none."
        )


@dataclass(eq=False)
class StreamUnit:
    """One copy's worth of offloaded weights: the device layout and where the bytes come from (see the module docstring)."""

    name: str
    hooks: list[Any]
    nbytes: int = 0
    """Bytes of the unit's device buffer (a multiple of ``ALIGNMENT``)."""
    views: dict[int, list[tuple[int, torch.dtype, tuple, tuple]]] = field(default_factory=dict)
    """Per hook (``id``): ``(byte offset, dtype, shape, stride)`` of each of its slots, in slot order."""
    direct: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    """Pinned host bytes (uint8) and their device offset: copied straight to the device."""
    staged: list[tuple[Callable[[], torch.Tensor], int]] = field(default_factory=list)
    """Host bytes read at each load (disk pages, pageable blocks) and their device offset: via staging."""
    staged_range: tuple[int, int] = (0, 0)
    """``(start, end)`` of the device bytes that go through staging (one copy from the staging buffer)."""
    sources: frozenset[str] = frozenset()
    blocks: list[Any] = field(default_factory=list)
    installed: set[int] = field(default_factory=set)
    """Hooks (``id``) whose slots hold views of the unit's buffer now."""
    pending: set[int] = field(default_factory=set)
    """Hooks (``id``) that have not run since the unit started; it ends when none is left."""
    escaped: bool = False
    """Some tensor of the buffer outlives the unit's computation (autograd, an output view)."""

    @property
    def staged_bytes(self) -> int:
        return self.staged_range[1] - self.staged_range[0]


def _host_value(hook: AlignDevicesHook, slot: _Slot) -> torch.Tensor:
    """Return the CPU tensor ``hook`` serves for ``slot``, in the slot's dtype (as ``AlignDevicesHook._fetch`` reads it)."""
    value = hook.weights_map[slot.name]
    want = slot.placeholder.dtype
    if value.dtype != want and value.is_floating_point() and want.is_floating_point:
        value = value.to(want)
    if value.device.type != "cpu":
        value = value.to("cpu")
    return value


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Return a contiguous ``tensor`` seen as flat uint8 bytes."""
    tensor = tensor.contiguous()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    return tensor.view(-1).view(torch.uint8)


def _replace(weights_map: Mapping, key: str, tensor: torch.Tensor) -> bool:
    """Serve ``tensor`` for ``key`` from the library's own weights map; return whether it was replaced."""
    if isinstance(weights_map, PrefixedDataset):
        return _replace(weights_map.dataset, weights_map.prefix + key, tensor)
    if isinstance(weights_map, OffloadedWeightsLoader):
        return weights_map.replace(key, tensor)
    if isinstance(weights_map, dict) and key in weights_map:
        weights_map[key] = tensor
        return True
    return False


def _staged_reader(hook: AlignDevicesHook, slot: _Slot) -> Callable[[], torch.Tensor]:
    """Return a function reading ``slot``'s bytes from ``hook``'s weights map (at each load: disk pages stay on disk)."""

    def read() -> torch.Tensor:
        data = _as_bytes(_host_value(hook, slot))
        if data.numel() != slot.nbytes:
            raise ValueError(
                f"{hook.module_name or 'module'}.{slot.name}: the weights map holds {data.numel()} bytes for it, "
                f"the model's tensor has {slot.nbytes} ({slot.placeholder.dtype}, {tuple(slot.placeholder.shape)}): "
                "the offloaded weights do not match the model; offload them again"
            )
        return data

    return read


def pack_unit(name: str, hooks: list[AlignDevicesHook], pinner: HostPinner, owned: bool) -> StreamUnit:
    """Return the :class:`StreamUnit` of ``hooks`` (their offloaded slots), its in-memory weights packed once.

    ``owned``: the weights maps belong to the library, so their in-memory entries are replaced by
    views of the packed block (their original tensors are then freed).
    """
    unit = StreamUnit(name, list(hooks))
    memory: list[tuple[Any, Any, torch.Tensor]] = []  # (hook, slot, value) held in CPU memory
    disk: list[tuple[Any, Any]] = []
    for hook in hooks:
        for slot in hook._slots:
            source = hook._sources.get(slot.name, "cpu")
            if source == "disk":
                disk.append((hook, slot))
            else:
                memory.append((hook, slot, _host_value(hook, slot)))
    unit.sources = frozenset({"disk"} if disk else set()) | ({"cpu"} if memory else set())
    offsets: dict[int, int] = {}  # id(slot) -> device byte offset
    placed: dict[tuple, int] = {}  # (data_ptr, dtype, shape) -> offset: a tensor shared within the unit
    end = 0
    for _, slot, value in memory:
        key = (value.data_ptr(), value.dtype, tuple(value.shape))
        if value.numel() and key in placed:
            offsets[id(slot)] = placed[key]
            continue
        offsets[id(slot)] = placed[key] = end
        end = _align(end + value.numel() * value.element_size())
    block = pinner.block(end)
    unit.blocks.append(block)
    for hook, slot, value in memory:
        start = offsets[id(slot)]
        nbytes = value.numel() * value.element_size()
        target = block.bytes[start : start + nbytes]
        if nbytes:
            target.copy_(_as_bytes(value))
        if owned and value.dtype == slot.placeholder.dtype:
            _replace(hook.weights_map, slot.name, target.view(value.dtype).view(value.shape))
    del memory  # the originals of replaced entries are freed here
    if end:
        if block.pinned:
            unit.direct.append((block.bytes, 0))
        else:
            unit.staged.append((lambda b=block: b.bytes, 0))
    staged_start = end if block.pinned or not end else 0
    for hook, slot in disk:
        offsets[id(slot)] = end
        unit.staged.append((_staged_reader(hook, slot), end))
        end = _align(end + slot.nbytes)
    unit.staged_range = (staged_start, end) if unit.staged else (0, 0)
    unit.nbytes = end
    for hook in hooks:
        unit.views[id(hook)] = [
            (offsets[id(slot)], slot.placeholder.dtype, tuple(slot.placeholder.shape), _strides(slot.placeholder.shape))
            for slot in hook._slots
        ]  # fmt: skip
    return unit


def _strides(shape: torch.Size) -> tuple[int, ...]:
    """Return the strides of a contiguous tensor of ``shape`` (a unit's tensors are packed contiguous)."""
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
