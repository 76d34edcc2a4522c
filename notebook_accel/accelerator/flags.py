"""Resolve the Accelerator's constructor flags into configuration objects, in one place.

Each helper takes what the user passed (plus the documented ``ACCELERATE_*`` environment
variables) and returns the object the Accelerator keeps, or raises with the bad value named.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._lazy import LazyModule
from ..utils.configs import DataLoaderConfiguration, ProjectConfiguration
from ..utils.enums import PrecisionType, check_mixed_precision
from ..utils.environment import parse_flag_from_env
from ..utils.plugins import GradientAccumulationPlugin, TorchDynamoPlugin

if TYPE_CHECKING:
    from ..integrations.deepspeed.plugin import DeepSpeedPlugin
    from ..integrations.fsdp.plugin import FullyShardedDataParallelPlugin
    from ..integrations.megatron.plugin import MegatronLMPlugin
    from ..parallelism_config import ParallelismConfig
    from ..utils.enums import DynamoBackend, RNGType
    from ..utils.kwargs import KwargsHandler
    from ..utils.plugins import TorchTensorParallelPlugin

__all__ = ["AcceleratorFlags", "resolve_flags"]

# The engines' plugins load when a flag or an environment variable asks for their engine.
_deepspeed = LazyModule("notebook_accel.integrations.deepspeed.plugin")
_fsdp = LazyModule("notebook_accel.integrations.fsdp.plugin")
_megatron = LazyModule("notebook_accel.integrations.megatron.plugin")
_recipes = LazyModule("notebook_accel.integrations.fp8.recipes")
# The kwargs handlers load when the user passes one (the plugins share only their base class).
kw = LazyModule("notebook_accel.utils.kwargs")


class _FromDataLoaderConfig:
    """Default of ``split_batches``: take the value from ``dataloader_config``."""

    def __repr__(self) -> str:
        return "<from dataloader_config>"


# The default of Accelerator(split_batches=...): tells "not given" from an explicit False.
SPLIT_BATCHES_UNSET: Any = _FromDataLoaderConfig()


@dataclasses.dataclass(frozen=True)
class AcceleratorFlags:
    """What the user asked ``Accelerator(...)`` for, checked and resolved once (environment included).

    Built by :func:`resolve_flags`; the Accelerator and the objects it builds read this instead of
    the raw arguments or ``os.environ``. The configuration objects inside stay the user's own
    (``project_config.iteration`` advances as checkpoints are written).
    """

    project_config: ProjectConfiguration
    dataloader_config: DataLoaderConfiguration
    handlers: Mapping[str, Any]
    """The kwargs handlers by slot: "ddp", "scaler", "init", "autocast", "fp8", "profile"."""
    mixed_precision: PrecisionType | None
    """The checked mode (a PrecisionType: below here nothing checks it again), or None to take the
    process state's (``ACCELERATE_MIXED_PRECISION``)."""
    cpu: bool
    device_placement: bool
    deepspeed_plugin: DeepSpeedPlugin | dict[str, DeepSpeedPlugin] | None
    fsdp_plugin: FullyShardedDataParallelPlugin | None
    torch_tp_plugin: TorchTensorParallelPlugin | None
    megatron_lm_plugin: MegatronLMPlugin | None
    parallelism_config: ParallelismConfig | None
    dynamo_plugin: TorchDynamoPlugin | None
    accumulation_plugin: GradientAccumulationPlugin
    rng_types: tuple[str, ...]
    step_scheduler_with_optimizer: bool
    log_with: Any

    def handler(self, slot: str) -> Any:
        """Return the kwargs handler of ``slot`` ("ddp", "scaler", ...), or None when none was given."""
        return self.handlers.get(slot)

    def init_kwargs(self) -> dict[str, Any]:
        """Return the ``init_process_group`` keyword arguments from InitProcessGroupKwargs (empty without one)."""
        handler = self.handler("init")
        return handler.to_kwargs() if handler is not None else {}


