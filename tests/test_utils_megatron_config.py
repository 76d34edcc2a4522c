"""Megatron-LM network arguments read from transformers configs (no Megatron needed to read them)."""

from __future__ import annotations

import types

import torch

from notebook_accel.utils import MegatronLMPlugin
from notebook_accel.utils.dataclasses import (
    MODEL_CONFIGS_TO_MEGATRON_PARSERS,
    add_model_config_to_megatron_parser,
    parse_gpt2_config,
    parse_llama_config,
)


def _model(name: str, **config):
    return type(name, (), {"config": types.SimpleNamespace(**config)})()


def test_gpt2_arguments_and_sequence_length_from_the_batch() -> None:
    plugin = MegatronLMPlugin()
    model = _model("GPT2LMHeadModel", n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=100)
    parse_gpt2_config(plugin, model, {"input_ids": torch.zeros(3, 32, dtype=torch.long)})
    args = plugin.megatron_lm_default_args
    assert (
        args["model_type_name"],
        args["num_layers"],
        args["hidden_size"],
        args["num_attention_heads"],
    ) == (
        "gpt",
        2,
        64,
        4,
    )
    assert args["seq_length"] == 32 and plugin.seq_length == 32 and args["orig_vocab_size"] == 100


def test_llama_arguments_with_grouped_query_attention() -> None:
    plugin = MegatronLMPlugin(seq_length=16)
    model = _model(
        "LlamaForCausalLM",
        num_hidden_layers=3,
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        vocab_size=50,
        intermediate_size=128,
    )
    MODEL_CONFIGS_TO_MEGATRON_PARSERS["llama"](plugin, model, None)
    args = plugin.megatron_lm_default_args
    assert args["seq_length"] == 16 and args["group_query_attention"] and args["num_query_groups"] == 2
    assert (
        args["swiglu"]
        and args["ffn_hidden_size"] == 128
        and MODEL_CONFIGS_TO_MEGATRON_PARSERS["llama"] is parse_llama_config
    )


def test_registering_a_parser() -> None:
    @add_model_config_to_megatron_parser("my_arch")
    def parse_mine(plugin, model, batch_data):
        plugin.megatron_lm_default_args["num_layers"] = model.config.depth

    try:
        plugin = MegatronLMPlugin()
        MODEL_CONFIGS_TO_MEGATRON_PARSERS["my_arch"](plugin, _model("Mine", depth=7), None)
        assert plugin.megatron_lm_default_args["num_layers"] == 7
    finally:
        MODEL_CONFIGS_TO_MEGATRON_PARSERS.pop("my_arch")
