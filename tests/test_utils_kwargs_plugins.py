"""Kwargs handlers, plugins and configurations: defaults, env fallbacks, conversions and every validation error."""

from __future__ import annotations

import base64
import json
import os
from datetime import timedelta

import pytest
import torch
from torch.distributed import fsdp

from notebook_accel.utils import (
    AutocastKwargs,
    BnbQuantizationConfig,
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    DynamoBackend,
    FP8RecipeKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    MegatronLMPlugin,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from notebook_accel.utils.environment import patch_environment
from tests.test_engine_configs import _from_launcher

# ---------------------------------------------------------------------------------------------- kwargs


def test_to_kwargs_returns_only_changed_fields() -> None:
    assert AutocastKwargs().to_kwargs() == {}
    assert AutocastKwargs(cache_enabled=True).to_kwargs() == {"cache_enabled": True}
    assert DistributedDataParallelKwargs(find_unused_parameters=True).to_kwargs() == {
        "find_unused_parameters": True
    }
    assert GradScalerKwargs(backoff_factor=0.25, growth_interval=10).to_kwargs() == {
        "backoff_factor": 0.25,
        "growth_interval": 10,
    }
    assert InitProcessGroupKwargs(timeout=timedelta(seconds=800)).to_kwargs() == {
        "timeout": timedelta(seconds=800)
    }
    # comm hook settings configure the handler, not the DDP constructor
    assert DistributedDataParallelKwargs(comm_hook="fp16").to_kwargs() == {}


def test_grad_scaler_kwargs_build_a_scaler() -> None:
    kwargs = GradScalerKwargs(init_scale=1024.0, growth_factor=3.0).to_kwargs()
    scaler = torch.amp.GradScaler("cpu", **kwargs)
    assert scaler.get_growth_factor() == 3.0


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda: AutocastKwargs(enabled="yes"), TypeError, "enabled must be a bool"),
        (lambda: AutocastKwargs(cache_enabled=1), TypeError, "cache_enabled must be a bool or None"),
        (lambda: DistributedDataParallelKwargs(comm_hook="zip"), ValueError, r"comm_hook='zip'.*power_sgd"),
        (
            lambda: DistributedDataParallelKwargs(comm_wrapper="int8"),
            ValueError,
            r"comm_wrapper='int8'.*'bf16'",
        ),
        (lambda: DistributedDataParallelKwargs(comm_wrapper="fp16"), ValueError, "wraps a PowerSGD hook"),
        (lambda: DistributedDataParallelKwargs(bucket_cap_mb=0), ValueError, "bucket_cap_mb must be > 0"),
        (lambda: GradScalerKwargs(init_scale=0), ValueError, "init_scale must be > 0"),
        (lambda: GradScalerKwargs(init_scale="x"), TypeError, r"init_scale must be a number, got 'x'"),
        (lambda: GradScalerKwargs(growth_factor=1.0), ValueError, r"growth_factor must be > 1\.0"),
        (lambda: GradScalerKwargs(backoff_factor=1.5), ValueError, r"backoff_factor must be in \(0, 1\)"),
        (lambda: GradScalerKwargs(growth_interval=0), ValueError, "growth_interval must be a positive int"),
        (lambda: InitProcessGroupKwargs(backend="tcp"), ValueError, r"backend='tcp'.*'gloo'"),
        (lambda: InitProcessGroupKwargs(backend=3), TypeError, "backend must be a str"),
        (lambda: InitProcessGroupKwargs(init_method=5), TypeError, "init_method must be a URL string"),
        (lambda: InitProcessGroupKwargs(timeout=60), TypeError, "timeout must be a datetime.timedelta"),
        (lambda: InitProcessGroupKwargs(timeout=timedelta(0)), ValueError, "timeout must be positive"),
        (lambda: FP8RecipeKwargs(backend="fp8lib"), ValueError, r"backend='FP8LIB'.*'TE'"),
        (lambda: FP8RecipeKwargs(opt_level="O3"), ValueError, r"opt_level='O3'.*'O1'"),
        (lambda: FP8RecipeKwargs(fp8_format="E6M1"), ValueError, r"fp8_format='E6M1'.*HYBRID"),
        (
            lambda: FP8RecipeKwargs(amax_compute_algo="mean"),
            ValueError,
            r"amax_compute_algo='mean'.*most_recent",
        ),
        (lambda: FP8RecipeKwargs(margin=-1), ValueError, "margin must be an int >= 0"),
        (lambda: FP8RecipeKwargs(interval=0), ValueError, "interval must be an int >= 1"),
        (lambda: FP8RecipeKwargs(amax_history_len=0), ValueError, "amax_history_len must be an int >= 1"),
        (lambda: FP8RecipeKwargs(override_linear_precision=(True,)), ValueError, "three bools"),
    ],
)
def test_kwargs_validation(build, error, match) -> None:
    with pytest.raises(error, match=match):
        build()


