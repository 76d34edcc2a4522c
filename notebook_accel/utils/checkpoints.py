"""Checkpoint I/O: find a checkpoint's files, read them memory-mapped, load them into a model, shard a state dict.

safetensors files are opened with ``safe_open``, whose CPU tensors are copy-on-write views of the page cache:
loading onto the CPU with matching dtypes copies nothing, so peak memory stays near what is actually used.
Weights mapped to "disk" from a safetensors checkpoint are not copied either: the offload index points into
the checkpoint's own files (``{"safetensors_file", "weight_name", "dtype", "shape"}``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from typing import Any, Union

import torch
from torch import nn

from .constants import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME
from .device_map import _device_lookup, check_device_map
from .offload import load_offloaded_weights, offload_weight, save_offload_index
from .sizes import _as_dtype, convert_file_size_to_int
from .tensors import set_module_tensor_to_device
from .tied_params import check_tied_parameters_on_same_device, find_tied_parameters, retie_parameters

__all__ = ["find_checkpoint_files", "load_checkpoint_in_model", "load_state_dict", "shard_checkpoint"]

logger = logging.getLogger(__name__)

Device = Union[int, str, torch.device]
_SAFE_FORMATS = ("pt", "tf", "flax", "mlx", "numpy")


def _is_disk(device: Device) -> bool:
    return isinstance(device, str) and device == "disk"


# ---------------------------------------------------------------------------------------------- reading files


class _Shard:
    """One checkpoint file opened for reading: safetensors memory-mapped, ``.bin`` via ``torch.load``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.safetensors = path.endswith(".safetensors")
        self._handles: dict[str, Any] = {}
        mapped = False
        if self.safetensors:
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
            self.keys = list(handle.keys())
            self.state: dict[str, torch.Tensor] = {}
        else:
            self.state, mapped = _torch_load(path)
            self.keys = list(self.state)
        # Tensors from memory-mapped files cost no RAM until written: nothing to gain by spilling them to disk.
        self.file_backed = self.safetensors or mapped

    def _handle(self, device: str):
        handle = self._handles.get(device)
        if handle is None:
            from safetensors import safe_open

            handle = self._handles[device] = safe_open(self.path, framework="pt", device=device)
        return handle

    def get(self, key: str, device: Device = "cpu") -> torch.Tensor:
        if not self.safetensors:
            return self.state[key]
        if isinstance(device, int):
            device = f"cuda:{device}"
        device = str(device)
        if device in ("cpu", "meta", "disk"):
            return self._handle("cpu").get_tensor(key)
        return self._handle(device).get_tensor(key)

    def close(self) -> None:
        self._handles.clear()
        self.state = {}


def _torch_load(path: str) -> tuple[dict[str, torch.Tensor], bool]:
    """Return ``(state dict, memory-mapped?)`` for a ``.bin``/``.pt`` file, read with ``weights_only=True``."""
    mapped = True
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as err:
        if "mmap" not in str(err) and "zipfile" not in str(err):
            raise
        # Legacy (pre-zipfile) checkpoints cannot be memory-mapped.
        state = torch.load(path, map_location="cpu", weights_only=True)
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
        lookup = _device_lookup(device_map)
        result = {}
        for key in shard.keys:
            device = lookup(key)
            if device is None:
                device = "cpu"
            if _is_disk(device):
                continue
            result[key] = shard.get(key, device)
        return result
    finally:
        shard.close()


# ------------------------------------------------------------------------------------ finding checkpoint files


def _read_index(index_path: str) -> tuple[list[str], dict[str, str]]:
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"The checkpoint index {index_path} is not valid JSON: {err}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(
            f"The checkpoint index {index_path} has no 'weight_map' dict of weight name -> shard file."
        )
    folder = os.path.dirname(index_path)
    files: list[str] = []
    for key, shard in weight_map.items():
        path = os.path.join(folder, shard)
        if path not in files:
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"Shard file {path!r} (holding {key!r}) named by the index {index_path!r} does not exist."
                )
            files.append(path)
    return files, weight_map


