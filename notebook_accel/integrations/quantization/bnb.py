"""bitsandbytes quantization pieces: check the library, choose the layers to keep, swap Linear layers.

``load_and_quantize_model`` (which also loads and dispatches the weights, so it needs the hooks) lives
in :mod:`notebook_accel.integrations.quantization.quantize`; this module lists it lazily at its Accelerate path.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from typing import Any

import torch
from torch import nn
from torch.torch_version import TorchVersion

from ..._lazy import attach
from ...utils import imports
from ...utils.checkpoint_io.checkpoints import (
    load_checkpoint_in_model as load_checkpoint_in_model,  # Accelerate's bnb has it
)
from ...utils.configs import BnbQuantizationConfig
from ...utils.device_planning.device_map import (
    check_strategy,
    infer_auto_device_map,
    resolve_device_map,
)
from ...utils.device_planning.device_memory import get_balanced_memory
from ...utils.device_planning.devices import OFFLOAD_KEYS, device_key
from ...utils.device_planning.tensors import set_module_tensor_to_device
from ...utils.device_planning.tied_params import find_tied_parameters
from ...utils.enums import CustomDtype
from ...utils.offload import offload_weight
from ...utils.package_checks import is_4bit_bnb_available, is_8bit_bnb_available

# load_and_quantize_model loads and dispatches (hooks): resolved at first use, not imported (a lazy
# table entry keeps utils below big_modeling).
_FROM_BIG_MODELING = {
    "load_and_quantize_model": "notebook_accel.integrations.quantization.quantize",
    # Accelerate's bnb module serves these too; they build on hooks, above utils.
    "dispatch_model": "notebook_accel.big_modeling",
    "init_empty_weights": "notebook_accel.big_modeling",
}
__all__ = [
    "default_skip_modules",
    "get_keys_to_not_convert",
    "get_parameter_device",
    "get_quantized_model_device_map",
    "has_4bit_bnb_layers",
    "is_skipped",
    "quantize_and_offload_8bit",
    "replace_linear_layers",
    "replace_with_bnb_layers",
    "require_bnb",
    "set_unquantized_dtypes",
    *sorted(_FROM_BIG_MODELING),
]
# Accelerate 1.15 serves these names at this path too (defined elsewhere).
__all__ += [
    "BnbQuantizationConfig",
    "find_tied_parameters",
    "load_checkpoint_in_model",
    "get_balanced_memory",
    "infer_auto_device_map",
    "is_4bit_bnb_available",
    "is_8bit_bnb_available",
    "offload_weight",
    "set_module_tensor_to_device",
]
__getattr__, __dir__ = attach(__name__, _FROM_BIG_MODELING)

logger = logging.getLogger(__name__)

_MIN_BNB = {"8bit": "0.37.2", "4bit": "0.39.0"}


def require_bnb(config: BnbQuantizationConfig) -> Any:
    """Return the imported ``bitsandbytes``; raise ImportError / RuntimeError naming what is missing."""
    if not imports.is_bnb_available():
        raise ImportError(
            "load_and_quantize_model requires `bitsandbytes`: pip install bitsandbytes (and a CUDA GPU)"
        )
    if not imports.is_cuda_available():
        raise RuntimeError(
            "bitsandbytes quantization needs a CUDA GPU, and none is visible here; run on a GPU machine "
            "(or check CUDA_VISIBLE_DEVICES)"
        )
    import bitsandbytes as bnb  # optional: only quantization needs it

    kind = "8bit" if config.load_in_8bit else "4bit"
    installed = importlib.metadata.version("bitsandbytes")
    # TorchVersion: torch's PEP 440 comparison (as in is_torch_version), "0.45.0.dev0" < "0.45.0".
    if TorchVersion(installed) < _MIN_BNB[kind]:
        raise ImportError(
            f"{kind} quantization needs bitsandbytes>={_MIN_BNB[kind]}, found {installed}: pip install -U bitsandbytes"
        )
    return bnb


def default_skip_modules(model: nn.Module) -> list[str]:
    """Return the modules to keep unquantized by default: tied weights and the output head."""
    tied = find_tied_parameters(model)
    tied_names = {name for group in tied for name in (group if isinstance(group, (list, tuple)) else [group])}
    names = sorted({name.rsplit(".", 1)[0] for name in tied_names if "." in name})
    children = list(model.named_children())
    if children:
        last = children[-1][0]
        if last not in names:
            names.append(last)  # the output projection (e.g. lm_head) loses too much when quantized
    return names


def is_skipped(name: str, skip: list[str]) -> bool:
    return any(name == s or name.startswith(s + ".") or name.endswith("." + s) for s in skip)


def replace_linear_layers(
    model: nn.Module,
    config: BnbQuantizationConfig,
    modules_to_not_convert: list[str],
    bnb_nn: Any,
    prefix: str = "",
) -> int:
    """Return how many ``nn.Linear`` layers of ``model`` were replaced by bitsandbytes layers from ``bnb_nn``."""
    replaced = 0
    for name, child in list(model.named_children()):
        full = f"{prefix}{name}"
        if is_skipped(full, modules_to_not_convert):
            continue
        if isinstance(child, nn.Linear):
            has_bias = child.bias is not None
            if config.load_in_8bit:
                new = bnb_nn.Linear8bitLt(
                    child.in_features,
                    child.out_features,
                    has_bias,
                    has_fp16_weights=False,
                    threshold=config.llm_int8_threshold,
                )
            else:
                new = bnb_nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    has_bias,
                    config.bnb_4bit_compute_dtype,
                    compress_statistics=config.bnb_4bit_use_double_quant,
                    quant_type=config.bnb_4bit_quant_type,
                )
            # Keep the float weights: bitsandbytes quantizes them when they move to the GPU.
            new.weight.data = child.weight.data
            if has_bias:
                new.bias.data = child.bias.data
            new.requires_grad_(False)
            setattr(model, name, new)
            replaced += 1
        else:
            replaced += replace_linear_layers(
                child, config, modules_to_not_convert, bnb_nn, prefix=f"{full}."
            )
    return replaced


def replace_with_bnb_layers(
    model: nn.Module,
    bnb_quantization_config: BnbQuantizationConfig,
    modules_to_not_convert: list[str] | None = None,
    current_key_name: list[str] | None = None,
) -> nn.Module:
    """Return ``model`` with its ``nn.Linear`` layers replaced, in place, by bitsandbytes 8-bit or 4-bit layers.

    ``modules_to_not_convert`` (default: ``get_keys_to_not_convert(model)``, the tied weights and output
    head) stay in full precision; ``current_key_name`` is the path of ``model`` inside a larger model
    (names are matched from there). Needs bitsandbytes and a CUDA GPU (the error names what is missing).
    """
    library = require_bnb(bnb_quantization_config)
    skip = get_keys_to_not_convert(model) if modules_to_not_convert is None else list(modules_to_not_convert)
    prefix = ".".join(current_key_name) + "." if current_key_name else ""
    if replace_linear_layers(model, bnb_quantization_config, skip, library.nn, prefix=prefix) == 0:
        logger.warning("replace_with_bnb_layers found no nn.Linear to quantize outside %s", skip)
    return model


def get_keys_to_not_convert(model: nn.Module) -> list[str]:
    """Return the modules to keep in full precision: those holding tied weights, and the output head."""
    return default_skip_modules(model)


def has_4bit_bnb_layers(model: nn.Module) -> bool:
    """Return whether ``model`` holds bitsandbytes ``Linear4bit`` layers."""
    return any(
        type(m).__name__ == "Linear4bit" and type(m).__module__.startswith("bitsandbytes")
        for m in model.modules()
    )


def get_parameter_device(parameter: nn.Module) -> torch.device:
    """Return the device of the first parameter of module ``parameter``."""
    try:
        return next(parameter.parameters()).device
    except StopIteration:
        raise ValueError(f"{type(parameter).__name__} has no parameters, so it has no device") from None


def set_unquantized_dtypes(model: nn.Module, config: BnbQuantizationConfig, bnb_nn: Any) -> None:
    """Cast unquantized parameters: fp32 for ``keep_in_fp32_modules``, ``torch_dtype`` for the rest."""
    quantized = (bnb_nn.Linear8bitLt, bnb_nn.Linear4bit)
    keep = config.keep_in_fp32_modules or []
    for name, module in model.named_modules():
        if isinstance(module, quantized):
            continue
        dtype = torch.float32 if is_skipped(name, keep) else config.torch_dtype
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.device.type != "meta":
                param.data = param.data.to(dtype)


def _planning_dtypes(model: nn.Module, config: BnbQuantizationConfig) -> dict[str, torch.dtype]:
    """Return the dtype each unquantized parameter is planned in: float32 if kept in fp32, else ``torch_dtype``."""
    keep = config.keep_in_fp32_modules or []
    skip = config.skip_modules if config.skip_modules is not None else default_skip_modules(model)
    dtypes = {}
    for name, _ in model.named_parameters():
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if is_skipped(owner, keep):
            dtypes[name] = torch.float32
        elif is_skipped(owner, skip):
            dtypes[name] = config.torch_dtype
    return dtypes


def get_quantized_model_device_map(
    model: nn.Module,
    bnb_quantization_config: BnbQuantizationConfig,
    device_map: str | dict[str, Any] | None = None,
    max_memory: dict[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
) -> dict[str, Any]:
    """Return where each module of ``model`` goes once quantized: the map given, the current GPU, or a planned map.

    ``device_map=None`` puts the whole model on the current CUDA device (RuntimeError without one); a dict is
    returned as given; a strategy ("auto", "balanced", "balanced_low_0", "sequential") is planned over
    ``max_memory`` with quantized weights counted as int8 (half a byte with ``load_in_4bit``), ``skip_modules``
    (default: tied weights and the output head) in ``torch_dtype`` and ``keep_in_fp32_modules`` in float32. 4-bit layers cannot be offloaded, so a planned map that sends
    a quantized module to "cpu" or "disk" raises ValueError with ``load_in_4bit``.
    """
    config = bnb_quantization_config
    if not isinstance(config, BnbQuantizationConfig):
        raise TypeError(
            "bnb_quantization_config must be a BnbQuantizationConfig, e.g. BnbQuantizationConfig(load_in_8bit=True); "
            f"got {type(config).__name__}"
        )
    if device_map is None:
        if not imports.is_cuda_available():
            raise RuntimeError(
                "device_map=None places the quantized model on the current CUDA GPU, and none is visible here: "
                "run on a GPU machine, or pass device_map= (a dict or a strategy such as 'sequential') to plan"
            )
        return {"": torch.cuda.current_device()}
    if isinstance(device_map, dict):
        return device_map
    check_strategy(device_map, alternatives="a dict of module name -> device")
    special_dtypes = _planning_dtypes(model, config)
    planned = resolve_device_map(
        model, device_map, max_memory=max_memory, no_split_module_classes=no_split_module_classes,
        dtype=CustomDtype.INT4 if config.load_in_4bit else torch.int8, special_dtypes=special_dtypes,
    )  # fmt: skip
    if config.load_in_4bit:
        unquantized = (config.skip_modules or []) + (config.keep_in_fp32_modules or [])
        if config.skip_modules is None:
            unquantized += default_skip_modules(model)
        offloaded = [
            name for name, dev in planned.items()
            if device_key(dev) in OFFLOAD_KEYS and not is_skipped(name, unquantized)
        ]  # fmt: skip
        if offloaded:
            raise ValueError(
                f"the 4-bit model does not fit on the GPU(s): {offloaded} would go to cpu/disk, and 4-bit layers "
                f"cannot be offloaded; give more max_memory, use load_in_8bit, or pass a device_map dict (offloaded modules then "
                f"stay unquantized, in torch_dtype) (planned map: {planned})"
            )
    elif any(device_key(dev) in OFFLOAD_KEYS for dev in planned.values()):
        logger.info("8-bit model partly offloaded: offloaded layers are stored int8 and computed on the GPU")
    return planned


def _int8_rowwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``weight`` quantized to int8 row by row (LLM.int8's vector-wise scheme) and each row's absmax (SCB)."""
    rows = weight.detach().to("cpu", torch.float32)
    scales = rows.abs().amax(dim=1)
    # An all-zero row quantizes to zeros whatever its divisor; 1 avoids dividing by zero.
    divisor = torch.where(scales == 0, torch.ones_like(scales), scales)
    quantized = torch.round(rows * (127.0 / divisor).unsqueeze(1)).to(torch.int8)
    return quantized, scales