def test_init_process_group_backends() -> None:
    assert InitProcessGroupKwargs(backend="gloo").backend == "gloo"
    assert InitProcessGroupKwargs(backend="cpu:gloo,cuda:nccl").to_kwargs() == {
        "backend": "cpu:gloo,cuda:nccl"
    }
    assert InitProcessGroupKwargs(backend=None).to_kwargs() == {"backend": None}


def test_ddp_comm_hook_registration_uses_the_hook() -> None:
    calls = []

    class FakeDDP:
        def register_comm_hook(self, state, hook):
            calls.append((state, hook))

    DistributedDataParallelKwargs().register_comm_hook(FakeDDP())
    assert calls == []
    DistributedDataParallelKwargs(comm_hook="fp16").register_comm_hook(FakeDDP())
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    assert calls[-1] == (None, default_hooks.fp16_compress_hook)
    DistributedDataParallelKwargs(
        comm_hook="power_sgd", comm_wrapper="bf16", comm_state_option={"matrix_approximation_rank": 2}
    ).register_comm_hook(FakeDDP())
    state, hook = calls[-1]
    assert state.matrix_approximation_rank == 2 and callable(hook)


# ---------------------------------------------------------------------------------------------- plugins


def test_gradient_accumulation_plugin() -> None:
    plugin = GradientAccumulationPlugin(num_steps=4)
    assert (plugin.num_steps, plugin.adjust_scheduler, plugin.sync_with_dataloader) == (4, True, True)
    with pytest.raises(ValueError, match="num_steps must be a positive int"):
        GradientAccumulationPlugin(num_steps=0)


def test_gradient_accumulation_plugin_to_dict_and_to_kwargs() -> None:
    # Accelerate 1.15: the plugin is a KwargsHandler; to_dict has every field, to_kwargs the changed ones
    plugin = GradientAccumulationPlugin(num_steps=3, sync_each_batch=True)
    assert plugin.to_dict() == {
        "num_steps": 3,
        "adjust_scheduler": True,
        "sync_with_dataloader": True,
        "sync_each_batch": True,
    }
    assert plugin.to_kwargs() == {"num_steps": 3, "sync_each_batch": True}
    assert GradientAccumulationPlugin().to_kwargs() == {}


def test_ddp_kwargs_to_dict_leaves_out_the_comm_hook_fields_unless_asked() -> None:
    handler = DistributedDataParallelKwargs(comm_hook="fp16", find_unused_parameters=True)
    plain = handler.to_dict()
    assert plain["find_unused_parameters"] is True and plain["bucket_cap_mb"] == 25
    assert not {"comm_hook", "comm_wrapper", "comm_state_option"} & set(plain)
    full = handler.to_dict(ignore_keys=())
    assert full["comm_hook"] == "fp16" and full["comm_state_option"] == {}
    assert "dim" not in handler.to_dict(ignore_keys=("dim",))


