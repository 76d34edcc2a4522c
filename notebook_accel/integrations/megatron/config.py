"""Megatron-LM network arguments read from a transformers model's config, one parser per architecture.

``MODEL_CONFIGS_TO_MEGATRON_PARSERS`` maps a transformers ``model_type`` to its parser; each parser
fills ``megatron_lm_plugin.megatron_lm_default_args`` (layers, hidden size, heads, positions,
sequence length, vocabulary) before Megatron builds the model. ``add_model_config_to_megatron_parser``
registers a parser for another architecture. Plain Python: no Megatron needed to read the config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn


__all__ = [
    "MODEL_CONFIGS_TO_MEGATRON_PARSERS",
    "add_model_config_to_megatron_parser",
    "parse_bert_config",
    "parse_glm4_moe_config",
    "parse_gpt2_config",
    "parse_llama_config",
    "parse_t5_config",
]

MODEL_CONFIGS_TO_MEGATRON_PARSERS: dict[str, Callable[[Any, Any, Any], None]] = {}


class _ArgsOwner(Protocol):
    """What the parsers use of a MegatronLMPlugin (megatron_plugin imports this module, so no import back)."""

    megatron_lm_default_args: dict[str, Any]
    seq_length: int | None


def add_model_config_to_megatron_parser(model_type: str) -> Callable:
    """Return a decorator registering its function as the Megatron parser of transformers ``model_type``."""

    def register(parser: Callable[[Any, Any, Any], None]) -> Callable[[Any, Any, Any], None]:
        MODEL_CONFIGS_TO_MEGATRON_PARSERS[model_type] = parser
        return parser

    return register


def _sequence_length(plugin: _ArgsOwner, batch_data: Mapping[str, torch.Tensor] | None, default: int) -> int:
    """Return the plugin's seq_length, else the batch's ``input_ids`` width, else ``default``."""
    if getattr(plugin, "seq_length", None) is not None:
        return plugin.seq_length
    if isinstance(batch_data, dict) and "input_ids" in batch_data:
        return int(batch_data["input_ids"].shape[1])
    return default


def _fill(plugin: _ArgsOwner, model_type_name: str, **network: Any) -> None:
    plugin.megatron_lm_default_args.update(model_type_name=model_type_name, **network)
    plugin.seq_length = network.get("seq_length", getattr(plugin, "seq_length", None))


def _network(config: Any, layers: str, hidden: str, heads: str, positions: int) -> dict[str, Any]:
    """Return what every architecture fills: ``positions`` and, read from ``config``, the layers, hidden size and
    attention heads (its attributes of those names) and the vocabulary size."""
    return {
        "num_layers": getattr(config, layers),
        "hidden_size": getattr(config, hidden),
        "num_attention_heads": getattr(config, heads),
        "max_position_embeddings": positions,
        "orig_vocab_size": config.vocab_size,
    }


@add_model_config_to_megatron_parser("megatron-bert")
def parse_bert_config(
    megatron_lm_plugin: _ArgsOwner, model: nn.Module, batch_data: Mapping[str, torch.Tensor] | None
) -> None:
    """Fill the Megatron arguments of a BERT model (pretraining heads when it is a masked-LM / pretraining model)."""
    config = model.config
    name = type(model).__name__.lower()
    positions = config.max_position_embeddings
    _fill(
        megatron_lm_plugin,
        "bert",
        **_network(config, "num_hidden_layers", "hidden_size", "num_attention_heads", positions),
        seq_length=_sequence_length(megatron_lm_plugin, batch_data, positions),
        pretraining_flag="maskedlm" in name or "pretraining" in name,
        num_labels=getattr(config, "num_labels", 2),
    )


@add_model_config_to_megatron_parser("gpt2")
def parse_gpt2_config(
    megatron_lm_plugin: _ArgsOwner, model: nn.Module, batch_data: Mapping[str, torch.Tensor] | None
) -> None:
    """Fill the Megatron arguments of a GPT-2 model."""
    config = model.config
    _fill(
        megatron_lm_plugin,
        "gpt",
        **_network(config, "n_layer", "n_embd", "n_head", config.n_positions),
        seq_length=_sequence_length(megatron_lm_plugin, batch_data, config.n_positions),
        return_logits=getattr(megatron_lm_plugin, "return_logits", False),
    )


@add_model_config_to_megatron_parser("t5")
def parse_t5_config(
    megatron_lm_plugin: _ArgsOwner, model: nn.Module, batch_data: Mapping[str, torch.Tensor] | None
) -> None:
    """Fill the Megatron arguments of a T5 model (encoder and decoder lengths from the plugin or 512/128)."""
    config = model.config
    encoder = getattr(megatron_lm_plugin, "encoder_seq_length", None) or 512
    decoder = getattr(megatron_lm_plugin, "decoder_seq_length", None) or 128
    _fill(
        megatron_lm_plugin,
        "t5",
        **_network(config, "num_layers", "d_model", "num_heads", getattr(config, "n_positions", 1024)),
        seq_length=encoder,
        encoder_seq_length=encoder,
        decoder_seq_length=decoder,
    )


def _llama_like(
    megatron_lm_plugin: _ArgsOwner, config: Any, batch_data: Mapping[str, torch.Tensor] | None
) -> dict[str, Any]:
    """Return the arguments of a Llama-shaped model: a GPT with SwiGLU, RMSNorm, rotary positions, GQA."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    positions = config.max_position_embeddings
    return {
        **_network(config, "num_hidden_layers", "hidden_size", "num_attention_heads", positions),
        "ffn_hidden_size": config.intermediate_size,
        "swiglu": True,
        "normalization": "RMSNorm",
        "position_embedding_type": "rope",
        "group_query_attention": kv_heads != heads,
        "num_query_groups": kv_heads,
        "seq_length": _sequence_length(megatron_lm_plugin, batch_data, positions),
    }


@add_model_config_to_megatron_parser("llama")
def parse_llama_config(
    megatron_lm_plugin: _ArgsOwner, model: nn.Module, batch_data: Mapping[str, torch.Tensor] | None
) -> None:
    """Fill the Megatron arguments of a Llama model (a GPT with SwiGLU, RMSNorm, rotary positions, GQA)."""
    _fill(megatron_lm_plugin, "gpt", **_llama_like(megatron_lm_plugin, model.config, batch_data))


@add_model_config_to_megatron_parser("glm4_moe")
def parse_glm4_moe_config(
    megatron_lm_plugin: _ArgsOwner, model: nn.Module, batch_data: Mapping[str, torch.Tensor] | None
) -> None:
    """Fill the Megatron arguments of a GLM-4 MoE model (Llama-like, with routed experts)."""
    config = model.config
    network = _llama_like(megatron_lm_plugin, config, batch_data)
    network.update(
        num_experts=getattr(config, "n_routed_experts", None),
        moe_router_topk=getattr(config, "num_experts_per_tok", None),
        moe_ffn_hidden_size=getattr(config, "moe_intermediate_size", None),
    )
    _fill(megatron_lm_plugin, "gpt", **network)
