"""Wrapping a model for FSDP, version 1 (``FullyShardedDataParallel``) or 2 (``fully_shard``), on CPU or GPU.

``prepare_fsdp`` is the one entry the Accelerator calls; the plugin (resolved once, see
``plugin.py``) says which version and how. FSDP1 replaces the model by a wrapper
module; FSDP2 keeps the model and swaps its parameters for sharded ``DTensor``s. Either way the
optimizer the user built on the unwrapped model is re-pointed at the new parameters here, and the
gradient norm is computed over all shards (``clip_grad_norm``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import fsdp
from torch.distributed.tensor import DTensor

from ...state import AcceleratorState
from ...utils._protocols import AcceleratorLike
from .fsdp2 import (
    checkpoint_activations,
    fsdp2_canonicalize_names,
    fsdp2_prepare_auto_wrap_policy,
    fsdp2_prepare_model,
)
from .plugin import FullyShardedDataParallelPlugin

__all__ = ["clip_grad_norm", "prepare_fsdp", "remap_optimizer_params"]

logger = logging.getLogger(__name__)


def prepare_fsdp(accelerator: AcceleratorLike, model: torch.nn.Module) -> torch.nn.Module:
    """Return ``model`` sharded with the FSDP version the Accelerator's plugin names."""
    plugin = accelerator.state.fsdp_plugin
    if plugin.fsdp_version == 2:
        return fsdp2_prepare_model(accelerator, model)
    return _wrap_fsdp1(model, accelerator.state, plugin)


def _wrap_fsdp1(
    model: torch.nn.Module, state: AcceleratorState, plugin: FullyShardedDataParallelPlugin
) -> torch.nn.Module:
    if isinstance(model, fsdp.FullyShardedDataParallel):
        return model
    selects = fsdp2_prepare_auto_wrap_policy(plugin, model) if plugin.activation_checkpointing else None
    plugin.set_auto_wrap_policy(model)  # a policy name becomes the callable FSDP1 needs
    kwargs = {k: v for k, v in plugin.to_fsdp_kwargs().items() if v is not None}
    ignored = plugin.ignored_module_list(model)
    if ignored:
        kwargs["ignored_modules"] = ignored
    kwargs["device_id"] = state.device
    if state.device.type == "cpu" and kwargs.get("sync_module_states"):
        # FSDP1's own sync broadcasts from GPU memory only; on CPU (gloo) broadcast rank 0's weights first,
        # after giving ranks that hold a meta model (cpu_ram_efficient_loading) real, empty storage.
        if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
            if plugin.param_init_fn is not None:
                model.apply(plugin.param_init_fn)
            else:
                model.to_empty(device=state.device)
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(tensor.data, src=0)
        kwargs["sync_module_states"] = False
    wrapped = fsdp.FullyShardedDataParallel(model, **kwargs)
    if plugin.activation_checkpointing:
        checkpoint_activations(wrapped, plugin, selects)
    return wrapped


def remap_optimizer_params(optimizers: list[Any], old_names: dict[int, str], model: torch.nn.Module) -> None:
    """Return nothing; point optimizers built on the unwrapped model at the sharded model's parameters.

    Parameters are matched by name. FSDP1 without ``use_orig_params`` exposes one flat parameter per
    wrapped unit instead, which only an optimizer with a single parameter group can follow.
    """
    new_by_name = fsdp2_canonicalize_names(dict(model.named_parameters()))
    flat = any(name.endswith("_flat_param") for name in new_by_name)
    for opt in optimizers:
        inner = getattr(opt, "optimizer", opt)
        if not any(id(p) in old_names for group in inner.param_groups for p in group["params"]):
            continue  # this optimizer belongs to another model
        if flat:
            if len(inner.param_groups) != 1:
                raise ValueError(
                    "FSDP1 with use_orig_params=False flattens the parameters, so an optimizer with "
                    f"{len(inner.param_groups)} parameter groups cannot follow them: set "
                    "FullyShardedDataParallelPlugin(use_orig_params=True), or use one parameter group"
                )
            inner.param_groups[0]["params"] = list(model.parameters())
            continue
        for group in inner.param_groups:
            group["params"] = [new_by_name.get(old_names.get(id(p), ""), p) for p in group["params"]]
    _forget_stale_state(optimizers)


def _forget_stale_state(optimizers: list[Any]) -> None:
    # State keyed by the old parameter objects would never be used again (and would keep them alive).
    for opt in optimizers:
        inner = getattr(opt, "optimizer", opt)
        live = {id(p) for group in inner.param_groups for p in group["params"]}
        for param in [p for p in inner.state if id(p) not in live]:
            del inner.state[param]


def clip_grad_norm(
    models: list[torch.nn.Module], parameters: list[torch.Tensor], max_norm: float, norm_type: float
) -> torch.Tensor:
    """Return the total gradient norm over all shards of ``parameters`` after clipping them to ``max_norm``."""
    wanted = {id(p) for p in parameters}
    for model in models:
        if isinstance(model, fsdp.FullyShardedDataParallel) and wanted <= {id(p) for p in model.parameters()}:
            return model.clip_grad_norm_(max_norm, norm_type)
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
    if isinstance(total, DTensor):
        total = total.full_tensor()  # the norm of each rank's shard combined into the global norm
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total
