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
from typing import Any

from ._validation import choice as _choice
from ._validation import env as _env
from ._validation import positive_int as _positive_int
from .environment import str_to_bool
from .imports import is_megatron_lm_available

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
_TENSORBOARD_FLAGS = (
    "log_timers_to_tensorboard",
    "log_validation_ppl_to_tensorboard",
    "log_memory_to_tensorboard",
)


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

    @staticmethod
    def require_megatron() -> None:
        """Raise ImportError naming megatron-core when Megatron-LM is not installed."""
        if not is_megatron_lm_available():
            raise ImportError(
                "MegatronLMPlugin requires Megatron-LM (`megatron.core`, NVIDIA GPUs): pip install megatron-core"
            )
