"""Plugins passed to the Accelerator: DeepSpeed, FSDP, gradient accumulation, Megatron-LM, torch.compile.

Each is a dataclass that validates its fields in ``__post_init__`` (a bad value raises ValueError
naming the field and the valid choices). Fields left at ``None`` fall back to the ``ACCELERATE_*`` /
``FSDP_*`` / ``MEGATRON_LM_*`` variables that ``accelerate launch`` exports, then to Accelerate's
defaults. The engines themselves (deepspeed, megatron-core) are imported only when used.
``DeepSpeedPlugin`` lives in ``deepspeed_plugin.py`` and is re-exported here.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ._validation import choice as _choice
from ._validation import env as _env
from ._validation import positive_int as _positive_int
from .deepspeed_plugin import DeepSpeedPlugin
from .enums import DynamoBackend
from .environment import parse_flag_from_env, str_to_bool

__all__ = [
    "DeepSpeedPlugin",
    "FullyShardedDataParallelPlugin",
    "GradientAccumulationPlugin",
    "MegatronLMPlugin",
    "TorchDynamoPlugin",
]

logger = logging.getLogger(__name__)


# =============================================================================================
# Gradient accumulation


@dataclass
class GradientAccumulationPlugin:
    """Configure gradient accumulation: ``Accelerator(gradient_accumulation_plugin=...)``."""

    num_steps: int = None
    """Number of steps to accumulate gradients over (None: the Accelerator's own setting)."""
    adjust_scheduler: bool = True
    """Whether the learning-rate scheduler steps account for accumulation."""
    sync_with_dataloader: bool = True
    """Whether gradients are synchronised at the end of the dataloader even mid-accumulation."""
    sync_each_batch: bool = False
    """Whether gradients are synchronised on every batch (lower memory, slower under DDP)."""

    def __post_init__(self) -> None:
        if self.num_steps is not None:
            _positive_int("GradientAccumulationPlugin", "num_steps", self.num_steps)


# =============================================================================================
# torch.compile


_DYNAMO_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class TorchDynamoPlugin:
    """Configure ``torch.compile`` for the prepared model.

    Unset fields read ``ACCELERATE_DYNAMO_BACKEND`` (default "no"), ``ACCELERATE_DYNAMO_MODE``
    (default "default"), ``ACCELERATE_DYNAMO_USE_FULLGRAPH`` and ``ACCELERATE_DYNAMO_USE_DYNAMIC``.
    """

    backend: DynamoBackend = None
    """A DynamoBackend member or its name (case-insensitive), e.g. "inductor"."""
    mode: str = None
    """One of "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"."""
    fullgraph: bool = None
    """Whether to require a single graph (no graph breaks)."""
    dynamic: bool = None
    """Whether to compile with dynamic shapes (None: torch decides)."""
    options: Any = None
    """Backend options dict (cannot be combined with a non-default ``mode``)."""
    disable: bool = False
    """Turn compilation into a no-op (debugging)."""
    use_regional_compilation: bool = None
    """Compile repeated blocks once each instead of the whole model."""

    def __post_init__(self) -> None:
        owner = "TorchDynamoPlugin"
        if self.backend is None:
            self.backend = _env("ACCELERATE_DYNAMO_BACKEND", "no")
        name = self.backend.value if isinstance(self.backend, DynamoBackend) else str(self.backend).upper()
        self.backend = DynamoBackend(_choice(owner, "backend", name, tuple(DynamoBackend.list())))
        if self.mode is None:
            self.mode = _env("ACCELERATE_DYNAMO_MODE", "default")
        _choice(owner, "mode", self.mode, _DYNAMO_MODES)
        if self.fullgraph is None:
            self.fullgraph = parse_flag_from_env("ACCELERATE_DYNAMO_USE_FULLGRAPH", False)
        if self.dynamic is None and os.environ.get("ACCELERATE_DYNAMO_USE_DYNAMIC"):
            self.dynamic = parse_flag_from_env("ACCELERATE_DYNAMO_USE_DYNAMIC")
        if self.use_regional_compilation is None:
            self.use_regional_compilation = parse_flag_from_env(
                "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", False
            )
        if self.options is not None:
            if not isinstance(self.options, dict):
                raise TypeError(f"{owner}: options must be a dict of backend options, got {self.options!r}")
            if self.mode != "default":
                raise ValueError(
                    f"{owner}: torch.compile takes either mode or options, not both (mode={self.mode!r}, "
                    f"options={self.options!r}); leave mode unset or drop options"
                )

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as plain values (backend as its lower-case torch.compile name)."""
        return {
            "backend": self.backend.value.lower(),
            "mode": self.mode,
            "fullgraph": self.fullgraph,
            "dynamic": self.dynamic,
            "options": self.options,
            "disable": self.disable,
        }

    def to_kwargs(self) -> dict[str, Any]:
        """Return the keyword arguments for ``torch.compile(model, **kwargs)``."""
        kwargs = self.to_dict()
        if kwargs["options"] is not None:
            kwargs.pop("mode")
        else:
            kwargs.pop("options")
        return kwargs


# =============================================================================================
# FSDP


_SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
_STATE_DICT_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")
_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}  # fmt: skip


def _enum_by_name(owner: str, name: str, value: Any, choices: tuple, enum_cls: Any) -> Any:
    """Map a member, its name (case-insensitive) or its 1-based index in ``choices`` to ``enum_cls``."""
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if not 1 <= value <= len(choices):
            raise ValueError(
                f"{owner}: {name}={value!r} is out of range; use 1..{len(choices)} or one of {list(choices)}"
            )
        value = choices[value - 1]
    key = str(value).upper()
    _choice(owner, name, key, choices)
    return enum_cls[key]


@dataclass
class FullyShardedDataParallelPlugin:
    """Configure PyTorch FullyShardedDataParallel (FSDP).

    String / int settings are mapped to the ``torch.distributed.fsdp`` enums. Unset fields read
    ``FSDP_SHARDING_STRATEGY`` (default FULL_SHARD), ``FSDP_BACKWARD_PREFETCH``, ``FSDP_OFFLOAD_PARAMS``,
    ``FSDP_STATE_DICT_TYPE`` (default FULL_STATE_DICT), ``FSDP_AUTO_WRAP_POLICY``,
    ``FSDP_TRANSFORMER_CLS_TO_WRAP`` and ``FSDP_MIN_NUM_PARAMS``.
    """

    sharding_strategy: Any = None
    """FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2 (name, 1-based int or enum)."""
    backward_prefetch: Any = None
    """BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH (None)."""
    mixed_precision_policy: Any = None
    """A ``MixedPrecision`` or a dict of its fields (dtypes may be strings like "bf16")."""
    auto_wrap_policy: Callable | None = None
    """TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP, or a callable policy."""
    cpu_offload: Any = None
    """A ``CPUOffload`` or a bool (offload parameters to CPU)."""
    ignored_modules: Any | None = None
    state_dict_type: Any = None
    """FULL_STATE_DICT, LOCAL_STATE_DICT or SHARDED_STATE_DICT."""
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool = True
    param_init_fn: Callable | None = None
    sync_module_states: bool = True
    forward_prefetch: bool = False
    activation_checkpointing: bool = False
    transformer_cls_names_to_wrap: list[str] | None = None
    """Layer class names wrapped by TRANSFORMER_BASED_WRAP (default: the model's ``_no_split_modules``)."""
    min_num_params: int | None = None
    """Parameter threshold of SIZE_BASED_WRAP (default 100,000,000)."""

    def __post_init__(self) -> None:
        from torch.distributed import fsdp

        owner = "FullyShardedDataParallelPlugin"
        if self.sharding_strategy is None:
            self.sharding_strategy = _env("FSDP_SHARDING_STRATEGY", "FULL_SHARD")
        self.sharding_strategy = _enum_by_name(
            owner, "sharding_strategy", self.sharding_strategy, _SHARDING, fsdp.ShardingStrategy
        )

        if self.backward_prefetch is None:
            self.backward_prefetch = _env("FSDP_BACKWARD_PREFETCH", "NO_PREFETCH")
        if not isinstance(self.backward_prefetch, fsdp.BackwardPrefetch):
            name = self.backward_prefetch
            if isinstance(name, int) or (isinstance(name, str) and name.isdigit()):
                name = _PREFETCH[int(name) - 1] if 1 <= int(name) <= len(_PREFETCH) else name
            name = _choice(owner, "backward_prefetch", str(name).upper(), _PREFETCH)
            self.backward_prefetch = None if name == "NO_PREFETCH" else fsdp.BackwardPrefetch[name]

        if self.cpu_offload is None:
            self.cpu_offload = parse_flag_from_env("FSDP_OFFLOAD_PARAMS", False)
        if isinstance(self.cpu_offload, bool):
            self.cpu_offload = fsdp.CPUOffload(offload_params=self.cpu_offload)
        elif not isinstance(self.cpu_offload, fsdp.CPUOffload):
            raise TypeError(f"{owner}: cpu_offload must be a bool or a CPUOffload, got {self.cpu_offload!r}")

        if self.state_dict_type is None:
            self.state_dict_type = _env("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
        self.state_dict_type = _enum_by_name(
            owner, "state_dict_type", self.state_dict_type, _STATE_DICT_TYPES, fsdp.StateDictType
        )
        if self.state_dict_type == fsdp.StateDictType.FULL_STATE_DICT:
            if self.state_dict_config is None:
                self.state_dict_config = fsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            if self.optim_state_dict_config is None:
                self.optim_state_dict_config = fsdp.FullOptimStateDictConfig(
                    offload_to_cpu=True, rank0_only=True
                )
        elif self.state_dict_type == fsdp.StateDictType.SHARDED_STATE_DICT:
            if self.state_dict_config is None:
                self.state_dict_config = fsdp.ShardedStateDictConfig(offload_to_cpu=True)
            if self.optim_state_dict_config is None:
                self.optim_state_dict_config = fsdp.ShardedOptimStateDictConfig(offload_to_cpu=True)

        if self.auto_wrap_policy is None:
            self.auto_wrap_policy = _env("FSDP_AUTO_WRAP_POLICY", "NO_WRAP")
        if isinstance(self.auto_wrap_policy, str):
            self.auto_wrap_policy = _choice(
                owner, "auto_wrap_policy", self.auto_wrap_policy.upper(), _WRAP_POLICIES
            )
        elif not callable(self.auto_wrap_policy):
            raise TypeError(
                f"{owner}: auto_wrap_policy must be a policy name or a callable, got {self.auto_wrap_policy!r}"
            )
        if self.transformer_cls_names_to_wrap is None and os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP"):
            self.transformer_cls_names_to_wrap = os.environ["FSDP_TRANSFORMER_CLS_TO_WRAP"].split(",")
        if isinstance(self.transformer_cls_names_to_wrap, str):
            self.transformer_cls_names_to_wrap = self.transformer_cls_names_to_wrap.split(",")
        if self.min_num_params is None:
            self.min_num_params = int(_env("FSDP_MIN_NUM_PARAMS", "100000000"))
        if self.min_num_params < 0:
            raise ValueError(f"{owner}: min_num_params must be >= 0, got {self.min_num_params!r}")

        if isinstance(self.mixed_precision_policy, dict):
            self.mixed_precision_policy = self._mixed_precision_from_dict(self.mixed_precision_policy)

    @staticmethod
    def _mixed_precision_from_dict(spec: dict) -> Any:
        from torch.distributed.fsdp import MixedPrecision

        kwargs = dict(spec)
        for key in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = kwargs.get(key)
            if isinstance(value, str):
                if value not in _DTYPES:
                    raise ValueError(
                        f"FullyShardedDataParallelPlugin: mixed_precision_policy[{key!r}]={value!r} is not a dtype; "
                        f"choose one of {list(_DTYPES)}"
                    )
                kwargs[key] = _DTYPES[value]
        try:
            return MixedPrecision(**kwargs)
        except TypeError as exc:
            raise TypeError(
                f"FullyShardedDataParallelPlugin: bad mixed_precision_policy {spec!r}: {exc}"
            ) from None

    def set_mixed_precision(
        self, mixed_precision: str, buffer_autocast: bool = False, override: bool = False
    ) -> None:
        """Set the MixedPrecision policy for "fp16" / "bf16" / "fp32" (unless one is set and not ``override``)."""
        dtype = {
            "fp16": torch.float16,
            "bf16": torch.bfloat16,
            "fp32": torch.float32,
            "no": torch.float32,
        }.get(mixed_precision)
        if dtype is None:
            raise ValueError(
                f"FullyShardedDataParallelPlugin: unknown mixed_precision {mixed_precision!r}; use fp16, bf16 or fp32"
            )
        if self.mixed_precision_policy is None or override:
            from torch.distributed.fsdp import MixedPrecision

            buffer_dtype = dtype if buffer_autocast else torch.float32
            self.mixed_precision_policy = MixedPrecision(
                param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=buffer_dtype
            )

    @staticmethod
    def get_module_class_from_name(module: torch.nn.Module, name: str) -> type | None:
        """Return the class called ``name`` among ``module`` and its submodules, or None."""
        if module.__class__.__name__ == name:
            return module.__class__
        for child in module.children():
            found = FullyShardedDataParallelPlugin.get_module_class_from_name(child, name)
            if found is not None:
                return found
        return None

    def set_auto_wrap_policy(self, model: torch.nn.Module) -> None:
        """Turn a policy name into the callable FSDP uses, resolving layer class names in ``model``."""
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

        if self.auto_wrap_policy == "TRANSFORMER_BASED_WRAP":
            names = self.transformer_cls_names_to_wrap or list(
                getattr(model, "_no_split_modules", None) or []
            )
            if not names:
                raise ValueError(
                    "FullyShardedDataParallelPlugin: TRANSFORMER_BASED_WRAP needs layer class names; set "
                    "transformer_cls_names_to_wrap (or FSDP_TRANSFORMER_CLS_TO_WRAP)"
                )
            classes = set()
            for name in names:
                cls = self.get_module_class_from_name(model, name.strip())
                if cls is None:
                    available = sorted({m.__class__.__name__ for m in model.modules()})
                    raise ValueError(
                        f"FullyShardedDataParallelPlugin: no layer class {name!r} in the model; classes present: {available}"
                    )
                classes.add(cls)
            self.auto_wrap_policy = functools.partial(
                transformer_auto_wrap_policy, transformer_layer_cls=classes
            )
        elif self.auto_wrap_policy == "SIZE_BASED_WRAP":
            self.auto_wrap_policy = functools.partial(
                size_based_auto_wrap_policy, min_num_params=self.min_num_params
            )
        elif self.auto_wrap_policy == "NO_WRAP":
            self.auto_wrap_policy = None

    def to_fsdp_kwargs(self) -> dict[str, Any]:
        """Return the keyword arguments for ``FullyShardedDataParallel(module, **kwargs)``."""
        policy = self.auto_wrap_policy
        return {
            "sharding_strategy": self.sharding_strategy,
            "cpu_offload": self.cpu_offload,
            "auto_wrap_policy": None if isinstance(policy, str) else policy,
            "mixed_precision": self.mixed_precision_policy,
            "backward_prefetch": self.backward_prefetch,
            "ignored_modules": self.ignored_modules,
            "param_init_fn": self.param_init_fn,
            "sync_module_states": self.sync_module_states,
            "forward_prefetch": self.forward_prefetch,
            "limit_all_gathers": self.limit_all_gathers,
            "use_orig_params": self.use_orig_params,
        }


# =============================================================================================
# Megatron-LM


_WD_STYLES = ("constant", "linear", "cosine")
_LR_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")


@dataclass
class MegatronLMPlugin:
    """Configure Megatron-LM: tensor, pipeline, sequence and data parallelism, activation recompute.

    Unset parallel degrees read ``MEGATRON_LM_TP_DEGREE``, ``MEGATRON_LM_PP_DEGREE``,
    ``MEGATRON_LM_NUM_MICRO_BATCHES`` (default 1 each), ``MEGATRON_LM_GRADIENT_CLIPPING`` (1.0),
    ``MEGATRON_LM_SEQUENCE_PARALLELISM``, ``MEGATRON_LM_RECOMPUTE_ACTIVATIONS`` and
    ``MEGATRON_LM_USE_DISTRIBUTED_OPTIMIZER``. ``megatron_lm_default_args`` holds the Megatron argument
    dict; ``require_megatron()`` raises ImportError naming megatron-core when it is missing.
    """

    tp_degree: int = None
    pp_degree: int = None
    num_micro_batches: int = None
    gradient_clipping: float = None
    sequence_parallelism: bool = None
    recompute_activations: bool = None
    use_distributed_optimizer: bool = None
    pipeline_model_parallel_split_rank: int = None
    num_layers_per_virtual_pipeline_stage: int = None
    is_train_batch_min: str = True
    train_iters: int = None
    train_samples: int = None
    weight_decay_incr_style: str = "constant"
    start_weight_decay: float = None
    end_weight_decay: float = None
    lr_decay_style: str = "linear"
    lr_decay_iters: int = None
    lr_decay_samples: int = None
    lr_warmup_iters: int = None
    lr_warmup_samples: int = None
    lr_warmup_fraction: float = None
    min_lr: float = 0
    consumed_samples: list[int] = None
    no_wd_decay_cond: Callable | None = None
    scale_lr_cond: Callable | None = None
    lr_mult: float = 1.0
    megatron_dataset_flag: bool = False
    seq_length: int = None
    encoder_seq_length: int = None
    decoder_seq_length: int = None
    tensorboard_dir: str = None
    set_all_logging_options: bool = False
    eval_iters: int = 100
    eval_interval: int = 1000
    return_logits: bool = False
    custom_train_step_class: Any | None = None
    custom_train_step_kwargs: dict[str, Any] | None = None
    custom_model_provider_function: Callable | None = None
    custom_prepare_model_function: Callable | None = None
    other_megatron_args: dict[str, Any] | None = None
    megatron_lm_default_args: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        owner = "MegatronLMPlugin"
        for name, var, default in (
            ("tp_degree", "MEGATRON_LM_TP_DEGREE", "1"),
            ("pp_degree", "MEGATRON_LM_PP_DEGREE", "1"),
            ("num_micro_batches", "MEGATRON_LM_NUM_MICRO_BATCHES", "1"),
        ):
            if getattr(self, name) is None:
                setattr(self, name, int(_env(var, default)))
            _positive_int(owner, name, getattr(self, name))
        if self.gradient_clipping is None:
            self.gradient_clipping = float(_env("MEGATRON_LM_GRADIENT_CLIPPING", "1.0"))
        if self.gradient_clipping < 0:
            raise ValueError(f"{owner}: gradient_clipping must be >= 0, got {self.gradient_clipping!r}")
        for name in ("sequence_parallelism", "recompute_activations", "use_distributed_optimizer"):
            if getattr(self, name) is None:
                setattr(self, name, bool(str_to_bool(_env(f"MEGATRON_LM_{name.upper()}", "false"))))
        _choice(owner, "weight_decay_incr_style", self.weight_decay_incr_style, _WD_STYLES)
        _choice(owner, "lr_decay_style", self.lr_decay_style, _LR_STYLES)
        if self.sequence_parallelism and self.tp_degree == 1:
            raise ValueError(
                f"{owner}: sequence_parallelism needs tensor parallelism; set tp_degree > 1 (got 1)"
            )
        if self.num_layers_per_virtual_pipeline_stage is not None and self.pp_degree == 1:
            raise ValueError(f"{owner}: num_layers_per_virtual_pipeline_stage needs pp_degree > 1 (got 1)")
        if self.lr_warmup_fraction is not None and not 0.0 <= self.lr_warmup_fraction <= 1.0:
            raise ValueError(
                f"{owner}: lr_warmup_fraction must be in [0, 1], got {self.lr_warmup_fraction!r}"
            )
        if self.consumed_samples is None:
            self.consumed_samples = [0, 0, 0]
        if len(self.consumed_samples) != 3:
            raise ValueError(
                f"{owner}: consumed_samples is [train, valid, test]; got {self.consumed_samples!r}"
            )

        args: dict[str, Any] = {
            "tensor_model_parallel_size": self.tp_degree,
            "pipeline_model_parallel_size": self.pp_degree,
            "pipeline_model_parallel_split_rank": self.pipeline_model_parallel_split_rank,
            "num_layers_per_virtual_pipeline_stage": self.num_layers_per_virtual_pipeline_stage,
            "DDP_impl": "local",
            "use_distributed_optimizer": self.use_distributed_optimizer,
            "sequence_parallel": self.sequence_parallelism,
            "clip_grad": self.gradient_clipping,
            "num_micro_batches": self.num_micro_batches,
            "consumed_samples": self.consumed_samples,
            "no_wd_decay_cond": self.no_wd_decay_cond,
            "scale_lr_cond": self.scale_lr_cond,
            "lr_mult": self.lr_mult,
            "megatron_dataset_flag": self.megatron_dataset_flag,
            "eval_iters": self.eval_iters,
            "eval_interval": self.eval_interval,
        }
        if self.recompute_activations:
            args["recompute_granularity"] = "selective"
        if self.tensorboard_dir is not None:
            args["tensorboard_dir"] = self.tensorboard_dir
            if self.set_all_logging_options:
                for flag in (
                    "log_timers_to_tensorboard",
                    "log_validation_ppl_to_tensorboard",
                    "log_memory_to_tensorboard",
                ):
                    args[flag] = True
        if self.other_megatron_args is not None:
            args.update(self.other_megatron_args)
        self.megatron_lm_default_args = args

    @staticmethod
    def require_megatron() -> None:
        """Raise ImportError naming megatron-core when Megatron-LM is not installed."""
        from .imports import is_megatron_lm_available

        if not is_megatron_lm_available():
            raise ImportError(
                "MegatronLMPlugin requires Megatron-LM (`megatron.core`): pip install megatron-core"
            )
