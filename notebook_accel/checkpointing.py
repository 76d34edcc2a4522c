"""Checkpoint files of ``Accelerator.save_state`` / ``load_state`` and ``save_model``.

Layout of a state folder (Accelerate's names; ``_{i}`` suffixes for the second and later object of
a kind): ``model.safetensors`` (or ``pytorch_model.bin``), ``optimizer.bin``, ``scheduler.bin``,
``sampler.bin``, ``dl_state_dict.bin`` (a stateful loader's ``state_dict()``, torchdata's as 1.15 writes
it), ``scaler.pt``, ``random_states_{process_index}.pkl`` (one per process) and
``custom_checkpoint_{i}.pkl``; ours beside them: ``dl_resume_state.bin`` (the loader's ``resume_state()``,
what an exact resumption needs that torchdata's state does not hold). Folders are written under a temporary name and renamed when
every process has finished (:func:`atomic_directory`), so a crash never leaves a half-written
checkpoint where a complete one is expected.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoint_folder import recover_directory
from .data_loader import SeedableRandomSampler
from .data_loader.loader_adapter import _PositionedLoader, find_sampler
from .logging import get_logger
from .state import PartialState
from .utils.atomic_files import NoSpaceError, atomic_write
from .utils.checkpoint_io.checkpoints import shard_checkpoint
from .utils.checkpoint_io.file_checks import safetensors_keys, torch_load_named
from .utils.constants import (
    MODEL_NAME,
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_MODEL_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SAMPLER_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)
from .utils.imports import (
    is_cuda_available,
    is_hpu_available,
    is_mlu_available,
    is_musa_available,
    is_neuron_available,
    is_sdaa_available,
    is_torch_xla_available,
    is_xpu_available,
)
from .utils.other import get_pretty_name, load, save
from .utils.versions import is_torch_version

__all__ = [
    "load_accelerator_state",
    "load_custom_state",
    "save_accelerator_state",
    "save_custom_state",
    "save_model_weights",
]
# Accelerate 1.15 serves these names at this path too (defined elsewhere).
__all__ += [
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "PartialState",
    "RNG_STATE_NAME",
    "SAFE_MODEL_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAMPLER_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "WEIGHTS_NAME",
    "get_logger",
    "get_pretty_name",
    "is_cuda_available",
    "is_hpu_available",
    "is_mlu_available",
    "is_musa_available",
    "is_neuron_available",
    "is_sdaa_available",
    "is_torch_version",
    "is_torch_xla_available",
    "is_xpu_available",
    "load",
    "save",
]

logger = logging.getLogger(__name__)

# A stateful prepared dataloader's position inside its epoch (Accelerate's file name).
DATALOADER_STATE_NAME = "dl_state_dict"
# Beside it (ours only): what an exact resumption needs that torchdata's state does not hold.
DATALOADER_RESUME_NAME = "dl_resume_state"


def _indexed(name: str, index: int) -> str:
    """Return ``name`` with ``_{index}`` before its extension for the second and later objects."""
    if index == 0:
        return name
    stem, dot, ext = name.partition(".")
    return f"{stem}_{index}{dot}{ext}"


def _model_file(index: int, safe_serialization: bool) -> str:
    return _indexed(SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME, index)


def _torch_save(obj: Any, path: Path) -> None:
    """Write ``obj`` with torch.save to a temporary name, then rename it into place."""
    atomic_write(os.fspath(path), lambda tmp: torch.save(obj, tmp), needs=_payload_bytes(obj))


def _payload_bytes(obj: Any) -> int:
    """Return the bytes of the tensors and arrays in ``obj`` (nested dicts, lists, tuples): what saving it takes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_payload_bytes(v) for v in obj)
    return 0


def _torch_load(path: Path, map_location: Any = None, **load_kwargs: Any) -> Any:
    """Return the objects in ``path`` read with ``weights_only=True`` (tensors, containers, numpy arrays).

    Everything ``save_state`` writes loads this way; anything else (a class, a ``__reduce__`` that
    would run code) is refused with an error naming the file, and nothing in it runs.
    """
    try:
        return torch_load_named(path, loader=load, map_location=map_location, **load_kwargs)
    except pickle.UnpicklingError as exc:
        reason = str(exc).strip().splitlines()
        detail = next(
            (line for line in reason if "GLOBAL" in line or "Unsupported" in line),
            reason[0] if reason else "",
        )
        raise pickle.UnpicklingError(
            f"checkpoint file {str(path)!r} holds objects other than tensors, plain containers and numpy arrays "
            f"({detail.strip()}); it was not loaded, because unpickling it could run code. If you wrote it and "
            "trust it, allow its classes with torch.serialization.add_safe_globals([...]) and load again"
        ) from None


