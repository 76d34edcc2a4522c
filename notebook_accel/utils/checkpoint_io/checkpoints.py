"""Checkpoint I/O: find a checkpoint's files, read them memory-mapped, load them into a model, shard a state dict.

safetensors files are opened with ``safe_open``, whose CPU tensors are copy-on-write views of the page cache:
loading onto the CPU with matching dtypes copies nothing, so peak memory stays near what is actually used.
Weights mapped to "disk" from a safetensors checkpoint are not copied either: the offload index points into
the checkpoint's own files (``{"safetensors_file", "weight_name", "dtype", "shape"}``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import tempfile
from typing import Any, Union

import torch
from safetensors import safe_open
from torch import nn

from ..constants import WEIGHTS_NAME
from ..device_planning.devices import Device, device_label, is_disk
from ..device_planning.placement import DeviceLookup, DevicePlacement, require_offload_folder
from ..device_planning.sizes import _as_dtype, convert_file_size_to_int
from ..device_planning.tensors import set_module_tensor_to_device, shape_mismatch
from ..device_planning.tied_params import (
    check_tied_parameters_on_same_device,
    find_tied_parameters,
    retie_parameters,
)
from ..offload import load_offloaded_weights, offload_weight, save_offload_index
from .file_checks import safetensors_keys, torch_load_named
from .locate import _check_shard_holds, _locate, find_checkpoint_files

__all__ = ["find_checkpoint_files", "load_checkpoint_in_model", "load_state_dict", "shard_checkpoint"]

logger = logging.getLogger(__name__)

_SAFE_FORMATS = ("pt", "tf", "flax", "mlx", "numpy")


# ---------------------------------------------------------------------------------------------- reading files


class _Shard:
    """One checkpoint file opened for reading: safetensors memory-mapped, ``.bin`` via ``torch.load``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.safetensors = path.endswith(".safetensors")
        self._handles: dict[str, Any] = {}
        mapped = False
        if self.safetensors:
            # safetensors' own reader says "header too small" without the file's name; the checked header
            # names the file and says whether it is empty or cut short.
            self.keys = safetensors_keys(path)
            handle = self._handle("cpu")
            metadata = handle.metadata() or {}
            fmt = metadata.get("format", "pt")
            if fmt not in _SAFE_FORMATS:
                raise OSError(
                    f"The safetensors file {path} has unknown format metadata {fmt!r}; save it with format 'pt'."
                )
            if fmt != "pt":
                raise ValueError(
                    f"The safetensors file {path} holds {fmt!r} weights; only PyTorch ('pt') ones load here."
                )
            self.state: dict[str, torch.Tensor] = {}
        else:
            self.state, mapped = _torch_load(path)
            self.keys = list(self.state)
        # Tensors from memory-mapped files cost no RAM until written: nothing to gain by spilling them to disk.
        self.file_backed = self.safetensors or mapped

    def _handle(self, device: str):
        handle = self._handles.get(device)
        if handle is None:
            handle = self._handles[device] = safe_open(self.path, framework="pt", device=device)
        return handle

    def get(self, key: str, device: Device = "cpu") -> torch.Tensor:
        if not self.safetensors:
            return self.state[key]
        label = device_label(device)
        if label in ("cpu", "meta", "disk"):  # read on the CPU; meta and disk weights are placed afterwards
            return self._handle("cpu").get_tensor(key)
        return self._handle(label).get_tensor(key)

    def close(self) -> None:
        self._handles.clear()
        self.state = {}


