"""Offloaded weights: write them to disk and map them back lazily (the weights maps the offload hooks read).

The helpers that read a hooked module's offloaded weights (``has_offloaded_params``,
``align_module_device``) live with the hooks, in :mod:`notebook_accel.hooks.offloaded`.

Two on-disk forms are read, both memory-mapped (``torch.from_file``, copy-on-write, no file
descriptor kept): the offload folder's raw ``<name>.dat`` files described by ``index.json``
(Accelerate's format: ``{"dtype": "float32", "shape": [...]}`` per weight), and a safetensors
checkpoint's own files (index entries ``{"safetensors_file": path, "weight_name": key, "dtype",
"shape"}``), so that offloading a safetensors checkpoint to "disk" copies nothing.

A mapped tensor is a view over the page cache: used on the CPU with a matching dtype it needs no
load at all. Writers put each file under a temporary name and rename it, so an interrupted
offload never leaves a half-written weight or index behind.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from .atomic_files import atomic_write
from .checkpoint_io.file_checks import path_inside
from .checkpoint_io.safetensors_header import SAFETENSORS_DTYPES, read_header
from .device_planning.devices import device_label
from .device_planning.tensors import set_module_tensor_to_device

__all__ = [
    "offload_weight",
    "load_offloaded_weight",
    "save_offload_index",
    "offload_state_dict",
    "load_offloaded_weights",
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "extract_submodules_state_dict",
    "weights_source",
]

logger = logging.getLogger(__name__)

INDEX_NAME = "index.json"


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Unknown dtype {name!r} in the offload index (expected e.g. 'float32', 'bfloat16')")
    return dtype


def _inside(folder: str | os.PathLike, relative: str, what: str) -> str:
    """Return ``folder/relative``; raise ValueError when it would leave ``folder`` (``..``, absolute, symlink)."""
    return path_inside(folder, relative, what, "offload folder")


def _check_index(index: object, where: str) -> dict:
    """Return ``index`` after checking it maps names to ``{"dtype": str, "shape": [int, ...]}`` entries."""
    if not isinstance(index, Mapping):
        raise TypeError(
            f"offload index of {where} must be a dict of weight name -> {{'dtype', 'shape'}}, not {type(index).__name__}"
        )
    for name, info in index.items():
        if not isinstance(info, Mapping):
            raise ValueError(f"offload index entry {name!r} of {where} must be a dict, not {info!r}")
        pointer = "safetensors_file" in info  # into a checkpoint: its own header describes the tensor
        if pointer and "dtype" in info:
            _dtype_from_name(info["dtype"])  # the dtype to convert to when read
        if pointer and "shape" not in info:
            continue
        if "dtype" not in info and not pointer:
            raise ValueError(f"offload index entry {name!r} of {where} has no 'dtype' (e.g. 'float32')")
        shape = info.get("shape")
        if not isinstance(shape, (list, tuple)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ValueError(
                f"offload index entry {name!r} of {where} has shape {shape!r}; a shape is a list of "
                "non-negative integers (no -1)"
            )
        if not pointer:
            _dtype_from_name(info["dtype"])
    return dict(index)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _atomic_write_bytes(path: str, tensor: torch.Tensor) -> None:
    """Write ``tensor``'s raw bytes to ``path`` through a temporary file and a rename."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            if tensor.numel():
                f.write(tensor.reshape(-1).view(torch.uint8).numpy())

    # A cache, not a checkpoint: fsyncing every weight made offloading 6x slower (48 MB: 70 -> 430 ms);
    # a file cut short by a power loss is refused on reading (its size must match the index exactly).
    atomic_write(path, write, durable=False)


