"""Save and load FSDP models and optimizers, whole (one file) or sharded (one folder of per-rank pieces).

Both FSDP versions go through torch's version-independent state-dict API
(``torch.distributed.checkpoint.state_dict``): a *full* state dict is gathered to rank 0 and written as
one ``torch.save`` file, a *sharded* one is written by every rank into a ``torch.distributed.checkpoint``
folder, which can be read back on another number of ranks. File names follow Accelerate's layout
(``pytorch_model_fsdp.bin`` / ``pytorch_model_fsdp_0/``, ``optimizer.bin`` / ``optimizer_0/``) so
checkpoints move between the two. With ``use_dcp=False`` an FSDP1 model goes through FSDP1's own
``state_dict_type`` context instead (torch's older path); FSDP2 has only the first. The FSDP2
preparation helpers (``fsdp2_prepare_model`` and friends) live in ``fsdp2.py``, re-exported here
at Accelerate's path.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed import fsdp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..._lazy import attach
from ...utils._protocols import AcceleratorLike
from ...utils.atomic_files import atomic_write
from ...utils.compilation import is_compiled_module
from ...utils.constants import OPTIMIZER_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_NAME
from ...utils.device_planning.allocation import get_non_persistent_buffers
from ...utils.other import is_peft_model, save
from ...utils.versions import is_torch_version
from .fsdp2 import (
    ensure_weights_retied,
    fsdp2_apply_ac,
    fsdp2_canonicalize_names,
    fsdp2_load_full_state_dict,
    fsdp2_prepare_auto_wrap_policy,
    fsdp2_prepare_model,
    fsdp2_switch_optimizer_parameters,
    get_fsdp2_grad_scaler,
    get_module_children_bottom_up,
    get_parameters_from_modules,
)
from .plugin import FullyShardedDataParallelPlugin, get_module_class_from_name

__all__ = [
    "FSDP_MODEL_NAME",
    "OPTIMIZER_NAME",
    "SAFE_WEIGHTS_NAME",
    "WEIGHTS_NAME",
    "disable_fsdp_ram_efficient_loading",
    "enable_fsdp_ram_efficient_loading",
    "ensure_weights_retied",
    "fsdp2_apply_ac",
    "fsdp2_canonicalize_names",
    "fsdp2_load_full_state_dict",
    "fsdp2_prepare_auto_wrap_policy",
    "fsdp2_prepare_model",
    "fsdp2_switch_optimizer_parameters",
    "get_fsdp2_grad_scaler",
    "get_module_children_bottom_up",
    "get_module_class_from_name",
    "get_non_persistent_buffers",
    "get_parameters_from_modules",
    "is_compiled_module",
    "is_peft_model",
    "is_torch_version",
    "load_fsdp_model",
    "load_fsdp_optimizer",
    "merge_fsdp_weights",
    "save_fsdp_model",
    "save",
    "save_fsdp_optimizer",
]
# Accelerate 1.15 serves get_logger here too; notebook_accel.logging reads the process state (a layer
# above utils), so the name is resolved on first use instead of imported.
_REEXPORTED_LAZILY = {"get_logger": "notebook_accel.logging"}
__all__ += sorted(_REEXPORTED_LAZILY)
__getattr__, __dir__ = attach(__name__, _REEXPORTED_LAZILY)

logger = logging.getLogger(__name__)

FSDP_MODEL_NAME = "pytorch_model_fsdp"


def enable_fsdp_ram_efficient_loading() -> None:
    """Return nothing; set ``FSDP_CPU_RAM_EFFICIENT_LOADING=True`` (transformers then loads weights on rank 0 only)."""
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "True"


def disable_fsdp_ram_efficient_loading() -> None:
    """Return nothing; set ``FSDP_CPU_RAM_EFFICIENT_LOADING=False`` (every rank loads the weights)."""
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "False"


def _is_full(plugin: FullyShardedDataParallelPlugin) -> bool:
    kind = plugin.state_dict_type
    if kind == fsdp.StateDictType.LOCAL_STATE_DICT:
        raise ValueError(
            "FSDP checkpoints: LOCAL_STATE_DICT pieces are pickled ShardedTensors, which notebook_accel does not "
            "read back (checkpoints load with torch.load(weights_only=True)); use SHARDED_STATE_DICT (same "
            "per-rank files, through torch.distributed.checkpoint) or FULL_STATE_DICT"
        )
    return kind == fsdp.StateDictType.FULL_STATE_DICT


def _piece(folder: str, base: str, index: int, full: bool) -> str:
    """Return where piece ``index`` of a checkpoint lies: one ``.bin`` file (full) or a DCP folder (sharded)."""
    if not full:
        return os.path.join(folder, f"{base}_{index}")
    return os.path.join(folder, f"{base}.bin" if index == 0 else f"{base}_{index}.bin")


def _save_piece(state: dict, folder: str, base: str, index: int, full: bool, key: str) -> str:
    """Return the path written: ``state`` as one file by rank 0 (full) or as DCP shards by every rank (``key``)."""
    path = _piece(folder, base, index, full)
    if not full:
        dcp.save({key: state}, checkpoint_id=path)
    elif _rank() == 0:
        _write(state, path)
    _barrier()
    return path


def _adapter_weights(state: dict) -> dict:
    """Return the PEFT adapter entries of ``state`` (names containing ``lora_``)."""
    return {name: value for name, value in state.items() if "lora_" in name}


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _write(obj: Any, path: str) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def _read(path: str) -> Any:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"FSDP checkpoint: no file {path!r}; was it saved with FULL_STATE_DICT?")
    return torch.load(path, map_location="cpu", weights_only=True)


def _check_folder(path: str) -> None:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"FSDP checkpoint: no folder {path!r}; was it saved with SHARDED_STATE_DICT?")


def _fsdp1_context(model: torch.nn.Module, plugin: FullyShardedDataParallelPlugin) -> Any:
    """Return FSDP1's ``state_dict_type`` context for ``model`` (the ``use_dcp=False`` path)."""
    if not isinstance(model, fsdp.FullyShardedDataParallel):
        raise ValueError(
            "use_dcp=False reads FSDP1's own state-dict context, but this model is not an FSDP1 "
            f"FullyShardedDataParallel ({type(model).__name__}); pass use_dcp=True (works for both versions)"
        )
    return fsdp.FullyShardedDataParallel.state_dict_type(
        model, plugin.state_dict_type, plugin.state_dict_config, plugin.optim_state_dict_config
    )


