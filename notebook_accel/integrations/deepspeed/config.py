"""``accelerate.utils.deepspeed``: DeepSpeed's config object and the placeholders a DeepSpeed config stands behind.

``HfDeepSpeedConfig`` parses and queries a DeepSpeed config (dict, JSON file or base64 JSON) without
DeepSpeed installed; transformers subclasses it. ``DummyOptim`` / ``DummyScheduler`` stand in for the
optimizer and scheduler that the DeepSpeed config itself defines. Building DeepSpeed's optimizers
(``map_pytorch_optim_to_deepspeed``) needs ``pip install deepspeed`` and a CUDA machine.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from copy import deepcopy
from typing import Any

import torch

from ..._lazy import attach
from ...utils.enums import DistributedType
from ...utils.package_checks import is_bnb_available
from ...utils.versions import compare_versions

# The engine/optimizer/scheduler wrappers extend the training-layer wrappers, which utils may not
# import; the lazy table serves them at this path (as the package facades do).
_LAZY = {
    "AcceleratedOptimizer": "notebook_accel.optimizer",
    "AcceleratedScheduler": "notebook_accel.scheduler",
    "DeepSpeedEngineWrapper": "notebook_accel.integrations.deepspeed.engine",
    "DeepSpeedOptimizerWrapper": "notebook_accel.integrations.deepspeed.engine",
    "DeepSpeedSchedulerWrapper": "notebook_accel.integrations.deepspeed.engine",
}
__getattr__, __dir__ = attach(__name__, _LAZY)

__all__ = sorted(_LAZY) + [
    "DistributedType",
    "DummyOptim",
    "DummyScheduler",
    "HfDeepSpeedConfig",
    "compare_versions",
    "deepcopy",
    "get_active_deepspeed_plugin",
    "is_bnb_available",
    "map_pytorch_optim_to_deepspeed",
]

_ZERO_STAGES = (0, 1, 2, 3, "auto")
_OFFLOAD_TARGETS = {"cpu", "nvme"}


def _read_config(config_file_or_dict: Any) -> dict:
    """Return the config dict from a dict (copied), a JSON file path or a base64-encoded JSON string."""
    if isinstance(config_file_or_dict, dict):
        return deepcopy(config_file_or_dict)  # the caller's dict must not change when we fill values
    if isinstance(config_file_or_dict, os.PathLike):
        config_file_or_dict = os.fspath(config_file_or_dict)
    if not isinstance(config_file_or_dict, str):
        raise TypeError(
            f"HfDeepSpeedConfig takes a dict, a path to a JSON file or a base64-encoded JSON string, not "
            f"{type(config_file_or_dict).__name__} {config_file_or_dict!r}."
        )
    if os.path.isfile(config_file_or_dict):
        with open(config_file_or_dict, encoding="utf-8") as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"The DeepSpeed config {config_file_or_dict} is not valid JSON: {err}"
                ) from None
    else:
        try:
            config = json.loads(base64.urlsafe_b64decode(config_file_or_dict).decode("utf-8"))
        except (binascii.Error, UnicodeDecodeError, ValueError):
            raise ValueError(
                "Expected a string path to an existing deepspeed config, or a dictionary, or a base64 encoded "
                f"string. Received: {config_file_or_dict}"
            ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"The DeepSpeed config must be a JSON object, got {type(config).__name__}: {config!r}"
        )
    return config


def config_node(config: dict, ds_key_long: str) -> tuple[dict | None, str]:
    """Return ``(parent dict, leaf key)`` for the dotted ``ds_key_long`` in ``config``; None when a parent is missing."""
    node: Any = config
    *parents, leaf = ds_key_long.split(".")
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return None, leaf
    return (node if isinstance(node, dict) else None), leaf


class HfDeepSpeedConfig:
    """A DeepSpeed config with the queries libraries ask of it (ZeRO stage, offload, dotted-key values).

    Args:
        config_file_or_dict: the config as a dict, a path to a JSON file, or a base64-encoded JSON string.
    """

    def __init__(self, config_file_or_dict) -> None:
        self.config = _read_config(config_file_or_dict)
        self.set_stage_and_offload()

    def set_stage_and_offload(self) -> None:
        """Return None after reading the ZeRO stage (-1 when unset) and whether anything is offloaded."""
        self._stage = self.get_value("zero_optimization.stage", -1)
        if self._stage not in _ZERO_STAGES and self._stage != -1:
            raise ValueError(
                f"zero_optimization.stage={self._stage!r} is not a ZeRO stage: use 0, 1, 2, 3 or 'auto'."
            )
        self._offload = False
        if self.is_zero2() or self.is_zero3():
            devices = {
                self.get_value("zero_optimization.offload_optimizer.device"),
                self.get_value("zero_optimization.offload_param.device"),
            }
            self._offload = bool(devices & _OFFLOAD_TARGETS)

    def find_config_node(self, ds_key_long):
        """Return ``(parent dict, leaf key)`` for the dotted ``ds_key_long``; the dict is None when a parent is missing."""
        return config_node(self.config, ds_key_long)

    def get_value(self, ds_key_long, default=None):
        """Return the value at the dotted key ``ds_key_long`` (e.g. "zero_optimization.stage"), or ``default``."""
        node, leaf = self.find_config_node(ds_key_long)
        return default if node is None else node.get(leaf, default)

    def del_config_sub_tree(self, ds_key_long, must_exist=False):
        """Return None after deleting the entry at ``ds_key_long``; raise ValueError if missing and ``must_exist``."""
        node, leaf = self.find_config_node(ds_key_long)
        if node is None or leaf not in node:
            if must_exist:
                raise ValueError(f"Can't find {ds_key_long} entry in the config: {self.config}")
            return
        del node[leaf]

    def is_true(self, ds_key_long):
        """Return whether the value at ``ds_key_long`` is set and truthy (False when absent)."""
        value = self.get_value(ds_key_long)
        return False if value is None else bool(value)

    def is_false(self, ds_key_long):
        """Return whether the value at ``ds_key_long`` is set and falsy (False when absent)."""
        value = self.get_value(ds_key_long)
        return False if value is None else not bool(value)

    def is_zero2(self):
        """Return whether the config uses ZeRO stage 2."""
        return self._stage == 2

    def is_zero3(self):
        """Return whether the config uses ZeRO stage 3."""
        return self._stage == 3

    def is_offload(self):
        """Return whether ZeRO 2/3 offloads the optimizer state or the parameters to CPU or NVMe."""
        return self._offload


class DummyOptim:
    """Stands for the optimizer defined in the DeepSpeed config (``"optimizer"`` section) when preparing.

    Args:
        params: the model parameters (or parameter groups) the DeepSpeed optimizer will own.
        lr: learning rate, filled into an ``"auto"`` value of the config.
        weight_decay: weight decay, filled into an ``"auto"`` value of the config.
        **kwargs: other optimizer arguments.
    """

    def __init__(self, params, lr=0.001, weight_decay=0, **kwargs) -> None:
        self.params = params
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs


class DummyScheduler:
    """Stands for the scheduler defined in the DeepSpeed config (``"scheduler"`` section), or built by a callable.

    Args:
        optimizer: the ``DummyOptim`` (or optimizer) it schedules.
        total_num_steps: total training steps, filled into an ``"auto"`` value of the config.
        warmup_num_steps: warm-up steps, filled into an ``"auto"`` value of the config.
        lr_scheduler_callable: a function ``optimizer -> scheduler`` used instead of the config's scheduler.
        **kwargs: other scheduler arguments.
    """

    def __init__(
        self, optimizer, total_num_steps=None, warmup_num_steps=0, lr_scheduler_callable=None, **kwargs
    ):
        if lr_scheduler_callable is not None and not callable(lr_scheduler_callable):
            raise TypeError(
                f"lr_scheduler_callable must be a function optimizer -> scheduler, not {lr_scheduler_callable!r}."
            )
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs


def map_pytorch_optim_to_deepspeed(optimizer):
    """Return DeepSpeed's CPU optimizer equivalent to the torch ``optimizer`` (Adam, AdamW or Adagrad).

    Needs DeepSpeed (``pip install deepspeed``); ZeRO offload runs its optimizer step on the CPU with
    these kernels.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"map_pytorch_optim_to_deepspeed takes a torch optimizer, not {type(optimizer).__name__}."
        )
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)):
        raise ValueError(
            f"{type(optimizer).__name__} has no DeepSpeed CPU equivalent: use torch.optim.Adam, AdamW or Adagrad, "
            "or define the optimizer in the DeepSpeed config and pass a DummyOptim."
        )
    try:
        import deepspeed.ops.adagrad
        import deepspeed.ops.adam
    except ImportError as err:
        raise ImportError(
            "map_pytorch_optim_to_deepspeed builds DeepSpeed's own optimizer kernels: `pip install deepspeed` "
            "(DeepSpeed runs on CUDA machines)."
        ) from err
    defaults = {k: v for k, v in optimizer.defaults.items() if k in ("lr", "weight_decay")}
    if isinstance(optimizer, torch.optim.Adagrad):
        return deepspeed.ops.adagrad.DeepSpeedCPUAdagrad(optimizer.param_groups, **defaults)
    defaults["adamw_mode"] = isinstance(optimizer, torch.optim.AdamW)
    return deepspeed.ops.adam.DeepSpeedCPUAdam(optimizer.param_groups, **defaults)


def get_active_deepspeed_plugin(state):
    """Return the selected ``DeepSpeedPlugin`` of ``state`` (an ``AcceleratorState``); ValueError when none is."""
    plugin = getattr(state, "deepspeed_plugin", None)
    if state.distributed_type != DistributedType.DEEPSPEED or plugin is None:
        raise ValueError(
            "Couldn't retrieve the active `DeepSpeedPlugin` as none were enabled. Please make sure that either "
            "`Accelerator` is configured for `deepspeed` or make sure that the desired `DeepSpeedPlugin` has been "
            "enabled (`AcceleratorState().select_deepspeed_plugin(name)`) before calling this function."
        )
    return plugin
