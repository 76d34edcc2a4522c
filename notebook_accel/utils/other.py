"""Helpers for parallel work: unwrap wrapped models, save on the right process, barriers, small dict/name helpers."""

from __future__ import annotations

import codecs
import io
import logging
import os
import platform
import sys
from collections.abc import Mapping
from typing import Any

import torch

from .._lazy import LazyModule, attach
from ..state import AcceleratorState, PartialState
from .atomic_files import atomic_write
from .compilation import (
    compile_regions,
    compile_regions_deepspeed,
    compile_regions_fsdp2,
    has_compiled_regions,
    has_repeated_blocks,
    is_compiled_module,
    is_repeated_blocks,
)
from .config_file import write_basic_config
from .constants import FSDP_PYTORCH_VERSION
from .enums import DistributedType
from .imports import is_torch_distributed_available, is_torch_xla_available, is_weights_only_available
from .network import get_free_port, is_port_in_use
from .package_checks import is_deepspeed_available, is_numpy_available, is_peft_available
from .versions import is_torch_version

__all__ = [
    "get_module_class_from_name",
    "compile_regions",
    "compile_regions_deepspeed",
    "compile_regions_fsdp2",
    "has_compiled_regions",
    "has_repeated_blocks",
    "is_repeated_blocks",
    "get_free_port",
    "is_compiled_module",
    "is_port_in_use",
    "TORCH_SAFE_GLOBALS",
    "check_os_kernel",
    "clean_state_dict_for_safetensors",
    "convert_bytes",
    "get_model_tp_size",
    "get_module_children_bottom_up",
    "load",
    "model_has_dtensor",
    "recursive_getattr",
    "extract_model_from_parallel",
    "get_pretty_name",
    "is_peft_model",
    "merge_dicts",
    "save",
    "wait_for_everyone",
]
# Accelerate 1.15 serves these names at this path too (defined elsewhere).
__all__ += [
    "DistributedType",
    "FSDP_PYTORCH_VERSION",
    "is_deepspeed_available",
    "is_numpy_available",
    "is_torch_distributed_available",
    "is_torch_version",
    "is_torch_xla_available",
    "is_weights_only_available",
]
__all__ += ["write_basic_config"]
# notebook_accel.logging sits above utils (it reads the process state): served at first use.
# convert_model belongs to the fp8 integration, above utils: served at first use too.
_REEXPORTED_LAZILY = {
    "id_tensor_storage": "notebook_accel.utils.device_planning.tensors",
    "get_logger": "notebook_accel.logging",
    "convert_model": "notebook_accel.integrations.fp8.transformer_engine",
}
__all__ += ["PartialState", *sorted(_REEXPORTED_LAZILY)]
__getattr__, __dir__ = attach(__name__, _REEXPORTED_LAZILY)
# The device-planning helpers load when a state dict is cleaned for safetensors.
_tensors = LazyModule("notebook_accel.utils.device_planning.tensors")


logger = logging.getLogger(__name__)


def _numpy_safe_globals() -> list:
    """Return the numpy functions and types a pickled array needs (empty without numpy)."""
    if not is_numpy_available():
        return []
    import numpy as np

    multiarray = getattr(np, "_core", None) or np.core
    return [
        multiarray.multiarray._reconstruct,
        np.ndarray,
        codecs.encode,
        np.dtype,
        type(np.dtype(np.uint32)),
    ]


def _parallel_wrappers() -> tuple[type, ...]:
    """Return the wrapper classes that hold the real model in ``.module``."""
    wrappers: list[type] = [torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel]
    # Only look at FSDP / DeepSpeed when already imported: a model cannot be wrapped otherwise,
    # and importing them costs time.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and hasattr(fsdp, "FullyShardedDataParallel"):
        wrappers.append(fsdp.FullyShardedDataParallel)
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is not None and hasattr(deepspeed, "DeepSpeedEngine"):
        wrappers.append(deepspeed.DeepSpeedEngine)
    return tuple(wrappers)


def extract_model_from_parallel(
    model: torch.nn.Module,
    keep_fp32_wrapper: bool = True,
    keep_torch_compile: bool = True,
    recursive: bool = False,
) -> torch.nn.Module:
    """Return the model inside its DDP / DataParallel / FSDP / DeepSpeed / ``torch.compile`` wrappers.

    With ``keep_fp32_wrapper=False`` the mixed-precision forward wrapper the Accelerator installed
    (original kept in ``model._original_forward``) is removed. With ``keep_torch_compile`` a compiled
    model stays compiled (its inner module unwrapped); otherwise the plain module is returned. With
    ``recursive`` the submodules are unwrapped too (a DDP- or compile-wrapped child is replaced, in its
    parent, by the module inside).

    Args:
        model: The wrapped model.
        keep_fp32_wrapper: Keep the mixed-precision forward the Accelerator installed.
        keep_torch_compile: Keep a compiled model compiled (only its inner module is unwrapped).
        recursive: Unwrap wrapped submodules too.
    """
    if recursive:
        _unwrap_children(model, keep_torch_compile)
    compiled = model if is_compiled_module(model) else None
    if compiled is not None:
        model = compiled._orig_mod
    wrappers = _parallel_wrappers()
    while isinstance(model, wrappers):
        model = model.module
    if is_compiled_module(model):  # compiled before being wrapped
        compiled = compiled or model
        model = model._orig_mod
    if not keep_fp32_wrapper:
        original = model.__dict__.pop("_original_forward", None)
        if original is not None:
            if getattr(original, "__func__", None) is type(model).forward and original.__self__ is model:
                model.__dict__.pop("forward", None)  # back to the class's forward
            else:
                model.forward = original  # an earlier instance-level forward (e.g. a hook) stays
    if keep_torch_compile and compiled is not None:
        compiled._orig_mod = model
        return compiled
    return model


