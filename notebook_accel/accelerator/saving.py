"""The Accelerator's saving and loading verbs: ``save``, ``save_model``, ``save_state``, ``load_state``...

``_SavingMixin`` gives ``Accelerator`` the verbs a training script calls; what a checkpoint holds and
which process writes it are decided by the ``Checkpointer`` in :mod:`.checkpoint`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from .._lazy import LazyModule
from ..utils.enums import DistributedType
from .checkpoint import _full_options

__all__: list[str] = []

# Offloaded models (cpu_offload / disk_offload hooks) are read back only when save_model meets one.
_modeling = LazyModule("notebook_accel.utils.modeling")
# The data loaders load when one is skipped into (or prepared), not with the Accelerator.
_data_loader = LazyModule("notebook_accel.data_loader")
_other = LazyModule("notebook_accel.utils.other")  # the file writers: at the first save


class _SavingMixin:
    """Save and load verbs over ``self._checkpointer`` and the prepared models."""

    # ------------------------------------------------------------------ checkpoints (see .checkpoint)
    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Save ``obj`` to ``f`` once per machine (see ``utils.save``)."""
        on_each_node = self.project_configuration.save_on_each_node
        _other.save(obj, f, save_on_each_node=on_each_node, safe_serialization=safe_serialization)

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
        inner = self.unwrap_model(model)
        if self.distributed_type != DistributedType.FSDP and any(
            map(_modeling.has_offloaded_params, inner.modules())
        ):
            # cpu_offload / disk_offload left meta tensors in the model: read the real weights back.
            state_dict = _modeling.get_state_dict_offloaded_model(inner)
        else:
            state_dict = self.get_state_dict(model)  # every process takes part (FSDP gathers)
        self._checkpointer.save_model(state_dict, save_directory, max_shard_size, safe_serialization)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, weights, output_dir)`` before ``save_state`` writes; return a removable handle."""
        return self._checkpointer.add_save_hook(hook)

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, input_dir)`` before ``load_state`` reads; return a removable handle."""
        return self._checkpointer.add_load_hook(hook)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include ``objects`` (each with ``state_dict``/``load_state_dict``) in ``save_state``/``load_state``."""
        self._checkpointer.register(*objects)

    def save_state(
        self,
        output_dir: str | os.PathLike | None = None,
        safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> str:
        """Save models, optimizers, schedulers, samplers, scaler, RNG states and registered objects; return the folder.

        With ``ProjectConfiguration(automatic_checkpoint_naming=True)`` the folder is
        ``project_dir/checkpoints/checkpoint_{iteration}`` (see :meth:`.checkpoint.Checkpointer.save`).
        ``save_model_func_kwargs`` are accepted for compatibility (DeepSpeed's saver takes them).
        """
        # FSDP models are written shard by shard (or gathered once) by the checkpointer: gathering each
        # whole model here too would hold it in every process's memory. Hooks get no weights then, as in 1.15.
        fsdp = self.distributed_type == DistributedType.FSDP
        weights = [] if fsdp else [self.get_state_dict(model) for model in self._models]
        return self._checkpointer.save(output_dir, weights, self.step, self.scaler, safe_serialization)

    def load_state(
        self,
        input_dir: str | os.PathLike | None = None,
        load_kwargs: dict | None = None,
        **load_model_func_kwargs: Any,
    ) -> None:
        """Restore everything ``save_state`` wrote (the latest automatic checkpoint when ``input_dir`` is None).

        ``load_kwargs`` go to the loader of each optimizer, scheduler, sampler, scaler and RNG file
        (e.g. ``{"mmap": True}``); ``load_model_func_kwargs`` to each model's ``load_state_dict``.
        """
        kwargs = dict(load_model_func_kwargs, load_kwargs=load_kwargs)
        saved = self._checkpointer.load(input_dir, self.unwrap_model, self.scaler, **kwargs)
        self.step = saved.get("step", self.step)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """Return ``dataloader`` resuming after its first ``num_batches`` batches (mid-epoch resume)."""
        return _data_loader.skip_first_batches(dataloader, num_batches=num_batches)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Return the full state dict of ``model`` (gathered from shards under FSDP / ZeRO-3)."""
        if self.distributed_type == DistributedType.DEEPSPEED and hasattr(
            model, "_zero3_consolidated_16bit_state_dict"
        ):
            if self.state.deepspeed_plugin.is_zero3:
                return model._zero3_consolidated_16bit_state_dict()
        if self.distributed_type == DistributedType.FSDP:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            # Every process takes part in gathering the full (unsharded) weights.
            return get_model_state_dict(model, options=_full_options(self.device))
        if unwrap:
            model = self.unwrap_model(model)
        return model.state_dict()
