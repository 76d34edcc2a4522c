"""What ``Accelerator.prepare`` hands out under Megatron-LM: the engine, the optimizer and scheduler wrappers.

Published at ``accelerate.utils.megatron_lm``; they live here, beside the optimizer, scheduler and data
loader they extend or use, because ``utils`` may not import the training layer. Megatron's engine owns
the optimizer and scheduler steps, so the wrappers' ``step`` calls do nothing. The parts that are plain
Python run anywhere (choosing the train step, splitting a batch into micro-batches, sharding a torch
DataLoader over the data-parallel ranks); building and running Megatron's model, optimizer and schedules
needs ``pip install megatron-core`` and NVIDIA GPUs, and raises ImportError naming it.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...data_loader import prepare_data_loader as _shard_data_loader
from ..engine_stepped import EngineSteppedOptimizer, EngineSteppedScheduler
from .lm import MegatronLMDummyDataLoader, megatron_only, megatron_plugin_of, require_megatron
from .train_steps import BertTrainStep, GPTTrainStep, T5TrainStep

__all__ = [
    "MegatronEngine",
    "MegatronLMOptimizerWrapper",
    "MegatronLMSchedulerWrapper",
    "prepare_data_loader",
    "prepare_model_optimizer_scheduler",
    "prepare_optimizer",
    "prepare_scheduler",
]

logger = logging.getLogger(__name__)

_TRAIN_STEPS = {"gpt": GPTTrainStep, "bert": BertTrainStep, "t5": T5TrainStep}


class MegatronLMOptimizerWrapper(EngineSteppedOptimizer):
    """Wrap Megatron's optimizer: ``MegatronEngine.train_step`` steps it, so ``step`` and ``zero_grad`` do nothing."""

    skip_flag = "skipped_iter"  # Megatron's optimizer raises it when a gradient overflow skipped the step

    def __init__(self, optimizer) -> None:
        # Not AcceleratedOptimizer.__init__: Megatron's optimizers are not torch.optim.Optimizer subclasses,
        # and they keep their own state on the device (no placement, no grad scaler).
        self._view_of(optimizer, device_placement=False, scaler=None)


class MegatronLMSchedulerWrapper(EngineSteppedScheduler):
    """Wrap Megatron's scheduler: ``MegatronEngine.train_step`` steps it, so ``step`` does nothing."""

    def step(self, *args, **kwargs) -> None:
        """Return None (Megatron's schedulers take arguments; the engine stepped it already)."""
        return super().step()


