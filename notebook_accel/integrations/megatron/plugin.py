"""``MegatronLMPlugin``: Megatron-LM's parallel layout and training options, validated without Megatron.

Megatron-LM runs only on NVIDIA GPUs with ``megatron-core`` installed, so notebook_accel does not
train with it; it keeps the configuration whole so a script moves unchanged to a machine where
Accelerate drives Megatron. The plugin's fields become Megatron's command-line arguments through
one declarative table (``_RENAMED``: our field -> Megatron's argument) plus a few derived
arguments, instead of an argument-by-argument body.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...utils._validation import choice as _choice
from ...utils._validation import env as _env
from ...utils._validation import positive_int as _positive_int
from ...utils.environment import str_to_bool
from ...utils.imports import is_megatron_lm_available
from .config import MODEL_CONFIGS_TO_MEGATRON_PARSERS

if TYPE_CHECKING:
    import torch

__all__ = ["MegatronLMPlugin"]

_OWNER = "MegatronLMPlugin"
_WD_STYLES = ("constant", "linear", "cosine")
_LR_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_RECOMPUTE_GRANULARITY = ("full", "selective")
_RECOMPUTE_METHODS = ("uniform", "block")
# Fields whose Megatron argument has another name; every other field listed in _PASSED keeps its name.
_RENAMED = {
    "tp_degree": "tensor_model_parallel_size",
    "pp_degree": "pipeline_model_parallel_size",
    "gradient_clipping": "clip_grad",
    "sequence_parallelism": "sequence_parallel",
    "use_rotary_position_embeddings": "position_embedding_type",
}
# Fields handed to Megatron as they are (when set); the rest configure this plugin or Accelerate's loop.
_PASSED = (
    "tp_degree", "pp_degree", "num_micro_batches", "gradient_clipping", "sequence_parallelism",
    "use_distributed_optimizer", "pipeline_model_parallel_split_rank", "num_layers_per_virtual_pipeline_stage",
    "consumed_samples", "no_wd_decay_cond", "scale_lr_cond", "lr_mult", "megatron_dataset_flag", "eval_iters",
    "eval_interval", "use_custom_fsdp", "overlap_cpu_optimizer_d2h_h2d", "no_load_optim", "eod_mask_loss",
    "no_save_optim", "optimizer_cpu_offload", "use_precision_aware_optimizer", "decoder_last_pipeline_num_layers",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "attention_backend",
    "expert_model_parallel_size", "context_parallel_size", "attention_dropout", "hidden_dropout",
    "attention_softmax_in_fp32", "expert_tensor_parallel_size", "calculate_per_token_loss",
)  # fmt: skip
_OPTIMIZERS = {"Adam": "adam", "AdamW": "adam", "SGD": "sgd"}
_TENSORBOARD_FLAGS = (
    "log_timers_to_tensorboard",
    "log_validation_ppl_to_tensorboard",
    "log_memory_to_tensorboard",
)


def _scheduler_steps(scheduler: object) -> tuple[int | None, int]:
    """Return the ``MegatronLMDummyScheduler``'s total and warm-up steps (ValueError for another scheduler).

    Accelerate's Megatron-LM guide spells them ``num_training_steps`` / ``num_warmup_steps`` (they land in
    ``kwargs``); those count when ``total_num_steps`` / ``warmup_num_steps`` are left at their defaults.
    """
    if not all(hasattr(scheduler, name) for name in ("total_num_steps", "warmup_num_steps", "kwargs")):
        raise ValueError(
            f"Megatron-LM builds its own learning-rate schedule; got {type(scheduler).__name__}: pass "
            "MegatronLMDummyScheduler(optimizer, total_num_steps=..., warmup_num_steps=...)"
        )
    total = scheduler.total_num_steps
    if total is None:
        total = scheduler.kwargs.get("num_training_steps")
    warmup = scheduler.warmup_num_steps or scheduler.kwargs.get("num_warmup_steps", 0)
    return total, warmup


def _optimizer_args(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Return Megatron's optimizer type and the hyperparameters of ``optimizer``'s first parameter group."""
    kind = _OPTIMIZERS.get(type(optimizer).__name__)
    if kind is None:
        raise ValueError(
            f"Megatron-LM builds Adam or SGD optimizers; got {type(optimizer).__name__}: use torch.optim.AdamW, "
            "Adam or SGD (their hyperparameters are handed over)"
        )
    group = optimizer.param_groups[0]
    args = {"optimizer": kind, "lr": group["lr"], "weight_decay": group.get("weight_decay", 0.0)}
    if kind == "adam":
        args.update(adam_beta1=group["betas"][0], adam_beta2=group["betas"][1], adam_eps=group["eps"])
    else:
        args["sgd_momentum"] = group.get("momentum", 0.0)
    return args


