"""``accelerate.utils.megatron_lm``: what a training script hands Accelerate's Megatron-LM integration.

Megatron-LM builds the model, optimizer, scheduler and data iterators itself from ``MegatronLMPlugin``;
the script passes placeholders that carry its choices: ``MegatronLMDummyScheduler`` (steps and warm-up)
and ``MegatronLMDummyDataLoader`` (Megatron's data arguments). ``megatron_training_args`` turns what
``prepare`` received into Megatron's arguments, in plain Python. The train-step classes (batch, forward
and loss functions, plain torch) are in :mod:`notebook_accel.integrations.megatron.train_steps`.
``avg_losses_across_data_parallel_group`` and ``gather_across_data_parallel_groups`` use Megatron's
data-parallel group when Megatron's parallel state is initialized; otherwise every process is a
data-parallel rank (plain data parallelism, as notebook_accel launches), so they use the default process
group. Building models and iterators (``initialize``, ``model_provider_func``, the engine) needs
``pip install megatron-core`` and NVIDIA GPUs: those raise ImportError naming it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..._lazy import attach
from ...utils._protocols import AcceleratorLike
from ...utils.imports import is_megatron_lm_available
from ...utils.operations import recursively_apply, send_to_device
from .plugin import _batch_args, _decay_args, _optimizer_args, _scheduler_steps

# The engine and the optimizer/scheduler wrappers extend the training-layer wrappers, which utils may
# not import; the train steps import this module. The lazy table serves them all at this path.
_ENGINE = "notebook_accel.integrations.megatron.engine"
_STEPS = "notebook_accel.integrations.megatron.train_steps"
_LAZY = {
    "AcceleratedOptimizer": "notebook_accel.optimizer",
    "AcceleratedScheduler": "notebook_accel.scheduler",
    "MegatronEngine": _ENGINE,
    "MegatronLMOptimizerWrapper": _ENGINE,
    "MegatronLMSchedulerWrapper": _ENGINE,
    "prepare_data_loader": _ENGINE,
    "prepare_model_optimizer_scheduler": _ENGINE,
    "prepare_optimizer": _ENGINE,
    "prepare_scheduler": _ENGINE,
    "AbstractTrainStep": _STEPS,
    "BertTrainStep": _STEPS,
    "GPTTrainStep": _STEPS,
    "T5TrainStep": _STEPS,
}
__getattr__, __dir__ = attach(__name__, _LAZY)

__all__ = sorted(_LAZY) + [
    "MegatronLMDummyDataLoader",
    "MegatronLMDummyScheduler",
    "avg_losses_across_data_parallel_group",
    "finish_mpu_init",
    "gather_across_data_parallel_groups",
    "initialize",
    "is_megatron_lm_available",
    "megatron_only",
    "megatron_plugin_of",
    "megatron_training_args",
    "model_provider_func",
    "recursively_apply",
    "require_megatron",
    "send_to_device",
]

logger = logging.getLogger(__name__)


def require_megatron(what: str) -> Any:
    """Return ``megatron.core``; raise ImportError naming megatron-core when it is not installed."""
    if not is_megatron_lm_available():
        raise ImportError(
            f"{what} needs Megatron-LM (`megatron.core`, NVIDIA GPUs): pip install megatron-core and run "
            "on a CUDA machine"
        )
    return importlib.import_module("megatron.core")


def megatron_only(what: str) -> None:
    """Raise ImportError naming megatron-core when it is missing, else RuntimeError: Accelerate drives this step."""
    if not is_megatron_lm_available():
        raise ImportError(
            f"{what} needs Megatron-LM (`megatron.core`, NVIDIA GPUs): pip install megatron-core and run "
            "on a CUDA machine"
        )
    # Megatron's training-loop API changes between releases; guessing it would fail in obscure ways.
    raise RuntimeError(
        f"{what}: notebook_accel validates Megatron-LM configurations but does not drive Megatron-LM's own "
        "training loop; run this script under Accelerate's Megatron-LM integration (accelerate launch on "
        "NVIDIA GPUs with megatron-core)"
    )


def _megatron_data_parallel_group() -> Any:
    """Return Megatron's data-parallel group when its parallel state is initialized, else None (the default group)."""
    if not is_megatron_lm_available():
        return None
    parallel_state = importlib.import_module("megatron.core.parallel_state")
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_data_parallel_group()


