"""Checkpoint verbs of the Accelerator: save / save_model / save_state / load_state and their hooks.

A mixin of :class:`notebook_accel.accelerator.Accelerator`, kept apart so each file reads in one
sitting; the file formats and the atomic folder swap live in :mod:`notebook_accel.checkpointing`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from .. import checkpointing as _ckpt
from ..data_loader import skip_first_batches
from ..utils.enums import DistributedType
from ..utils.other import save

__all__: list[str] = []


class _CheckpointMixin:
    """save, save_model, save_state, load_state, pre-hooks, register_for_checkpointing, skip_first_batches."""

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Save ``obj`` to ``f`` once per machine (see ``utils.save``)."""
        save(
            obj,
            f,
            save_on_each_node=self.project_configuration.save_on_each_node,
            safe_serialization=safe_serialization,
        )

    def _is_writer(self) -> bool:
        return (
            self.is_local_main_process
            if self.project_configuration.save_on_each_node
            else self.is_main_process
        )

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write ``model``'s weights to ``save_directory`` (safetensors, sharded with an index past ``max_shard_size``)."""
        save_directory = Path(save_directory)
        if save_directory.is_file():
            raise ValueError(f"save_model needs a directory, but {str(save_directory)!r} is a file")
        state_dict = self.get_state_dict(model)
        if self._is_writer():
            save_directory.mkdir(parents=True, exist_ok=True)
            _ckpt.save_sharded_weights(state_dict, save_directory, max_shard_size, safe_serialization)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, weights, output_dir)`` before ``save_state`` writes; return a removable handle."""
        handle = RemovableHandle(self._save_model_state_pre_hook)
        self._save_model_state_pre_hook[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, input_dir)`` before ``load_state`` reads; return a removable handle."""
        handle = RemovableHandle(self._load_model_state_pre_hook)
        self._load_model_state_pre_hook[handle.id] = hook
        return handle

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include ``objects`` (each with ``state_dict``/``load_state_dict``) in ``save_state``/``load_state``."""
        invalid = [
            obj
            for obj in objects
            if not (
                callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
            )
        ]
        if invalid:
            # Accelerate 1.15's wording, which users match on (its index counts the invalid items).
            items = "".join(
                f"\n\t- Item at index {i}, `{type(obj).__name__}`" for i, obj in enumerate(invalid)
            )
            raise ValueError(
                "All `objects` must include a `state_dict` and `load_state_dict` function to be stored. "
                f"The following inputs are invalid:{items}"
            )
        self._custom_objects.extend(objects)

    def save_state(
        self,
        output_dir: str | os.PathLike | None = None,
        safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> str:
        """Save models, optimizers, schedulers, samplers, scaler, RNG states and registered objects; return the folder.

        With ``ProjectConfiguration(automatic_checkpoint_naming=True)`` the folder is
        ``project_dir/checkpoints/checkpoint_{iteration}`` and ``total_limit`` prunes the oldest
        once the new one is complete.
        The folder appears only once complete (written under a temporary name, then renamed).
        Pre-hooks receive the temporary folder as ``output_dir``. ``save_model_func_kwargs`` are
        accepted for compatibility (Accelerate hands them to DeepSpeed's saver); the DDP and FSDP
        paths here have no use for them.
        """
        config = self.project_configuration
        if config.automatic_checkpoint_naming:
            if config.project_dir is None:
                raise ValueError(
                    "automatic_checkpoint_naming needs a project_dir: ProjectConfiguration(project_dir=...)"
                )
            root = Path(config.project_dir) / "checkpoints"
            if self._is_writer():
                root.mkdir(parents=True, exist_ok=True)
            target = root / f"checkpoint_{config.iteration}"
            if target.exists():
                raise ValueError(
                    f"checkpoint folder {str(target)!r} already exists: set "
                    "accelerator.project_configuration.iteration to the number to continue from"
                )
        elif output_dir is None:
            raise ValueError(
                "save_state needs output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)"
            )
        else:
            target = Path(output_dir).expanduser()
        self.wait_for_everyone()
        writer = self._is_writer()
        weights = [self.get_state_dict(model) for model in self._models]
        optimizers = self._optimizers
        if self.distributed_type == DistributedType.FSDP:
            # Sharded optimizer state: every process takes part in gathering the full one.
            optimizers = [_FullOptimizerState(self._models, opt, self.device) for opt in self._optimizers]
        with _ckpt.atomic_directory(target, self.state, writer) as tmp:
            for hook in self._save_model_state_pre_hook.values():
                hook(self._models, weights, str(tmp))
            _ckpt.save_accelerator_state(
                tmp,
                weights,
                optimizers,
                self._schedulers,
                self._dataloaders,
                self.process_index,
                self.step,
                scaler=self.scaler,
                save_on_each_node=config.save_on_each_node,
                safe_serialization=safe_serialization,
                is_writer=writer,
            )
            if writer:
                for i, obj in enumerate(self._custom_objects):
                    _ckpt.save_custom_state(obj, tmp, i)
        if config.automatic_checkpoint_naming and config.total_limit is not None and writer:
            # Pruned only once the new checkpoint is complete: a failed save never costs an old one.
            folders = _ckpt.checkpoint_folders(config.project_dir)
            for old in folders[: max(len(folders) - config.total_limit, 0)]:
                shutil.rmtree(old)
        config.iteration += 1
        return str(target)

    def load_state(self, input_dir: str | os.PathLike | None = None, **load_model_func_kwargs: Any) -> None:
        """Restore everything ``save_state`` wrote (the latest automatic checkpoint when ``input_dir`` is None)."""
        config = self.project_configuration
        if input_dir is not None:
            source = Path(input_dir).expanduser()
            _ckpt.recover_directory(source)  # a save killed between its two renames hid it
            if not source.is_dir():
                raise FileNotFoundError(f"load_state: checkpoint folder {str(source)!r} does not exist")
        elif config.automatic_checkpoint_naming:
            folders = _ckpt.checkpoint_folders(config.project_dir or ".")
            if not folders:
                raise FileNotFoundError(
                    f"load_state: no checkpoints/checkpoint_* folder in {config.project_dir!r}"
                )
            source = folders[-1]
        else:
            raise ValueError(
                "load_state needs input_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)"
            )
        models = [self.unwrap_model(m) for m in self._models]
        optimizers = self._optimizers
        if self.distributed_type == DistributedType.FSDP:
            models = [_FullModelState(m) for m in self._models]
            optimizers = [_FullOptimizerState(self._models, opt, self.device) for opt in self._optimizers]
        for hook in self._load_model_state_pre_hook.values():
            hook(self._models, str(source))
        override = _ckpt.load_accelerator_state(
            source,
            models,
            optimizers,
            self._schedulers,
            self._dataloaders,
            self.process_index,
            scaler=self.scaler,
            **load_model_func_kwargs,
        )
        self.step = override.get("step", self.step)
        for i, obj in enumerate(self._custom_objects):
            _ckpt.load_custom_state(obj, source, i)
        if config.automatic_checkpoint_naming and source.name.startswith("checkpoint_"):
            config.iteration = int(source.name.split("_")[-1]) + 1

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """Return ``dataloader`` resuming after its first ``num_batches`` batches (mid-epoch resume)."""
        return skip_first_batches(dataloader, num_batches=num_batches)


def _full_options(device: torch.device, strict: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=device.type != "cpu", strict=strict)


class _FullModelState:
    """Load a full (unsharded) state dict into an FSDP-wrapped model, on every process."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}  # no tied aliases to account for: the full state dict names every tensor

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> Any:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        return set_model_state_dict(
            self.model, state, options=_full_options(torch.device("cpu"), strict=strict)
        )


class _FullOptimizerState:
    """Read and write the full optimizer state of a model sharded with FSDP."""

    def __init__(self, models: list[torch.nn.Module], optimizer: Any, device: torch.device) -> None:
        self.optimizer = getattr(optimizer, "optimizer", optimizer)
        owned = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        self.model = next((m for m in models if owned & {id(p) for p in m.parameters()}), None)
        if self.model is None:
            raise ValueError(
                "save_state/load_state with FSDP: an optimizer's parameters belong to no prepared model"
            )
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer, options=_full_options(self.device))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state, options=_full_options(self.device))