class MegatronEngine(nn.Module):
    """Megatron-LM model wrapper: runs the train and eval steps through Megatron's pipeline schedules.

    Args:
        accelerator (`Accelerator`): the accelerator, whose state holds the ``MegatronLMPlugin``.
        model: the Megatron model (a list of model chunks).
        optimizer: Megatron's optimizer.
        scheduler: Megatron's learning-rate scheduler.
    """

    def __init__(self, accelerator, model, optimizer, scheduler) -> None:
        super().__init__()
        plugin = megatron_plugin_of(accelerator)
        self.module = nn.ModuleList(model if isinstance(model, (list, tuple)) else [model])
        self.base_model = self.module[0]
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.num_micro_batches = plugin.num_micro_batches
        args = argparse.Namespace(**plugin.megatron_lm_default_args)
        if plugin.custom_train_step_class is not None:
            self.train_step_handler = plugin.custom_train_step_class(
                accelerator, args, **(plugin.custom_train_step_kwargs or {})
            )
        else:
            model_type = getattr(args, "model_type_name", None)
            if model_type not in _TRAIN_STEPS:
                raise ValueError(
                    f"MegatronEngine: model_type_name={model_type!r} has no train step; use one of {sorted(_TRAIN_STEPS)} "
                    "or MegatronLMPlugin(custom_train_step_class=...)"
                )
            self.train_step_handler = _TRAIN_STEPS[model_type](accelerator, args)
        self.eval_total_loss_dict: dict[str, torch.Tensor] = {}
        self.eval_iterations = 0

    def train(self) -> MegatronEngine:
        """Return self, with every model chunk (and so ``forward``) in training mode; takes no ``mode``, as in Accelerate."""
        for chunk in self.module:
            chunk.train()
        self.training = True
        return self

    def eval(self) -> MegatronEngine:
        """Return self, with every model chunk in evaluation mode: ``forward`` then runs evaluation steps."""
        for chunk in self.module:
            chunk.eval()
        self.training = False
        return self

    def get_batch_data_iterator(self, batch_data):
        """Return an iterator over ``batch_data`` cut into ``num_micro_batches`` micro-batches along dim 0."""
        if not batch_data:
            return None
        sizes = {value.shape[0] for value in batch_data.values()}
        if len(sizes) != 1 or next(iter(sizes)) % self.num_micro_batches:
            raise ValueError(
                f"MegatronEngine: every tensor of the batch needs the same batch size, divisible by "
                f"num_micro_batches={self.num_micro_batches}; got sizes {sorted(sizes)}"
            )
        chunks = {key: value.chunk(self.num_micro_batches, dim=0) for key, value in batch_data.items()}
        micro_batches = [
            {key: parts[i] for key, parts in chunks.items()} for i in range(self.num_micro_batches)
        ]
        return iter(micro_batches)

    def train_step(self, **batch_data):
        """Check the batch splits into micro-batches for Megatron's training schedule; raise ImportError without megatron-core, else RuntimeError (Accelerate runs it)."""
        self.get_batch_data_iterator(batch_data)
        megatron_only("MegatronEngine.train_step")

    def eval_step(self, **batch_data):
        """Check the batch splits into micro-batches for Megatron's evaluation schedule; raise ImportError without megatron-core, else RuntimeError (Accelerate runs it)."""
        self.get_batch_data_iterator(batch_data)
        megatron_only("MegatronEngine.eval_step")

    def forward(self, **batch_data):
        """Return the step's loss: a train step in training mode, an evaluation step otherwise."""
        return self.train_step(**batch_data) if self.training else self.eval_step(**batch_data)

    def log_eval_results(self) -> str:
        """Return the averaged evaluation losses (and perplexity of "lm loss") as text, logged; then reset them."""
        if not self.eval_iterations:
            return ""
        parts = []
        for key, total in self.eval_total_loss_dict.items():
            value = (total / self.eval_iterations).item()
            parts.append(f"{key} value: {value:.6E}")
            if "lm loss" in key:
                parts.append(f"{key} PPL: {torch.exp(torch.tensor(min(20.0, value))).item():.6E}")
        text = " | ".join(parts)
        logger.info("validation results: %s", text)
        self.eval_total_loss_dict, self.eval_iterations = {}, 0
        return text

    def get_module_config(self):
        """Stand for reading Megatron's model configuration; raise ImportError without megatron-core, else RuntimeError (Accelerate runs it)."""
        megatron_only("MegatronEngine.get_module_config")

    def save_checkpoint(self, output_dir):
        """Stand for saving Megatron's distributed checkpoint; raise ImportError without megatron-core, else RuntimeError (Accelerate runs it)."""
        megatron_only(f"MegatronEngine.save_checkpoint({output_dir!r})")

    def load_checkpoint(self, input_dir):
        """Stand for loading Megatron's distributed checkpoint; raise ImportError without megatron-core, else RuntimeError (Accelerate runs it)."""
        megatron_only(f"MegatronEngine.load_checkpoint({input_dir!r})")


def _data_parallel_rank_and_size(plugin: Any) -> tuple[int, int]:
    """Return this process's data-parallel rank and the data-parallel degree."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    if plugin.tp_degree * plugin.pp_degree == 1:
        return dist.get_rank(), dist.get_world_size()  # every process is a data-parallel rank
    core = require_megatron("data-parallel sharding with tp_degree/pp_degree > 1")
    return core.parallel_state.get_data_parallel_rank(), core.parallel_state.get_data_parallel_world_size()


def prepare_data_loader(accelerator, dataloader):
    """Return ``dataloader`` sharded over the data-parallel ranks, or Megatron's iterators for the dummy loader."""
    plugin = megatron_plugin_of(accelerator)
    if isinstance(dataloader, MegatronLMDummyDataLoader):
        return dataloader.build_train_valid_test_data_iterators(accelerator)
    if not isinstance(dataloader, torch.utils.data.DataLoader):
        raise TypeError(
            f"prepare_data_loader takes a torch DataLoader or MegatronLMDummyDataLoader, got {type(dataloader).__name__}"
        )
    rank, size = _data_parallel_rank_and_size(plugin)
    return _shard_data_loader(dataloader, num_processes=size, process_index=rank, put_on_device=False)


def prepare_optimizer(accelerator, model):
    """Check the accelerator has a MegatronLMPlugin before Megatron builds the optimizer; raise ImportError without megatron-core, else RuntimeError (Accelerate runs it)."""
    megatron_plugin_of(accelerator)
    megatron_only("megatron_lm.prepare_optimizer")


def prepare_scheduler(accelerator, optimizer, scheduler):
    """Check the accelerator has a MegatronLMPlugin before Megatron builds the scheduler; raise ImportError without megatron-core, else RuntimeError (Accelerate runs it)."""
    megatron_plugin_of(accelerator)
    megatron_only("megatron_lm.prepare_scheduler")


def prepare_model_optimizer_scheduler(accelerator):
    """Check the accelerator has a MegatronLMPlugin before Megatron builds model, optimizer, scheduler; raise ImportError without megatron-core, else RuntimeError (Accelerate runs it)."""
    megatron_plugin_of(accelerator)
    megatron_only("megatron_lm.prepare_model_optimizer_scheduler")
