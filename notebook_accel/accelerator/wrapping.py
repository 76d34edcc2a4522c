"""Model preparation for the Accelerator: DDP wrapping, torch.compile, DeepSpeed (autocast: ``.precision``).

Also the checks for the engines notebook_accel drives but does not ship (DeepSpeed, Megatron-LM,
FP8 engines): their plugins are validated here and a missing engine is named with its pip command.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from .._lazy import LazyModule
from ..state import AcceleratorState
from ..utils import imports
from ..utils._protocols import AcceleratorLike
from ..utils.enums import DistributedType

__all__: list[str] = []

# FSDP wrapping loads torch.distributed.fsdp: imported when a model is prepared for FSDP.
_fsdp = LazyModule("notebook_accel.integrations.fsdp.wrap")
_recurrent = LazyModule("notebook_accel.utils._sequence_parallel")
_recipes = LazyModule("notebook_accel.integrations.fp8.recipes")

logger = logging.getLogger(__name__)

_DATA_PARALLEL_TYPES = (
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_SDAA,
    DistributedType.MULTI_MUSA,
    DistributedType.MULTI_HPU,
    DistributedType.MULTI_XPU,
)


class _WrappingAccelerator(AcceleratorLike, Protocol):
    """The Accelerator as ``wrap_for_distributed_type`` reads it (the engine helpers' view and three more)."""

    @property
    def ddp_handler(self) -> Any:
        """The ``DistributedDataParallelKwargs`` given, or None."""

    @property
    def native_amp(self) -> bool:
        """Whether the mode runs under torch.autocast (fp16 / bf16)."""

    def data_parallel_world(self) -> tuple[int, int]:
        """The (size, rank) of this process's data-parallel group."""


def wrap_for_distributed_type(accelerator: _WrappingAccelerator, model: torch.nn.Module) -> torch.nn.Module:
    """Return ``model`` in the wrapper its Accelerator's distributed type trains with (unchanged if none).

    The one place the wrapper is chosen: DistributedDataParallel for the data-parallel types
    (when there is more than one data-parallel rank), FSDP (version 1 or 2, per the plugin) under
    FSDP. A new engine adds its branch here.
    """
    if accelerator.num_processes <= 1:
        return model
    distributed_type = accelerator.distributed_type
    if distributed_type in _DATA_PARALLEL_TYPES:
        if accelerator.data_parallel_world()[0] > 1:
            return wrap_ddp(model, accelerator.state, accelerator.ddp_handler)
        return model
    if distributed_type == DistributedType.FSDP:
        if accelerator.native_amp:  # keeps a policy the user set on the plugin
            accelerator.state.fsdp_plugin.set_mixed_precision(accelerator.mixed_precision)
        return _fsdp.prepare_fsdp(accelerator, model)
    return model


def wrap_ddp(model: torch.nn.Module, state: AcceleratorState, ddp_handler: Any) -> torch.nn.Module:
    """Return ``model`` in DistributedDataParallel (a model without trainable parameters unchanged)."""
    if not any(p.requires_grad for p in model.parameters()):
        return model
    kwargs = ddp_handler.to_kwargs() if ddp_handler is not None else {}
    if state.device.type == "cpu":
        ddp = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
    else:
        index = state.device.index if state.device.index is not None else state.local_process_index
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[index], output_device=index, **kwargs
        )
    if ddp_handler is not None:
        ddp_handler.register_comm_hook(ddp)
    return ddp


def compile_model(model: torch.nn.Module, dynamo_plugin: Any) -> torch.nn.Module:
    """Return ``torch.compile(model, ...)`` per the TorchDynamoPlugin (regional compilation honoured)."""
    kwargs = dynamo_plugin.to_kwargs()
    if getattr(dynamo_plugin, "use_regional_compilation", False):
        return _compile_regions(model, kwargs)
    return torch.compile(model, **kwargs)


def _compile_regions(model: torch.nn.Module, kwargs: dict[str, Any]) -> torch.nn.Module:
    # Compile each block of the first ModuleList (the repeated layers) once, leave the rest eager.
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            for i, block in enumerate(module):
                module[i] = torch.compile(block, **kwargs)
            return model
    return torch.compile(model, **kwargs)


def check_engines(
    state: AcceleratorState, megatron_lm_plugin: Any, mixed_precision: str, fp8_handler: Any
) -> None:
    """Raise ImportError naming the engine a plugin or precision needs when it is not installed."""
    if state.distributed_type == DistributedType.DEEPSPEED and not imports.is_deepspeed_available():
        raise ImportError("Accelerator(deepspeed_plugin=...) requires `deepspeed`: pip install deepspeed")
    if (
        state.distributed_type == DistributedType.DEEPSPEED
        and state.device.type == "cpu"
        and not imports.is_package_available("oneccl_bindings_for_pytorch")
    ):
        # Measured: deepspeed 0.19.8's ZeRO-1/2 step on 2 CPU processes without oneCCL never finishes.
        raise RuntimeError(
            "DeepSpeed on CPU processes needs Intel's oneCCL bindings (pip install oneccl_bind_pt); without "
            "them its ZeRO step hangs. Run DeepSpeed on CUDA GPUs, or shard on CPU with FSDP2: "
            "Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=N)) (like ZeRO-3) or "
            "FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=False) (like ZeRO-2)"
        )
    if megatron_lm_plugin is not None and not imports.is_megatron_lm_available():
        raise ImportError(
            "Accelerator(megatron_lm_plugin=...) requires `megatron-core`: pip install megatron-core"
        )
    if mixed_precision == "fp8":
        if fp8_handler is None:
            # 1.15's default FP8 engine is TransformerEngine (FP8RecipeKwargs is deprecated).
            fp8_handler = _recipes.TERecipeKwargs()
        fp8_handler.check_engine()


def prepare_deepspeed(model: Any, optimizer: Any, scheduler: Any, plugin: Any, state: Any) -> tuple:
    """Return ``deepspeed.initialize``'s engine, optimizer and scheduler for the prepared objects."""
    if model is None:
        raise ValueError("With DeepSpeed, prepare() needs the model in the same call as its optimizer")
    parallelism = getattr(state, "parallelism_config", None)
    if parallelism is not None and parallelism.sp_enabled:
        _recurrent._refuse_recurrent_layers_under_sequence_parallelism(model)
    import deepspeed

    config = dict(plugin.deepspeed_config)
    engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config_params=config
    )
    return engine, ds_optimizer, ds_scheduler