def _batch_args(micro_batch_size: int, num_micro_batches: int, dp_degree: int) -> dict[str, int]:
    """Return the micro/global batch sizes and data-parallel size: global = micro x micro-batches x dp."""
    return {
        "micro_batch_size": micro_batch_size,
        "global_batch_size": micro_batch_size * num_micro_batches * dp_degree,
        "data_parallel_size": dp_degree,
    }


def _decay_args(plugin: MegatronLMPlugin) -> dict[str, Any]:
    """Return the plugin's learning-rate / weight-decay schedule settings that are set."""
    names = ("lr_decay_style", "min_lr", "weight_decay_incr_style", "lr_decay_iters")
    return {name: getattr(plugin, name) for name in names if getattr(plugin, name, None) is not None}


@dataclass
class MegatronLMPlugin:
    """Configure Megatron-LM: tensor, pipeline, expert, context and data parallelism, recompute, schedules.

    Unset degrees read ``MEGATRON_LM_TP_DEGREE``, ``MEGATRON_LM_PP_DEGREE``, ``MEGATRON_LM_NUM_MICRO_BATCHES``
    (1 each), ``MEGATRON_LM_GRADIENT_CLIPPING`` (1.0), ``MEGATRON_LM_SEQUENCE_PARALLELISM``,
    ``MEGATRON_LM_RECOMPUTE_ACTIVATIONS`` and ``MEGATRON_LM_USE_DISTRIBUTED_OPTIMIZER``.
    ``megatron_lm_default_args`` holds the resulting Megatron arguments; ``require_megatron()`` raises
    ImportError naming megatron-core when it is missing.
    """

    tp_degree: int = None
    """Tensor-parallel degree."""
    pp_degree: int = None
    """Pipeline-parallel degree."""
    use_custom_fsdp: bool = None
    """Use Megatron's own FSDP implementation."""
    overlap_cpu_optimizer_d2h_h2d: bool = None
    """Overlap the optimizer's device/host copies when it is offloaded."""
    no_load_optim: bool = None
    """Skip loading the optimizer state from checkpoints."""
    eod_mask_loss: bool = None
    """Mask the loss at end-of-document tokens."""
    no_save_optim: bool = None
    """Skip saving the optimizer state in checkpoints."""
    optimizer_cpu_offload: bool = None
    """Keep the optimizer state in CPU memory."""
    use_precision_aware_optimizer: bool = None
    """Let the optimizer keep lower-precision master weights and states."""
    decoder_last_pipeline_num_layers: int = None
    """Number of decoder layers in the last pipeline stage."""
    recompute_granularity: str = None
    """Activation recompute: "full" or "selective"."""
    recompute_method: str = None
    """How layers are recomputed with full granularity: "uniform" or "block"."""
    recompute_num_layers: int = None
    """Layers per recompute unit (full granularity)."""
    attention_backend: Any = None
    """Megatron's attention implementation (an ``AttnBackend`` value)."""
    expert_model_parallel_size: int = None
    """Expert (MoE) parallel degree."""
    context_parallel_size: int = None
    """Context-parallel degree (sequence split across ranks)."""
    attention_dropout: float = None
    """Dropout on attention probabilities."""
    hidden_dropout: float = None
    """Dropout on hidden states."""
    attention_softmax_in_fp32: bool = None
    """Compute the attention softmax in fp32."""
    expert_tensor_parallel_size: int = None
    """Tensor-parallel degree inside experts."""
    calculate_per_token_loss: bool = None
    """Average the loss over tokens rather than over micro-batches."""
    use_rotary_position_embeddings: bool = None
    """Use rotary position embeddings (Megatron's position_embedding_type="rope")."""
    num_micro_batches: int = None
    """Micro-batches per step in the pipeline schedule."""
    gradient_clipping: float = None
    """Global gradient-norm clipping value (0 disables)."""
    sequence_parallelism: bool = None
    """Split layer norms and dropout along the sequence (needs tp_degree > 1)."""
    recompute_activations: bool = None
    """Recompute activations selectively (shorthand for recompute_granularity="selective")."""
    use_distributed_optimizer: bool = None
    """Shard the optimizer state across data-parallel ranks."""
    pipeline_model_parallel_split_rank: int = None
    """Rank where encoder and decoder split in encoder-decoder pipelines."""
    num_layers_per_virtual_pipeline_stage: int = None
    """Layers per virtual (interleaved) pipeline stage (needs pp_degree > 1)."""
    is_train_batch_min: str = True
    """With several train batch sizes, whether the smallest one is used."""
    train_iters: int = None
    """Total training iterations (for the schedulers)."""
    train_samples: int = None
    """Total training samples (instead of train_iters)."""
    weight_decay_incr_style: str = "constant"
    """Weight-decay schedule: "constant", "linear" or "cosine"."""
    start_weight_decay: float = None
    """Weight decay at the start of a non-constant schedule."""
    end_weight_decay: float = None
    """Weight decay at the end of a non-constant schedule."""
    lr_decay_style: str = "linear"
    """Learning-rate decay: "constant", "linear", "cosine", "inverse-square-root" or "WSD"."""
    lr_decay_iters: int = None
    """Iterations over which the learning rate decays."""
    lr_decay_samples: int = None
    """Samples over which the learning rate decays."""
    lr_warmup_iters: int = None
    """Linear warm-up iterations."""
    lr_warmup_samples: int = None
    """Linear warm-up samples."""
    lr_warmup_fraction: float = None
    """Warm-up as a fraction of the decay span, in [0, 1]."""
    min_lr: float = 0
    """Floor of the learning rate."""
    consumed_samples: list[int] = None
    """Samples already consumed for [train, valid, test] (resume); default [0, 0, 0]."""
    no_wd_decay_cond: Callable | None = None
    """Predicate choosing parameters without weight decay."""
    scale_lr_cond: Callable | None = None
    """Predicate choosing parameters whose learning rate is scaled by lr_mult."""
    lr_mult: float = 1.0
    """Learning-rate multiplier for the parameters scale_lr_cond selects."""
    megatron_dataset_flag: bool = False
    """Whether the dataset is in Megatron's own format."""
    seq_length: int = None
    """Maximum sequence length."""
    encoder_seq_length: int = None
    """Encoder sequence length (encoder-decoder models)."""
    decoder_seq_length: int = None
    """Decoder sequence length (encoder-decoder models)."""
    tensorboard_dir: str = None
    """Where Megatron writes TensorBoard logs."""
    set_all_logging_options: bool = False
    """Also log timers, validation perplexity and memory to TensorBoard."""
    eval_iters: int = 100
    """Iterations per evaluation."""
    eval_interval: int = 1000
    """Training iterations between evaluations."""
    return_logits: bool = False
    """Return logits from the custom train step."""
    custom_train_step_class: Any | None = None
    """A replacement for Accelerate's Megatron train-step class."""
    custom_train_step_kwargs: dict[str, Any] | None = None
    """Keyword arguments of the custom train step."""
    custom_model_provider_function: Callable | None = None
    """Builds the Megatron model."""
    custom_prepare_model_function: Callable | None = None
    """Prepares the Megatron model instead of the default preparation."""
    custom_megatron_datasets_provider_function: Callable | None = None
    """Builds the Megatron datasets."""
    custom_get_batch_function: Callable | None = None
    """Reads one batch for the train step."""
    custom_loss_function: Callable | None = None
    """Computes the loss from the model output."""
    other_megatron_args: dict[str, Any] | None = None
    """Further Megatron arguments, applied last (they win over everything above)."""

    def __post_init__(self) -> None:
        self._read_environment()
        self._validate()
        self.megatron_lm_default_args: dict[str, Any] = self._megatron_args()

    def _read_environment(self) -> None:
        for name, default in (("tp_degree", "1"), ("pp_degree", "1"), ("num_micro_batches", "1")):
            if getattr(self, name) is None:
                setattr(self, name, int(_env(f"MEGATRON_LM_{name.upper()}", default)))
        if self.gradient_clipping is None:
            self.gradient_clipping = float(_env("MEGATRON_LM_GRADIENT_CLIPPING", "1.0"))
        for name in ("sequence_parallelism", "recompute_activations", "use_distributed_optimizer"):
            if getattr(self, name) is None:
                setattr(self, name, bool(str_to_bool(_env(f"MEGATRON_LM_{name.upper()}", "false"))))
        if self.consumed_samples is None:
            self.consumed_samples = [0, 0, 0]
        if self.recompute_activations and self.recompute_granularity is None:
            self.recompute_granularity = "selective"

    def _validate(self) -> None:
        for name in ("tp_degree", "pp_degree", "num_micro_batches"):
            _positive_int(_OWNER, name, getattr(self, name))
        for name in ("expert_model_parallel_size", "context_parallel_size", "expert_tensor_parallel_size"):
            if getattr(self, name) is not None:
                _positive_int(_OWNER, name, getattr(self, name))
        if self.gradient_clipping < 0:
            raise ValueError(f"{_OWNER}: gradient_clipping must be >= 0, got {self.gradient_clipping!r}")
        _choice(_OWNER, "weight_decay_incr_style", self.weight_decay_incr_style, _WD_STYLES)
        _choice(_OWNER, "lr_decay_style", self.lr_decay_style, _LR_STYLES)
        if self.recompute_granularity is not None:
            _choice(_OWNER, "recompute_granularity", self.recompute_granularity, _RECOMPUTE_GRANULARITY)
        if self.recompute_method is not None:
            _choice(_OWNER, "recompute_method", self.recompute_method, _RECOMPUTE_METHODS)
        if self.sequence_parallelism and self.tp_degree == 1:
            raise ValueError(
                f"{_OWNER}: sequence_parallelism needs tensor parallelism; set tp_degree > 1 (got 1)"
            )
        if self.num_layers_per_virtual_pipeline_stage is not None and self.pp_degree == 1:
            raise ValueError(f"{_OWNER}: num_layers_per_virtual_pipeline_stage needs pp_degree > 1 (got 1)")
        if self.lr_warmup_fraction is not None and not 0.0 <= self.lr_warmup_fraction <= 1.0:
            raise ValueError(
                f"{_OWNER}: lr_warmup_fraction must be in [0, 1], got {self.lr_warmup_fraction!r}"
            )
        if len(self.consumed_samples) != 3:
            raise ValueError(
                f"{_OWNER}: consumed_samples is [train, valid, test]; got {self.consumed_samples!r}"
            )
        for name in ("attention_dropout", "hidden_dropout"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ValueError(f"{_OWNER}: {name} must be in [0, 1), got {value!r}")

    def _megatron_args(self) -> dict[str, Any]:
        args = {
            _RENAMED.get(name, name): getattr(self, name)
            for name in _PASSED
            if getattr(self, name) is not None
        }
        # Accelerate's Megatron loop wraps models in Megatron's own DDP ("local").
        args["DDP_impl"] = "local"
        if self.use_rotary_position_embeddings:
            args["position_embedding_type"] = "rope"
        else:
            args.pop("position_embedding_type", None)
        if self.tensorboard_dir is not None:
            args["tensorboard_dir"] = self.tensorboard_dir
            if self.set_all_logging_options:
                args.update(dict.fromkeys(_TENSORBOARD_FLAGS, True))
        args.update(self.other_megatron_args or {})
        return args

    # -- filled in by Accelerator.prepare from the objects it is given -----------------------------
    def set_network_size_args(self, model: Any, batch_data: Any = None) -> None:
        """Return None; fill the network size arguments (layers, hidden size, heads, ...) from ``model.config``.

        The parser is chosen by the transformers ``model_type`` (``MODEL_CONFIGS_TO_MEGATRON_PARSERS``; an
        entry contained in the type also matches, e.g. "bert" for "megatron-bert"); ``batch_data``'s
        ``input_ids`` width gives the sequence length when ``seq_length`` is unset.
        """
        model_type = str(getattr(getattr(model, "config", None), "model_type", "")).lower()
        parser = MODEL_CONFIGS_TO_MEGATRON_PARSERS.get(model_type)
        if parser is None:
            parser = next(
                (
                    parse
                    for name, parse in MODEL_CONFIGS_TO_MEGATRON_PARSERS.items()
                    if model_type and name in model_type
                ),
                None,
            )
        if parser is None:
            raise ValueError(
                f"{_OWNER}: no Megatron-LM network parser for model_type={model_type!r}; known types are "
                f"{sorted(MODEL_CONFIGS_TO_MEGATRON_PARSERS)} (register one with add_model_config_to_megatron_parser)"
            )
        parser(self, model, batch_data)

    def set_mixed_precision(self, mixed_precision: str) -> None:
        """Return None; turn on Megatron's ``fp16`` or ``bf16`` argument for that ``mixed_precision`` ("no": neither)."""
        _choice(_OWNER, "mixed_precision", mixed_precision, ("no", "fp16", "bf16", "fp8"))
        if mixed_precision in ("fp16", "bf16"):
            self.megatron_lm_default_args[mixed_precision] = True
        # Megatron's own DDP ("local") is what Accelerate's Megatron loop wraps models in.
        self.megatron_lm_default_args["DDP_impl"] = "local"

    def set_training_args(self, micro_batch_size: int, dp_degree: int) -> None:
        """Return None; set the micro batch, the global batch (micro x ``num_micro_batches`` x ``dp_degree``) and dp size."""
        _positive_int(_OWNER, "micro_batch_size", micro_batch_size)
        _positive_int(_OWNER, "dp_degree", dp_degree)
        args = _batch_args(micro_batch_size, self.num_micro_batches, dp_degree)
        self.micro_batch_size, self.global_batch_size = args["micro_batch_size"], args["global_batch_size"]
        self.megatron_lm_default_args.update(args)

    def set_optimizer_type(self, optimizer: torch.optim.Optimizer) -> None:
        """Return None; set Megatron's optimizer ("adam" or "sgd") and ``optimizer``'s lr, weight decay, betas/momentum."""
        self.megatron_lm_default_args.update(_optimizer_args(optimizer))

    def set_scheduler_args(self, scheduler: object) -> None:
        """Return None; set ``train_iters`` / ``lr_warmup_iters`` from a ``MegatronLMDummyScheduler`` (the plugin's win).

        The plugin's decay settings (``lr_decay_style``, ``min_lr``, ...) are set along with them.
        """
        total, warmup = _scheduler_steps(scheduler)
        train_iters = self.train_iters or total
        if train_iters is None:
            raise ValueError(
                f"{_OWNER}: Megatron-LM needs the number of training steps: give the MegatronLMDummyScheduler "
                "total_num_steps=... or the plugin train_iters=..."
            )
        args = {"train_iters": train_iters, "lr_warmup_iters": self.lr_warmup_iters or warmup}
        self.megatron_lm_default_args.update(args, **_decay_args(self))

    def set_tensorboard_logging_options(self) -> None:
        """Return None; turn on Megatron's timers, validation perplexity and memory logging to TensorBoard."""
        self.megatron_lm_default_args.update(dict.fromkeys(_TENSORBOARD_FLAGS, True))

    @staticmethod
    def require_megatron() -> None:
        """Raise ImportError naming megatron-core when Megatron-LM is not installed."""
        if not is_megatron_lm_available():
            raise ImportError(
                "MegatronLMPlugin requires Megatron-LM (`megatron.core`, NVIDIA GPUs): pip install megatron-core"
            )