def quantize_and_offload_8bit(
    model: nn.Module,
    param: torch.Tensor,
    param_name: str,
    new_dtype: torch.dtype,
    offload_folder: str | os.PathLike,
    offload_index: dict,
    fp16_statistics: torch.Tensor | None,
) -> dict:
    """Return ``offload_index`` updated with the int8 weight ``param_name`` and its scales, written to ``offload_folder``.

    Without ``fp16_statistics`` the float ``param`` (out_features x in_features) is quantized row by row
    as bitsandbytes' ``Int8Params`` does (int8 values and each row's absmax); with them, ``param`` is
    already int8 and ``fp16_statistics`` are its row scales (an 8-bit checkpoint). Two files are written:
    ``<param_name>.dat`` (int8) and ``<...>.SCB.dat`` (the scales, named as bitsandbytes names them), and
    the model's tensor becomes an empty meta tensor of ``new_dtype``, read back from disk when needed.
    """
    if not param_name.endswith("weight"):
        raise ValueError(
            f"8-bit offload stores Linear weights with their scales; {param_name!r} is not a weight"
        )
    if fp16_statistics is None:
        if not param.is_floating_point() or param.dim() != 2:
            raise ValueError(
                f"{param_name!r}: quantizing needs a 2-D floating weight, got {param.dtype} of shape "
                f"{tuple(param.shape)}; pass fp16_statistics when the weight is already int8"
            )
        quantized, scales = _int8_rowwise(param)
    else:
        if param.dtype != torch.int8 or fp16_statistics.shape[0] != param.shape[0]:
            raise ValueError(
                f"{param_name!r}: with fp16_statistics the weight must be int8 with one scale per row; got "
                f"{param.dtype} {tuple(param.shape)} and {tuple(fp16_statistics.shape)} scales"
            )
        quantized, scales = param, fp16_statistics
    offload_index = offload_weight(quantized, param_name, offload_folder, index=offload_index)
    scb_name = param_name[: -len("weight")] + "SCB"
    offload_index = offload_weight(scales, scb_name, offload_folder, index=offload_index)
    set_module_tensor_to_device(
        model, param_name, "meta", value=torch.empty(param.shape, device="meta"), dtype=new_dtype
    )
    return offload_index
