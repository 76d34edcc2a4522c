"""``Accelerator``: the object a training loop talks to inside a launched function.

It resolves the user's flags once (constructor) into the state singletons and handler objects,
then prepares models, optimizers, dataloaders and schedulers for the process it runs in, and
provides the loop's verbs (backward, accumulate, autocast, gather_for_metrics, save_state, ...).
Model wrapping lives in ``.wrapping``, checkpoint files in ``checkpointing``, data
sharding in ``data_loader``, trackers in ``tracking``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._lazy import LazyModule
from ..optimizer import AcceleratedOptimizer
from ..scheduler import AcceleratedScheduler
from ..state import AcceleratorState, GradientState
from ..utils.compilation import is_compiled_module
from ..utils.enums import DistributedType, PrecisionType
from ..utils.memory import release_memory
from . import mesh as _mesh
from . import profiling as _profiling
from . import wrapping as _model
from .checkpoint import Checkpointer, PreparedObjects
from .flags import SPLIT_BATCHES_UNSET, AcceleratorFlags, resolve_flags
from .precision import Precision
from .prepared import _mark_prepared, _quantized_placement, _reuse_prepared
from .process import _ProcessMixin
from .saving import _SavingMixin
from .tracking import _TrackingMixin
from .training import _TrainingMixin

__all__ = ["Accelerator"]

# FSDP wrapping loads torch.distributed.fsdp: imported when a model is prepared for FSDP.
_fsdp = LazyModule("notebook_accel.integrations.fsdp.wrap")
_fsdp_plugin = LazyModule("notebook_accel.integrations.fsdp.plugin")
# Data loaders and trackers load when the first DataLoader is prepared / the first tracker is named.
_data_loader = LazyModule("notebook_accel.data_loader")
_tracking = LazyModule("notebook_accel.tracking")
_ops = LazyModule("notebook_accel.utils.operations")  # the collectives: at the first gather/reduce
_other = LazyModule("notebook_accel.utils.other")

logger = logging.getLogger(__name__)


class Accelerator(_ProcessMixin, _SavingMixin, _TrackingMixin, _TrainingMixin, _mesh.ParallelismMixin):
    """Prepare a training loop for the current process world (single process, DDP, FSDP, mixed precision).

    Args:
        device_placement: Move prepared models and batches to the process's device (default True).
        split_batches: Shortcut for ``DataLoaderConfiguration(split_batches=...)``: cut each batch across the
            processes instead of giving each its own.
        mixed_precision: "no", "fp16", "bf16" or "fp8" (a string or ``PrecisionType``); default
            ``ACCELERATE_MIXED_PRECISION``, else "no".
        gradient_accumulation_steps: Batches whose gradients add up before one optimizer step (default 1).
        cpu: Run on the CPU even where an accelerator is visible.
        dataloader_config: A ``DataLoaderConfiguration`` for prepared data loaders.
        deepspeed_plugin: A ``DeepSpeedPlugin`` (or a dict of named ones) to train with DeepSpeed.
        fsdp_plugin: A ``FullyShardedDataParallelPlugin`` to shard the model with FSDP.
        torch_tp_plugin: A ``TorchTensorParallelPlugin`` for torch's tensor parallelism.
        megatron_lm_plugin: A ``MegatronLMPlugin`` to train with Megatron-LM.
        rng_types: Random generators synchronised at the start of each epoch (default ``["generator"]``).
        log_with: Experiment trackers: names ("tensorboard", "wandb", "all"...), ``LoggerType`` values or
            tracker objects.
        project_dir: Folder for checkpoints and logs (sets ``project_config.project_dir``).
        project_config: A ``ProjectConfiguration``: folders, checkpoint naming and how many checkpoints to
            keep.
        gradient_accumulation_plugin: A ``GradientAccumulationPlugin``, instead of
            ``gradient_accumulation_steps``.
        step_scheduler_with_optimizer: Step the learning-rate schedulers once per optimizer step and process
            (default True).
        kwargs_handlers: At most one each of AutocastKwargs, DistributedDataParallelKwargs, GradScalerKwargs,
            InitProcessGroupKwargs, an FP8 recipe and ProfileKwargs.
        dynamo_backend: A ``torch.compile`` backend name; the prepared model is compiled with it.
        dynamo_plugin: A ``TorchDynamoPlugin``, instead of ``dynamo_backend``.
        deepspeed_plugins: Several named DeepSpeed configurations (a dict), one of them active at a time.
        parallelism_config: A ``ParallelismConfig`` describing data, tensor and context parallel sizes.
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = SPLIT_BATCHES_UNSET,
        mixed_precision: PrecisionType | str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: Any = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        rng_types: list[str] | None = None,
        log_with: Any = None,
        project_dir: str | os.PathLike | None = None,
        project_config: Any = None,
        gradient_accumulation_plugin: Any = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[Any] | None = None,
        dynamo_backend: Any = None,
        dynamo_plugin: Any = None,
        deepspeed_plugins: Any = None,
        parallelism_config: Any = None,
    ) -> None:
        flags = resolve_flags(
            device_placement=device_placement,
            split_batches=split_batches,
            mixed_precision=mixed_precision,
            gradient_accumulation_steps=gradient_accumulation_steps,
            cpu=cpu,
            dataloader_config=dataloader_config,
            deepspeed_plugin=deepspeed_plugin,
            fsdp_plugin=fsdp_plugin,
            torch_tp_plugin=torch_tp_plugin,
            megatron_lm_plugin=megatron_lm_plugin,
            rng_types=rng_types,
            log_with=log_with,
            project_dir=project_dir,
            project_config=project_config,
            gradient_accumulation_plugin=gradient_accumulation_plugin,
            step_scheduler_with_optimizer=step_scheduler_with_optimizer,
            kwargs_handlers=kwargs_handlers,
            dynamo_backend=dynamo_backend,
            dynamo_plugin=dynamo_plugin,
            deepspeed_plugins=deepspeed_plugins,
            parallelism_config=parallelism_config,
        )
        self._flags = flags
        self._keep_flags(flags)
        self.state = self._join_process_state(flags)
        self._set_up_training(flags)

    def _keep_flags(self, flags: AcceleratorFlags) -> None:
        """Expose the resolved flags under the attribute names Accelerate code reads."""
        self.project_configuration = flags.project_config
        self.dataloader_config = flags.dataloader_config
        self.ddp_handler = flags.handler("ddp")
        self.scaler_handler = flags.handler("scaler")
        self.init_handler = flags.handler("init")
        self.autocast_handler = flags.handler("autocast")
        self.fp8_recipe_handler = flags.handler("fp8")
        self.profile_handler = flags.handler("profile")
        self.device_placement = flags.device_placement
        self.step_scheduler_with_optimizer = flags.step_scheduler_with_optimizer
        self.rng_types = list(flags.rng_types)

    def _join_process_state(self, flags: AcceleratorFlags) -> AcceleratorState:
        """Return the process's AcceleratorState set up with these flags (checked against an existing one)."""
        parallelism_config, fsdp_plugin = _mesh.plugins_for_parallelism(
            flags.parallelism_config, flags.fsdp_plugin, flags.torch_tp_plugin
        )
        state = AcceleratorState(
            mixed_precision=flags.mixed_precision,
            cpu=flags.cpu,
            dynamo_plugin=flags.dynamo_plugin,
            deepspeed_plugin=flags.deepspeed_plugin,
            fsdp_plugin=fsdp_plugin,
            torch_tp_plugin=flags.torch_tp_plugin,
            megatron_lm_plugin=flags.megatron_lm_plugin,
            parallelism_config=parallelism_config,
            _from_accelerator=True,
            **flags.init_kwargs(),
        )
        _model.check_engines(state, flags.megatron_lm_plugin, state.mixed_precision, self.fp8_recipe_handler)
        if fsdp_plugin is not None or parallelism_config is not None:  # a re-run cell: equal settings pass
            _fsdp_plugin.check_same_settings(
                state, fsdp_plugin=fsdp_plugin, parallelism_config=parallelism_config
            )
        for name, given in (("megatron_lm_plugin", flags.megatron_lm_plugin),):
            if given is not None and getattr(state, name) is not given:
                # The process state is shared; silently training without the plugin would mislead.
                raise ValueError(
                    f"{name} was given, but this process's AcceleratorState was already set up without it: "
                    "call AcceleratorState._reset_state() (or restart the kernel) before this Accelerator"
                )
        self._torch_device_mesh = _mesh.build_mesh(state, state.parallelism_config)
        self.dynamo_plugin = flags.dynamo_plugin if flags.dynamo_plugin is not None else state.dynamo_plugin
        return state

    def _set_up_training(self, flags: AcceleratorFlags) -> None:
        """Create the gradient bookkeeping, precision, trackers and the registries of prepared objects."""
        self.gradient_state = GradientState(gradient_accumulation_plugin=flags.accumulation_plugin)
        log_with = flags.log_with
        self.log_with = [] if log_with is None else _tracking.filter_trackers(log_with, self.logging_dir)
        self.trackers: list[Any] = []  # GeneralTracker objects, from init_trackers
        self.precision = Precision(self.state.mixed_precision, self.device.type, self.autocast_handler)
        self.native_amp = self.precision.native_amp
        self.scaler = self.precision.grad_scaler(self.distributed_type, self.scaler_handler)
        self.step = 0
        self.flag_tensor: torch.Tensor | None = None
        prepared = PreparedObjects()
        self._checkpointer = Checkpointer(self.project_configuration, self.state, prepared)
        # The registries under the attribute names Accelerate code reads; the same list objects.
        self._models: list[torch.nn.Module] = prepared.models
        self._optimizers: list[AcceleratedOptimizer] = prepared.optimizers
        self._schedulers: list[AcceleratedScheduler] = prepared.schedulers
        self._dataloaders: list[Any] = prepared.dataloaders
        self._custom_objects: list[Any] = prepared.custom_objects
        self._save_model_state_pre_hook: OrderedDict[int, Callable] = prepared.save_hooks
        self._load_model_state_pre_hook: OrderedDict[int, Callable] = prepared.load_hooks
        self.deepspeed_engine_wrapped: Any = None

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args: Any, device_placement: list[bool | None] | None = None) -> Any:
        """Return ``args`` prepared for this process, in the same order (the object itself for one arg).

        Models are placed, wrapped for mixed precision, DDP/FSDP and compiled as configured;
        optimizers, schedulers and dataloaders are wrapped. Other objects come back unchanged.
        """
        if device_placement is None:
            device_placement = [None] * len(args)
        elif len(device_placement) != len(args):
            raise ValueError(
                f"device_placement has {len(device_placement)} entries for {len(args)} objects: give one per object"
            )
        if self.distributed_type == DistributedType.DEEPSPEED:
            return self._prepare_deepspeed(*args)
        if self.distributed_type == DistributedType.MEGATRON_LM:
            # Training without the tensor/pipeline parallelism the plugin asks for would be a silent fallback.
            raise RuntimeError(
                "MegatronLMPlugin is validated, but notebook_accel does not build Megatron-LM models: "
                "train with DDP/FSDP here, or use Accelerate's Megatron-LM integration for this run"
            )
        old_params = {}
        # Sharding (FSDP, tensor parallelism) replaces parameter objects: optimizers must follow them.
        if self.distributed_type == DistributedType.FSDP or self.parallelism_config is not None:
            for obj in args:
                if isinstance(obj, torch.nn.Module):
                    old_params.update({id(p): n for n, p in obj.named_parameters()})
        # Schedulers last: they wrap the optimizers prepared in the same call.
        result = [
            obj if _is_scheduler(obj) else self._prepare_one(obj, placement)
            for obj, placement in zip(args, device_placement)
        ]
        if old_params:
            for model in (r for r in result if isinstance(r, torch.nn.Module)):
                _fsdp.remap_optimizer_params(
                    [o for o in result if isinstance(o, AcceleratedOptimizer)], old_params, model
                )
        result = [self.prepare_scheduler(obj) if _is_scheduler(obj) else obj for obj in result]
        return result[0] if len(result) == 1 else tuple(result)

    def _prepare_one(self, obj: Any, device_placement: bool | None) -> Any:
        preparers = (
            (torch.utils.data.DataLoader, self.prepare_data_loader),
            (torch.nn.Module, self.prepare_model),
            (torch.optim.Optimizer, self.prepare_optimizer),
        )
        prepare = next((method for kind, method in preparers if isinstance(obj, kind)), None)
        return obj if prepare is None else prepare(obj, device_placement=device_placement)

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Return ``model`` on the device, under autocast, wrapped for DDP/FSDP and compiled as configured."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"prepare_model expects a torch.nn.Module, got {type(model).__name__}")
        if _reuse_prepared(self._models, model):
            return model
        if device_placement is None:
            device_placement = self.device_placement and self.distributed_type != DistributedType.FSDP
        if _quantized_placement(model):
            device_placement = False  # bitsandbytes placed it; its weights cannot be moved
        self._models.append(model)
        if device_placement and not self.verify_device_map(model):
            model = model.to(self.device)
        self.precision.wrap_forward(model)
        config = self.parallelism_config
        if config is not None and config.tp_enabled and self.torch_device_mesh is not None:
            model = _mesh.apply_tensor_parallel(model, self.torch_device_mesh, config)
        if not evaluation_mode:
            model = _model.wrap_for_distributed_type(self, model)
        dynamo = self.dynamo_plugin
        if dynamo is not None and str(dynamo.backend.value).upper() != "NO" and not is_compiled_module(model):
            model = _model.compile_model(model, dynamo)
        self._models[-1] = model
        return _mark_prepared(model)

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> Any:
        """Return ``optimizer`` wrapped to follow accumulation and fp16 scaling."""
        if isinstance(optimizer, AcceleratedOptimizer):
            _reuse_prepared(self._optimizers, _mark_prepared(optimizer))
            return optimizer
        if device_placement is None:
            device_placement = self.device_placement
        wrapped = AcceleratedOptimizer(optimizer, device_placement=device_placement, scaler=self.scaler)
        self._optimizers.append(wrapped)
        return _mark_prepared(wrapped)

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Return ``scheduler`` wrapped to step with the prepared optimizer it drives."""
        if isinstance(scheduler, AcceleratedScheduler):
            return scheduler  # as 1.15: returned as it is, not registered again here
        target = getattr(scheduler, "optimizer", None)
        optimizers = [
            opt for opt in self._optimizers if opt.optimizer is target or opt is target
        ] or self._optimizers
        wrapped = AcceleratedScheduler(
            scheduler,
            optimizers,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
        )
        self._schedulers.append(wrapped)
        return _mark_prepared(wrapped)

    def prepare_data_loader(
        self,
        data_loader: torch.utils.data.DataLoader,
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Any = None,
    ) -> Any:
        """Return ``data_loader`` sharded for this process (see :func:`notebook_accel.data_loader.prepare_data_loader`)."""
        if _reuse_prepared(self._dataloaders, data_loader):
            return data_loader
        if device_placement is None:
            device_placement = self.device_placement
        cfg = self.dataloader_config
        # Ranks of one tensor-parallel group share their batches: shard over data-parallel ranks only.
        num_processes, process_index = self.data_parallel_world()
        prepared = _data_loader.prepare_data_loader(
            data_loader,
            self.device,
            num_processes=num_processes,
            process_index=process_index,
            split_batches=cfg.split_batches,
            put_on_device=device_placement,
            rng_types=list(self.rng_types),
            dispatch_batches=cfg.dispatch_batches,
            even_batches=cfg.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=cfg.use_seedable_sampler,
            data_seed=cfg.data_seed,
            non_blocking=cfg.non_blocking,
            use_stateful_dataloader=cfg.use_stateful_dataloader,
            # The counts above shard in place; a dispatched loader splits over the mesh's dp ranks.
            torch_device_mesh=self.torch_device_mesh,
        )
        self._dataloaders.append(prepared)
        return _mark_prepared(prepared)

    def _prepare_deepspeed(self, *args: Any) -> Any:
        model = next((a for a in args if isinstance(a, torch.nn.Module)), None)
        optimizer = next((a for a in args if isinstance(a, torch.optim.Optimizer)), None)
        scheduler = next((a for a in args if _is_scheduler(a)), None)
        engine, ds_optimizer, ds_scheduler = _model.prepare_deepspeed(
            model, optimizer, scheduler, self.state.deepspeed_plugin, self.state
        )
        self.deepspeed_engine_wrapped = engine
        out = []
        for obj in args:
            if obj is model:
                self._models.append(engine)
                out.append(engine)
            elif obj is optimizer:
                wrapped = AcceleratedOptimizer(ds_optimizer, device_placement=False)
                self._optimizers.append(wrapped)
                out.append(wrapped)
            elif obj is scheduler:
                out.append(self.prepare_scheduler(ds_scheduler))
            else:
                out.append(self._prepare_one(obj, None))
        return out[0] if len(out) == 1 else tuple(out)

    def verify_device_map(self, model: torch.nn.Module) -> bool:
        """Return whether ``model`` was dispatched over several devices (and must not be moved)."""
        for module in model.modules():
            device_map = getattr(module, "hf_device_map", None)
            if device_map is not None and len(set(device_map.values())) > 1:
                return True
        return False

    # ------------------------------------------------------------------ training step
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate ``loss`` divided by the accumulation steps, through the fp16 scaler if any."""
        if self.distributed_type == DistributedType.DEEPSPEED:
            self.deepspeed_engine_wrapped.backward(loss, **kwargs)
            return
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)

    def _do_sync(self) -> None:
        """Count one micro-batch and record whether its backward pass synchronises gradients.

        A window of ``num_steps`` micro-batches ends with a synchronising one. When the dataloader
        is on its last batch (and the accumulation follows the dataloader), that batch closes the
        window early, whatever the count, and the next epoch starts a fresh window.
        """
        gradients = self.gradient_state
        closes_epoch = gradients.sync_with_dataloader and gradients.end_of_dataloader
        self.step = 0 if closes_epoch else self.step + 1
        window_full = self.step % gradients.num_steps == 0
        gradients._set_sync_gradients(closes_epoch or window_full)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """Run a training step that only synchronises gradients every ``gradient_accumulation_steps`` steps."""
        self._do_sync()
        with contextlib.ExitStack() as stack:
            if not (self.sync_gradients or self.gradient_state.sync_each_batch):
                for model in models:
                    stack.enter_context(self.no_sync(model))
            yield

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Skip the gradient all-reduce of ``model`` inside the block (local accumulation)."""
        context = getattr(model, "no_sync", None) if self.use_distributed else None
        if context is None:
            yield
            return
        with context():
            yield

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None) -> Iterator[None]:
        """Train on uneven per-process inputs: processes that run out of batches shadow the others' collectives.

        Wraps ``torch.distributed.algorithms.Join`` over ``joinables`` (DDP models, ZeroRedundancyOptimizer);
        ``even_batches`` temporarily overrides the prepared dataloaders' padding of the last round.
        """
        if not (self.use_distributed and self.distributed_type in _model._DATA_PARALLEL_TYPES):
            yield
            return
        from torch.distributed.algorithms import Join

        samplers = [
            getattr(dl, "batch_sampler", None)
            for dl in self._dataloaders
            if hasattr(getattr(dl, "batch_sampler", None), "even_batches")
        ]
        saved = [sampler.even_batches for sampler in samplers]
        if even_batches is not None:
            for sampler in samplers:
                sampler.even_batches = even_batches
        try:
            with Join(joinables):
                yield
        finally:
            for sampler, value in zip(samplers, saved):
                sampler.even_batches = value

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide the fp16-scaled gradients of ``optimizer`` (all prepared ones when None) by the scale."""
        if self.scaler is None:
            return
        optimizers = self._optimizers if optimizer is None else optimizer
        if not isinstance(optimizers, (list, tuple)):
            optimizers = [optimizers]
        for opt in optimizers:
            self.scaler.unscale_(getattr(opt, "optimizer", opt))

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor | None:
        """Clip the gradient norm of ``parameters`` (unscaled first under fp16); return the total norm.

        On accumulating steps (``sync_gradients`` False) the gradients are incomplete, so nothing
        is clipped and None is returned; clipping happens on the synchronising step.
        """
        if not self.sync_gradients:
            return None
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        self.unscale_gradients()
        if self.distributed_type == DistributedType.FSDP or self.parallelism_config is not None:
            # Sharded gradients: the norm must combine every rank's shard.
            return _fsdp.clip_grad_norm(self._models, parameters, max_norm, norm_type)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp every gradient of ``parameters`` to ``[-clip_value, clip_value]`` (unscaled first under fp16).

        Like :meth:`clip_grad_norm_`, it acts only on synchronising steps.
        """
        if self.distributed_type == DistributedType.FSDP:
            raise RuntimeError(
                "clip_grad_value_ is not available with FSDP (gradients are sharded): use clip_grad_norm_"
            )
        if not self.sync_gradients:
            return
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    @contextlib.contextmanager
    def autocast(self, autocast_handler: Any = None) -> Iterator[None]:
        """Run the block under the mixed-precision autocast (a no-op for mixed_precision="no")."""
        with self.precision.autocast(autocast_handler):
            yield

    def profile(self, profile_handler: Any = None) -> contextlib.AbstractContextManager:
        """Return a context that profiles its block with torch.profiler (``ProfileKwargs``; see ``.profiling``).

        ``profile_handler`` overrides the ``ProfileKwargs`` given in ``kwargs_handlers``; with
        ``output_trace_dir`` each rank writes ``trace_rank<N>.json`` there when the block ends.
        """
        handler = profile_handler if profile_handler is not None else self.profile_handler
        return _profiling.profile(handler, self.process_index)

    def set_trigger(self) -> None:
        """Raise a flag on this process that ``check_trigger`` sees on every process."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """Return whether any process called ``set_trigger`` since the last check (and reset it)."""
        raised = self.flag_tensor if self.flag_tensor is not None else torch.tensor(0, device=self.device)
        self.flag_tensor = torch.tensor(0, device=self.device)  # every process takes its flag down
        return bool(_ops.reduce(raised, reduction="sum").item() > 0)

    # ------------------------------------------------------------------ collectives
    def gather(self, tensor: Any) -> Any:
        """Return ``tensor`` (or nested structure) concatenated over all processes."""
        return _ops.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Return ``input_data`` gathered over processes, without the duplicates padding the last batch.

        On the last batch of a prepared dataloader only the ``GradientState.remainder`` real
        samples are kept, so the gathered predictions number exactly ``len(dataset)``.
        Non-tensor data (or ``use_gather_object=True``) goes through ``gather_object``.
        """
        if not use_gather_object:
            use_gather_object = not _only_tensors(input_data)
        data = _ops.gather_object(input_data) if use_gather_object else _ops.gather(input_data)
        gs = self.gradient_state
        if not gs.end_of_dataloader or gs.remainder <= 0:
            return data
        remainder = gs.remainder
        if use_gather_object:
            return data[:remainder]
        try:
            return _ops.recursively_apply(lambda t: t[:remainder], data)
        except IndexError:
            # A 0-d value (a loss, a count) has no samples to drop: the whole structure comes back as
            # gathered, as on Accelerate 1.15.
            return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Return ``tensor`` reduced ("sum", "mean" or "none") over all processes, times ``scale``."""
        return _ops.reduce(tensor, reduction=reduction, scale=scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        """Return ``tensor`` padded along ``dim`` to the largest size over processes."""
        return _ops.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    # ------------------------------------------------------------------ models and memory
    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> torch.nn.Module:
        """Return ``model`` without its DDP/FSDP/DeepSpeed wrapper (and fp32/compile wrappers when asked)."""
        return _other.extract_model_from_parallel(model, keep_fp32_wrapper, keep_torch_compile)

    def free_memory(self, *objects: Any) -> Any:
        """Forget the prepared objects, release ``objects`` and the device cache; return the released list."""
        self._checkpointer.prepared.forget_prepared()
        self.deepspeed_engine_wrapped = None
        self.step = 0
        return release_memory(*objects)

    def clear(self, *objects: Any) -> Any:
        """Alias of :meth:`free_memory`."""
        return self.free_memory(*objects)

    def __repr__(self) -> str:
        return (
            f"Accelerator(distributed_type={self.distributed_type.value}, num_processes={self.num_processes}, "
            f"process_index={self.process_index}, device={self.device}, mixed_precision={self.mixed_precision!r})"
        )


def _only_tensors(data: Any) -> bool:
    """Return whether ``data`` is a tensor or nested lists/tuples/dicts of tensors only."""
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, (list, tuple)):
        return all(_only_tensors(item) for item in data)
    if isinstance(data, dict):
        return all(_only_tensors(item) for item in data.values())
    return False


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
        type(obj).__name__.endswith(("LR", "Scheduler"))
        and hasattr(obj, "step")
        and hasattr(obj, "optimizer")
    )
