"""save_state / load_state for one Accelerator: which folder, which process writes, what goes in.

:class:`PreparedObjects` holds what the Accelerator prepared or registered (models, optimizers,
schedulers, dataloaders, custom objects and the pre-hooks); :class:`Checkpointer` writes and reads
them. Both are explicit objects the Accelerator builds and hands what they need (the project
configuration, the process state), so the checkpoint logic reads no Accelerator attribute. The
file formats and the atomic folder swap live in :mod:`notebook_accel.checkpointing`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from .._lazy import LazyModule
from ..utils.configs import ProjectConfiguration
from ..utils.enums import DistributedType

__all__ = ["Checkpointer", "PreparedObjects"]

# torch.distributed.checkpoint loads DTensor (and sympy): imported when a sharded model is saved or loaded.
_dcp_state = LazyModule("torch.distributed.checkpoint.state_dict")
# The checkpoint file formats (with safetensors and the weight-file readers) load at the first save or load.
_ckpt = LazyModule("notebook_accel.checkpointing")
_folder = LazyModule("notebook_accel.checkpoint_folder")
_fsdp_ckpt = LazyModule("notebook_accel.integrations.fsdp.checkpoints")


@dataclasses.dataclass
class PreparedObjects:
    """What an Accelerator prepared or registered, in preparation order (what a checkpoint holds)."""

    models: list[torch.nn.Module] = dataclasses.field(default_factory=list)
    optimizers: list[Any] = dataclasses.field(default_factory=list)
    schedulers: list[Any] = dataclasses.field(default_factory=list)
    dataloaders: list[Any] = dataclasses.field(default_factory=list)
    custom_objects: list[Any] = dataclasses.field(default_factory=list)
    save_hooks: OrderedDict[int, Callable] = dataclasses.field(default_factory=OrderedDict)
    load_hooks: OrderedDict[int, Callable] = dataclasses.field(default_factory=OrderedDict)

    def forget_prepared(self) -> None:
        """Empty the prepared-object lists in place (registered objects and hooks stay)."""
        for objects in (self.models, self.optimizers, self.schedulers, self.dataloaders):
            objects.clear()


class Checkpointer:
    """Write and read checkpoint folders of the objects in ``prepared``.

    Args:
        config: the Accelerator's ProjectConfiguration (folder naming, ``total_limit``,
            ``save_on_each_node``; its ``iteration`` advances with each automatic checkpoint).
        state: the process state (rank, device, distributed type).
        prepared: the objects to save and restore.
    """

    def __init__(self, config: ProjectConfiguration, state: Any, prepared: PreparedObjects) -> None:
        self.config = config
        self.state = state
        self.prepared = prepared

    def is_writer(self) -> bool:
        """Return whether this process writes files (once per machine or once per run)."""
        if self.config.save_on_each_node:
            return self.state.is_local_main_process
        return self.state.is_main_process

    def register(self, *objects: Any) -> None:
        """Add ``objects`` (each with ``state_dict``/``load_state_dict``) to every checkpoint."""
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
        self.prepared.custom_objects.extend(objects)

    @staticmethod
    def _add_hook(hooks: OrderedDict[int, Callable], hook: Callable[..., None]) -> RemovableHandle:
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def add_save_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, weights, output_dir)`` before each save writes; return a removable handle."""
        return self._add_hook(self.prepared.save_hooks, hook)

    def add_load_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, input_dir)`` before each load reads; return a removable handle."""
        return self._add_hook(self.prepared.load_hooks, hook)

    def save_model(
        self, state_dict: dict[str, torch.Tensor], save_directory: Path, max_shard_size: Any, safe: bool
    ) -> None:
        """Write ``state_dict`` to ``save_directory`` on the writing process (sharded past ``max_shard_size``)."""
        if self.is_writer():
            save_directory.mkdir(parents=True, exist_ok=True)
            _ckpt.save_sharded_weights(state_dict, save_directory, max_shard_size, safe)

    def _save_target(self, output_dir: str | os.PathLike | None) -> Path:
        """Return the folder a save writes: ``output_dir``, or the next automatic checkpoint folder."""
        config = self.config
        if not config.automatic_checkpoint_naming:
            if output_dir is None:
                raise ValueError(
                    "save_state needs output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)"
                )
            return Path(output_dir).expanduser()
        if config.project_dir is None:
            raise ValueError(
                "automatic_checkpoint_naming needs a project_dir: ProjectConfiguration(project_dir=...)"
            )
        root = Path(config.project_dir) / "checkpoints"
        if self.is_writer():
            root.mkdir(parents=True, exist_ok=True)
        target = root / f"checkpoint_{config.iteration}"
        if target.exists():
            raise ValueError(
                f"checkpoint folder {str(target)!r} already exists: set "
                "accelerator.project_configuration.iteration to the number to continue from"
            )
        return target

    def _fsdp_pairs(self) -> list[tuple[Any, torch.nn.Module]]:
        """Return each prepared optimizer with the sharded model that owns its parameters (FSDP only)."""
        pairs = []
        for opt in self.prepared.optimizers:
            owned = {id(p) for group in getattr(opt, "optimizer", opt).param_groups for p in group["params"]}
            model = next((m for m in self.prepared.models if owned & {id(p) for p in m.parameters()}), None)
            if model is None:
                raise ValueError(
                    "save_state/load_state with FSDP: an optimizer's parameters belong to no prepared model; "
                    "prepare the model and its optimizer with this Accelerator"
                )
            pairs.append((opt, model))
        return pairs

    def save(
        self,
        output_dir: str | os.PathLike | None,
        weights: list[dict[str, torch.Tensor]],
        step: int,
        scaler: torch.amp.GradScaler | None,
        safe_serialization: bool,
    ) -> str:
        """Write a checkpoint of ``weights`` (one state dict per model) and every prepared object; return its folder.

        The folder appears only once complete (written under a temporary name, then renamed);
        pre-hooks see the temporary folder. Automatic checkpoints beyond ``total_limit`` are pruned,
        oldest first, once the new one is complete.
        """
        target = self._save_target(output_dir)
        self.state.wait_for_everyone()
        writer, prepared = self.is_writer(), self.prepared
        fsdp = self.state.distributed_type == DistributedType.FSDP
        optimizers = [] if fsdp else prepared.optimizers
        with _folder.atomic_directory(target, self.state, writer) as tmp:
            for hook in prepared.save_hooks.values():
                hook(list(prepared.models), weights, str(tmp))
            if fsdp:  # Accelerate's FSDP layout: the plugin's state_dict_type says full file or shards
                self._fsdp_files(tmp, _fsdp_ckpt.save_fsdp_model, _fsdp_ckpt.save_fsdp_optimizer)
            _ckpt.save_accelerator_state(
                tmp,
                [] if fsdp else weights,
                optimizers,
                prepared.schedulers,
                prepared.dataloaders,
                self.state.process_index,
                step,
                scaler=scaler,
                save_on_each_node=self.config.save_on_each_node,
                safe_serialization=safe_serialization,
                is_writer=writer,
            )
            if writer:
                for i, obj in enumerate(prepared.custom_objects):
                    _ckpt.save_custom_state(obj, tmp, i)
        self._prune(writer)
        self.config.iteration += 1
        return str(target)

    def _prune(self, writer: bool) -> None:
        config = self.config
        if not (config.automatic_checkpoint_naming and config.total_limit is not None and writer):
            return
        folders = _ckpt.checkpoint_folders(config.project_dir)
        for old in folders[: max(len(folders) - config.total_limit, 0)]:
            shutil.rmtree(old)

    def _fsdp_files(self, folder: Path, model_files: Callable, optimizer_files: Callable) -> None:
        """Save or load (``fsdp_utils``' pair of functions given) every prepared model, then every optimizer."""
        plugin = self.state.fsdp_plugin
        for i, model in enumerate(self.prepared.models):
            model_files(plugin, None, model, str(folder), i)
        for i, (opt, model) in enumerate(self._fsdp_pairs()):
            optimizer_files(plugin, None, opt, model, str(folder), i)

    def _load_source(self, input_dir: str | os.PathLike | None) -> Path:
        """Return the folder a load reads: ``input_dir``, or the latest automatic checkpoint."""
        config = self.config
        if input_dir is not None:
            source = Path(input_dir).expanduser()
            _folder.recover_directory(source)  # a save killed between its two renames hid it
            if not source.is_dir():
                raise FileNotFoundError(f"load_state: checkpoint folder {str(source)!r} does not exist")
            return source
        if not config.automatic_checkpoint_naming:
            raise ValueError(
                "load_state needs input_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)"
            )
        folders = _ckpt.checkpoint_folders(config.project_dir or ".")
        if not folders:
            raise FileNotFoundError(
                f"load_state: no checkpoints/checkpoint_* folder in {config.project_dir!r}"
            )
        return folders[-1]

    def load(
        self,
        input_dir: str | os.PathLike | None,
        unwrap: Callable[[torch.nn.Module], torch.nn.Module],
        scaler: torch.amp.GradScaler | None,
        **load_model_func_kwargs: Any,
    ) -> dict[str, Any]:
        """Restore every prepared object from a checkpoint; return the Accelerator attributes it saved (``step``).

        ``unwrap`` takes a prepared model to the module whose state dict the checkpoint holds.
        """
        source = self._load_source(input_dir)
        prepared = self.prepared
        fsdp = self.state.distributed_type == DistributedType.FSDP
        # Hooks get a list of their own: a model they pop (diffusers' hooks load their models
        # themselves and pop them) is not loaded again here, and stays prepared.
        remaining = list(prepared.models)
        for hook in prepared.load_hooks.values():
            hook(remaining, str(source))
        read_all = False  # set once this process read every file: from then on it has told the others

        def load_shards() -> None:
            # The other files were read and checked on this process; the shards load collectively, so
            # every process first learns whether all the others got this far.
            nonlocal read_all
            read_all = True
            failed = _folder.failed_processes(self.state, True)
            if failed:
                raise RuntimeError(
                    f"load_state failed on process(es) {failed} while reading {str(source)!r} (the error is "
                    "raised there); nothing was restored"
                )
            self._fsdp_files(source, _fsdp_ckpt.load_fsdp_model, _fsdp_ckpt.load_fsdp_optimizer)

        try:
            override = _ckpt.load_accelerator_state(
                source,
                [] if fsdp else [unwrap(m) for m in remaining],
                [] if fsdp else prepared.optimizers,
                prepared.schedulers,
                prepared.dataloaders,
                self.state.process_index,
                scaler=scaler,
                custom_objects=prepared.custom_objects,
                before_restore=load_shards if fsdp else None,
                **load_model_func_kwargs,
            )
        except BaseException:
            if fsdp and not read_all:  # this process failed reading: the others must not wait for it
                _folder.failed_processes(self.state, False)
            raise
        if self.config.automatic_checkpoint_naming and source.name.startswith("checkpoint_"):
            self.config.iteration = int(source.name.split("_")[-1]) + 1
        return override


def _full_options(device: torch.device, strict: bool = True) -> Any:
    return _dcp_state.StateDictOptions(full_state_dict=True, cpu_offload=device.type != "cpu", strict=strict)