def offload_weight(
    weight: torch.Tensor, weight_name: str, offload_folder: str | os.PathLike, index: dict | None = None
) -> dict:
    """Return ``index`` updated with ``weight_name`` after writing ``weight`` to ``<offload_folder>/<weight_name>.dat``.

    The file holds the raw bytes (memory-mappable); the index entry records dtype and shape.

    Args:
        weight: The tensor to write.
        weight_name: Its name; the file is ``<weight_name>.dat``.
        offload_folder: Where to write.
        index: The index to add the entry to (default: a new one).
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(
            f"offload_weight needs a torch.Tensor for {weight_name!r}, got {type(weight).__name__}"
        )
    if weight.device.type == "meta":
        raise ValueError(
            f"Cannot offload {weight_name!r}: it is on the meta device and has no data. "
            "Load its weights first (e.g. load_checkpoint_in_model)."
        )
    os.makedirs(offload_folder, exist_ok=True)
    path = _inside(offload_folder, f"{weight_name}.dat", "weight name")
    tensor = weight.detach().to("cpu").contiguous()
    _atomic_write_bytes(path, tensor)
    if index is None:
        index = {}
    index[weight_name] = {"dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape)}
    return index


def _map_file(path: str, nbytes: int) -> torch.Tensor:
    """Return a copy-on-write memory map of ``path`` as a flat uint8 tensor."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)


def _view(raw: torch.Tensor, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor | None:
    """Return the tensor at byte ``offset`` of ``raw`` without copying, or None if misaligned."""
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if offset % itemsize:
        return None
    return raw[offset : offset + numel * itemsize].view(dtype).view(shape)


def load_offloaded_weight(weight_file: str | os.PathLike, weight_info: dict) -> torch.Tensor:
    """Return the tensor stored in ``weight_file`` (described by ``weight_info``), memory-mapped, not read."""
    path = os.fspath(weight_file)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"Offloaded weight file {path!r} does not exist (is the offload folder complete?)"
        )
    _check_index({os.path.basename(path): weight_info}, repr(path))
    dtype = _dtype_from_name(weight_info["dtype"])
    shape = list(weight_info["shape"])
    size = os.path.getsize(path)
    expected = dtype.itemsize
    for s in shape:
        expected *= s
    if size != expected:
        raise ValueError(
            f"Offloaded weight file {path!r} holds {size} bytes but its index entry ({shape} {dtype}) "
            f"needs exactly {expected}: the file and index.json do not belong together; offload the weights again"
        )
    return _view(_map_file(path, size), 0, dtype, shape)


def save_offload_index(index: dict, offload_folder: str | os.PathLike) -> None:
    """Merge ``index`` into ``<offload_folder>/index.json`` (written atomically)."""
    if not index:
        return
    os.makedirs(offload_folder, exist_ok=True)
    path = os.path.join(os.fspath(offload_folder), INDEX_NAME)
    current: dict = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            current = _check_index(json.load(f), repr(path))
    current.update(_check_index(index, "save_offload_index"))

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(current, f, indent=2)

    atomic_write(path, write)


def offload_state_dict(save_dir: str | os.PathLike, state_dict: dict[str, torch.Tensor]) -> None:
    """Write every tensor of ``state_dict`` to ``save_dir`` plus its ``index.json``; return nothing.

    The weights are first written into a hidden staging folder inside ``save_dir``; only once all of
    them are on disk do they replace the files of the same name, and the index is written last. A
    failure on the way (a bad tensor, a full disk) leaves ``save_dir`` as it was, an earlier complete
    offload included.
    """
    os.makedirs(save_dir, exist_ok=True)
    for name in state_dict:
        _inside(save_dir, f"{name}.dat", "weight name")
    staging = os.path.join(os.fspath(save_dir), f".staging-{os.getpid()}")
    index: dict = {}
    try:
        for name, tensor in state_dict.items():
            index = offload_weight(tensor, name, staging, index=index)
        for name in index:
            final = os.path.join(os.fspath(save_dir), f"{name}.dat")
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.replace(os.path.join(staging, f"{name}.dat"), final)
        save_offload_index(index, save_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_offloaded_weights(model: nn.Module, index: dict, offload_folder: str | os.PathLike) -> None:
    """Load the weights listed in ``index`` from ``offload_folder`` into ``model`` (on the CPU); return nothing.

    Args:
        model: The model to fill.
        index: Weight name -> dtype and shape, as ``offload_weight`` records them.
        offload_folder: The folder of the ``.dat`` files.
    """
    if not index:
        return
    loader = OffloadedWeightsLoader(save_folder=offload_folder, index=index)
    for name in index:
        set_module_tensor_to_device(model, name, "cpu", value=loader[name])


class _SafetensorsFile:
    """One safetensors file, its header checked (``read_header``) and its bytes mapped once; tensors are views."""

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"safetensors file {path!r} named in the offload index does not exist")
        self.path = path
        header = read_header(path)
        self.header, self.data_start = header.entries, header.data_start
        self.raw = _map_file(path, os.path.getsize(path))

    def tensor(self, key: str) -> torch.Tensor:
        info = self.header.get(key)
        if info is None:
            raise KeyError(f"{key!r} is not in the safetensors file {self.path!r}")
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        start, _ = info["data_offsets"]
        view = None if dtype is None else _view(self.raw, self.data_start + start, dtype, info["shape"])
        if view is None:  # exotic dtype or misaligned tensor: let safetensors read it
            with safe_open(self.path, framework="pt") as f:
                view = f.get_tensor(key)
        return view