def _offload(model: torch.nn.Module, full: bool) -> bool:
    # Gathering to CPU memory only where the weights live elsewhere: torch's CPU-offload copy of a
    # full state dict fails on parameters that are already CPU tensors (FSDP on CPU processes).
    return full and any(p.device.type != "cpu" for p in model.parameters())


def _model_state(
    model: torch.nn.Module, plugin: FullyShardedDataParallelPlugin, full: bool, use_dcp: bool
) -> dict:
    if use_dcp:
        options = StateDictOptions(full_state_dict=full, cpu_offload=_offload(model, full))
        return get_model_state_dict(model, options=options)
    with _fsdp1_context(model, plugin):
        return model.state_dict()


def _load_model_state(
    model: torch.nn.Module, plugin: FullyShardedDataParallelPlugin, state: dict, full: bool, use_dcp: bool
) -> Any:
    if use_dcp:
        return set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=full, strict=True))
    with _fsdp1_context(model, plugin):
        return model.load_state_dict(state)


def save_fsdp_model(
    fsdp_plugin: FullyShardedDataParallelPlugin,
    accelerator: AcceleratorLike,
    model: torch.nn.Module,
    output_dir: str,
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> str:
    """Return the path written: ``model``'s full state dict (one file, rank 0) or its shards (a folder, all ranks).

    Call on every rank. ``adapter_only`` keeps only PEFT adapter weights (names containing ``lora_``).

    Args:
        fsdp_plugin: The FSDP plugin: its state-dict type says which form to write.
        accelerator: The Accelerator (any object with its ``state`` and ``device``).
        model: The sharded model to save.
        output_dir: The folder to write to.
        model_index: Which of the prepared models (0 for the first); it names the files.
        adapter_only: Save only PEFT adapter weights.
        use_dcp: Write a sharded checkpoint with torch.distributed.checkpoint.
    """
    full = _is_full(fsdp_plugin)
    os.makedirs(output_dir, exist_ok=True)
    state = _model_state(model, fsdp_plugin, full, use_dcp)
    if adapter_only:
        state = _adapter_weights(state)
    path = _save_piece(state, output_dir, FSDP_MODEL_NAME, model_index, full, "model")
    logger.info("FSDP model saved to %s", path)
    return path


def load_fsdp_model(
    fsdp_plugin: FullyShardedDataParallelPlugin,
    accelerator: AcceleratorLike,
    model: torch.nn.Module,
    input_dir: str,
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> Any:
    """Return torch's load result after loading what ``save_fsdp_model`` wrote into ``model`` (every rank).

    Args:
        fsdp_plugin: The FSDP plugin: its state-dict type says which form to read.
        accelerator: The Accelerator (any object with its ``state`` and ``device``).
        model: The sharded model to fill.
        input_dir: The folder ``save_fsdp_model`` wrote to.
        model_index: Which of the prepared models (0 for the first).
        adapter_only: Read only PEFT adapter weights.
        use_dcp: Read a sharded checkpoint with torch.distributed.checkpoint.
    """
    full = _is_full(fsdp_plugin)
    _barrier()
    path = _piece(input_dir, FSDP_MODEL_NAME, model_index, full)
    if full:
        state = _read(path)
    else:
        _check_folder(path)
        state = _model_state(model, fsdp_plugin, False, use_dcp)
        if adapter_only:
            state = _adapter_weights(state)
        dcp.load({"model": state}, checkpoint_id=path)
    if adapter_only:
        # Only the adapter weights were saved: start from the model's own weights for everything else.
        merged = _model_state(model, fsdp_plugin, full, use_dcp)
        merged.update(state)
        state = merged
    return _load_model_state(model, fsdp_plugin, state, full, use_dcp)


def save_fsdp_optimizer(
    fsdp_plugin: FullyShardedDataParallelPlugin,
    accelerator: AcceleratorLike,
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    output_dir: str,
    optimizer_index: int = 0,
    use_dcp: bool = True,
) -> str:
    """Return the path written: the optimizer state of sharded ``model`` (full: one file; sharded: a folder).

    Args:
        fsdp_plugin: The FSDP plugin: its state-dict type says which form to write.
        accelerator: The Accelerator (any object with its ``state`` and ``device``).
        optimizer: The optimizer of the sharded model.
        model: The sharded model.
        output_dir: The folder to write to.
        optimizer_index: Which of the prepared optimizers (0 for the first); it names the files.
        use_dcp: Write a sharded checkpoint with torch.distributed.checkpoint.
    """
    full = _is_full(fsdp_plugin)
    optimizer = getattr(optimizer, "optimizer", optimizer)  # an AcceleratedOptimizer holds torch's
    os.makedirs(output_dir, exist_ok=True)
    state = _optimizer_state(model, optimizer, fsdp_plugin, full, use_dcp)
    return _save_piece(state, output_dir, OPTIMIZER_NAME, optimizer_index, full, "optimizer")


def load_fsdp_optimizer(
    fsdp_plugin: FullyShardedDataParallelPlugin,
    accelerator: AcceleratorLike,
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    input_dir: str,
    optimizer_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    """Return nothing; load what ``save_fsdp_optimizer`` wrote into ``optimizer`` (every rank).

    Args:
        fsdp_plugin: The FSDP plugin: its state-dict type says which form to read.
        accelerator: The Accelerator (any object with its ``state`` and ``device``).
        optimizer: The optimizer of the sharded model.
        model: The sharded model.
        input_dir: The folder ``save_fsdp_optimizer`` wrote to.
        optimizer_index: Which of the prepared optimizers (0 for the first).
        adapter_only: The model holds only PEFT adapter weights.
        use_dcp: Read a sharded checkpoint with torch.distributed.checkpoint.
    """
    full = _is_full(fsdp_plugin)
    optimizer = getattr(optimizer, "optimizer", optimizer)
    _barrier()
    path = _piece(input_dir, OPTIMIZER_NAME, optimizer_index, full)
    if full:
        state = _read(path)
    else:
        _check_folder(path)
        state = _optimizer_state(model, optimizer, fsdp_plugin, False, use_dcp)
        # FSDP1 flattens a unit's parameters into one flat shard per rank: a parameter that falls wholly in
        # another rank's shard has no state entry here, so this rank reads only the entries it holds.
        flat = isinstance(model, fsdp.FullyShardedDataParallel)
        dcp.load(
            {"optimizer": state}, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=flat)
        )
    if use_dcp:
        set_optimizer_state_dict(
            model, optimizer, state, options=StateDictOptions(full_state_dict=full and _has_shardable(state))
        )
        return
    with _fsdp1_context(model, fsdp_plugin):
        optimizer.load_state_dict(
            fsdp.FullyShardedDataParallel.optim_state_dict_to_load(model, optimizer, state)
        )


def _has_shardable(state: dict) -> bool:
    """Return whether a full optimizer state holds a tensor to split into shards (dim > 0).

    torch distributes a full optimizer state by the device of the local state's tensors, and fails
    ("Expected device to be set") for an optimizer whose state has none, e.g. SGD without momentum.
    Such a state (hyperparameters and scalars, keyed by parameter names) is the same on every rank,
    so it loads as is, through the local path.
    """
    tensors = [v for entry in state.get("state", {}).values() for v in _values(entry)]
    return any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in tensors)


def _values(entry: Any) -> list[Any]:
    return list(entry.values()) if isinstance(entry, dict) else [entry]


def _optimizer_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    plugin: FullyShardedDataParallelPlugin,
    full: bool,
    use_dcp: bool,
) -> dict:
    if use_dcp:
        options = StateDictOptions(full_state_dict=full, cpu_offload=_offload(model, full))
        return get_optimizer_state_dict(model, optimizer, options=options)
    with _fsdp1_context(model, plugin):
        return fsdp.FullyShardedDataParallel.optim_state_dict(model, optimizer)


