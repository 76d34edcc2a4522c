"""FSDP2 (``torch.distributed.fsdp.fully_shard``) preparation: which modules to shard, activation checkpointing,
loading a full state dict into sharded parameters, optimizer re-pointing.

FSDP2 shards each parameter in place as a ``DTensor`` over a device mesh instead of wrapping the model
in a flat-parameter module, so a model keeps its class, names and ``forward``; only the parameter
objects change, which is why an optimizer built before sharding must be pointed at the new ones.
The functions take the ``Accelerator`` as a plain object (``state.fsdp_plugin``, ``torch_device_mesh``,
``device``, ``parallelism_config``), so this module stays below the accelerator in the layering.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ...utils._protocols import AcceleratorLike
from ...utils.other import get_module_children_bottom_up

__all__ = [
    "fsdp2_apply_ac",
    "fsdp2_canonicalize_names",
    "fsdp2_load_full_state_dict",
    "fsdp2_prepare_auto_wrap_policy",
    "fsdp2_prepare_model",
    "ensure_weights_retied",
    "fsdp2_switch_optimizer_parameters",
    "get_fsdp2_grad_scaler",
    "get_module_children_bottom_up",
    "get_parameters_from_modules",
]

logger = logging.getLogger(__name__)

# Prefixes that wrappers insert into parameter names; the user's model never has them.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def ensure_weights_retied(
    param_init_fn: Callable[[torch.nn.Module], None], model: torch.nn.Module, device: torch.device
) -> Callable[[torch.nn.Module], None]:
    """Return ``param_init_fn`` wrapped so that weights tied in ``model`` are tied again after it runs.

    Materialising a module created on the meta device (``to_empty`` + init) gives each parameter its own
    storage, which silently unties shared weights (e.g. input and output embeddings); the wrapper points
    every alias back at the first owner.

    Args:
        param_init_fn: The function that materialises a module's parameters.
        model: The model whose tied weights must stay tied.
        device: The device the weights are materialised on.
    """
    owners: dict[int, tuple[torch.nn.Module, str]] = {}
    aliases: dict[torch.nn.Module, list[tuple[str, torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in owners:
                owner, owner_name = owners[id(param)]
                aliases.setdefault(module, []).append((name, owner, owner_name))
            else:
                owners[id(param)] = (module, name)
    if not aliases:
        return param_init_fn

    def init_and_retie(module: torch.nn.Module) -> Any:
        result = (
            param_init_fn(module)
            if param_init_fn is not None
            else module.to_empty(device=device, recurse=False)
        )
        for name, owner, owner_name in aliases.get(module, []):
            setattr(module, name, getattr(owner, owner_name))
        return result

    return init_and_retie


def fsdp2_prepare_auto_wrap_policy(
    fsdp2_plugin: Any, model: torch.nn.Module
) -> Callable[[torch.nn.Module], bool] | None:
    """Return a predicate telling which submodules get their own ``fully_shard`` (None: only the root)."""
    policy = fsdp2_plugin.auto_wrap_policy
    if policy == "TRANSFORMER_BASED_WRAP":
        classes = tuple(fsdp2_plugin.layer_classes(model))
        return lambda module: isinstance(module, classes)
    if policy == "SIZE_BASED_WRAP":
        threshold = fsdp2_plugin.min_num_params
        return lambda module: sum(p.numel() for p in module.parameters()) > threshold
    if policy in (None, "NO_WRAP"):
        return None
    if isinstance(policy, functools.partial) or callable(policy):
        # A torch FSDP1 policy (module, recurse, nonwrapped_numel) -> bool, asked about this module alone.
        return lambda module: bool(
            policy(module=module, recurse=False, nonwrapped_numel=sum(p.numel() for p in module.parameters()))
        )
    raise TypeError(f"FullyShardedDataParallelPlugin: unusable auto_wrap_policy {policy!r}")


def get_parameters_from_modules(
    modules: Iterable[torch.nn.Module] | str | None, model: torch.nn.Module, device: torch.device
) -> set[torch.nn.Parameter]:
    """Return the parameters of ``modules`` (or of the modules of ``model`` whose name fullmatches the regex)."""
    if modules is None:
        return set()
    if isinstance(modules, str):
        pattern = re.compile(modules)
        modules = [module for name, module in model.named_modules() if pattern.fullmatch(name)]
    params: set[torch.nn.Parameter] = set()
    for module in modules:
        params.update(module.parameters())
    return params


def fsdp2_apply_ac(accelerator: AcceleratorLike, model: torch.nn.Module) -> torch.nn.Module:
    """Return ``model`` with activation checkpointing on the layers its auto-wrap policy selects."""
    plugin = accelerator.state.fsdp_plugin
    selects = fsdp2_prepare_auto_wrap_policy(plugin, model)
    return checkpoint_activations(model, plugin, selects)


def checkpoint_activations(model: torch.nn.Module, plugin: Any, selects: Callable | None) -> torch.nn.Module:
    """Return ``model`` with the layers ``selects`` picks wrapped for activation checkpointing (FSDP 1 or 2).

    The plugin's ``activation_checkpointing_offload`` keeps the saved activations on the CPU instead of
    recomputing them; without a layer selection (no transformer-based wrap policy) there is nothing to wrap.
    """
    if selects is None:
        raise ValueError(
            "FullyShardedDataParallelPlugin: activation_checkpointing needs to know the layers to recompute; "
            "set auto_wrap_policy='transformer_based_wrap' with transformer_cls_names_to_wrap"
        )
    if plugin.activation_checkpointing_offload:
        wrapper = offload_wrapper
    else:
        wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=selects)
    return model


def fsdp2_canonicalize_names(named_params: dict[str, Any]) -> dict[str, Any]:
    """Return ``named_params`` with wrapper prefixes (checkpoint, compile, FSDP1) removed from the names."""
    clean = {}
    for name, value in named_params.items():
        for prefix in _WRAPPER_PREFIXES:
            name = name.replace(prefix, "")
        clean[name] = value
    return clean


def fsdp2_switch_optimizer_parameters(
    optimizer: torch.optim.Optimizer, mapping: dict[int, torch.nn.Parameter]
) -> None:
    """Return nothing; replace each parameter ``p`` of ``optimizer`` by ``mapping[id(p)]`` (all must be mapped)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    for group in inner.param_groups:
        missing = [i for i, p in enumerate(group["params"]) if id(p) not in mapping]
        if missing:
            raise KeyError(
                f"fsdp2_switch_optimizer_parameters: {len(missing)} optimizer parameter(s) have no sharded "
                "counterpart; build the optimizer from the model passed to prepare() (same call or before it)"
            )
        group["params"] = [mapping[id(p)] for p in group["params"]]


