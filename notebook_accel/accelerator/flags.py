"""Resolve the Accelerator's constructor flags into configuration objects, in one place.

Each helper takes what the user passed (plus the documented ``ACCELERATE_*`` environment
variables) and returns the object the Accelerator keeps, or raises with the bad value named.
"""

from __future__ import annotations

import os
from typing import Any

__all__: list[str] = []


def project_configuration(project_dir: Any, project_config: Any) -> Any:
    """Return the ProjectConfiguration, with ``project_dir`` applied when given."""
    from ..utils.configs import ProjectConfiguration

    if project_config is None:
        project_config = ProjectConfiguration(
            project_dir=os.fspath(project_dir) if project_dir is not None else None
        )
    elif not isinstance(project_config, ProjectConfiguration):
        raise TypeError(f"project_config must be a ProjectConfiguration, got {type(project_config).__name__}")
    elif project_dir is not None:
        project_config.set_directories(os.fspath(project_dir))
    return project_config


def dataloader_configuration(dataloader_config: Any, split_batches: Any) -> Any:
    """Return the DataLoaderConfiguration, honouring the ``split_batches`` shortcut."""
    from ..utils.configs import DataLoaderConfiguration
    from .core import _split_batches

    given = split_batches is not _split_batches
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
    "FP8RecipeKwargs": "fp8",
    "ProfileKwargs": "profile",
}


def sort_kwargs_handlers(kwargs_handlers: list[Any] | None) -> dict[str, Any]:
    """Return ``{"ddp"|"scaler"|"init"|"autocast"|"fp8": handler}``; one handler of each kind at most."""
    from ..utils import kwargs as kw

    out: dict[str, Any] = {}
    for handler in kwargs_handlers or []:
        slot = None
        for name, key in _HANDLER_SLOTS.items():
            if isinstance(handler, getattr(kw, name)):
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


def check_precision(mixed_precision: Any) -> str:
    """Return the mixed precision mode lower-cased, or raise ValueError listing the valid ones."""
    from ..utils.enums import PrecisionType

    value = str(getattr(mixed_precision, "value", mixed_precision)).lower()
    if value not in PrecisionType.list():
        raise ValueError(f"Unknown mixed_precision {mixed_precision!r}: choose one of {PrecisionType.list()}")
    return value


def deepspeed_plugin(deepspeed_plugin: Any, deepspeed_plugins: Any) -> Any:
    """Return the DeepSpeed plugin(s) from the argument(s) or ``ACCELERATE_USE_DEEPSPEED``."""
    from ..utils.environment import parse_flag_from_env
    from ..utils.plugins import DeepSpeedPlugin

    if deepspeed_plugin is not None and deepspeed_plugins is not None:
        raise ValueError("pass deepspeed_plugin or deepspeed_plugins, not both")
    plugin = deepspeed_plugins if deepspeed_plugins is not None else deepspeed_plugin
    if plugin is None and parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        plugin = DeepSpeedPlugin()
    if plugin is not None:  # one plugin or a dict of named ones: deepspeed is needed either way
        DeepSpeedPlugin.require_deepspeed()
    return plugin


def fsdp_plugin(fsdp_plugin: Any) -> Any:
    """Return the FSDP plugin from the argument or ``ACCELERATE_USE_FSDP``."""
    from ..utils.environment import parse_flag_from_env
    from ..utils.plugins import FullyShardedDataParallelPlugin

    if fsdp_plugin is None and parse_flag_from_env("ACCELERATE_USE_FSDP"):
        fsdp_plugin = FullyShardedDataParallelPlugin()
    if fsdp_plugin is not None and not isinstance(fsdp_plugin, FullyShardedDataParallelPlugin):
        raise TypeError(
            f"fsdp_plugin must be a FullyShardedDataParallelPlugin, got {type(fsdp_plugin).__name__}"
        )
    return fsdp_plugin


def dynamo_plugin(dynamo_backend: Any, plugin: Any) -> Any:
    """Return the TorchDynamoPlugin for ``dynamo_backend`` or ``plugin`` (None: from the environment)."""
    from ..utils.plugins import TorchDynamoPlugin

    if dynamo_backend is not None and plugin is not None:
        raise ValueError("pass dynamo_backend or dynamo_plugin, not both")
    if dynamo_backend is not None:
        return TorchDynamoPlugin(backend=dynamo_backend)
    if plugin is not None and not isinstance(plugin, TorchDynamoPlugin):
        raise TypeError(f"dynamo_plugin must be a TorchDynamoPlugin, got {type(plugin).__name__}")
    return plugin


def check_accumulation_steps(steps: Any) -> None:
    """Raise ValueError unless ``steps`` is an int >= 1 (a valid ``gradient_accumulation_steps``)."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be an int >= 1, got {steps!r}")


def accumulation_plugin(plugin: Any, steps: int) -> Any:
    """Return the GradientAccumulationPlugin from the plugin or ``gradient_accumulation_steps``."""
    from ..utils.plugins import GradientAccumulationPlugin

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