def merge_fsdp_weights(
    checkpoint_dir: str,
    output_path: str,
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
) -> str:
    """Return the file written: the sharded checkpoint folder ``checkpoint_dir`` merged into one full state dict.

    Runs in a single process (no process group needed). Writes ``model.safetensors`` (or
    ``pytorch_model.bin`` when ``safe_serialization=False``) inside ``output_path``.

    Args:
        checkpoint_dir: The folder of a sharded FSDP checkpoint.
        output_path: The folder to write the full weights to.
        safe_serialization: Write safetensors (default) rather than a torch pickle.
        remove_checkpoint_dir: Delete the sharded folder afterwards.
    """
    if not os.path.isdir(checkpoint_dir) or not os.path.isfile(os.path.join(checkpoint_dir, ".metadata")):
        raise FileNotFoundError(
            f"merge_fsdp_weights: {checkpoint_dir!r} is not a torch.distributed.checkpoint folder (no .metadata); "
            "pass the folder save_fsdp_model wrote with SHARDED_STATE_DICT (e.g. .../pytorch_model_fsdp_0)"
        )
    os.makedirs(output_path, exist_ok=True)
    scratch = os.path.join(output_path, ".merge_fsdp_weights.tmp")
    dcp_to_torch_save(checkpoint_dir, scratch)
    state = torch.load(scratch, map_location="cpu", weights_only=True)
    os.unlink(scratch)
    state = state.get("model", state)  # save_fsdp_model nests the weights under "model"
    state = {name: tensor.contiguous() for name, tensor in state.items()}
    if safe_serialization:
        target = os.path.join(output_path, SAFE_WEIGHTS_NAME)
        atomic_write(target, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    else:
        target = os.path.join(output_path, WEIGHTS_NAME)
        _write(state, target)
    if remove_checkpoint_dir:
        shutil.rmtree(checkpoint_dir)
    return target
