"""String enums naming distributed setups, precisions, compile backends, trackers and RNG kinds.

Each member is a ``str`` equal to its value, so ``DistributedType.MULTI_GPU == "MULTI_GPU"`` and
``"fp16" in PrecisionType`` hold, and configuration files can store plain strings.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = [
    "MIXED_PRECISION_CHOICES",
    "BaseEnum",
    "ComputeEnvironment",
    "CustomDtype",
    "DDPCommunicationHookType",
    "DistributedType",
    "DynamoBackend",
    "EnumWithContains",
    "FP8BackendType",
    "LoggerType",
    "PrecisionType",
    "RNGType",
    "SageMakerDistributedType",
    "check_mixed_precision",
]


class EnumWithContains(enum.EnumMeta):
    """Metaclass letting ``"fp16" in PrecisionType`` test values as well as members."""

    def __contains__(cls, item: object) -> bool:
        if isinstance(item, cls):
            return True
        return any(item == member.value for member in cls)


class BaseEnum(str, enum.Enum, metaclass=EnumWithContains):
    """String enum whose ``str()`` is its value."""

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def list(cls) -> list[str]:
        """Return the values of every member, in definition order (aliases excluded)."""
        return [member.value for member in cls]


class _QualifiedStrEnum(BaseEnum):
    """A string enum whose ``str()`` and f-string form is ``Class.MEMBER``.

    Accelerate 1.15 declares ComputeEnvironment, DistributedType and SageMakerDistributedType as plain
    ``(str, Enum)``, so printing one (``PartialState()``'s "Distributed environment: DistributedType.NO",
    a log line) shows the qualified name while comparisons still use the value; this keeps that output.
    """

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __format__(self, format_spec: str) -> str:
        return format(str(self), format_spec)


class ComputeEnvironment(_QualifiedStrEnum):
    """Where the job runs: ``LOCAL_MACHINE`` (own/custom cluster) or ``AMAZON_SAGEMAKER``."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class DistributedType(_QualifiedStrEnum):
    """The kind of distributed environment.

    ``NO`` is a single process; ``MULTI_*`` is data parallel over several processes of that device
    kind; ``DEEPSPEED``, ``FSDP``, ``MEGATRON_LM``, ``TP`` name the engine; ``XLA`` is TPU/XLA
    (``TPU`` is the older name of the same member).
    """

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_HPU = "MULTI_HPU"
    MULTI_XPU = "MULTI_XPU"
    MULTI_NEURON = "MULTI_NEURON"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    TP = "TP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    # Accelerate <= 0.27 called XLA "TPU"; an alias keeps that spelling working.
    TPU = "XLA"


class SageMakerDistributedType(_QualifiedStrEnum):
    """The SageMaker distributed mode: ``NO``, ``DATA_PARALLEL`` or ``MODEL_PARALLEL``."""

    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"


class DynamoBackend(BaseEnum):
    """A ``torch.compile`` (TorchDynamo) backend; ``NO`` disables compilation."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    IPEX = "IPEX"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


class LoggerType(BaseEnum):
    """An experiment tracker; ``ALL`` means every supported tracker that is installed."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    TRACKIO = "trackio"


class PrecisionType(BaseEnum):
    """Floating-point precision: ``NO`` (fp32), ``FP8``, ``FP16`` or ``BF16``."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


# The mixed-precision modes, in the order messages list them. The one list: the process state, the
# launcher, config files, the DeepSpeed plugin and the Accelerator all validate through
# check_mixed_precision (they sit at different layers, so the fact lives in the lowest one).
MIXED_PRECISION_CHOICES: tuple[str, ...] = tuple(
    member.value for member in (PrecisionType.NO, PrecisionType.FP16, PrecisionType.BF16, PrecisionType.FP8)
)


def check_mixed_precision(value: Any, source: str = "mixed_precision") -> str:
    """Return ``value`` (a string or a PrecisionType) as a lower-case mode; raise ValueError if it is none.

    ``source`` names where the value came from in the message (an argument or an environment variable).
    """
    text = str(getattr(value, "value", value)).lower()
    if text not in MIXED_PRECISION_CHOICES:
        choices = ", ".join(repr(choice) for choice in MIXED_PRECISION_CHOICES)
        raise ValueError(f"Unknown {source} {value!r}: choose one of {choices}")
    return text


class RNGType(BaseEnum):
    """A random number generator whose state can be synchronised across processes."""

    TORCH = "torch"
    CUDA = "cuda"
    NPU = "npu"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    HPU = "hpu"
    XLA = "xla"
    XPU = "xpu"
    NEURON = "neuron"
    GENERATOR = "generator"


class CustomDtype(enum.Enum):
    """Sub-byte and fp8 weight types ``infer_auto_device_map`` can size (``dtype_byte_size`` knows them)."""

    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"


class DDPCommunicationHookType(BaseEnum):
    """A DDP communication hook: none, fp16/bf16 gradient compression, or (batched) PowerSGD."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


class FP8BackendType(str, enum.Enum, metaclass=EnumWithContains):
    """The library behind fp8 training: ``TE`` (TransformerEngine), ``MSAMP``, ``AO`` (torchao) or ``NO``."""

    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"
