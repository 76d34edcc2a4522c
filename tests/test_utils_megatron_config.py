"""Megatron-LM network arguments read from transformers configs (no Megatron needed to read them)."""

from __future__ import annotations

import types

import pytest
import torch

from notebook_accel.utils import MegatronLMPlugin
from notebook_accel.utils.dataclasses import (
    MODEL_CONFIGS_TO_MEGATRON_PARSERS,
    add_model_config_to_megatron_parser,
    parse_bert_config,
    parse_glm4_moe_config,
    parse_gpt2_config,
    parse_llama_config,
    parse_t5_config,
)


def _model(name: str, **config):
    return type(name, (), {"config": types.SimpleNamespace(**config)})()


_BERT = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 64}
_LLAMA = {"num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 8, "max_position_embeddings": 256}
_LLAMA_FILLED = {"num_layers": 3, "hidden_size": 64, "num_attention_heads": 8, "max_position_embeddings": 256}
_LLAMA_FILLED |= {"model_type_name": "gpt", "orig_vocab_size": 50, "ffn_hidden_size": 128, "swiglu": True}
_LLAMA_FILLED |= {"normalization": "RMSNorm", "position_embedding_type": "rope"}
_BATCH_OF_32 = {"input_ids": torch.zeros(3, 32, dtype=torch.long)}

# id: (model type, model class, its config, batch, MegatronLMPlugin arguments, what the parser fills)
_PARSED = {
    "gpt2, sequence length from the batch": (
        "gpt2", "GPT2LMHeadModel", {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 128, "vocab_size": 100},
        _BATCH_OF_32, {},
        {"model_type_name": "gpt", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "max_position_embeddings": 128, "orig_vocab_size": 100, "seq_length": 32, "return_logits": False},
    ),
    "bert pretraining, sequence length from the positions": (
        "megatron-bert", "BertForMaskedLM", {**_BERT, "vocab_size": 90}, None, {},
        {"model_type_name": "bert", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
         "max_position_embeddings": 64, "orig_vocab_size": 90, "seq_length": 64, "pretraining_flag": True,
         "num_labels": 2},
    ),
    "bert classification": (
        "megatron-bert", "BertForSequenceClassification", {**_BERT, "vocab_size": 90, "num_labels": 3},
        _BATCH_OF_32, {},
        {"model_type_name": "bert", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
         "max_position_embeddings": 64, "orig_vocab_size": 90, "seq_length": 32, "pretraining_flag": False,
         "num_labels": 3},
    ),
    "t5, encoder length from the plugin": (
        "t5", "T5ForConditionalGeneration", {"num_layers": 2, "d_model": 32, "num_heads": 4, "vocab_size": 70},
        None, {"encoder_seq_length": 40},
        {"model_type_name": "t5", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
         "max_position_embeddings": 1024, "orig_vocab_size": 70, "seq_length": 40, "encoder_seq_length": 40,
         "decoder_seq_length": 128},
    ),
    "llama with grouped query attention": (
        "llama", "LlamaForCausalLM",
        {**_LLAMA, "num_key_value_heads": 2, "vocab_size": 50, "intermediate_size": 128}, None, {"seq_length": 16},
        {**_LLAMA_FILLED, "seq_length": 16, "group_query_attention": True, "num_query_groups": 2},
    ),
    "glm4 moe, routed experts": (
        "glm4_moe", "Glm4MoeForCausalLM",
        {**_LLAMA, "vocab_size": 50, "intermediate_size": 128, "n_routed_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32},
        None, {},
        {**_LLAMA_FILLED, "seq_length": 256, "group_query_attention": False, "num_query_groups": 8,
         "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32},
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("model_type", "class_name", "config", "batch", "plugin_args", "filled"),
    list(_PARSED.values()),
    ids=list(_PARSED),
)
def test_parser_fills_the_network_arguments(
    model_type, class_name, config, batch, plugin_args, filled
) -> None:
    plugin = MegatronLMPlugin(**plugin_args)
    defaults = set(plugin.megatron_lm_default_args)
    MODEL_CONFIGS_TO_MEGATRON_PARSERS[model_type](plugin, _model(class_name, **config), batch)
    args = plugin.megatron_lm_default_args
    assert {key: args.get(key) for key in filled} == filled
    assert set(args) == defaults | set(filled)  # nothing else filled
    assert plugin.seq_length == filled["seq_length"]


def test_parsers_are_registered_by_model_type() -> None:
    expected = {
        "gpt2": parse_gpt2_config,
        "megatron-bert": parse_bert_config,
        "t5": parse_t5_config,
        "llama": parse_llama_config,
        "glm4_moe": parse_glm4_moe_config,
    }
    assert {name: MODEL_CONFIGS_TO_MEGATRON_PARSERS[name] for name in expected} == expected


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