def resolve_flags(
    *,
    device_placement: bool,
    split_batches: bool | _FromDataLoaderConfig,
    mixed_precision: PrecisionType | str | None,
    gradient_accumulation_steps: int,
    cpu: bool,
    dataloader_config: DataLoaderConfiguration | None,
    deepspeed_plugin: DeepSpeedPlugin | dict[str, DeepSpeedPlugin] | None,
    fsdp_plugin: FullyShardedDataParallelPlugin | None,
    torch_tp_plugin: TorchTensorParallelPlugin | None,
    megatron_lm_plugin: MegatronLMPlugin | None,
    rng_types: list[str | RNGType] | None,
    log_with: Any,
    project_dir: str | os.PathLike | None,
    project_config: ProjectConfiguration | None,
    gradient_accumulation_plugin: GradientAccumulationPlugin | None,
    step_scheduler_with_optimizer: bool,
    kwargs_handlers: list[KwargsHandler] | None,
    dynamo_backend: DynamoBackend | str | None,
    dynamo_plugin: TorchDynamoPlugin | None,
    deepspeed_plugins: DeepSpeedPlugin | dict[str, DeepSpeedPlugin] | None,
    parallelism_config: ParallelismConfig | None,
) -> AcceleratorFlags:
    """Return the Accelerator's arguments checked and resolved into one frozen :class:`AcceleratorFlags`."""
    return AcceleratorFlags(
        project_config=project_configuration(project_dir, project_config),
        dataloader_config=dataloader_configuration(dataloader_config, split_batches),
        handlers=sort_kwargs_handlers(kwargs_handlers),
        mixed_precision=None
        if mixed_precision is None
        else PrecisionType(check_mixed_precision(mixed_precision)),
        cpu=cpu,
        device_placement=device_placement,
        deepspeed_plugin=resolve_deepspeed_plugin(deepspeed_plugin, deepspeed_plugins),
        fsdp_plugin=resolve_fsdp_plugin(fsdp_plugin),
        torch_tp_plugin=torch_tp_plugin,
        megatron_lm_plugin=resolve_megatron_lm_plugin(megatron_lm_plugin),
        parallelism_config=parallelism_config,
        dynamo_plugin=resolve_dynamo_plugin(dynamo_backend, dynamo_plugin),
        accumulation_plugin=accumulation_plugin(gradient_accumulation_plugin, gradient_accumulation_steps),
        rng_types=("generator",)
        if rng_types is None
        else tuple(str(getattr(r, "value", r)) for r in rng_types),
        step_scheduler_with_optimizer=step_scheduler_with_optimizer,
        log_with=log_with,
    )


def project_configuration(
    project_dir: str | os.PathLike | None, project_config: ProjectConfiguration | None
) -> ProjectConfiguration:
    """Return the ProjectConfiguration, with ``project_dir`` applied when given."""
    if project_config is None:
        project_config = ProjectConfiguration(
            project_dir=os.fspath(project_dir) if project_dir is not None else None
        )
    elif not isinstance(project_config, ProjectConfiguration):
        raise TypeError(f"project_config must be a ProjectConfiguration, got {type(project_config).__name__}")
    elif project_dir is not None:
        project_config.set_directories(os.fspath(project_dir))
    return project_config


def dataloader_configuration(
    dataloader_config: DataLoaderConfiguration | None, split_batches: bool | _FromDataLoaderConfig
) -> DataLoaderConfiguration:
    """Return the DataLoaderConfiguration, honouring the ``split_batches`` shortcut."""
    given = split_batches is not SPLIT_BATCHES_UNSET
    if dataloader_config is None:
        dataloader_config = DataLoaderConfiguration()
    elif not isinstance(dataloader_config, DataLoaderConfiguration):
        raise TypeError(
            f"dataloader_config must be a DataLoaderConfiguration, got {type(dataloader_config).__name__}"
        )
    elif given:
        raise ValueError(
            f"split_batches={split_batches!r} and dataloader_config were both given: set "
            "DataLoaderConfiguration(split_batches=...) only"
        )
    if given:
        if not isinstance(split_batches, bool):
            raise TypeError(f"split_batches must be a bool, got {split_batches!r}")
        dataloader_config.split_batches = split_batches
    return dataloader_config


_HANDLER_SLOTS = {
    "DistributedDataParallelKwargs": "ddp",
    "GradScalerKwargs": "scaler",
    "InitProcessGroupKwargs": "init",
    "AutocastKwargs": "autocast",
    "ProfileKwargs": "profile",
    # the fp8 recipes (integrations/fp8/recipes.py) load only if no plain handler matched
    "FP8RecipeKwargs": "fp8",
    "TERecipeKwargs": "fp8",
    "MSAMPRecipeKwargs": "fp8",
    "AORecipeKwargs": "fp8",
}


def sort_kwargs_handlers(kwargs_handlers: list[Any] | None) -> dict[str, Any]:
    """Return ``{"ddp"|"scaler"|"init"|"autocast"|"fp8": handler}``; one handler of each kind at most."""
    out: dict[str, Any] = {}
    for handler in kwargs_handlers or []:
        slot = None
        for name, key in _HANDLER_SLOTS.items():
            if isinstance(handler, getattr(_recipes if name.endswith("RecipeKwargs") else kw, name)):
                slot = key
        if slot is None:
            raise TypeError(
                f"kwargs_handlers accepts {sorted(_HANDLER_SLOTS)} instances, got {type(handler).__name__}"
            )
        if slot in out:
            raise ValueError(
                f"kwargs_handlers holds two {type(handler).__name__}: pass only one of each kind"
            )
        out[slot] = handler
    return out