def get_fsdp2_grad_scaler(**kwargs: Any) -> torch.amp.GradScaler:
    """Return a ``torch.amp.GradScaler`` (it handles FSDP2's DTensor gradients as they are)."""
    return torch.amp.GradScaler(**kwargs)


def fsdp2_load_full_state_dict(
    accelerator: AcceleratorLike,
    model: torch.nn.Module,
    full_sd: dict[str, torch.Tensor],
    cpu_offload: bool = False,
) -> Any:
    """Return torch's load result after putting rank 0's full ``full_sd`` into the sharded ``model`` (broadcast).

    Args:
        accelerator: The Accelerator (any object with its ``state`` and ``device``).
        model: The FSDP2-sharded model.
        full_sd: The full state dict; only rank 0's is read.
        cpu_offload: The model's shards live on the CPU.
    """
    options = StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, cpu_offload=cpu_offload, strict=True
    )
    return set_model_state_dict(model, full_sd if dist.get_rank() == 0 else {}, options=options)


def _fsdp_mesh(accelerator: AcceleratorLike) -> Any:
    mesh = getattr(accelerator, "torch_device_mesh", None)
    config = getattr(accelerator, "parallelism_config", None)
    if mesh is not None and config is not None:
        return mesh[tuple(config.fsdp_dim_names)]
    if mesh is not None:
        return mesh
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(accelerator.device.type, (dist.get_world_size(),), mesh_dim_names=("dp_shard",))


def fsdp2_prepare_model(accelerator: AcceleratorLike, model: torch.nn.Module) -> torch.nn.Module:
    """Return ``model`` sharded with ``fully_shard`` as the Accelerator's FSDP2 plugin says (same object, sharded).

    Layers the auto-wrap policy selects are sharded first (each gathers its weights only while it runs),
    then the root. With ``cpu_ram_efficient_loading`` only rank 0's weights count: they are broadcast
    into the shards afterwards (other ranks may hold empty or meta weights).
    """
    if isinstance(model, FSDPModule):
        return model
    plugin = accelerator.state.fsdp_plugin
    full_sd = None
    if plugin.cpu_ram_efficient_loading:
        full_sd = model.state_dict() if dist.get_rank() == 0 else {}
    if plugin.activation_checkpointing:
        fsdp2_apply_ac(accelerator, model)
    kwargs = {
        "mesh": _fsdp_mesh(accelerator),
        # True is torch's "auto" (None): every sharded layer frees its gathered weights after forward,
        # except the root, whose weights backward needs at once; freeing them costs one all-gather a step.
        "reshard_after_forward": None
        if plugin.reshard_after_forward is True
        else plugin.reshard_after_forward,
        "offload_policy": plugin.cpu_offload,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        "ignored_params": get_parameters_from_modules(plugin.ignored_modules, model, accelerator.device)
        or None,
    }
    selects = fsdp2_prepare_auto_wrap_policy(plugin, model)
    if selects is not None:
        for module in get_module_children_bottom_up(model)[:-1]:
            if selects(module) and not isinstance(module, FSDPModule):
                fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=accelerator.device)
    if full_sd is not None:
        fsdp2_load_full_state_dict(accelerator, model, full_sd, cpu_offload=plugin.cpu_offload_enabled)
    return model
