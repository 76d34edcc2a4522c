"""The engine configurations of Accelerate 1.15: ParallelismConfig, FSDP2 plugin fields, TP plugin, ProfileKwargs.

Single-process checks of defaults, environment variables (every plugin's, from the variables ``accelerate
launch`` sets: ``_LAUNCHER_ENVIRONMENT``) and validation; the engines themselves run
on 2 and 4 CPU processes in tests/test_fsdp_engines.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed import fsdp

from notebook_accel.parallelism_config import ParallelismConfig
from notebook_accel.utils import (
    DeepSpeedPlugin,
    DynamoBackend,
    FullyShardedDataParallelPlugin,
    MegatronLMPlugin,
    ProfileKwargs,
    TorchContextParallelConfig,
    TorchDynamoPlugin,
    TorchTensorParallelConfig,
    TorchTensorParallelPlugin,
    patch_environment,
)

# ---------------------------------------------------------------------------------------------- ParallelismConfig


def test_parallelism_config_defaults_dims_and_env() -> None:
    config = ParallelismConfig()
    assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size, config.cp_size) == (1, 1, 1, 1)
    assert (config.cp_backend, config.sp_backend, config.total_size) == ("torch", "deepspeed", 1)
    assert config.tp_handler is None and config.cp_handler is None and config.device_mesh is None

    hsdp = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
    assert hsdp.active_mesh_dims == ["dp_replicate", "dp_shard"] and hsdp.total_size == 4
    assert hsdp.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"] and hsdp.dp_shard_cp_dim_names == [
        "dp_shard"
    ]
    assert hsdp._get_mesh() == (("dp_replicate", "dp_shard"), (2, 2))

    shard_cp = ParallelismConfig(dp_shard_size=2, cp_size=2)
    assert shard_cp.dp_shard_cp_dim_names == ["dp_shard", "cp"] and shard_cp.non_dp_dim_names == ["cp"]
    assert shard_cp.data_parallel_size == 2 and shard_cp.non_data_parallel_size == 2
    assert shard_cp.cp_handler == TorchContextParallelConfig("allgather")
    assert isinstance(ParallelismConfig(tp_size=2).tp_handler, TorchTensorParallelConfig)
    assert json.loads(hsdp.to_json())["dp_replicate_size"] == 2

    with patch_environment(PARALLELISM_CONFIG_DP_SHARD_SIZE="3", PARALLELISM_CONFIG_TP_SIZE="2"):
        from_env = ParallelismConfig()
    assert (from_env.dp_shard_size, from_env.tp_size, from_env.total_size) == (3, 2, 6)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dp_shard_size": 0}, ValueError, "dp_shard_size must be at least 1, got 0"),
        ({"tp_size": "2"}, TypeError, "tp_size must be an int, got '2'"),
        ({"cp_backend": "ring"}, ValueError, r"cp_backend='ring' is not valid; choose one of \['torch'\]"),
        ({"sp_size": 2, "sp_backend": "x"}, ValueError, r"sp_backend='x'"),
        ({"cp_size": 2, "sp_size": 2}, ValueError, r"exclude each other \(cp_size=2, sp_size=2\)"),
        (
            {"tp_size": 2, "tp_handler": {"enable_async_tp": True}},
            TypeError,
            "tp_handler must be a TorchTensor",
        ),
    ],
)
def test_parallelism_config_rejects(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        ParallelismConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "world", "version", "match"),
    [
        ({"dp_shard_size": 2}, 4, 2, r"multiply to 2 \(dp_replicate_size=1, dp_shard_size=2.*4 processes"),
        (
            {"dp_replicate_size": 2},
            2,
            None,
            "dp_replicate_size=2 with dp_shard_size=1 is plain data parallel",
        ),
        (
            {"dp_shard_size": 2},
            2,
            1,
            r"shard with FSDP2; pass FullyShardedDataParallelPlugin\(fsdp_version=2\)",
        ),
        ({"sp_size": 2}, 2, None, "sp_size=2 needs DeepSpeed's sequence parallelism"),
    ],
)
def test_parallelism_config_validate_world(kwargs, world, version, match) -> None:
    with pytest.raises(ValueError, match=match):
        ParallelismConfig(**kwargs).validate_world(world, version)
    ParallelismConfig(dp_replicate_size=2, dp_shard_size=2).validate_world(4, 2)


def test_context_parallel_strategy_and_device_mesh_needs_type() -> None:
    with pytest.raises(
        ValueError, match=r"^Invalid cp_comm_strategy: ring. Must be one of 'allgather' or 'alltoall'.\n"
    ):
        TorchContextParallelConfig("ring")
    with pytest.raises(ValueError, match="no device mesh built yet; pass device_type"):
        ParallelismConfig().get_device_mesh()


# ---------------------------------------------------------------------------------------------- FSDP plugin


def test_fsdp2_plugin_defaults_and_conversions() -> None:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    assert plugin.reshard_after_forward is True and plugin.sharding_strategy is None
    assert plugin.state_dict_type is fsdp.StateDictType.SHARDED_STATE_DICT
    assert type(plugin.cpu_offload) is fsdp.OffloadPolicy and not plugin.cpu_offload_enabled
    assert (
        plugin.use_orig_params is None
        and plugin.sync_module_states is None
        and plugin.forward_prefetch is None
    )
    offloaded = FullyShardedDataParallelPlugin(
        fsdp_version=2, cpu_offload=True, mixed_precision_policy="bf16"
    )
    assert isinstance(offloaded.cpu_offload, fsdp.CPUOffloadPolicy) and offloaded.cpu_offload_enabled
    assert offloaded.mixed_precision_policy == fsdp.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16
    )
    assert (
        FullyShardedDataParallelPlugin(
            fsdp_version=2, reshard_after_forward="SHARD_GRAD_OP"
        ).reshard_after_forward
        is False
    )
    v1 = FullyShardedDataParallelPlugin(reshard_after_forward="SHARD_GRAD_OP", cpu_ram_efficient_loading=True)
    assert v1.sharding_strategy is fsdp.ShardingStrategy.SHARD_GRAD_OP and v1.sync_module_states is True
    assert v1.use_orig_params is False  # 1.15's FSDP1 default
    v1.set_mixed_precision("bf16")
    assert v1.mixed_precision_policy.param_dtype is torch.bfloat16
    v2 = FullyShardedDataParallelPlugin(fsdp_version=2)
    v2.set_mixed_precision("fp16")
    assert v2.mixed_precision_policy.output_dtype is torch.float32


# The variables `accelerate launch` sets for a plugin, and the fields a plugin built without arguments
# takes from them: plugin class, environment, fields (compared with their types: an enum, not its text).
_LAUNCHER_ENVIRONMENT = {
    "dynamo": (
        TorchDynamoPlugin,
        {"ACCELERATE_DYNAMO_BACKEND": "inductor", "ACCELERATE_DYNAMO_MODE": "max-autotune",
         "ACCELERATE_DYNAMO_USE_FULLGRAPH": "1", "ACCELERATE_DYNAMO_USE_DYNAMIC": "false"},
        {"backend": DynamoBackend.INDUCTOR, "mode": "max-autotune", "fullgraph": True, "dynamic": False},
    ),
    "deepspeed": (
        DeepSpeedPlugin,
        {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1",
         "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "ACCELERATE_GRADIENT_CLIPPING": "0.5",
         "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true"},
        # zero3_init only means something for ZeRO 3
        {"gradient_accumulation_steps": 4, "zero_stage": 1, "offload_optimizer_device": "cpu",
         "gradient_clipping": 0.5, "zero3_init_flag": False},
    ),
    "fsdp, size-based wrap": (
        FullyShardedDataParallelPlugin,
        {"FSDP_SHARDING_STRATEGY": "NO_SHARD", "FSDP_OFFLOAD_PARAMS": "true",
         "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_MIN_NUM_PARAMS": "10"},
        {"sharding_strategy": fsdp.ShardingStrategy.NO_SHARD, "auto_wrap_policy": "SIZE_BASED_WRAP",
         "min_num_params": 10},
    ),
    "fsdp2": (
        FullyShardedDataParallelPlugin,
        {"FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false", "FSDP_OFFLOAD_PARAMS": "true",
         "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
         "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block, Head", "FSDP_ACTIVATION_CHECKPOINTING": "true",
         "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"},
        {"fsdp_version": 2, "reshard_after_forward": False, "cpu_offload_enabled": True,
         "state_dict_type": fsdp.StateDictType.FULL_STATE_DICT, "transformer_cls_names_to_wrap": ["Block", "Head"],
         "activation_checkpointing": True, "cpu_ram_efficient_loading": True},
    ),
    "fsdp1 modules and parameters": (
        FullyShardedDataParallelPlugin,
        {"FSDP_USE_ORIG_PARAMS": "true", "FSDP_SYNC_MODULE_STATES": "true", "FSDP_IGNORED_MODULES": "head.*"},
        {"use_orig_params": True, "sync_module_states": True, "ignored_modules": "head.*"},
    ),
}  # fmt: skip


def _from_launcher(case: str):
    """Return the plugin of ``_LAUNCHER_ENVIRONMENT[case]`` built without arguments under its environment."""
    plugin_class, environment, _ = _LAUNCHER_ENVIRONMENT[case]
    with patch_environment(**environment):
        return plugin_class()


@pytest.mark.parametrize("case", sorted(_LAUNCHER_ENVIRONMENT))
def test_plugin_takes_its_fields_from_the_launcher_environment(case) -> None:
    plugin, fields = _from_launcher(case), _LAUNCHER_ENVIRONMENT[case][2]
    assert {name: (type(value), value) for name in fields for value in [getattr(plugin, name)]} == {
        name: (type(value), value) for name, value in fields.items()
    }


def test_fsdp_plugin_ignored_modules_name_submodules() -> None:
    # The fields the launcher's FSDP_* variables set: tests/test_utils_kwargs_plugins.py (_LAUNCHER_ENVIRONMENT).
    v1 = FullyShardedDataParallelPlugin(ignored_modules="head.*")
    model = torch.nn.Sequential()
    model.add_module("body", torch.nn.Linear(2, 2))
    model.add_module("head", torch.nn.Linear(2, 2))
    assert v1.ignored_module_list(model) == [model.head]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fsdp_version": 3}, ValueError, "fsdp_version=3 is not valid; use 1 or 2"),
        (
            {"fsdp_version": 2, "sharding_strategy": "FULL_SHARD"},
            ValueError,
            "does not exist in FSDP2; set reshard",
        ),
        (
            {"fsdp_version": 2, "reshard_after_forward": "sometimes"},
            ValueError,
            "'sometimes' is not valid with fsdp_version=2",
        ),
        ({"reshard_after_forward": True}, ValueError, "is an FSDP2 setting; with fsdp_version=1"),
        ({"reshard_after_forward": "FULL_SHARD", "sharding_strategy": "FULL_SHARD"}, ValueError, "not both"),
        (
            {"fsdp_version": 2, "state_dict_type": "LOCAL_STATE_DICT"},
            ValueError,
            "FSDP2 has no LOCAL_STATE_DICT",
        ),
        ({"fsdp_version": 2, "forward_prefetch": True}, ValueError, "forward_prefetch is an FSDP1 option"),
        ({"activation_checkpointing_offload": True}, ValueError, "needs activation_checkpointing=True"),
        (
            {"fsdp_version": 2, "cpu_offload": fsdp.CPUOffload(True)},
            TypeError,
            "OffloadPolicy with fsdp_version=2",
        ),
        ({"mixed_precision_policy": "fp8"}, ValueError, "mixed_precision_policy='fp8' is not valid"),
        (
            {"fsdp_version": 2, "mixed_precision_policy": {"buffer_dtype": "bf16"}},
            TypeError,
            "keys: \\['param_dtype'",
        ),
        (
            {"fsdp_version": 2, "mixed_precision_policy": fsdp.MixedPrecision()},
            TypeError,
            "MixedPrecisionPolicy",
        ),
    ],
)
def test_fsdp_plugin_version_rules(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        FullyShardedDataParallelPlugin(**kwargs)


def test_fsdp1_kwargs_refused_for_fsdp2() -> None:
    with pytest.raises(ValueError, match="to_fsdp_kwargs\\(\\) is for fsdp_version=1"):
        FullyShardedDataParallelPlugin(fsdp_version=2).to_fsdp_kwargs()


# ---------------------------------------------------------------------------------------------- TP, profile, Megatron


def test_tensor_parallel_plugin() -> None:
    assert TorchTensorParallelPlugin().tp_size == 1
    with pytest.raises(ValueError, match="tp_size must be a positive int, got 0"):
        TorchTensorParallelPlugin(tp_size=0)


def test_profile_kwargs_builds_a_profiler() -> None:
    kwargs = ProfileKwargs(
        activities=["cpu"], schedule_option={"wait": 1, "warmup": 1, "active": 2}, record_shapes=True
    )
    assert kwargs.to_kwargs() == {
        "activities": ["cpu"],
        "schedule_option": {"wait": 1, "warmup": 1, "active": 2},
        "record_shapes": True,
    }
    profiler = kwargs.build()
    assert isinstance(profiler, torch.profiler.profile) and profiler.record_shapes
    assert profiler.activities == {torch.profiler.ProfilerActivity.CPU}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"activities": ["gpu"]}, ValueError, r"activities='gpu' is not valid"),
        ({"activities": "cpu"}, TypeError, "activities must be a list"),
        ({"schedule_option": {"wait": 1, "warmup": 1}}, ValueError, r"schedule_option needs \['active'\]"),
        (
            {"schedule_option": {"wait": 1, "warmup": 1, "active": 1, "pause": 2}},
            ValueError,
            r"unknown schedule_option keys \['pause'\]",
        ),
        (
            {"schedule_option": {"wait": -1, "warmup": 1, "active": 1}},
            ValueError,
            r"schedule_option\['wait'\] must be",
        ),
        ({"on_trace_ready": "print"}, TypeError, "on_trace_ready must be callable"),
    ],
)
def test_profile_kwargs_rejects(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        ProfileKwargs(**kwargs)


def test_megatron_plugin_new_fields() -> None:
    plugin = MegatronLMPlugin(tp_degree=2, use_rotary_position_embeddings=True, expert_model_parallel_size=2,
                              recompute_activations=True, attention_dropout=0.1)  # fmt: skip
    args = plugin.megatron_lm_default_args
    assert args["position_embedding_type"] == "rope" and args["expert_model_parallel_size"] == 2
    assert args["recompute_granularity"] == "selective" and args["attention_dropout"] == 0.1
    assert "use_rotary_position_embeddings" not in args and "seq_length" not in args
    with pytest.raises(ValueError, match=r"recompute_method='layer'.*uniform"):
        MegatronLMPlugin(recompute_method="layer")
    with pytest.raises(ValueError, match=r"hidden_dropout must be in \[0, 1\), got 1.5"):
        MegatronLMPlugin(hidden_dropout=1.5)
    with pytest.raises(ValueError, match="context_parallel_size must be a positive int"):
        MegatronLMPlugin(context_parallel_size=0)


# ---------------------------------------------------------------------------------------------- FSDP2 helpers


def test_fsdp2_helpers_order_names_and_retie() -> None:
    from notebook_accel.utils.fsdp_utils import (
        ensure_weights_retied,
        fsdp2_canonicalize_names,
        get_module_children_bottom_up,
    )

    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight  # tied input and output embeddings
    assert get_module_children_bottom_up(model) == [model[0], model[1], model]
    assert [name for name, _ in get_module_children_bottom_up(model, return_fqns=True)] == ["0", "1", ""]
    assert fsdp2_canonicalize_names({"layers.0._checkpoint_wrapped_module.w": 1, "_orig_mod.b": 2}) == {
        "layers.0.w": 1,
        "b": 2,
    }
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    meta[1].weight = meta[0].weight
    init = ensure_weights_retied(lambda m: m.to_empty(device="cpu", recurse=False), meta, torch.device("cpu"))
    for module in meta.modules():
        init(module)
    assert meta[1].weight is meta[0].weight and meta[0].weight.device.type == "cpu"
    untied = torch.nn.Linear(2, 2)
    fn = lambda m: None  # noqa: E731
    assert ensure_weights_retied(fn, untied, torch.device("cpu")) is fn  # nothing tied: unchanged


# ---------------------------------------------------------------------------------------------- Accelerator's reading


def test_accelerator_side_of_parallelism_config_rejects() -> None:
    from types import SimpleNamespace

    from notebook_accel.accelerator import mesh

    with pytest.raises(ValueError, match=r"shards with FSDP2, but fsdp_plugin has fsdp_version=1"):
        mesh.plugins_for_parallelism(
            ParallelismConfig(dp_shard_size=2), FullyShardedDataParallelPlugin(), None
        )
    with pytest.raises(
        ValueError, match=r"torch_tp_plugin.tp_size=2 and parallelism_config.tp_size=4 disagree"
    ):
        mesh.plugins_for_parallelism(ParallelismConfig(tp_size=4), None, TorchTensorParallelPlugin(tp_size=2))
    with pytest.raises(TypeError, match="parallelism_config must be a ParallelismConfig, got dict"):
        mesh.plugins_for_parallelism({"dp_shard_size": 2}, None, None)
    config, plugin = mesh.plugins_for_parallelism(None, None, TorchTensorParallelPlugin(tp_size=2))
    assert config.tp_size == 2 and plugin is None
    config, plugin = mesh.plugins_for_parallelism(ParallelismConfig(dp_shard_size=2), None, None)
    assert plugin.fsdp_version == 2

    state = SimpleNamespace(fsdp_plugin=plugin, num_processes=4, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="cp_size=2 needs torch's context parallelism"):
        mesh.build_mesh(state, ParallelismConfig(dp_shard_size=2, cp_size=2))

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.tp_plan = {"0": "diagonal"}
    with pytest.raises(ValueError, match=r"tp_plan\['0'\]='diagonal' is not a known style"):
        mesh.apply_tensor_parallel(model, None, ParallelismConfig(tp_size=2))
    model.tp_plan = {"0": 3}
    with pytest.raises(TypeError, match=r"tp_plan\['0'\] must be a style name or a ParallelStyle"):
        mesh.apply_tensor_parallel(model, None, ParallelismConfig(tp_size=2))


def _layered_model(layer_types, *, text_config=True):
    from types import SimpleNamespace

    config = SimpleNamespace(layer_types=layer_types)
    if text_config:
        config.get_text_config = lambda: config
    model = torch.nn.Linear(2, 2)
    model.config = config
    return model


def test_sequence_parallelism_refuses_recurrent_layers_before_deepspeed():
    """A model whose layer_types hold ``linear_attention`` is refused under sp_size > 1, as in 1.15 (issue 35):
    at ``accelerate.big_modeling``'s private name 1.15's tests import, and in prepare before DeepSpeed."""
    from types import SimpleNamespace

    from notebook_accel.accelerator.wrapping import prepare_deepspeed
    from notebook_accel.big_modeling import _refuse_recurrent_layers_under_sequence_parallelism as refuse

    hybrid = _layered_model(["full_attention", "linear_attention"])
    with pytest.raises(ValueError, match=r"sp_size > 1.*Linear.*\['linear_attention'\].*Use sp_size=1"):
        refuse(hybrid)
    refuse(_layered_model(["full_attention", "sliding_attention"]))
    refuse(_layered_model(None, text_config=False))
    refuse(torch.nn.Linear(2, 2))  # no config at all
    inner = SimpleNamespace(layer_types=["linear_attention"])
    outer = SimpleNamespace(layer_types=["full_attention"], get_text_config=lambda: inner)
    with pytest.raises(ValueError, match="linear_attention"):
        refuse(SimpleNamespace(config=outer))  # the text config is the one read
    state = SimpleNamespace(parallelism_config=SimpleNamespace(sp_enabled=True))
    with pytest.raises(ValueError, match="linear_attention"):
        prepare_deepspeed(hybrid, None, None, plugin=None, state=state)
