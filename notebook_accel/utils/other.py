"""Helpers for parallel work: unwrap wrapped models, save on the right process, barriers, small dict/name helpers."""

from __future__ import annotations

import io
import os
import sys
import tempfile
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from .package_checks import is_peft_available

__all__ = [
    "extract_model_from_parallel",
    "get_pretty_name",
    "is_peft_model",
    "merge_dicts",
    "save",
    "wait_for_everyone",
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


def _is_compiled_module(model: Any) -> bool:
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return dynamo is not None and isinstance(model, dynamo.OptimizedModule)


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
    """
    if recursive:
        _unwrap_children(model, keep_torch_compile)
    compiled = model if _is_compiled_module(model) else None
    if compiled is not None:
        model = compiled._orig_mod
    wrappers = _parallel_wrappers()
    while isinstance(model, wrappers):
        model = model.module
    if _is_compiled_module(model):  # compiled before being wrapped
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
            while isinstance(inner, wrappers) or (not keep_torch_compile and _is_compiled_module(inner)):
                inner = inner.module if isinstance(inner, wrappers) else inner._orig_mod
            if inner is not child:
                setattr(parent, name, inner)


def _state():
    from ..state import PartialState

    return PartialState()


def wait_for_everyone() -> None:
    """Return once every process has reached this point (a barrier; immediate with one process)."""
    _state().wait_for_everyone()


def _atomic_write(path: str, write) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
    """
    if safe_serialization:
        if not isinstance(obj, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
        ):
            raise TypeError(
                "save(safe_serialization=True) needs a state dict mapping str to torch.Tensor; "
                f"got {type(obj).__name__} (use safe_serialization=False for other objects)"
            )
        if isinstance(obj, OrderedDict):
            obj = dict(obj)
    state = _state()
    should_save = state.is_local_main_process if save_on_each_node else state.is_main_process
    if not should_save:
        return
    if safe_serialization:
        from safetensors.torch import save, save_file

        # safetensors needs contiguous CPU-resident data; it copies anyway.
        tensors = {k: v.detach().contiguous() for k, v in obj.items()}
        if isinstance(f, (str, os.PathLike)):
            _atomic_write(os.fspath(f), lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        else:
            f.write(save(tensors, metadata={"format": "pt"}))
        return
    if isinstance(f, (str, os.PathLike)):
        _atomic_write(os.fspath(f), lambda tmp: torch.save(obj, tmp))
    else:
        torch.save(obj, f)


def merge_dicts(source: Mapping, destination: dict) -> dict:
    """Return ``destination`` after recursively merging ``source`` into it (nested dicts merged, others replaced)."""
    for key, value in source.items():
        if isinstance(value, Mapping):
            node = destination.setdefault(key, {})
            if not isinstance(node, dict):
                node = destination[key] = {}
            merge_dicts(value, node)
        else:
            destination[key] = value
    return destination


def get_pretty_name(obj: Any) -> str:
    """Return a readable name for ``obj``: its own name for functions and classes, else its class's."""
    # Instances (a model, a partial) have no name of their own: the class names them.
    for candidate in (obj, type(obj)):
        name = getattr(candidate, "__qualname__", None) or getattr(candidate, "__name__", None)
        if isinstance(name, str):
            return name
    return str(obj)


def is_peft_model(model: Any) -> bool:
    """Return whether ``model`` is a peft ``PeftModel`` (False when peft is not installed)."""
    if not is_peft_available():
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)