def _rng_state(step: int) -> dict[str, Any]:
    state: dict[str, Any] = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    # Only touch CUDA when the run already uses it (querying would initialise it in a fresh process).
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random_state"])
    np.random.set_state(state["numpy_random_seed"])
    torch.set_rng_state(state["torch_manual_seed"])
    if "torch_cuda_manual_seed" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state_all(state["torch_cuda_manual_seed"])


def _sampler_state(dataloader: Any) -> dict[str, Any] | None:
    """Return what restores a seedable sampler's shuffling (its epoch and seed), or None.

    A sampler drawing from a generator is not saved, as in Accelerate: a resumed run rebuilds its
    loader with the same generator seed, so ``skip_first_batches`` replays the interrupted epoch's
    permutation; restoring the mid-epoch generator state would start the next permutation instead.
    """
    sampler = find_sampler(dataloader)
    if not isinstance(sampler, SeedableRandomSampler):
        return None
    out: dict[str, Any] = {"sampler": sampler.state_dict()}
    if hasattr(dataloader, "iteration"):
        out["iteration"] = dataloader.iteration
    return out


def _load_sampler_state(dataloader: Any, state: dict[str, Any]) -> None:
    sampler = find_sampler(dataloader)
    if "sampler" in state and hasattr(sampler, "load_state_dict"):
        sampler.load_state_dict(state["sampler"])
    if "iteration" in state and hasattr(dataloader, "iteration"):
        dataloader.iteration = state["iteration"]