def find_checkpoint_files(checkpoint: Union[str, os.PathLike]) -> tuple[list[str], str | None]:
    """Return ``(files, index_path)`` for the four checkpoint forms; safetensors wins when both formats exist.

    Forms: one weights file; an ``.index.json`` of shards; a folder holding one ``.index.json``; a folder
    holding ``model.safetensors`` or ``pytorch_model.bin``.
    """
    path = os.fspath(checkpoint)
    if os.path.isfile(path):
        if path.endswith(".json"):
            return _read_index(path)[0], path
        return [path], None
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Checkpoint {path!r} is neither a file nor a folder.")
    entries = set(os.listdir(path))
    # safetensors before .bin; within a format a single file before an index, as Accelerate does.
    for name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME):
        if name in entries:
            full = os.path.join(path, name)
            return (_read_index(full)[0], full) if name.endswith(".json") else ([full], None)
    indexes = sorted(f for f in entries if f.endswith(".index.json"))
    if len(indexes) > 1:
        raise ValueError(
            f"{path} holds more than one `.index.json` file ({', '.join(indexes)}): delete the irrelevant ones "
            "or pass the index file itself."
        )
    if indexes:
        index_path = os.path.join(path, indexes[0])
        return _read_index(index_path)[0], index_path
    raise FileNotFoundError(
        f"{path} is not a folder containing a `.index.json` file or a {SAFE_WEIGHTS_NAME} or {WEIGHTS_NAME} file."
    )


# -------------------------------------------------------------------------------------- loading into a model


def _expected_tensors(model: nn.Module) -> dict[str, bool]:
    """Return ``{name: is_buffer}`` for everything a checkpoint may set (tied names included)."""
    expected = {name: False for name, _ in model.named_parameters(remove_duplicate=False)}
    for name, _ in model.named_buffers(remove_duplicate=False):
        expected[name] = True
    return expected


def _persistent_names(model: nn.Module) -> set[str]:
    return set(model.state_dict(keep_vars=True).keys())


def _fp32_matcher(keep_in_fp32_modules: list[str] | None):
    if not keep_in_fp32_modules:
        return lambda name: False
    mods = list(keep_in_fp32_modules)

    def keep(name: str) -> bool:
        parts = name.split(".")
        return any(m in parts or name.startswith(m + ".") for m in mods)

    return keep


