"""bitsandbytes quantization pieces: check the library, choose the layers to keep, swap Linear layers.

``load_and_quantize_model`` (which also loads and dispatches the weights, so it needs the hooks) lives
in :mod:`notebook_accel.big_modeling.quantize`; this module lists it lazily at its Accelerate path.
"""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Any

import torch
from torch import nn
from torch.torch_version import TorchVersion

from .._lazy import attach
from . import imports
from .checkpoints import load_checkpoint_in_model as load_checkpoint_in_model  # Accelerate's bnb has it
from .configs import BnbQuantizationConfig
from .device_map import infer_auto_device_map
from .device_memory import get_balanced_memory
from .offload import offload_weight
from .package_checks import is_4bit_bnb_available, is_8bit_bnb_available
from .tensors import set_module_tensor_to_device
from .tied_params import find_tied_parameters

# load_and_quantize_model loads and dispatches (hooks): resolved at first use, not imported (a lazy
# table entry keeps utils below big_modeling).
_FROM_BIG_MODELING = {
    "load_and_quantize_model": "notebook_accel.big_modeling.quantize",
    # Accelerate's bnb module serves these too; they build on hooks, above utils.
    "dispatch_model": "notebook_accel.big_modeling",
    "init_empty_weights": "notebook_accel.big_modeling",
}
__all__ = [
    "default_skip_modules",
    "get_keys_to_not_convert",
    "get_parameter_device",
    "has_4bit_bnb_layers",
    "is_skipped",
    "replace_linear_layers",
    "replace_with_bnb_layers",
    "require_bnb",
    "set_unquantized_dtypes",
    *sorted(_FROM_BIG_MODELING),
]
# Accelerate 1.15 serves these names at this path too (defined elsewhere).
__all__ += [
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