def resolve_deepspeed_plugin(
    deepspeed_plugin: DeepSpeedPlugin | dict[str, DeepSpeedPlugin] | None,
    deepspeed_plugins: DeepSpeedPlugin | dict[str, DeepSpeedPlugin] | None,
) -> DeepSpeedPlugin | dict[str, DeepSpeedPlugin] | None:
    """Return the DeepSpeed plugin(s) from the argument(s) or ``ACCELERATE_USE_DEEPSPEED``."""
    if deepspeed_plugin is not None and deepspeed_plugins is not None:
        raise ValueError("pass deepspeed_plugin or deepspeed_plugins, not both")
    plugin = deepspeed_plugins if deepspeed_plugins is not None else deepspeed_plugin
    if plugin is None and parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        plugin = _deepspeed.DeepSpeedPlugin()
    if plugin is not None:  # one plugin or a dict of named ones: deepspeed is needed either way
        _deepspeed.DeepSpeedPlugin.require_deepspeed()
    return plugin


def resolve_fsdp_plugin(
    fsdp_plugin: FullyShardedDataParallelPlugin | None,
) -> FullyShardedDataParallelPlugin | None:
    """Return the FSDP plugin from the argument or ``ACCELERATE_USE_FSDP``."""
    if fsdp_plugin is None and parse_flag_from_env("ACCELERATE_USE_FSDP"):
        fsdp_plugin = _fsdp.FullyShardedDataParallelPlugin()
    if fsdp_plugin is not None and not isinstance(fsdp_plugin, _fsdp.FullyShardedDataParallelPlugin):
        raise TypeError(
            f"fsdp_plugin must be a FullyShardedDataParallelPlugin, got {type(fsdp_plugin).__name__}"
        )
    return fsdp_plugin


def resolve_megatron_lm_plugin(plugin: MegatronLMPlugin | None) -> MegatronLMPlugin | None:
    """Return the Megatron-LM plugin from the argument or ``ACCELERATE_USE_MEGATRON_LM`` (set by the launcher).

    As in 1.15, ``accelerate launch --use_megatron_lm`` (or a MEGATRON_LM config) runs the script, and its
    Accelerator is the one that needs megatron-core: ImportError naming it when it is missing.
    """
    if plugin is None and parse_flag_from_env("ACCELERATE_USE_MEGATRON_LM"):
        if not _megatron.is_megatron_lm_available():
            raise ImportError(
                "ACCELERATE_USE_MEGATRON_LM=true (set by `accelerate launch --use_megatron_lm` or a MEGATRON_LM "
                "config) trains with Megatron-LM: pip install megatron-core (NVIDIA GPUs), or launch without it."
            )
        plugin = _megatron.MegatronLMPlugin()
    return plugin


def resolve_dynamo_plugin(
    dynamo_backend: DynamoBackend | str | None, plugin: TorchDynamoPlugin | None
) -> TorchDynamoPlugin | None:
    """Return the TorchDynamoPlugin for ``dynamo_backend`` or ``plugin`` (None: from the environment)."""
    if dynamo_backend is not None and plugin is not None:
        raise ValueError("pass dynamo_backend or dynamo_plugin, not both")
    if dynamo_backend is not None:
        return TorchDynamoPlugin(backend=dynamo_backend)
    if plugin is not None and not isinstance(plugin, TorchDynamoPlugin):
        raise TypeError(f"dynamo_plugin must be a TorchDynamoPlugin, got {type(plugin).__name__}")
    return plugin


def check_accumulation_steps(steps: object) -> None:
    """Raise ValueError unless ``steps`` is an int >= 1 (a valid ``gradient_accumulation_steps``)."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be an int >= 1, got {steps!r}")


def accumulation_plugin(plugin: GradientAccumulationPlugin | None, steps: int) -> GradientAccumulationPlugin:
    """Return the GradientAccumulationPlugin from the plugin or ``gradient_accumulation_steps``."""
    if plugin is not None:
        if steps != 1:
            raise ValueError(
                f"gradient_accumulation_steps={steps} and gradient_accumulation_plugin were both given: "
                "set GradientAccumulationPlugin(num_steps=...) only"
            )
        if plugin.num_steps is None:
            plugin.num_steps = 1
        return plugin
    check_accumulation_steps(steps)
    env = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if steps == 1 and env:
        steps = int(env)
    return GradientAccumulationPlugin(num_steps=steps)