def _read_folder_index(folder: str) -> dict:
    """Return the parsed ``index.json`` of the offload folder ``folder``."""
    path = os.path.join(folder, INDEX_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"the offload folder {folder!r} has no {INDEX_NAME}: write the weights there first "
            "(offload_state_dict) or pass the index yourself (`offload_index` / `index`)"
        ) from None


class OffloadedWeightsLoader(Mapping):
    """A lazy, read-only mapping from weight name to tensor over CPU tensors and files on disk.

    ``state_dict`` tensors come first; other names are looked up in ``index`` (default: the
    ``index.json`` of ``save_folder``) and memory-mapped on first access (raw ``.dat`` files of
    the offload folder, or tensors inside a safetensors checkpoint). Mapped files are cached and
    stay mapped, so repeated reads cost nothing and page tables stay warm. ``device`` moves what
    is returned (default: leave it on the CPU).

    Args:
        state_dict: Tensors held in memory, served first.
        save_folder: An offload folder: its ``index.json`` and ``.dat`` files.
        index: Weight name -> entry (dtype and shape, or a safetensors file), instead of the folder's index.
        device: Where returned tensors are moved (default: they stay on the CPU).
    """

    def __init__(
        self,
        state_dict: dict[str, torch.Tensor] | None = None,
        save_folder: str | os.PathLike | None = None,
        index: Mapping | None = None,
        device: int | str | torch.device | None = None,
    ) -> None:
        if all(source is None for source in (state_dict, save_folder, index)):
            raise ValueError(
                "OffloadedWeightsLoader has nothing to read: give it `state_dict` (tensors in memory), "
                "`save_folder` (an offload folder with its index.json) and/or `index`"
            )
        self.device = device
        self.save_folder = None if save_folder is None else os.fspath(save_folder)
        if index is None:
            index = {} if self.save_folder is None else _read_folder_index(self.save_folder)
        self.index = _check_index(index, repr(self.save_folder or "the index"))
        self.state_dict = {} if state_dict is None else state_dict
        # In-memory names first, then the ones only on disk (dicts keep the first position of a key).
        self.all_keys = list({**dict.fromkeys(self.state_dict), **dict.fromkeys(self.index)})
        self._files: dict[str, _SafetensorsFile] = {}
        self._mapped: dict[str, torch.Tensor] = {}

    def _resolve(self, path: str) -> str:
        # An absolute path points into a checkpoint (as load_checkpoint_and_dispatch writes them); a
        # relative one is the offload folder's own. Only when no such file is there but one exists
        # relative to the working directory is that one read: Accelerate opens relative paths from the
        # working directory, and peft 0.21 writes its adapters' offload index that way.
        if os.path.isabs(path):
            return path
        if self.save_folder is None:
            if os.path.isfile(path):
                return os.path.abspath(path)
            raise ValueError(f"safetensors_file {path!r} is relative but the loader has no `save_folder`")
        inside = _inside(self.save_folder, path, "safetensors_file")
        if not os.path.exists(inside) and os.path.isfile(path):
            return os.path.abspath(path)
        return inside

    def _mapped_tensor(self, key: str) -> torch.Tensor:
        # Only the mapped view is cached (it costs no memory); a dtype conversion is redone at each
        # read so that the converted copy is released with the weights after the forward.
        tensor = self._mapped.get(key)
        info = self.index[key]
        if tensor is None:
            if "safetensors_file" in info:
                path = self._resolve(info["safetensors_file"])
                handle = self._files.get(path)
                if handle is None:
                    handle = self._files[path] = _SafetensorsFile(path)
                tensor = handle.tensor(info.get("weight_name", key))
            else:
                if self.save_folder is None:
                    raise ValueError(
                        f"{key!r} is offloaded to a .dat file but the loader has no `save_folder`."
                    )
                tensor = load_offloaded_weight(_inside(self.save_folder, f"{key}.dat", "index key"), info)
            self._mapped[key] = tensor
        if "safetensors_file" in info and "dtype" in info:
            wanted = _dtype_from_name(info["dtype"])
            if tensor.dtype != wanted:
                tensor = tensor.to(wanted)
        return tensor

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        if key not in self.index:
            raise KeyError(key)
        tensor = self._mapped_tensor(key)
        if self.device is not None and str(self.device) != "cpu":
            tensor = tensor.to(self.device)
        return tensor

    def replace(self, key: str, tensor: torch.Tensor) -> bool:
        """Serve ``tensor`` for the in-memory entry ``key`` from now on; return False (nothing changed) for any other key.

        The streaming offload moves the library's own in-memory weights into pinned blocks this way,
        so that they are held once.
        """
        if key not in self.state_dict:
            return False
        self.state_dict[key] = tensor
        return True

    def source(self, key: str) -> str:
        """Return where ``key`` is stored: ``"disk"`` or the device of the in-memory tensor."""
        if key in self.state_dict:
            return device_label(self.state_dict[key].device)
        return "disk"

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)

    def __contains__(self, key: object) -> bool:
        return key in self.state_dict or key in self.index

    def __repr__(self) -> str:
        on_disk = len(self.all_keys) - len(self.state_dict)
        return f"OffloadedWeightsLoader({len(self.state_dict)} in memory, {on_disk} on disk, folder={self.save_folder!r})"