def save_accelerator_state(
    output_dir: str | os.PathLike,
    model_states: list[dict[str, torch.Tensor] | torch.nn.Module],
    optimizers: list[Any],
    schedulers: list[Any],
    dataloaders: list[Any],
    process_index: int,
    step: int,
    scaler: torch.amp.GradScaler | None = None,
    save_on_each_node: bool = False,
    safe_serialization: bool = True,
    *,
    is_writer: bool = True,
) -> Path:
    """Write the training state into ``output_dir`` (which must exist); return its path.

    ``model_states`` holds state dicts (or modules) of the prepared models. The process with
    ``is_writer`` writes the shared files; every process writes its own RNG state.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    # Gathering a sharded optimizer state is collective: every process computes it.
    optimizer_states = [optimizer.state_dict() for optimizer in optimizers]
    try:
        _write_state(output_dir, model_states, optimizer_states, schedulers, dataloaders, scaler,
                     safe_serialization, is_writer)  # fmt: skip
        _torch_save(_rng_state(step), output_dir / f"{RNG_STATE_NAME}_{process_index}.pkl")
    except NoSpaceError as exc:
        states = [s.state_dict() if isinstance(s, torch.nn.Module) else s for s in model_states]
        total = _payload_bytes(states) + _payload_bytes(optimizer_states)
        raise NoSpaceError(
            exc.errno, f"{exc.strerror} The whole checkpoint needs about {total / 1e6:.1f} MB", exc.filename
        ) from exc
    logger.info("saved training state to %s", output_dir)
    return output_dir


def _write_state(
    output_dir: Path, model_states: list[Any], optimizer_states: list[Any], schedulers: list[Any],
    dataloaders: list[Any], scaler: Any, safe_serialization: bool, is_writer: bool,
) -> None:  # fmt: skip
    """Write the shared files of a state folder (on the writing process only)."""
    if is_writer:
        for i, state in enumerate(model_states):
            save_model_weights(state, output_dir / _model_file(i, safe_serialization), safe_serialization)
        for i, state in enumerate(optimizer_states):
            _torch_save(state, output_dir / f"{_indexed(OPTIMIZER_NAME, i)}.bin")
        for i, scheduler in enumerate(schedulers):
            _torch_save(scheduler.state_dict(), output_dir / f"{_indexed(SCHEDULER_NAME, i)}.bin")
        for i, dataloader in enumerate(dataloaders):
            state = _sampler_state(dataloader)
            if state is not None:
                _torch_save(state, output_dir / f"{_indexed(SAMPLER_NAME, i)}.bin")
            if getattr(dataloader, "use_stateful_dataloader", False):  # the position inside the epoch
                _torch_save(dataloader.state_dict(), output_dir / f"{_indexed(DATALOADER_STATE_NAME, i)}.bin")
                if isinstance(dataloader, _PositionedLoader):  # beside torchdata's state, which stays as 1.15's
                    _torch_save(dataloader.resume_state(), output_dir / f"{_indexed(DATALOADER_RESUME_NAME, i)}.bin")
        if scaler is not None:
            _torch_save(scaler.state_dict(), output_dir / SCALER_NAME)


def _read_loader_state(files: Any, index: int, dataloader: Any) -> tuple[Any, Any, Any]:
    """Return ``(sampler state, position, resume state)`` of loader ``index`` (None for each one absent)."""
    sampler = files.optional(f"{_indexed(SAMPLER_NAME, index)}.bin")
    if not getattr(dataloader, "use_stateful_dataloader", False):
        return sampler, None, None
    position = files.optional(f"{_indexed(DATALOADER_STATE_NAME, index)}.bin")
    return sampler, position, files.optional(f"{_indexed(DATALOADER_RESUME_NAME, index)}.bin")


def _restore_loader(dataloader: Any, sampler_state: Any, position: Any, resume: Any) -> None:
    if sampler_state is not None:
        _load_sampler_state(dataloader, sampler_state)
    if position is not None and resume is not None and isinstance(dataloader, _PositionedLoader):
        dataloader.resume_from(position, resume)
    elif position is not None:  # 1.15's checkpoint, or a loader of another kind
        dataloader.load_state_dict(position)


def load_accelerator_state(
    input_dir: str | os.PathLike,
    models: list[torch.nn.Module],
    optimizers: list[Any],
    schedulers: list[Any],
    dataloaders: list[Any],
    process_index: int,
    scaler: torch.amp.GradScaler | None = None,
    map_location: Any = None,
    load_kwargs: dict | None = None,
    *,
    custom_objects: list[Any] | None = None,
    before_restore: Callable[[], None] | None = None,
    **load_model_func_kwargs: Any,
) -> dict[str, Any]:
    """Restore the state written by :func:`save_accelerator_state`; return attributes to restore (``step``).

    Every file is read and checked (present, not empty or cut short, the model's keys and shapes) before
    anything is restored, so a bad file leaves the run as it was. ``load_kwargs`` go to every
    ``torch.load`` of optimizer, scheduler, sampler, scaler and RNG files (e.g. ``mmap=True``); they
    always load with ``weights_only=True``. ``load_model_func_kwargs`` go to ``load_state_dict`` of each
    model (e.g. ``strict=False``). ``custom_objects`` (registered objects) are restored last;
    ``before_restore`` runs once all was read, before any restore (FSDP shards load there).
    """
    load_kwargs = dict(load_kwargs or {})
    if load_kwargs.pop("weights_only", True) is not True:
        raise ValueError(
            "load_accelerator_state: checkpoints load with weights_only=True only; drop weights_only from load_kwargs"
        )
    input_dir = Path(input_dir)
    recover_directory(input_dir)
    if not input_dir.is_dir():
        raise FileNotFoundError(f"checkpoint folder {str(input_dir)!r} does not exist")
    files = _StateFiles(input_dir, "cpu" if map_location is None else map_location, load_kwargs)
    model_states = [files.model(i) for i in range(len(models))]
    for model, state in zip(models, model_states):
        _check_fits(model, state, load_model_func_kwargs.get("strict", True))
    optimizer_states = [files.required(f"{_indexed(OPTIMIZER_NAME, i)}.bin", f"optimizer {i}", True)
                        for i in range(len(optimizers))]  # fmt: skip
    scheduler_states = [files.required(f"{_indexed(SCHEDULER_NAME, i)}.bin", f"scheduler {i}")
                        for i in range(len(schedulers))]  # fmt: skip
    loader_states = [_read_loader_state(files, i, dataloader) for i, dataloader in enumerate(dataloaders)]
    scaler_state = None if scaler is None else files.required(SCALER_NAME, "the fp16 gradient scaler")
    rng = files.optional(f"{RNG_STATE_NAME}_{process_index}.pkl")
    custom_states = [
        files.required(f"custom_checkpoint_{i}.pkl", f"registered object {i} ({type(obj).__name__})")
        for i, obj in enumerate(custom_objects or ())
    ]
    if before_restore is not None:  # everything was read: restore in one go
        before_restore()
    for model, state in zip(models, model_states):
        _load_into(model, state, **load_model_func_kwargs)
    for optimizer, state in zip(optimizers, optimizer_states):
        optimizer.load_state_dict(state)
    for scheduler, state in zip(schedulers, scheduler_states):
        scheduler.load_state_dict(state)
    for dataloader, state in zip(dataloaders, loader_states):
        _restore_loader(dataloader, *state)
    if scaler is not None:
        scaler.load_state_dict(scaler_state)
    for obj, state in zip(custom_objects or (), custom_states):
        obj.load_state_dict(state)
    if rng is None:
        logger.warning(
            "no RNG state for process %d in %s: random streams are not restored", process_index, input_dir
        )
        return {}
    _set_rng_state(rng)
    return {"step": rng.get("step", 0)}


class _StateFiles:
    """Reads the files of one checkpoint folder, each failure naming its file (nothing is restored here)."""

    def __init__(self, folder: Path, map_location: Any, load_kwargs: dict[str, Any]) -> None:
        self.folder, self.map_location, self.load_kwargs = folder, map_location, load_kwargs

    def model(self, i: int) -> dict[str, torch.Tensor]:
        safe, legacy = self.folder / _model_file(i, True), self.folder / _model_file(i, False)
        if safe.exists():
            return _load_safetensors(safe)
        if legacy.exists():
            return torch_load_named(legacy, map_location="cpu", weights_only=True)
        raise FileNotFoundError(
            f"no weights for model {i} in {str(self.folder)!r}: expected {safe.name} or {legacy.name}"
        )

    def required(self, name: str, what: str, mapped: bool = False) -> Any:
        path = self.folder / name
        _require(path, what)
        return _torch_load(path, self.map_location if mapped else None, **self.load_kwargs)

    def optional(self, name: str) -> Any:
        path = self.folder / name
        return _torch_load(path, **self.load_kwargs) if path.exists() else None


def _require(path: Path, what: str) -> None:
    if not path.exists():
        raise FileNotFoundError(
            f"checkpoint {str(path.parent)!r} has no {path.name} for {what}: was it saved with the same "
            "number of prepared objects?"
        )


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    safetensors_keys(path)  # names the file when it is empty or cut short (safetensors does not)
    return load_file(str(path), device="cpu")


def _check_fits(model: Any, state: dict[str, torch.Tensor], strict: bool) -> None:
    """Raise before anything is restored when ``state`` cannot load into ``model`` (keys, shapes)."""
    if not isinstance(model, torch.nn.Module):
        return  # a full-state adapter (FSDP): its own loader checks
    own = model.state_dict()
    for name, tensor in state.items():
        if name in own and own[name].shape != tensor.shape:
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(model).__name__}: size mismatch for {name}: copying "
                f"a param with shape {tensor.shape} from checkpoint, the shape in current model is "
                f"{own[name].shape}. Nothing was restored."
            )
    if strict:
        aliases = _alias_names(own)
        missing = [k for k in own if k not in state and k not in aliases]
        unexpected = [k for k in state if k not in own]
        if missing or unexpected:
            raise RuntimeError(
                f"checkpoint does not match {type(model).__name__}: missing keys {missing[:10]}, "
                f"unexpected keys {unexpected[:10]} (pass strict=False to load_state to accept). Nothing was "
                "restored."
            )


def _load_into(model: torch.nn.Module, state: dict[str, torch.Tensor], **kwargs: Any) -> None:
    """Load ``state`` into ``model``, accepting the tied aliases dropped when saving."""
    strict = kwargs.pop("strict", True)
    missing, unexpected = model.load_state_dict(state, strict=False, **kwargs)
    if strict:
        aliases = _alias_names(model.state_dict())
        missing = [k for k in missing if k not in aliases]
        if missing or unexpected:
            raise RuntimeError(
                f"checkpoint does not match {type(model).__name__}: missing keys {missing[:10]}, "
                f"unexpected keys {unexpected[:10]} (pass strict=False to load_state to accept)"
            )


def _alias_names(state: dict[str, torch.Tensor]) -> set[str]:
    """Return the names whose tensor shares storage with an earlier name (tied weights)."""
    seen: set[tuple] = set()
    aliases = set()
    for name, tensor in state.items():
        if tensor.device.type == "meta":
            continue
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.dtype,
        )
        if key in seen:
            aliases.add(name)
        seen.add(key)
    return aliases


def _dedupe_for_safetensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Return ``state`` without tied aliases and with contiguous CPU-readable tensors."""
    aliases = _alias_names(state)
    if aliases:
        logger.info("not saving tied aliases %s (they share storage with another tensor)", sorted(aliases))
    return {k: v.detach().contiguous() for k, v in state.items() if k not in aliases}


def save_model_weights(
    state: dict[str, torch.Tensor] | torch.nn.Module, path: str | os.PathLike, safe_serialization: bool = True
) -> None:
    """Write one weights file (safetensors or torch pickle) at ``path`` via a temporary name."""
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    path = Path(path)
    if safe_serialization:
        from safetensors.torch import save_file

        tensors = _dedupe_for_safetensors(state)
        atomic_write(
            os.fspath(path),
            lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}),
            needs=_payload_bytes(tensors),
        )
    else:
        _torch_save(state, path)