def _torch_load(path: str) -> tuple[dict[str, torch.Tensor], bool]:
    """Return ``(state dict, memory-mapped?)`` for a ``.bin``/``.pt`` file, read with ``weights_only=True``."""
    mapped = True
    try:
        state = torch_load_named(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as err:
        if "mmap" not in str(err) and "zipfile" not in str(err):
            raise
        # Legacy (pre-zipfile) checkpoints cannot be memory-mapped.
        state = torch_load_named(path, map_location="cpu", weights_only=True)
        mapped = False
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict of tensors.")
    return state, mapped


def load_state_dict(
    checkpoint_file: Union[str, os.PathLike], device_map: dict[str, Device] | None = None
) -> dict:
    """Return the state dict stored in ``checkpoint_file``.

    safetensors files are memory-mapped (CPU tensors are views of the file). With ``device_map`` each tensor
    goes straight to its device and "disk" entries are left out. ``.bin`` files go through
    ``torch.load(weights_only=True, mmap=True)`` and stay on the CPU.
    """
    path = os.fspath(checkpoint_file)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Checkpoint file {path!r} does not exist.")
    shard = _Shard(path)
    try:
        if device_map is None or not shard.safetensors:
            if shard.safetensors:
                return {key: shard.get(key) for key in shard.keys}
            return shard.state
        lookup = DeviceLookup(device_map)
        result = {}
        for key in shard.keys:
            device = lookup(key)
            if device is None:
                device = "cpu"
            if is_disk(device):
                continue
            result[key] = shard.get(key, device)
        return result
    finally:
        shard.close()


# -------------------------------------------------------------------------------------- loading into a model


def _expected_tensors(model: nn.Module) -> dict[str, bool]:
    """Return ``{name: is_buffer}`` for everything a checkpoint may set (tied names included)."""
    expected = {name: False for name, _ in model.named_parameters(remove_duplicate=False)}
    for name, _ in model.named_buffers(remove_duplicate=False):
        expected[name] = True
    return expected


def _persistent_names(model: nn.Module) -> set[str]:
    return set(model.state_dict(keep_vars=True).keys())


def _kept_in_fp32(name: str, modules: list[str]) -> bool:
    """Return whether weight ``name`` belongs to one of ``modules`` (``keep_in_fp32_modules``)."""
    parts = name.split(".")
    return any(m in parts or name.startswith(m + ".") for m in modules)


class _CurrentDevices:
    """Device of each tensor when no device_map is given: where it is now, or the CPU for meta tensors."""

    def __init__(self, model: nn.Module) -> None:
        self._where = {name: t.device for name, t in model.named_parameters(remove_duplicate=False)}
        self._where.update({name: t.device for name, t in model.named_buffers(remove_duplicate=False)})

    def __call__(self, name: str) -> Device:
        device = self._where.get(name)
        return "cpu" if device is None or device.type == "meta" else device


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: Union[str, os.PathLike],
    device_map: dict[str, Device] | DevicePlacement | None = None,
    offload_folder: Union[str, os.PathLike, None] = None,
    dtype: Union[str, torch.dtype, None] = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: list[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> None:
    """Load a (possibly sharded) checkpoint into ``model``, each weight to its ``device_map`` device; return nothing.

    Shards are read one at a time (memory-mapped when possible) with a progress bar for several shards.
    "disk" weights from safetensors files are recorded in ``offload_folder``'s ``index.json`` as pointers into
    the checkpoint (no copy); from ``.bin`` files they are written there as ``.dat`` files. ``dtype`` casts
    floating weights (``keep_in_fp32_modules`` stay float32). ``strict`` raises on missing/unexpected keys.
    Tied parameters are tied again afterwards. Without ``device_map`` weights load where the model's tensors
    are (meta tensors to the CPU). ``device_map`` may also be a ``DevicePlacement`` already checked for
    ``model`` (what ``load_checkpoint_and_dispatch`` passes), which is not checked again.

    Args:
        model: The model to fill.
        checkpoint: A checkpoint file, a sharded checkpoint's index file or a folder holding one.
        device_map: Module name -> device for each weight (default: where the model's tensors are).
        offload_folder: Folder of the weights mapped to "disk".
        dtype: Cast floating weights to this dtype.
        offload_state_dict: Stage the CPU weights on disk while loading.
        offload_buffers: Offload buffers mapped to "disk" too.
        keep_in_fp32_modules: Modules whose weights stay float32 whatever ``dtype`` says.
        offload_8bit_bnb: Offload 8-bit bitsandbytes weights with their scales.
        strict: Raise on keys missing from the checkpoint or unknown to the model.
        full_state_dict: With ``broadcast_from_rank0``, set the weights as one full state dict (False: as the
            model's shards).
        broadcast_from_rank0: Read on rank 0 only and broadcast.
    """
    if offload_8bit_bnb and importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError("offload_8bit_bnb=True needs `bitsandbytes`: pip install bitsandbytes")
    target_dtype = None if dtype is None else _as_dtype(dtype)
    if broadcast_from_rank0:
        _load_broadcast(model, checkpoint, target_dtype, strict, full_state_dict)
        return
    tied = find_tied_parameters(model)
    placement = None
    if device_map is not None:
        placement = DevicePlacement.check(model, device_map)
        check_tied_parameters_on_same_device(tied, placement.device_map)
        require_offload_folder(placement.disk_modules, offload_folder, "offload_folder")
    loader = _CheckpointLoader(
        model, placement, offload_folder, target_dtype, list(keep_in_fp32_modules or ()), offload_state_dict,
        offload_buffers,
    )  # fmt: skip
    files, index_path, weight_map = _locate(os.fspath(checkpoint))
    loader.load(files, tied, index_path, weight_map)
    retie_parameters(model, tied)
    _report_keys(model, os.fspath(checkpoint), loader, tied, strict)


class _CheckpointLoader:
    """One load of checkpoint files into a model: each weight to its device, to disk, or spilled and read back."""

    def __init__(
        self,
        model: nn.Module,
        placement: DevicePlacement | None,
        offload_folder: Union[str, os.PathLike, None],
        dtype: torch.dtype | None,
        keep_in_fp32_modules: list[str],
        offload_state_dict: bool,
        offload_buffers: bool,
    ) -> None:
        self.model = model
        self.by_map = placement is not None
        self.device_of = placement.device_of if placement is not None else _CurrentDevices(model)
        self.offload_folder = offload_folder
        self.dtype = dtype
        self.keep_in_fp32_modules = keep_in_fp32_modules
        self.offload_buffers = offload_buffers
        self.expected = _expected_tensors(model)
        self.loaded: set[str] = set()
        self.unexpected: list[str] = []
        self.offload_index: dict[str, dict] = {}
        # CPU weights read from files that cannot be memory-mapped are spilled here, then mapped back.
        self.spill_folder = tempfile.mkdtemp(prefix="na-state-dict-") if offload_state_dict else None
        self.spill_index: dict[str, dict] = {}

    def load(
        self, files: list[str], tied: list[list[str]], index_path: str | None = None,
        weight_map: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        """Load every file; on failure remove the ``.dat`` files written so far. The spill folder is always removed.

        With an index, each ``.bin`` shard is checked to hold what the index maps to it (safetensors shards
        were checked from their headers before anything loaded).
        """
        folder = os.path.dirname(index_path or "")
        try:
            for path in _progress(files):
                shard = _Shard(path)
                try:
                    if weight_map is not None and not shard.safetensors:
                        wanted = [k for k, f in weight_map.items() if os.path.join(folder, f) == path]
                        _check_shard_holds(index_path, path, wanted, shard.keys)
                    for key in shard.keys:
                        self._load_one(shard, key)
                finally:
                    shard.close()
            self._finish(tied)
        except BaseException:
            # A failed load leaves no partial set of .dat files behind (each file itself is written atomically).
            for name, info in self.offload_index.items():
                if "safetensors_file" not in info:
                    with contextlib.suppress(OSError):
                        os.remove(os.path.join(os.fspath(self.offload_folder), f"{name}.dat"))
            raise
        finally:
            if self.spill_folder is not None:
                shutil.rmtree(self.spill_folder, ignore_errors=True)

    def _dtype_for(self, key: str, value: torch.Tensor) -> torch.dtype | None:
        """Return the dtype ``value`` is cast to (None: keep it).

        With ``dtype`` floating weights are cast to it (``keep_in_fp32_modules`` to float32), integer and
        bool ones never. Without it, a weight of another kind than the model's tensor (an int64 tensor for
        a float parameter) takes the model tensor's dtype, as ``load_state_dict`` does.
        """
        if not value.is_floating_point():
            current = _current_tensor(self.model, key)
            if self.dtype is None and current is not None and current.is_floating_point():
                return current.dtype
            return None
        if self.dtype is not None and _kept_in_fp32(key, self.keep_in_fp32_modules):
            return torch.float32
        return self.dtype

    def _load_one(self, shard: _Shard, key: str) -> None:
        is_buffer = self.expected.get(key)
        if is_buffer is None:
            self.unexpected.append(key)
            return
        device = self.device_of(key)
        if device is None:
            raise ValueError(f"{key} has no device in the device_map; add its module or ''.")
        value = shard.get(key, "cpu" if is_disk(device) else device)
        dtype = self._dtype_for(key, value)
        if dtype is not None and not value.is_floating_point():  # an integer tensor for a float weight
            value, dtype = value.to(dtype), None
        if is_disk(device) and (self.offload_buffers or not is_buffer):
            self._to_disk(shard, key, value, dtype or value.dtype)
        elif self.spill_folder is not None and not shard.file_backed and str(device) == "cpu":
            _check_shape(self.model, key, value)
            offload_weight(value.to(dtype or value.dtype), key, self.spill_folder, index=self.spill_index)
            set_module_tensor_to_device(self.model, key, "meta", dtype=dtype or value.dtype)
        elif not self.by_map and dtype is None and _copy_in_place(self.model, key, value):
            pass  # an existing (non-meta) tensor keeps its identity, so optimizers stay valid
        else:
            target = "cpu" if is_disk(device) else device
            set_module_tensor_to_device(self.model, key, target, value=value, dtype=dtype)
        self.loaded.add(key)

    def _to_disk(self, shard: _Shard, key: str, value: torch.Tensor, dtype: torch.dtype) -> None:
        """Offload ``key``: an index entry pointing into a safetensors file, or a ``.dat`` file written."""
        _check_shape(self.model, key, value)
        if shard.safetensors:
            self.offload_index[key] = {
                "safetensors_file": os.path.abspath(shard.path), "weight_name": key,
                "dtype": str(dtype).replace("torch.", ""), "shape": list(value.shape),
            }  # fmt: skip
        else:
            offload_weight(value.to(dtype), key, self.offload_folder, index=self.offload_index)
        set_module_tensor_to_device(self.model, key, "meta", dtype=dtype)

    def _finish(self, tied: list[list[str]]) -> None:
        """Write the offload index (tied names share their entry) and read spilled weights back."""
        if self.offload_index:
            # A tied weight is stored once; hooks look weights up by each module's own names.
            for group in tied:
                source = next((name for name in group if name in self.offload_index), None)
                for name in group if source is not None else ():
                    if name not in self.offload_index and is_disk(self.device_of(name)):
                        self.offload_index[name] = self.offload_index[source]
                        self.loaded.add(name)
            save_offload_index(self.offload_index, self.offload_folder)
        if self.spill_index:
            load_offloaded_weights(self.model, self.spill_index, self.spill_folder)


def _current_tensor(model: nn.Module, key: str) -> torch.Tensor | None:
    """Return the model's parameter or buffer ``key`` (None when the model has no such tensor)."""
    module_name, _, leaf = key.rpartition(".")
    owner = model.get_submodule(module_name) if module_name else model
    return owner._parameters.get(leaf) if leaf in owner._parameters else owner._buffers.get(leaf)


def _copy_in_place(model: nn.Module, key: str, value: torch.Tensor) -> bool:
    """Copy ``value`` into the model's existing tensor ``key`` (as ``load_state_dict`` does); False if it is meta."""
    current = _current_tensor(model, key)
    if current is None or current.device.type == "meta":
        return False
    _check_shape(model, key, value)
    with torch.no_grad():
        current.copy_(value)
    return True


def _check_shape(model: nn.Module, key: str, value: torch.Tensor) -> None:
    old = _current_tensor(model, key)
    if old is not None and old.shape != value.shape:
        raise shape_mismatch(key, model, old.shape, value.shape)


def _report_keys(
    model: nn.Module, checkpoint: str, loader: _CheckpointLoader, tied: list[list[str]], strict: bool
) -> None:
    covered = set(loader.loaded)
    for group in tied:
        if covered.intersection(group):
            covered.update(group)
    persistent = _persistent_names(model)
    missing = [name for name in loader.expected if name not in covered and name in persistent]
    unexpected = loader.unexpected
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append("Missing key(s): " + ", ".join(missing))
        if unexpected:
            parts.append("Unexpected key(s): " + ", ".join(unexpected))
        raise RuntimeError(
            f"Error(s) in loading the checkpoint into {type(model).__name__}: " + "; ".join(parts)
        )
    if missing:
        logger.warning("Some weights were not in the checkpoint and keep their current values: %s", missing)
    if unexpected:
        # Accelerate 1.15's wording (a set of names), which users and tests match on.
        logger.warning(
            "Some weights of the model checkpoint at %s were not used when initializing %s: %s. This may or may "
            "not be an issue - make sure that the checkpoint does not have unnecessary parameters, or that the "
            "model definition correctly corresponds to the checkpoint.",
            checkpoint, type(model).__name__, set(unexpected),
        )  # fmt: skip


def _progress(files: list[str]):
    if len(files) < 2:
        return files
    # Imported here, not at the top: tqdm.auto probes for IPython/ipywidgets, which the headless core
    # must not import when a module is imported.
    from tqdm.auto import tqdm

    # delay: quick loads (memory-mapped, page-cached) finish before a bar would be worth drawing.
    return tqdm(files, desc="Loading checkpoint shards", unit="shard", leave=False, delay=0.5)


def _load_broadcast(
    model: nn.Module, checkpoint: Union[str, os.PathLike], dtype: torch.dtype | None, strict: bool, full: bool
) -> None:
    """Rank 0 reads the checkpoint and broadcasts it tensor by tensor; other ranks receive and shard it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "broadcast_from_rank0=True needs an initialised process group: create PartialState() or call "
            "torch.distributed.init_process_group first."
        )
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if dtype is not None:
        # Accelerate 1.15 loads into the model's own dtypes here too (the values are not rounded to dtype).
        logger.warning(
            "broadcast_from_rank0=True loads the weights in the model's own dtypes; dtype=%s is not applied "
            "(cast the model with model.to(dtype) first)",
            dtype,
        )
    state: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0:
        for path in _progress(find_checkpoint_files(checkpoint)[0]):
            state.update(load_state_dict(path))
    options = StateDictOptions(full_state_dict=full, broadcast_from_rank0=True, strict=strict)
    set_model_state_dict(model, state, options=options)


# ------------------------------------------------------------------------------------------------- sharding


def shard_checkpoint(
    state_dict: dict[str, torch.Tensor],
    max_shard_size: Union[int, str] = "10GB",
    weights_name: str = WEIGHTS_NAME,
) -> tuple[dict[str, dict[str, torch.Tensor]], dict | None]:
    """Return ``(shards, index)``: ``state_dict`` split in key order into shards of at most ``max_shard_size``.

    The split is greedy in key order (a tensor larger than the limit gets a shard of its own). With one
    shard, ``shards`` is ``{weights_name: state_dict}`` and ``index`` is None; otherwise shard files are named
    like ``pytorch_model-00001-of-00003.bin`` and ``index`` is ``{"metadata": {"total_size"}, "weight_map"}``.

    Args:
        state_dict: The weights to split.
        max_shard_size: Largest shard, in bytes or as text like "5GB" (default "10GB").
        weights_name: File name of a single shard, and the pattern of several.
    """
    limit = convert_file_size_to_int(max_shard_size)
    blocks: list[dict[str, torch.Tensor]] = [{}]
    current = 0
    total = 0
    for key, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if blocks[-1] and current + nbytes > limit:
            blocks.append({})
            current = 0
        blocks[-1][key] = tensor
        current += nbytes
        total += nbytes
    if len(blocks) == 1:
        return {weights_name: blocks[0]}, None
    stem, dot, ext = weights_name.rpartition(".")
    if not dot:
        stem, ext = weights_name, ""
    shards: dict[str, dict[str, torch.Tensor]] = {}
    weight_map: dict[str, str] = {}
    for number, block in enumerate(blocks, start=1):
        name = f"{stem}-{number:05d}-of-{len(blocks):05d}" + (f".{ext}" if ext else "")
        shards[name] = block
        for key in block:
            weight_map[key] = name
    return shards, {"metadata": {"total_size": total}, "weight_map": weight_map}