def test_dynamo_plugin_defaults_env_and_kwargs() -> None:
    plugin = TorchDynamoPlugin()
    assert plugin.backend is DynamoBackend.NO and plugin.mode == "default" and plugin.fullgraph is False
    plugin = _from_launcher("dynamo")
    assert plugin.to_kwargs() == {
        "backend": "inductor",
        "mode": "max-autotune",
        "fullgraph": True,
        "dynamic": False,
    }  # only what differs from torch.compile's defaults, as Accelerate 1.15 gives
    with_options = TorchDynamoPlugin(backend=DynamoBackend.EAGER, options={"trace.enabled": True})
    assert (
        with_options.to_kwargs()["options"] == {"trace.enabled": True}
        and "mode" not in with_options.to_kwargs()
    )
    model = torch.compile(torch.nn.Linear(2, 2), **TorchDynamoPlugin(backend="eager").to_kwargs())
    assert hasattr(model, "_orig_mod")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"backend": "turbo"}, ValueError, r"backend='TURBO'.*'INDUCTOR'"),
        ({"mode": "fast"}, ValueError, r"mode='fast'.*reduce-overhead"),
        ({"options": [1]}, TypeError, "options must be a dict"),
        ({"mode": "max-autotune", "options": {"a": 1}}, ValueError, "either mode or options"),
    ],
)
def test_dynamo_plugin_validation(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        TorchDynamoPlugin(**kwargs)


def test_deepspeed_plugin_builds_config_from_fields() -> None:
    plugin = DeepSpeedPlugin(
        gradient_accumulation_steps=2, gradient_clipping=1.0, zero_stage=3, offload_param_device="cpu"
    )
    cfg = plugin.deepspeed_config
    assert cfg["gradient_accumulation_steps"] == 2 and cfg["gradient_clipping"] == 1.0
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert cfg["train_batch_size"] == "auto" and plugin.is_zero3


def test_deepspeed_plugin_defaults() -> None:
    default = DeepSpeedPlugin()
    assert (default.zero_stage, default.gradient_accumulation_steps, default.offload_param_device) == (
        2,
        "auto",
        "none",
    )


def test_deepspeed_plugin_loads_json_dict_and_base64(tmp_path) -> None:
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}  # fmt: skip
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    from_file = DeepSpeedPlugin(hf_ds_config=str(path), gradient_accumulation_steps=8)
    assert from_file.zero_stage == 3 and from_file.offload_param_device == "cpu"
    assert from_file.deepspeed_config["gradient_accumulation_steps"] == 8  # "auto" filled from the field
    assert DeepSpeedPlugin(hf_ds_config=config).deepspeed_config["zero_optimization"]["stage"] == 3
    encoded = base64.urlsafe_b64encode(json.dumps(config).encode()).decode()
    assert DeepSpeedPlugin(hf_ds_config=encoded).zero_stage == 3
    with patch_environment(ACCELERATE_DEEPSPEED_CONFIG_FILE=str(path)):
        assert DeepSpeedPlugin().zero_stage == 3


def test_deepspeed_config_process_fills_auto_and_reports_mismatches() -> None:
    plugin = DeepSpeedPlugin(
        hf_ds_config={
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": 2},
        }
    )
    plugin.deepspeed_config_process(train_micro_batch_size_per_gpu=16, gradient_accumulation_steps=2)
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 16
    assert plugin.get_value("zero_optimization.stage") == 2 and plugin.get_value("missing.key", 7) == 7
    with pytest.raises(
        ValueError,
        match=r"(?s)does not fit.*gradient_accumulation_steps=2 vs arg gradient_accumulation_steps=4",
    ):
        plugin.deepspeed_config_process(gradient_accumulation_steps=4)
    plugin.deepspeed_config_process(must_match=False, gradient_accumulation_steps=4)  # no check asked for
    fresh = DeepSpeedPlugin(hf_ds_config={"train_batch_size": "auto", "zero_optimization": {"stage": 1}})
    with pytest.raises(ValueError, match="`train_batch_size` is 'auto'"):
        fresh.deepspeed_config_process()