def save_sharded_weights(
    state: dict[str, torch.Tensor], save_directory: Path, max_shard_size: int | str, safe_serialization: bool
) -> list[Path]:
    """Write ``state`` as one file or as shards plus an index; return the files written."""
    weights_name = SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME
    index_name = SAFE_WEIGHTS_INDEX_NAME if safe_serialization else WEIGHTS_INDEX_NAME
    if safe_serialization:
        state = _dedupe_for_safetensors(state)
    shards, index = shard_checkpoint(state, max_shard_size=max_shard_size, weights_name=weights_name)
    _remove_stale_shards(save_directory, weights_name, set(shards))
    written = []
    for filename, shard in shards.items():
        save_model_weights(shard, save_directory / filename, safe_serialization)
        written.append(save_directory / filename)
    index_path = save_directory / index_name
    if index is None:
        index_path.unlink(missing_ok=True)
    else:
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        atomic_write(os.fspath(index_path), lambda tmp: Path(tmp).write_text(text))
        written.append(index_path)
    return written


def _remove_stale_shards(directory: Path, weights_name: str, keep: set[str]) -> None:
    # Shards of an earlier, differently sharded save would otherwise be picked up with the new index.
    stem, _, ext = weights_name.partition(".")
    pattern = re.compile(rf"^{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?\.{re.escape(ext)}$")
    for entry in directory.iterdir():
        if entry.is_file() and pattern.match(entry.name) and entry.name not in keep:
            entry.unlink()


def save_custom_state(
    obj: Any, path: str | os.PathLike, index: int = 0, save_on_each_node: bool = False
) -> Path:
    """Write ``obj.state_dict()`` to ``path/custom_checkpoint_{index}.pkl``; return the file path."""
    del save_on_each_node  # the caller decides which process writes
    target = Path(path) / f"custom_checkpoint_{index}.pkl"
    _torch_save(obj.state_dict(), target)
    return target


def load_custom_state(obj: Any, path: str | os.PathLike, index: int = 0) -> None:
    """Restore ``obj`` from ``path/custom_checkpoint_{index}.pkl``."""
    target = Path(path) / f"custom_checkpoint_{index}.pkl"
    _require(target, f"registered object {index} ({type(obj).__name__})")
    obj.load_state_dict(_torch_load(target))


def checkpoint_folders(project_dir: str | os.PathLike) -> list[Path]:
    """Return ``project_dir/checkpoints/checkpoint_{i}`` folders sorted by ``i``."""
    root = Path(project_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = re.fullmatch(r"checkpoint_(\d+)", entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return [path for _, path in sorted(found)]