def _default_device(model: nn.Module):
    """Device of each tensor when no device_map is given: where it is now, or the CPU for meta tensors."""
    where = {name: t.device for name, t in model.named_parameters(remove_duplicate=False)}
    where.update({name: t.device for name, t in model.named_buffers(remove_duplicate=False)})

    def lookup(name: str) -> Device:
        device = where.get(name)
        return "cpu" if device is None or device.type == "meta" else device

    return lookup


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: Union[str, os.PathLike],
    device_map: dict[str, Device] | None = None,
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
    are (meta tensors to the CPU).
    """
    if offload_8bit_bnb:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ImportError("offload_8bit_bnb=True needs `bitsandbytes`: pip install bitsandbytes")
    target_dtype = None if dtype is None else _as_dtype(dtype)
    if broadcast_from_rank0:
        _load_broadcast(model, checkpoint, target_dtype, strict, full_state_dict)
        return

    tied = find_tied_parameters(model)
    if device_map is not None:
        check_device_map(model, device_map)
        check_tied_parameters_on_same_device(tied, device_map)
        if offload_folder is None and any(_is_disk(d) for d in device_map.values()):
            disk = [name for name, d in device_map.items() if _is_disk(d)]
            raise ValueError(
                f"The device_map sends {disk[:5]} to 'disk': pass `offload_folder=` (a folder for the offloaded "
                "weights, or for the index that points into a safetensors checkpoint)."
            )
        lookup = _device_lookup(device_map)
    else:
        lookup = _default_device(model)
    files, index_path = find_checkpoint_files(checkpoint)
    expected = _expected_tensors(model)
    keep_fp32 = _fp32_matcher(keep_in_fp32_modules)

    offload_index: dict[str, dict] = {}
    spill_index: dict[str, dict] = {}
    spill_folder = tempfile.mkdtemp(prefix="na-state-dict-") if offload_state_dict else None
    loaded: set[str] = set()
    unexpected: list[str] = []
    try:
        for path in _progress(files):
            shard = _Shard(path)
            try:
                for key in shard.keys:
                    is_buffer = expected.get(key)
                    if is_buffer is None:
                        unexpected.append(key)
                        continue
                    device = lookup(key)
                    if device is None:
                        raise ValueError(f"{key} has no device in the device_map; add its module or ''.")
                    value = shard.get(key, "cpu" if _is_disk(device) else device)
                    new_dtype = target_dtype
                    if new_dtype is not None and value.is_floating_point() and keep_fp32(key):
                        new_dtype = torch.float32
                    if not value.is_floating_point():
                        new_dtype = None
                    if _is_disk(device) and (offload_buffers or not is_buffer):
                        _check_shape(model, key, value)
                        final = new_dtype or value.dtype
                        if shard.safetensors:
                            offload_index[key] = {
                                "safetensors_file": os.path.abspath(path), "weight_name": key,
                                "dtype": str(final).replace("torch.", ""), "shape": list(value.shape),
                            }  # fmt: skip
                        else:
                            offload_weight(value.to(final), key, offload_folder, index=offload_index)
                        set_module_tensor_to_device(model, key, "meta", dtype=final)
                    elif offload_state_dict and not shard.file_backed and str(device) == "cpu":
                        _check_shape(model, key, value)
                        final = new_dtype or value.dtype
                        offload_weight(value.to(final), key, spill_folder, index=spill_index)
                        set_module_tensor_to_device(model, key, "meta", dtype=final)
                    elif device_map is None and new_dtype is None and _copy_in_place(model, key, value):
                        pass  # an existing (non-meta) tensor keeps its identity, so optimizers stay valid
                    else:
                        set_module_tensor_to_device(
                            model, key, "cpu" if _is_disk(device) else device, value=value, dtype=new_dtype
                        )
                    loaded.add(key)
            finally:
                shard.close()
        if offload_index:
            # A tied weight is stored once; hooks look weights up by each module's own names.
            for group in tied:
                source = next((name for name in group if name in offload_index), None)
                for name in group if source is not None else ():
                    if name not in offload_index and _is_disk(lookup(name)):
                        offload_index[name] = offload_index[source]
                        loaded.add(name)
            save_offload_index(offload_index, offload_folder)
        if spill_index:
            load_offloaded_weights(model, spill_index, spill_folder)
    except BaseException:
        # A failed load leaves no partial set of .dat files behind (each file itself is written atomically).
        for name, info in offload_index.items():
            if "safetensors_file" not in info:
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(os.fspath(offload_folder), f"{name}.dat"))
        raise
    finally:
        if spill_folder is not None:
            shutil.rmtree(spill_folder, ignore_errors=True)

    retie_parameters(model, tied)
    _report_keys(model, expected, loaded, unexpected, tied, strict)


def _copy_in_place(model: nn.Module, key: str, value: torch.Tensor) -> bool:
    """Copy ``value`` into the model's existing tensor ``key`` (as ``load_state_dict`` does); False if it is meta."""
    module_name, _, leaf = key.rpartition(".")
    owner = model.get_submodule(module_name) if module_name else model
    current = owner._parameters.get(leaf) if leaf in owner._parameters else owner._buffers.get(leaf)
    if current is None or current.device.type == "meta":
        return False
    _check_shape(model, key, value)
    with torch.no_grad():
        current.copy_(value)
    return True


def _check_shape(model: nn.Module, key: str, value: torch.Tensor) -> None:
    module_name, _, leaf = key.rpartition(".")
    owner = model.get_submodule(module_name) if module_name else model
    old = owner._parameters.get(leaf) if leaf in owner._parameters else owner._buffers.get(leaf)
    if old is not None and old.shape != value.shape:
        raise ValueError(
            f"Trying to set a tensor of shape {tuple(value.shape)} in {key!r} (which has shape {tuple(old.shape)}): "
            "the checkpoint does not match the model."
        )


def _report_keys(
    model: nn.Module, expected: dict[str, bool], loaded: set[str], unexpected: list[str], tied: list[list[str]],
    strict: bool,
) -> None:  # fmt: skip
    covered = set(loaded)
    for group in tied:
        if covered.intersection(group):
            covered.update(group)
    persistent = _persistent_names(model)
    missing = [name for name in expected if name not in covered and name in persistent]
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
        logger.warning("Some weights of the checkpoint are not used by the model: %s", unexpected)


def _progress(files: list[str]):
    if len(files) < 2:
        return files
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

    state: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0:
        for path in _progress(find_checkpoint_files(checkpoint)[0]):
            for key, value in load_state_dict(path).items():
                state[key] = value.to(dtype) if dtype is not None and value.is_floating_point() else value
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
