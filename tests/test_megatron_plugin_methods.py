"""MegatronLMPlugin's set_* methods (Accelerate 1.15): they fill megatron_lm_default_args from prepare()'s objects.

Plain Python: no Megatron-LM is needed to compute the arguments.
"""

from __future__ import annotations

import types

import pytest
import torch

from notebook_accel.utils import MegatronLMPlugin
from notebook_accel.utils.megatron_lm import MegatronLMDummyScheduler


def _model(model_type: str, **config):
    return type("Model", (), {"config": types.SimpleNamespace(model_type=model_type, **config)})()


_GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 128, "vocab_size": 100}


def test_set_network_size_args_picks_the_parser_by_model_type() -> None:
    plugin = MegatronLMPlugin()
    plugin.set_network_size_args(_model("gpt2", **_GPT2), {"input_ids": torch.zeros(2, 16, dtype=torch.long)})
    args = plugin.megatron_lm_default_args
    assert (args["model_type_name"], args["num_layers"], args["hidden_size"], args["seq_length"]) == (
        "gpt",
        2,
        64,
        16,
    )
    # the transformers model_type "megatron-bert" is registered; a type containing a known one matches it
    bert = {"num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 2}
    bert.update(max_position_embeddings=64, vocab_size=10)
    other = MegatronLMPlugin()
    other.set_network_size_args(_model("My-GPT2-Variant", **_GPT2))
    assert other.megatron_lm_default_args["model_type_name"] == "gpt"
    other.set_network_size_args(_model("megatron-bert", **bert))
    assert other.megatron_lm_default_args["model_type_name"] == "bert"
    assert other.megatron_lm_default_args["num_layers"] == 3
    with pytest.raises(
        ValueError, match=r"no Megatron-LM network parser for model_type='mamba'; known types are \["
    ):
        MegatronLMPlugin().set_network_size_args(_model("mamba"))


def test_set_mixed_precision() -> None:
    plugin = MegatronLMPlugin()
    plugin.set_mixed_precision("bf16")
    args = plugin.megatron_lm_default_args
    assert args["bf16"] is True and "fp16" not in args and args["DDP_impl"] == "local"
    plugin = MegatronLMPlugin()
    plugin.set_mixed_precision("no")
    assert "bf16" not in plugin.megatron_lm_default_args and "fp16" not in plugin.megatron_lm_default_args
    with pytest.raises(ValueError, match=r"mixed_precision.*'fp32'"):
        plugin.set_mixed_precision("fp32")


def test_set_training_args_computes_the_global_batch() -> None:
    plugin = MegatronLMPlugin(num_micro_batches=4)
    plugin.set_training_args(micro_batch_size=2, dp_degree=3)
    args = plugin.megatron_lm_default_args
    assert (args["micro_batch_size"], args["global_batch_size"], args["data_parallel_size"]) == (2, 24, 3)
    assert (plugin.micro_batch_size, plugin.global_batch_size) == (2, 24)
    with pytest.raises(ValueError, match=r"dp_degree must be a positive int"):
        plugin.set_training_args(micro_batch_size=2, dp_degree=0)


def test_set_optimizer_type_hands_over_the_hyperparameters() -> None:
    params = [torch.nn.Parameter(torch.zeros(1))]
    plugin = MegatronLMPlugin()
    plugin.set_optimizer_type(
        torch.optim.AdamW(params, lr=1e-3, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.2)
    )
    args = plugin.megatron_lm_default_args
    assert (args["optimizer"], args["lr"], args["weight_decay"]) == ("adam", 1e-3, 0.2)
    assert (args["adam_beta1"], args["adam_beta2"], args["adam_eps"]) == (0.8, 0.9, 1e-7)
    plugin.set_optimizer_type(torch.optim.SGD(params, lr=0.5, momentum=0.7))
    assert (args["optimizer"], args["sgd_momentum"]) == ("sgd", 0.7)
    with pytest.raises(ValueError, match=r"builds Adam or SGD optimizers; got Adagrad"):
        plugin.set_optimizer_type(torch.optim.Adagrad(params))


def test_set_scheduler_args_from_the_dummy_scheduler() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    plugin = MegatronLMPlugin(lr_decay_style="cosine")
    plugin.set_scheduler_args(MegatronLMDummyScheduler(optimizer, total_num_steps=100, warmup_num_steps=10))
    args = plugin.megatron_lm_default_args
    assert (args["train_iters"], args["lr_warmup_iters"], args["lr_decay_style"]) == (100, 10, "cosine")
    fixed = MegatronLMPlugin(train_iters=7, lr_warmup_iters=2)
    fixed.set_scheduler_args(MegatronLMDummyScheduler(optimizer, total_num_steps=100, warmup_num_steps=10))
    assert (
        fixed.megatron_lm_default_args["train_iters"],
        fixed.megatron_lm_default_args["lr_warmup_iters"],
    ) == (7, 2)
    with pytest.raises(ValueError, match=r"got StepLR: pass MegatronLMDummyScheduler"):
        plugin.set_scheduler_args(torch.optim.lr_scheduler.StepLR(optimizer, 1))
    with pytest.raises(ValueError, match=r"needs the number of training steps"):
        MegatronLMPlugin().set_scheduler_args(MegatronLMDummyScheduler(optimizer))


def test_set_tensorboard_logging_options() -> None:
    plugin = MegatronLMPlugin()
    assert "log_timers_to_tensorboard" not in plugin.megatron_lm_default_args
    plugin.set_tensorboard_logging_options()
    args = plugin.megatron_lm_default_args
    assert args["log_timers_to_tensorboard"] and args["log_validation_ppl_to_tensorboard"]
    assert args["log_memory_to_tensorboard"]