def avg_losses_across_data_parallel_group(losses: list[torch.Tensor]) -> torch.Tensor:
    """Return the losses averaged over the data-parallel ranks, one value per loss (a 1-D tensor).

    Each loss is detached first (the average is for logging; backward uses the local loss). Without an
    initialized process group (one process) the losses come back as they are, stacked.
    """
    if not isinstance(losses, (list, tuple)) or not losses:
        raise TypeError(f"losses must be a non-empty list of scalar tensors, got {losses!r}")
    for loss in losses:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"each loss must be a one-element tensor, got {loss!r}")
    averaged = torch.cat([loss.clone().detach().view(1) for loss in losses])
    if not (dist.is_available() and dist.is_initialized()):
        return averaged
    group = _megatron_data_parallel_group()
    dist.all_reduce(averaged, group=group)
    return averaged / dist.get_world_size(group=group)


def gather_across_data_parallel_groups(tensor: Any) -> Any:
    """Return ``tensor`` (nested lists/tuples/dicts of tensors) gathered from the data-parallel ranks.

    Each tensor becomes the concatenation along dim 0 of every rank's tensor, in rank order (0-dim
    tensors are gathered as 1-element ones); the shapes must match. One process: returned as given.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    group = _megatron_data_parallel_group()

    def _gather_one(value: torch.Tensor) -> torch.Tensor:
        value = value.contiguous().view(1) if value.dim() == 0 else value.contiguous()
        parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group=group))]
        dist.all_gather(parts, value, group=group)
        return torch.cat(parts, dim=0)

    return recursively_apply(_gather_one, tensor, error_on_other_type=True)


class MegatronLMDummyScheduler:
    """Stand in for the learning-rate scheduler Megatron-LM builds from ``MegatronLMPlugin``.

    Args:
        optimizer (`torch.optim.Optimizer`): the optimizer the scheduler drives.
        total_num_steps (`int`, *optional*): training iterations (Megatron's ``train_iters``).
        warmup_num_steps (`int`, defaults to 0): warm-up iterations (Megatron's ``lr_warmup_iters``).
        **kwargs: other scheduler arguments, kept in ``kwargs``.
    """

    def __init__(self, optimizer, total_num_steps=None, warmup_num_steps=0, **kwargs) -> None:
        for name, value in (("total_num_steps", total_num_steps), ("warmup_num_steps", warmup_num_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(
                    f"MegatronLMDummyScheduler: {name} must be an int >= 0 or None, got {value!r}"
                )
        if total_num_steps is not None and warmup_num_steps > total_num_steps:
            raise ValueError(
                f"MegatronLMDummyScheduler: warmup_num_steps={warmup_num_steps} exceeds "
                f"total_num_steps={total_num_steps}"
            )
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.kwargs = kwargs


def _check_data_args(args: dict[str, Any]) -> None:
    for name in ("seq_length", "micro_batch_size", "num_workers"):
        value = args.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"MegatronLMDummyDataLoader: {name} must be an int >= 0, got {value!r}")
    splits = args.get("split", args.get("splits_string"))
    if splits is not None:
        parts = str(splits).replace("/", ",").split(",")
        if len(parts) != 3 or not all(p.strip().replace(".", "", 1).isdigit() for p in parts):
            raise ValueError(
                f"MegatronLMDummyDataLoader: the split is train,valid,test weights such as '949,50,1'; got {splits!r}"
            )
    data_path = args.get("data_path")
    if data_path is not None and not isinstance(data_path, (str, list, tuple)):
        raise TypeError(f"MegatronLMDummyDataLoader: data_path must be a path or a list, got {data_path!r}")


class MegatronLMDummyDataLoader:
    """Stand in for the train/valid/test data iterators Megatron-LM builds from its own datasets.

    Args:
        **dataset_kwargs: Megatron data arguments (``data_path``, ``splits_string``, ``seq_length``,
            ``micro_batch_size``, ...), kept in ``dataset_args``.
    """

    def __init__(self, **dataset_kwargs) -> None:
        _check_data_args(dataset_kwargs)
        self.dataset_args = dict(dataset_kwargs)

    def set_megatron_data_args(self) -> None:
        """Stand for copying ``dataset_args`` onto Megatron's global arguments; raise ImportError without megatron-core, else RuntimeError (Accelerate runs it)."""
        megatron_only("MegatronLMDummyDataLoader.set_megatron_data_args")

    def get_train_valid_test_datasets_provider(self, accelerator) -> Callable:
        """Return the plugin's ``custom_megatron_datasets_provider_function``, or raise naming megatron-core."""
        plugin = megatron_plugin_of(accelerator)
        if plugin.custom_megatron_datasets_provider_function is not None:
            return plugin.custom_megatron_datasets_provider_function
        megatron_only("Megatron's default GPT/BERT/T5 datasets provider (or MegatronLMPlugin's custom one)")

    def build_train_valid_test_data_iterators(self, accelerator) -> tuple:
        """Check the plugin has a datasets provider for Megatron's train/valid/test iterators; raise ImportError without megatron-core, else RuntimeError (Accelerate runs it)."""
        self.get_train_valid_test_datasets_provider(accelerator)
        megatron_only("MegatronLMDummyDataLoader.build_train_valid_test_data_iterators")


def megatron_plugin_of(accelerator: AcceleratorLike) -> Any:
    """Return the accelerator's MegatronLMPlugin; raise ValueError when it has none."""
    plugin = getattr(getattr(accelerator, "state", None), "megatron_lm_plugin", None)
    if plugin is None:
        raise ValueError(
            "this needs an Accelerator(megatron_lm_plugin=MegatronLMPlugin(...)); the accelerator given has none"
        )
    return plugin


def _micro_batch_size(objects: tuple) -> int | None:
    for obj in objects:
        if isinstance(obj, MegatronLMDummyDataLoader) and obj.dataset_args.get("micro_batch_size"):
            return obj.dataset_args["micro_batch_size"]
        if isinstance(obj, torch.utils.data.DataLoader) and obj.batch_size is not None:
            return obj.batch_size
    return None


def megatron_training_args(plugin: Any, objects: tuple, num_processes: int) -> dict[str, Any]:
    """Return Megatron's arguments for a ``prepare(*objects)`` call: the plugin's, plus batch, steps and optimizer.

    The data-parallel degree is ``num_processes / (tp_degree * pp_degree)``; the micro-batch size comes
    from the first data loader (or ``MegatronLMDummyDataLoader``'s ``micro_batch_size``); the global batch
    is micro-batch x ``num_micro_batches`` x data-parallel degree. ``MegatronLMDummyScheduler`` gives
    ``train_iters`` / ``lr_warmup_iters`` unless the plugin sets them; a torch Adam/AdamW/SGD gives the
    optimizer type and hyperparameters of its first parameter group.
    """
    model_parallel = plugin.tp_degree * plugin.pp_degree
    if num_processes % model_parallel:
        raise ValueError(
            f"{num_processes} processes cannot hold tp_degree={plugin.tp_degree} x pp_degree={plugin.pp_degree}: "
            "the process count must be a multiple of their product"
        )
    args = dict(plugin.megatron_lm_default_args)
    micro = _micro_batch_size(objects)
    if micro is None:
        raise ValueError(
            "prepare() under Megatron-LM needs a DataLoader or MegatronLMDummyDataLoader(micro_batch_size=...)"
        )
    args.update(_batch_args(micro, plugin.num_micro_batches, num_processes // model_parallel))
    for obj in objects:
        if isinstance(obj, MegatronLMDummyDataLoader):
            args.update(obj.dataset_args)
            args["megatron_dataset_flag"] = True
        elif isinstance(obj, MegatronLMDummyScheduler):
            total, warmup = _scheduler_steps(obj)
            args["train_iters"] = plugin.train_iters or total
            args["lr_warmup_iters"] = plugin.lr_warmup_iters or warmup
        elif isinstance(obj, torch.optim.Optimizer):
            args.update(_optimizer_args(obj))
    for name, value in _decay_args(plugin).items():
        args.setdefault(name, value)
    return args


def initialize(accelerator, extra_args_provider=None, args_defaults=None) -> None:
    """Check the arguments of Megatron-LM's initialization (arguments, process groups, seeds); raise ImportError without megatron-core, else RuntimeError (Accelerate runs it)."""
    plugin = megatron_plugin_of(accelerator)
    if extra_args_provider is not None and not callable(extra_args_provider):
        raise TypeError(
            f"extra_args_provider must be callable (it adds argparse arguments), got {extra_args_provider!r}"
        )
    if args_defaults is not None and not isinstance(args_defaults, dict):
        raise TypeError(f"args_defaults must be a dict of Megatron arguments, got {args_defaults!r}")
    megatron_only(f"megatron_lm.initialize (tp_degree={plugin.tp_degree}, pp_degree={plugin.pp_degree})")


def finish_mpu_init() -> None:
    """Stand for Megatron's model-parallel initialization (process groups, seeds); raise ImportError without megatron-core, else RuntimeError (Accelerate runs it)."""
    megatron_only("megatron_lm.finish_mpu_init")


def model_provider_func(pre_process=True, post_process=True, add_encoder=True, add_decoder=True) -> Any:
    """Check the flags of Megatron's model builder (GPT, BERT or T5); raise ImportError without megatron-core, else RuntimeError (Accelerate runs it)."""
    for name, value in (("pre_process", pre_process), ("post_process", post_process),
                        ("add_encoder", add_encoder), ("add_decoder", add_decoder)):  # fmt: skip
        if not isinstance(value, bool):
            raise TypeError(f"model_provider_func: {name} must be a bool, got {value!r}")
    megatron_only(
        "model_provider_func (pass MegatronLMPlugin(custom_model_provider_function=...) under Accelerate)"
    )