class PrefixedDataset(Mapping):
    """A read-only view of ``dataset`` restricted to the keys starting with ``prefix`` (prefix removed)."""

    def __init__(self, dataset: Mapping, prefix: str) -> None:
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.dataset[f"{self.prefix}{key}"]

    def __contains__(self, key: object) -> bool:
        return f"{self.prefix}{key}" in self.dataset

    def __iter__(self) -> Iterator[str]:
        n = len(self.prefix)
        return iter([key[n:] for key in self.dataset if key.startswith(self.prefix)])

    def __len__(self) -> int:
        return sum(1 for key in self.dataset if key.startswith(self.prefix))

    def source(self, key: str) -> str:
        """Return where ``key`` is stored (see :meth:`OffloadedWeightsLoader.source`)."""
        return weights_source(self.dataset, f"{self.prefix}{key}")


def weights_source(weights_map: Any, key: str) -> str:
    """Return ``"disk"`` or the device string of ``weights_map[key]``'s storage."""
    source = getattr(weights_map, "source", None)
    if source is not None:
        return source(key)
    try:
        return device_label(weights_map[key].device)
    except (KeyError, AttributeError):
        return "unknown"


def extract_submodules_state_dict(state_dict: dict[str, torch.Tensor], submodule_names: list[str]) -> dict:
    """Return the entries of ``state_dict`` that belong to one of ``submodule_names`` ("" = all)."""
    result = {}
    for name in submodule_names:
        prefix = f"{name}." if name else ""
        result.update({k: v for k, v in state_dict.items() if k == name or k.startswith(prefix)})
    return result