def _unwrap_children(model: torch.nn.Module, keep_torch_compile: bool) -> None:
    """Replace, in place and at any depth, each wrapped submodule of ``model`` by the module inside."""
    wrappers = _parallel_wrappers()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            inner = child
            while isinstance(inner, wrappers) or (not keep_torch_compile and is_compiled_module(inner)):
                inner = inner.module if isinstance(inner, wrappers) else inner._orig_mod
            if inner is not child:
                setattr(parent, name, inner)


def _state() -> PartialState:
    return PartialState()


def _accelerator_state() -> AcceleratorState:
    # For utils modules that need the mixed precision: only this module and operations read the state.
    return AcceleratorState()


def wait_for_everyone() -> None:
    """Return once every process has reached this point (a barrier; immediate with one process)."""
    _state().wait_for_everyone()


def save(
    obj: Any,
    f: str | os.PathLike | io.IOBase,
    save_on_each_node: bool = False,
    safe_serialization: bool = False,
) -> None:
    """Return nothing; save ``obj`` to ``f`` from the main process only (``torch.save`` replacement).

    With ``save_on_each_node`` the local main process of every node saves. With ``safe_serialization``
    ``obj`` must be a state dict (str -> tensor) and is written with safetensors. A path is written
    atomically (temporary file, then rename), so a crash never leaves a half-written file.

    Args:
        obj: What to save (a state dict with ``safe_serialization``).
        f: A path or a writable binary file.
        save_on_each_node: Save from each node's local main process, not only the main one.
        safe_serialization: Write safetensors instead of a torch pickle.
    """
    if safe_serialization:
        if not isinstance(obj, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
        ):
            raise TypeError(
                "save(safe_serialization=True) needs a state dict mapping str to torch.Tensor; "
                f"got {type(obj).__name__} (use safe_serialization=False for other objects)"
            )
        # Tensors sharing memory (tied weights) are de-duplicated first, as 1.15 does for a model's
        # state dict, instead of failing in safetensors; the caller's dict is left as it was.
        obj = clean_state_dict_for_safetensors(dict(obj))
    state = _state()
    should_save = state.is_local_main_process if save_on_each_node else state.is_main_process
    if not should_save:
        return
    if safe_serialization:
        from safetensors.torch import save, save_file

        # safetensors needs contiguous CPU-resident data; it copies anyway.
        tensors = {k: v.detach().contiguous() for k, v in obj.items()}
        if isinstance(f, (str, os.PathLike)):
            atomic_write(os.fspath(f), lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        else:
            f.write(save(tensors, metadata={"format": "pt"}))
        return
    if isinstance(f, (str, os.PathLike)):
        atomic_write(os.fspath(f), lambda tmp: torch.save(obj, tmp))
    else:
        torch.save(obj, f)


def merge_dicts(source: Mapping, destination: dict) -> dict:
    """Return ``destination`` after recursively merging ``source`` into it (nested dicts merged, others replaced)."""
    pending = [(source, destination)]  # (what to merge, where) pairs, one per nested level
    while pending:
        incoming, target = pending.pop()
        for key, value in incoming.items():
            if not isinstance(value, Mapping):
                target[key] = value
                continue
            if not isinstance(target.get(key), dict):  # a plain value (or nothing) gives way to a dict
                target[key] = {}
            pending.append((value, target[key]))
    return destination


def get_pretty_name(obj: object) -> str:
    """Return a readable name for ``obj``: its own name for functions and classes, else its class's."""
    # Instances (a model, a partial) have no name of their own: the class names them.
    for candidate in (obj, type(obj)):
        name = getattr(candidate, "__qualname__", None) or getattr(candidate, "__name__", None)
        if isinstance(name, str):
            return name
    return str(obj)


def is_peft_model(model: object) -> bool:
    """Return whether ``model`` is a peft ``PeftModel`` (False when peft is not installed)."""
    if not is_peft_available():
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def recursive_getattr(obj: Any, attr: str) -> Any:
    """Return ``obj.a.b.c`` for ``attr="a.b.c"`` (AttributeError naming the missing part)."""
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def convert_bytes(size: float) -> str:
    """Return ``size`` bytes in the largest unit that keeps it >= 1: ``"1.18 MB"``, ``"512 bytes"``."""
    if size < 1024:
        return f"{size} bytes"
    for unit in ("KB", "MB", "GB", "TB"):
        size /= 1024
        if size < 1024:
            return f"{round(size, 2)} {unit}"
    return f"{round(size / 1024, 2)} PB"


def get_module_children_bottom_up(model: torch.nn.Module, return_fqns: bool = False) -> list:
    """Return every submodule of ``model`` children first, ``model`` itself last (post-order).

    With ``return_fqns`` each item is ``(dotted name, module)``, the model's name being ``""``.
    """
    order: list = []

    def visit(name: str, module: torch.nn.Module) -> None:
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        order.append((name, module) if return_fqns else module)

    visit("", model)
    return order


def model_has_dtensor(model: torch.nn.Module) -> bool:
    """Return whether a parameter of ``model`` is a ``DTensor`` (sharded by tensor parallelism or FSDP2)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def get_model_tp_size(model: torch.nn.Module) -> int | None:
    """Return the tensor-parallel degree a transformers model was sharded with, or None when it was not.

    transformers < 5 sets it on the model (``tp_size``); 5 leaves ``model.tp_size`` as None and keeps it
    in ``model.config.distributed_config`` (an object, or a dict after a JSON round trip).
    """
    size = getattr(model, "_tp_size", None) or getattr(model, "tp_size", None)
    if not size:
        distributed = getattr(getattr(model, "config", None), "distributed_config", None)
        if isinstance(distributed, dict):
            size = distributed.get("tp_size")
        else:
            size = getattr(distributed, "tp_size", None)
    return int(size) if size else None


def clean_state_dict_for_safetensors(state_dict: dict) -> dict:
    """Return ``state_dict`` ready for safetensors: repeated names of one tensor dropped, shared views copied.

    safetensors refuses two entries over one memory. A name for the very same tensor as an earlier
    one (tied weights: an embedding and a head) is removed; the removed names are logged in one warning,
    1.15's ("Removed shared tensor {...} while saving..."). A different view of memory already written
    (a slice, a reshaped view) becomes its own copy, where 1.15 drops it. The dict is changed in place and
    returned.
    """
    storages: set[tuple] = set()
    exact: dict[tuple, str] = {}
    removed: list[str] = []
    for name in list(state_dict):
        tensor = state_dict[name]
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            continue
        storage = _tensors.id_tensor_storage(tensor)
        view = (storage, tensor.data_ptr(), tuple(tensor.shape), tensor.stride())
        if view in exact:
            removed.append(name)
            del state_dict[name]
            continue
        exact[view] = name
        if storage in storages:
            state_dict[name] = tensor.clone()
        storages.add(storage)
    if removed:
        names = "{" + ", ".join(repr(name) for name in removed) + "}"
        logger.warning(
            f"Removed shared tensor {names} while saving. This should be OK, but check by verifying that you "
            "don't receive any warning while reloading"
        )
    return state_dict


def check_os_kernel() -> None:
    """Warn, naming the running kernel's version, when this Linux kernel is older than 5.5 (processes can hang)."""
    info = platform.uname()
    if info.system != "Linux":
        return
    release = str(info.release)
    numbers = release.split("-")[0].split("+")[0]
    try:
        version = tuple(int(part) for part in numbers.split(".")[:2])
    except ValueError:
        return
    if version < (5, 5):
        # 1.15's message, formatted before it is logged so that the record's own ``msg`` names the version
        # (handlers and tests read record.msg), then the full release.
        logger.warning(
            f"Detected kernel version {numbers}, which is below the recommended minimum of 5.5.0; this can cause "
            "the process to hang. It is recommended to upgrade the kernel to the minimum version or higher. "
            f"(running kernel: {release})"
        )


# What ``load`` allows beyond tensors: numpy arrays (saved random states hold them).
TORCH_SAFE_GLOBALS = _numpy_safe_globals()


def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """Return ``torch.load(f, map_location, weights_only=True)`` with numpy arrays allowed.

    Only tensors, plain containers and the numpy types in ``TORCH_SAFE_GLOBALS`` are unpickled;
    ``kwargs`` go to ``torch.load``.

    Args:
        f: A path or a readable binary file.
        map_location: Where tensors are loaded, as ``torch.load`` takes it.
        **kwargs: Further ``torch.load`` arguments.
    """
    kwargs.setdefault("weights_only", True)
    if not kwargs["weights_only"] or not TORCH_SAFE_GLOBALS:
        return torch.load(f, map_location=map_location, **kwargs)
    with torch.serialization.safe_globals(TORCH_SAFE_GLOBALS):
        return torch.load(f, map_location=map_location, **kwargs)


def get_module_class_from_name(module: torch.nn.Module, name: str) -> type | None:
    """Return the class called ``name`` among ``module`` and its submodules (breadth first), or None.

    Used to turn layer class names (``"GPT2Block"``) into classes, e.g. for an FSDP wrap policy.
    """
    queue = [module]
    while queue:
        current = queue.pop(0)
        if type(current).__name__ == name:
            return type(current)
        queue.extend(current.children())
    return None