def test_deepspeed_config_process_reports_every_problem_in_one_error() -> None:
    config = {
        "train_batch_size": "auto",
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
        "scheduler": {"params": {"warmup_num_steps": "auto"}},
    }
    plugin = DeepSpeedPlugin(hf_ds_config=config)
    with pytest.raises(ValueError) as caught:
        plugin.deepspeed_config_process(
            gradient_accumulation_steps=4,
            **{"zero_optimization.stage": 3, "zero_optimization.reduce_bucket_size": 9},
        )
    lines = str(caught.value).splitlines()
    assert "- `train_batch_size` is 'auto' in the DeepSpeed config and no value was given for it" in lines
    assert "- `scheduler.params.warmup_num_steps` is 'auto' in the DeepSpeed config" in str(caught.value)
    assert "- ds gradient_accumulation_steps=2 vs arg gradient_accumulation_steps=4" in lines
    assert "- ds zero_optimization.stage=2 vs arg zero_optimization.stage=3" in lines
    assert plugin.get_value("zero_optimization.reduce_bucket_size") == 9  # filled on the way
    # fill_match: one key; disagreements go to the caller's list, a missing 'auto' value raises.
    found: list[str] = []
    plugin.fill_match("zero_optimization.stage", found, **{"zero_optimization.stage": 1})
    assert found == ["- ds zero_optimization.stage=2 vs arg zero_optimization.stage=1"]
    plugin.fill_match("no.such.key", found, **{"no.such.key": 1})
    assert len(found) == 1
    with pytest.raises(ValueError, match=r"`train_batch_size` is 'auto'.*\n.*pass it to the plugin"):
        plugin.fill_match("train_batch_size")
    # A caller with its own prefix and list collects the disagreements without an error.
    nested: list[str] = []
    plugin.deepspeed_config_process(
        prefix="zero_optimization.", mismatches=nested, config=config["zero_optimization"],
        **{"zero_optimization.stage": 3, "zero_optimization.reduce_bucket_size": 5},
    )  # fmt: skip
    assert nested == ["- ds zero_optimization.stage=2 vs arg zero_optimization.stage=3"]
    assert plugin.get_value("scheduler.params.warmup_num_steps") == "auto"


