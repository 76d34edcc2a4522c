"""What the Accelerator reports about its run, and the engine-specific training verbs.

A mixin of :class:`notebook_accel.accelerator.Accelerator`: the read-only answers Accelerate 1.15
gives (``deepspeed_plugin``, ``fp8_backend``, ``multi_device``, ``should_save_model``,
``use_stateful_dataloader``), ``trigger_sync_in_backward`` (a static context manager, as in 1.15),
the LOMO optimizers' fused backward and the DeepSpeed Ulysses dataloader adapter.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator
from typing import Any

import torch

from .._lazy import LazyModule
from ..utils.enums import DistributedType, FP8BackendType

__all__: list[str] = []

# Distributed types that spread one run over several accelerator devices (CPU processes are not).
_MULTI_DEVICE = frozenset(
    {
        DistributedType.MULTI_GPU,
        DistributedType.MULTI_NPU,
        DistributedType.MULTI_MLU,
        DistributedType.MULTI_SDAA,
        DistributedType.MULTI_MUSA,
        DistributedType.MULTI_XPU,
        DistributedType.MULTI_HPU,
        DistributedType.MULTI_NEURON,
    }
)
# The fp8 integration loads when an fp8 recipe handler is given.
_recipes = LazyModule("notebook_accel.integrations.fp8.recipes")
# Checked in this order: FP8RecipeKwargs derives from both TE and MS-AMP recipes and names its backend.
_RECIPE_BACKENDS = (
    ("AORecipeKwargs", FP8BackendType.AO),
    ("TERecipeKwargs", FP8BackendType.TE),
    ("MSAMPRecipeKwargs", FP8BackendType.MSAMP),
)
# The DDP switches no_sync turns off; trigger_sync_in_backward turns them on for one block.
_SYNC_FLAGS = ("require_backward_grad_sync", "require_forward_param_sync")


class _TrainingMixin:
    """Run facts and engine verbs over ``self.state``, ``self.fp8_recipe_handler`` and the prepared optimizers."""

    @property
    def deepspeed_plugin(self) -> Any:
        """The active ``DeepSpeedPlugin`` (None unless DeepSpeed is the distributed type).

        With several named plugins the first is active until ``state.select_deepspeed_plugin(key)``.
        """
        if self.state.distributed_type != DistributedType.DEEPSPEED:
            return None
        return self.state.deepspeed_plugin

    @property
    def fp8_backend(self) -> FP8BackendType:
        """The backend for fp8 training: the fp8 recipe handler's, MSAMP for a DeepSpeed plugin with ``enable_msamp``, else NO."""
        handler = self.fp8_recipe_handler
        if handler is not None:
            if isinstance(handler, _recipes.FP8RecipeKwargs):
                return FP8BackendType(handler.backend)
            for kind, backend in _RECIPE_BACKENDS:
                if isinstance(handler, getattr(_recipes, kind)):
                    return backend
        plugin = self.state.deepspeed_plugin
        if plugin is not None and getattr(plugin, "enable_msamp", False):
            return FP8BackendType.MSAMP
        return FP8BackendType.NO

    @property
    def multi_device(self) -> bool:
        """True when the run is distributed over several accelerator devices (GPU, NPU, XPU...; not CPU processes)."""
        return self.use_distributed and self.distributed_type in _MULTI_DEVICE

    @property
    def should_save_model(self) -> bool:
        """Whether this process takes part in saving the model.

        With a ``ParallelismConfig`` every process does (each holds its shard); otherwise only each
        node's local main process.
        """
        if self.parallelism_config is not None:
            return True
        return self.state.is_local_main_process

    @property
    def use_stateful_dataloader(self) -> bool:
        """Whether prepared dataloaders keep their position (``DataLoaderConfiguration.use_stateful_dataloader``)."""
        return bool(getattr(self.dataloader_config, "use_stateful_dataloader", False))

    @staticmethod
    @contextlib.contextmanager
    def trigger_sync_in_backward(model: torch.nn.Module) -> Iterator[None]:
        """Force the next backward of a DDP ``model`` to synchronise, even inside ``no_sync``.

        Does nothing for a model that is not ``DistributedDataParallel`` (not launched distributed).
        """
        forced = _SYNC_FLAGS if isinstance(model, torch.nn.parallel.DistributedDataParallel) else ()
        before = {flag: getattr(model, flag) for flag in forced}
        for flag in forced:
            setattr(model, flag, True)
        if forced:
            # A forward under no_sync left the reducer without its unused-parameter search; start it afresh.
            model.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            for flag, value in before.items():
                setattr(model, flag, value)

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """Return nothing; run the fused backward-and-update of the prepared LOMO/AdaLomo optimizer.

        LOMO updates each parameter during the backward pass, so it replaces ``backward`` and
        ``optimizer.step()``. Needs ``pip install lomo-optim`` and a ``Lomo``/``AdaLomo`` optimizer
        passed to ``prepare``.
        """
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"lomo_backward: loss must be a torch.Tensor, got {type(loss).__name__}")
        if (
            isinstance(learning_rate, bool)
            or not isinstance(learning_rate, numbers.Real)
            or learning_rate < 0
        ):
            raise ValueError(
                f"lomo_backward: learning_rate must be a non-negative number, got {learning_rate!r}"
            )
        try:
            from lomo_optim import AdaLomo, Lomo
        except ImportError as exc:
            raise ImportError("lomo_backward needs the LOMO optimizers: pip install lomo-optim") from exc
        for optimizer in self._optimizers:
            inner = getattr(optimizer, "optimizer", optimizer)
            if isinstance(inner, (Lomo, AdaLomo)):
                inner.fused_backward(loss, learning_rate)
                return
        kinds = [type(getattr(o, "optimizer", o)).__name__ for o in self._optimizers]
        raise ValueError(
            f"lomo_backward: no LOMO optimizer was prepared (prepared optimizers: {kinds}); pass a "
            "lomo_optim.Lomo or AdaLomo to accelerator.prepare(), or call accelerator.backward(loss)"
        )

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Any) -> Any:
        """Return ``dl`` split along the sequence for DeepSpeed Ulysses sequence parallelism (``dl`` itself without it).

        ``prepare`` does this for dataloaders prepared with the model; call it after
        ``prepare(model)`` for a dataloader prepared on its own. Sequence parallelism
        (``ParallelismConfig(sp_size > 1)``) runs on DeepSpeed only (GPUs).
        """
        config = self.parallelism_config
        if config is None or config.sp_size == 1:
            return dl
        if self.distributed_type != DistributedType.DEEPSPEED:
            raise ValueError(
                f"deepspeed_ulysses_dl_adapter: sp_size={config.sp_size} needs DeepSpeed, but the distributed "
                f"type is {getattr(self.distributed_type, 'value', self.distributed_type)}; launch with a DeepSpeedPlugin or set sp_size=1"
            )
        try:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
            from deepspeed.utils import groups
        except ImportError as exc:
            raise ImportError(
                "deepspeed_ulysses_dl_adapter needs DeepSpeed's sequence parallelism: pip install deepspeed "
                "(runs on CUDA GPUs)"
            ) from exc
        return UlyssesSPDataLoaderAdapter(
            dl,
            sp_rank=groups._get_sequence_parallel_rank(),
            sp_group=groups._get_sequence_parallel_group(),
            sp_world_size=groups._get_sequence_parallel_world_size(),
            device=self.device,
        )
