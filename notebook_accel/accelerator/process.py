"""The Accelerator's read-through of its process state and configuration, and its process-control verbs.

``_ProcessMixin`` gives ``Accelerator`` the properties that read ``self.state``, ``self.gradient_state``,
``self.dataloader_config`` and ``self.project_configuration`` (rank, device, mixed precision, batching and
accumulation settings), and the verbs that hand over to the state (``wait_for_everyone``,
``main_process_first``, ``on_main_process``...).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..utils.enums import DistributedType
from .flags import check_accumulation_steps

__all__: list[str] = []


class _ProcessMixin:
    """Properties over the process state and configuration objects; verbs handed to the state."""

    # ------------------------------------------------------------------ state read-through
    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        """Whether more than one process trains together."""
        return self.state.use_distributed

    @property
    def mixed_precision(self) -> str:
        return self.state.mixed_precision

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def dispatch_batches(self) -> bool | None:
        return self.dataloader_config.dispatch_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        """Number of the next automatically named checkpoint."""
        return self.project_configuration.iteration

    @property
    def sync_gradients(self) -> bool:
        """Whether this step synchronises gradients (False while accumulating)."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, sync_gradients: bool) -> None:
        self.gradient_state._set_sync_gradients(sync_gradients)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        check_accumulation_steps(steps)
        self.gradient_state.plugin_kwargs.update({"num_steps": steps})

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (fp16 overflow)."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    @property
    def is_fsdp2(self) -> bool:
        return self.state.is_fsdp2

    # ------------------------------------------------------------------ process control
    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point."""
        self.state.wait_for_everyone()

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Yield this process's share of ``inputs`` (see ``PartialState.split_between_processes``)."""
        with self.state.split_between_processes(inputs, apply_padding=apply_padding) as part:
            yield part

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on the main process first, then on the others."""
        with self.state.main_process_first():
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Run the block on each node's local main process first, then on the others."""
        with self.state.local_main_process_first():
            yield

    def on_main_process(self, function: Callable | None = None) -> Callable:
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable | None = None) -> Callable:
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable) -> Callable:
        return self.state.on_last_process(function)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        return self.state.on_process(function, process_index=process_index)

    def on_local_process(
        self, function: Callable | None = None, local_process_index: int | None = None
    ) -> Callable:
        return self.state.on_local_process(function, local_process_index=local_process_index)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        self.state.print(*args, **kwargs)