def test_deepspeed_mixed_precision() -> None:
    plugin = DeepSpeedPlugin()
    plugin.set_mixed_precision("bf16")
    assert plugin.deepspeed_config["bf16"] == {"enabled": True} and plugin.deepspeed_config["fp16"] == {
        "enabled": False
    }
    clash = DeepSpeedPlugin(hf_ds_config={"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match="enables fp16"):
        clash.set_mixed_precision("bf16")
    with pytest.raises(ValueError, match=r"mixed_precision='int4'"):
        plugin.set_mixed_precision("int4")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"zero_stage": 4}, ValueError, r"zero_stage=4.*\[0, 1, 2, 3\]"),
        ({"offload_optimizer_device": "gpu"}, ValueError, r"offload_optimizer_device='gpu'.*'nvme'"),
        ({"offload_param_device": "cpu", "zero_stage": 2}, ValueError, "needs ZeRO stage 3"),
        ({"offload_optimizer_device": "nvme"}, ValueError, "needs a path"),
        (
            {"gradient_accumulation_steps": 0},
            ValueError,
            "gradient_accumulation_steps must be a positive int",
        ),
        ({"gradient_clipping": -1.0}, ValueError, "gradient_clipping must be a positive number"),
        ({"hf_ds_config": "/no/such/ds_config.json"}, FileNotFoundError, "neither an existing JSON file"),
        ({"hf_ds_config": 42}, TypeError, "must be a dict or a path"),
        ({"hf_ds_config": {"zero_optimization": {"stage": 9}}}, ValueError, r"zero_optimization.stage=9"),
    ],
)
def test_deepspeed_plugin_validation(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        DeepSpeedPlugin(**kwargs)


def test_deepspeed_bad_json_file(tmp_path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        DeepSpeedPlugin(hf_ds_config=str(tmp_path / "bad.json"))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must be a JSON object"):
        DeepSpeedPlugin(hf_ds_config=str(tmp_path / "list.json"))


def test_deepspeed_engine_required_only_when_used() -> None:
    plugin = DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True)
    with pytest.raises(ImportError, match="requires `deepspeed`"):
        plugin.require_deepspeed()
    with pytest.raises(ImportError, match="requires `deepspeed`"):
        plugin.zero3_init_context_manager(enable=True)
    with plugin.zero3_init_context_manager(enable=False):
        pass


def test_fsdp_state_dict_type_brings_its_gather_configs_and_keeps_given_ones() -> None:
    full = FullyShardedDataParallelPlugin(state_dict_type="FULL_STATE_DICT")
    assert (full.state_dict_config.offload_to_cpu, full.state_dict_config.rank0_only) == (True, True)
    assert isinstance(full.optim_state_dict_config, fsdp.FullOptimStateDictConfig)
    assert (full.optim_state_dict_config.offload_to_cpu, full.optim_state_dict_config.rank0_only) == (
        True,
        True,
    )
    sharded = FullyShardedDataParallelPlugin(fsdp_version=2)
    assert sharded.state_dict_type is fsdp.StateDictType.SHARDED_STATE_DICT
    assert isinstance(sharded.optim_state_dict_config, fsdp.ShardedOptimStateDictConfig)
    assert sharded.state_dict_config.offload_to_cpu and sharded.optim_state_dict_config.offload_to_cpu
    mine = fsdp.FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    given = FullyShardedDataParallelPlugin(state_dict_config=mine)
    assert given.state_dict_config is mine and isinstance(
        given.optim_state_dict_config, fsdp.FullOptimStateDictConfig
    )
    local = FullyShardedDataParallelPlugin(state_dict_type="LOCAL_STATE_DICT")
    assert local.state_dict_config is None and local.optim_state_dict_config is None


def test_fsdp_plugin_maps_names_and_ints_to_torch_enums() -> None:
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.sharding_strategy is fsdp.ShardingStrategy.FULL_SHARD
    assert plugin.state_dict_type is fsdp.StateDictType.FULL_STATE_DICT
    assert plugin.backward_prefetch is None and plugin.cpu_offload == fsdp.CPUOffload(offload_params=False)
    assert isinstance(plugin.state_dict_config, fsdp.FullStateDictConfig)
    plugin = FullyShardedDataParallelPlugin(sharding_strategy=2, backward_prefetch="backward_pre", cpu_offload=True,
                                            state_dict_type="SHARDED_STATE_DICT", mixed_precision_policy={"param_dtype": "bf16"})  # fmt: skip
    assert plugin.sharding_strategy is fsdp.ShardingStrategy.SHARD_GRAD_OP
    assert plugin.backward_prefetch is fsdp.BackwardPrefetch.BACKWARD_PRE
    assert plugin.cpu_offload.offload_params is True
    assert isinstance(plugin.state_dict_config, fsdp.ShardedStateDictConfig)
    assert plugin.mixed_precision_policy.param_dtype is torch.bfloat16
    from_env = _from_launcher("fsdp, size-based wrap")
    assert from_env.cpu_offload.offload_params
    kwargs = from_env.to_fsdp_kwargs()
    assert (
        kwargs["sharding_strategy"] is fsdp.ShardingStrategy.NO_SHARD and kwargs["auto_wrap_policy"] is None
    )


def test_fsdp_auto_wrap_policies() -> None:
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

    model = torch.nn.Sequential(Block(), Block())
    assert FullyShardedDataParallelPlugin.get_module_class_from_name(model, "Block") is Block
    assert FullyShardedDataParallelPlugin.get_module_class_from_name(model, "Nope") is None
    plugin = FullyShardedDataParallelPlugin(
        auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap="Block"
    )
    plugin.set_auto_wrap_policy(model)
    assert plugin.auto_wrap_policy.keywords["transformer_layer_cls"] == {Block}
    sized = FullyShardedDataParallelPlugin(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=5)
    sized.set_auto_wrap_policy(model)
    assert sized.auto_wrap_policy.keywords["min_num_params"] == 5
    missing = FullyShardedDataParallelPlugin(
        auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_cls_names_to_wrap=["Decoder"]
    )
    with pytest.raises(ValueError, match=r"no layer class 'Decoder'.*'Block'"):
        missing.set_auto_wrap_policy(model)
    unnamed = FullyShardedDataParallelPlugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP")
    with pytest.raises(ValueError, match="needs layer class names"):
        unnamed.set_auto_wrap_policy(model)


def test_fsdp_mixed_precision_setter() -> None:
    plugin = FullyShardedDataParallelPlugin()
    plugin.set_mixed_precision("fp16")
    assert plugin.mixed_precision_policy.param_dtype is torch.float16
    assert plugin.mixed_precision_policy.buffer_dtype is torch.float32
    with pytest.raises(ValueError, match="unknown mixed_precision 'int8'"):
        plugin.set_mixed_precision("int8")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sharding_strategy": "HALF_SHARD"}, ValueError, r"sharding_strategy='HALF_SHARD'.*FULL_SHARD"),
        ({"sharding_strategy": 9}, ValueError, r"sharding_strategy=9 is out of range; use 1\.\.5"),
        ({"backward_prefetch": "SIDEWAYS"}, ValueError, r"backward_prefetch='SIDEWAYS'.*BACKWARD_PRE"),
        ({"state_dict_type": "HALF"}, ValueError, r"state_dict_type='HALF'.*LOCAL_STATE_DICT"),
        ({"auto_wrap_policy": "MAGIC"}, ValueError, r"auto_wrap_policy='MAGIC'.*SIZE_BASED_WRAP"),
        ({"auto_wrap_policy": 3}, TypeError, "a policy name or a callable"),
        ({"cpu_offload": "yes"}, TypeError, "cpu_offload must be a bool or a CPUOffload"),
        ({"min_num_params": -1}, ValueError, "min_num_params must be >= 0"),
        ({"mixed_precision_policy": {"param_dtype": "fp12"}}, ValueError, r"param_dtype'\]='fp12'"),
        ({"mixed_precision_policy": {"precision": "bf16"}}, TypeError, "bad mixed_precision_policy"),
    ],
)
def test_fsdp_plugin_validation(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        FullyShardedDataParallelPlugin(**kwargs)


def test_megatron_plugin_args_and_env() -> None:
    with patch_environment(
        MEGATRON_LM_TP_DEGREE="2", MEGATRON_LM_PP_DEGREE="2", MEGATRON_LM_RECOMPUTE_ACTIVATIONS="true"
    ):
        plugin = MegatronLMPlugin(
            sequence_parallelism=True,
            tensorboard_dir="tb",
            set_all_logging_options=True,
            other_megatron_args={"seed": 3},
        )
    args = plugin.megatron_lm_default_args
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]) == (2, 2)
    assert args["recompute_granularity"] == "selective" and args["sequence_parallel"] is True
    assert args["log_timers_to_tensorboard"] and args["seed"] == 3 and args["clip_grad"] == 1.0
    assert plugin.consumed_samples == [0, 0, 0]
    with pytest.raises(ImportError, match="megatron-core"):
        plugin.require_megatron()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp_degree": 0}, "tp_degree must be a positive int"),
        ({"gradient_clipping": -1.0}, "gradient_clipping must be >= 0"),
        ({"weight_decay_incr_style": "step"}, r"weight_decay_incr_style='step'.*cosine"),
        ({"lr_decay_style": "exp"}, r"lr_decay_style='exp'.*inverse-square-root"),
        ({"sequence_parallelism": True}, "needs tensor parallelism"),
        ({"num_layers_per_virtual_pipeline_stage": 2}, "needs pp_degree > 1"),
        ({"lr_warmup_fraction": 2.0}, r"lr_warmup_fraction must be in \[0, 1\]"),
        ({"consumed_samples": [0]}, "consumed_samples is"),
    ],
)
def test_megatron_plugin_validation(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        MegatronLMPlugin(**kwargs)


# ---------------------------------------------------------------------------------------------- configs


def test_bnb_config_defaults_and_dtypes() -> None:
    eight = BnbQuantizationConfig(load_in_8bit=True)
    assert eight.torch_dtype is torch.float16 and eight.target_dtype is torch.int8
    four = BnbQuantizationConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="bf16")
    assert four.bnb_4bit_compute_dtype is torch.bfloat16 and four.torch_dtype is torch.bfloat16
    assert four.target_dtype == "int4"
    assert BnbQuantizationConfig(load_in_4bit=True, torch_dtype="fp32").torch_dtype is torch.float32


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"load_in_8bit": True, "load_in_4bit": True}, ValueError, "cannot both be True"),
        ({}, ValueError, r"set load_in_8bit=True or load_in_4bit=True"),
        ({"load_in_8bit": "yes"}, TypeError, "load_in_8bit must be a bool"),
        (
            {"load_in_4bit": True, "bnb_4bit_quant_type": "int4"},
            ValueError,
            r"bnb_4bit_quant_type='int4'.*'nf4'",
        ),
        (
            {"load_in_4bit": True, "bnb_4bit_compute_dtype": "fp64"},
            ValueError,
            r"bnb_4bit_compute_dtype='fp64'.*'bf16'",
        ),
        ({"load_in_8bit": True, "torch_dtype": "half"}, ValueError, r"torch_dtype='half'"),
        (
            {"load_in_8bit": True, "llm_int8_threshold": -1},
            ValueError,
            "llm_int8_threshold must be a number >= 0",
        ),
        ({"load_in_8bit": True, "skip_modules": "lm_head"}, TypeError, "skip_modules must be a list"),
        (
            {"load_in_8bit": True, "keep_in_fp32_modules": [1]},
            TypeError,
            "keep_in_fp32_modules must be a list",
        ),
    ],
)
def test_bnb_config_validation(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        BnbQuantizationConfig(**kwargs)


def test_project_configuration_directories(tmp_path) -> None:
    config = ProjectConfiguration(project_dir=tmp_path)
    assert config.project_dir == os.fspath(tmp_path) and config.logging_dir == os.fspath(tmp_path)
    config = ProjectConfiguration(project_dir="p", logging_dir="logs")
    config.set_directories("q")
    assert (config.project_dir, config.logging_dir) == ("q", "logs")
    fresh = ProjectConfiguration()
    fresh.set_directories("r")
    assert (fresh.project_dir, fresh.logging_dir) == ("r", "r")
    with pytest.raises(ValueError, match="total_limit must be None or an int >= 1"):
        ProjectConfiguration(total_limit=0)
    with pytest.raises(ValueError, match="iteration must be an int >= 0"):
        ProjectConfiguration(iteration=-1)


def test_dataloader_configuration() -> None:
    config = DataLoaderConfiguration()
    assert (
        config.split_batches,
        config.dispatch_batches,
        config.even_batches,
        config.use_seedable_sampler,
    ) == (False, None, True, False)
    assert (config.non_blocking, config.use_stateful_dataloader, config.data_seed) == (False, False, None)
    with pytest.raises(TypeError, match="even_batches must be a bool"):
        DataLoaderConfiguration(even_batches="yes")
    with pytest.raises(TypeError, match="dispatch_batches must be a bool or None"):
        DataLoaderConfiguration(dispatch_batches=1)
    with pytest.raises(TypeError, match="data_seed must be an int or None"):
        DataLoaderConfiguration(data_seed="7")
    from notebook_accel.utils.imports import is_package_available

    if not is_package_available("torchdata"):
        with pytest.raises(ImportError, match="requires `torchdata`"):
            DataLoaderConfiguration(use_stateful_dataloader=True)
