"""Constants keep Accelerate's documented values; enums are string enums with the documented members."""

from __future__ import annotations

import json

import pytest

from notebook_accel import utils
from notebook_accel.utils import (
    ComputeEnvironment,
    DistributedType,
    DynamoBackend,
    LoggerType,
    PrecisionType,
    RNGType,
    SageMakerDistributedType,
)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MODEL_NAME", "pytorch_model"),
        ("OPTIMIZER_NAME", "optimizer"),
        ("RNG_STATE_NAME", "random_states"),
        ("SCALER_NAME", "scaler.pt"),
        ("SCHEDULER_NAME", "scheduler"),
        ("SAMPLER_NAME", "sampler"),
        ("SAFE_MODEL_NAME", "model"),
        ("WEIGHTS_NAME", "pytorch_model.bin"),
        ("SAFE_WEIGHTS_NAME", "model.safetensors"),
        ("WEIGHTS_INDEX_NAME", "pytorch_model.bin.index.json"),
        ("SAFE_WEIGHTS_INDEX_NAME", "model.safetensors.index.json"),
        ("ACCELERATE_DEBUG_MODE", "ACCELERATE_DEBUG_MODE"),
    ],
)
def test_constant_values(name: str, value: str) -> None:
    assert getattr(utils, name) == value


def test_shard_patterns_format() -> None:
    assert utils.WEIGHTS_PATTERN_NAME.format(suffix="-00001-of-00002") == "pytorch_model-00001-of-00002.bin"
    assert (
        utils.SAFE_WEIGHTS_PATTERN_NAME.format(suffix="-00001-of-00002") == "model-00001-of-00002.safetensors"
    )


@pytest.mark.parametrize(
    ("enum", "members"),
    [
        (ComputeEnvironment, ["LOCAL_MACHINE", "AMAZON_SAGEMAKER"]),
        (
            DistributedType,
            [
                "NO",
                "MULTI_CPU",
                "MULTI_GPU",
                "MULTI_NPU",
                "MULTI_XPU",
                "DEEPSPEED",
                "FSDP",
                "XLA",
                "MEGATRON_LM",
                "TPU",
            ],
        ),
        (
            DynamoBackend,
            [
                "NO",
                "EAGER",
                "AOT_EAGER",
                "INDUCTOR",
                "AOT_TS_NVFUSER",
                "NVPRIMS_NVFUSER",
                "CUDAGRAPHS",
                "OFI",
                "FX2TRT",
                "ONNXRT",
                "TENSORRT",
                "IPEX",
                "TVM",
            ],
        ),  # fmt: skip
        (LoggerType, ["ALL", "TENSORBOARD", "WANDB", "COMETML", "DVCLIVE", "AIM", "MLFLOW", "CLEARML"]),
        (PrecisionType, ["NO", "FP16", "BF16", "FP8"]),
        (RNGType, ["TORCH", "CUDA", "XLA", "NPU", "XPU", "GENERATOR"]),
        (SageMakerDistributedType, ["NO", "DATA_PARALLEL", "MODEL_PARALLEL"]),
    ],
)
def test_documented_members_exist(enum, members) -> None:
    for member in members:
        assert isinstance(getattr(enum, member), enum)


def test_string_enums_compare_to_values() -> None:
    assert DistributedType.MULTI_GPU == "MULTI_GPU"
    assert PrecisionType.FP16 == "fp16" and str(PrecisionType.BF16) == "bf16"
    assert LoggerType.COMETML == "comet_ml"
    assert RNGType("generator") is RNGType.GENERATOR
    assert "fp16" in PrecisionType and "fp64" not in PrecisionType
    assert PrecisionType.list() == ["no", "fp8", "fp16", "bf16"]
    assert json.dumps({"d": DistributedType.NO}) == '{"d": "NO"}'


def test_printed_form_is_accelerates() -> None:
    # Accelerate 1.15 (a recorded fact): (str, Enum) types print as Class.MEMBER, its BaseEnum types
    # print their value; both compare and serialise as the value.
    from notebook_accel.state import PartialState
    from notebook_accel.utils import ComputeEnvironment, DynamoBackend, SageMakerDistributedType

    assert str(DistributedType.MULTI_CPU) == "DistributedType.MULTI_CPU"
    assert f"{DistributedType.NO}|{DistributedType.NO:>20}" == "DistributedType.NO|  DistributedType.NO"
    assert str(ComputeEnvironment.LOCAL_MACHINE) == "ComputeEnvironment.LOCAL_MACHINE"
    assert str(SageMakerDistributedType.DATA_PARALLEL) == "SageMakerDistributedType.DATA_PARALLEL"
    assert (
        f"{PrecisionType.FP16} {DynamoBackend.INDUCTOR} {LoggerType.TENSORBOARD}"
        == "fp16 INDUCTOR tensorboard"
    )
    assert DistributedType.MULTI_CPU == "MULTI_CPU" and DistributedType("XLA") is DistributedType.XLA
    assert str(PartialState()).startswith("Distributed environment: DistributedType.NO\n")


def test_tpu_is_the_old_name_of_xla() -> None:
    assert DistributedType.TPU is DistributedType.XLA
    assert "TPU" not in DistributedType.list()


def test_unknown_value_raises() -> None:
    with pytest.raises(ValueError, match="'fp64' is not a valid PrecisionType"):
        PrecisionType("fp64")
