"""Quantize a model with bitsandbytes (LLM.int8() or 4-bit FP4/NF4) and load/dispatch its weights."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from . import imports
from .checkpoints import load_checkpoint_in_model
from .configs import BnbQuantizationConfig
from .device_map import DEVICE_MAP_STRATEGIES, resolve_device_map
from .devices import OFFLOAD_KEYS
from .placement import DevicePlacement, require_offload_folder
from .tied_params import find_tied_parameters

__all__ = ["load_and_quantize_model", "replace_with_bnb_layers"]

logger = logging.getLogger(__name__)

_MIN_BNB = {"8bit": "0.37.2", "4bit": "0.39.0"}


def _require_bnb(config: BnbQuantizationConfig) -> Any:
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
    import importlib.metadata

    import bitsandbytes as bnb
    from torch.torch_version import TorchVersion

    kind = "8bit" if config.load_in_8bit else "4bit"
    installed = importlib.metadata.version("bitsandbytes")
    # TorchVersion: torch's PEP 440 comparison (as in is_torch_version), "0.45.0.dev0" < "0.45.0".
    if TorchVersion(installed) < _MIN_BNB[kind]:
        raise ImportError(
            f"{kind} quantization needs bitsandbytes>={_MIN_BNB[kind]}, found {installed}: pip install -U bitsandbytes"
        )
    return bnb


def _default_skip_modules(model: nn.Module) -> list[str]:
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


def _skipped(name: str, skip: list[str]) -> bool:
    return any(name == s or name.startswith(s + ".") or name.endswith("." + s) for s in skip)


def replace_with_bnb_layers(
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
        if _skipped(full, modules_to_not_convert):
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
            replaced += replace_with_bnb_layers(
                child, config, modules_to_not_convert, bnb_nn, prefix=f"{full}."
            )
    return replaced


def _set_dtypes(model: nn.Module, config: BnbQuantizationConfig, bnb_nn: Any) -> None:
    """Cast unquantized parameters: fp32 for ``keep_in_fp32_modules``, ``torch_dtype`` for the rest."""
    quantized = (bnb_nn.Linear8bitLt, bnb_nn.Linear4bit)
    keep = config.keep_in_fp32_modules or []
    for name, module in model.named_modules():
        if isinstance(module, quantized):
            continue
        dtype = torch.float32 if _skipped(name, keep) else config.torch_dtype
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.device.type != "meta":
                param.data = param.data.to(dtype)


def _quantized_device_map(
    model: nn.Module,
    config: BnbQuantizationConfig,
    device_map: Any,
    max_memory: dict | None,
    no_split_module_classes: list[str] | None,
) -> dict:
    if device_map is None:
        return {"": torch.cuda.current_device()}
    if isinstance(device_map, dict):
        return device_map
    if device_map not in DEVICE_MAP_STRATEGIES:
        raise ValueError(
            f"device_map={device_map!r} is not valid; use a dict or one of {list(DEVICE_MAP_STRATEGIES)}"
        )
    keep = config.keep_in_fp32_modules or []
    special_dtypes = {
        name: torch.float32 if _skipped(name.rsplit(".", 1)[0], keep) else config.torch_dtype
        for name, _ in model.named_parameters()
        if _skipped(name.rsplit(".", 1)[0], (config.skip_modules or []) + keep)
    }
    # 4-bit weights are counted as int8: twice their real size, which errs on the safe side.
    device_map = resolve_device_map(
        model,
        device_map,
        max_memory=max_memory,
        no_split_module_classes=no_split_module_classes,
        dtype=torch.int8,
        special_dtypes=special_dtypes,
    )
    if config.load_in_4bit and any(v in ("cpu", "disk") for v in device_map.values()):
        raise ValueError(
            "the 4-bit model does not fit on the GPU(s) and 4-bit layers cannot be offloaded to cpu/disk; "
            f"give more max_memory or use load_in_8bit (device map: {device_map})"
        )
    return device_map


def load_and_quantize_model(
    model: torch.nn.Module,
    bnb_quantization_config: BnbQuantizationConfig,
    weights_location: str | os.PathLike = None,
    device_map: dict[str, int | str | torch.device] | None = None,
    no_split_module_classes: list[str] | None = None,
    max_memory: dict[int | str, int | str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    offload_state_dict: bool = False,
) -> torch.nn.Module:
    """Return ``model`` quantized with bitsandbytes as ``bnb_quantization_config`` says.

    A model already holding weights is quantized in place and moved to the GPU. A model on the meta
    device (built under ``init_empty_weights``) has its layers replaced, then its weights loaded from
    ``weights_location`` (file, index or folder) following ``device_map`` and dispatched.
    Needs bitsandbytes and a CUDA GPU.
    """
    if not isinstance(bnb_quantization_config, BnbQuantizationConfig):
        raise TypeError(
            "bnb_quantization_config must be a BnbQuantizationConfig, e.g. BnbQuantizationConfig(load_in_8bit=True); "
            f"got {type(bnb_quantization_config).__name__}"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = bnb_quantization_config
    bnb = _require_bnb(config)

    skip = list(config.skip_modules) if config.skip_modules is not None else _default_skip_modules(model)
    if config.load_in_4bit and isinstance(device_map, dict):
        skip.extend(name for name, dev in device_map.items() if dev in ("cpu", "disk"))
    not_convert = skip + list(config.keep_in_fp32_modules or [])

    on_meta = any(p.device.type == "meta" for p in model.parameters())
    if not on_meta:
        replace_with_bnb_layers(model, config, not_convert, bnb.nn)
        _set_dtypes(model, config, bnb.nn)
        logger.info("quantized the loaded model; moving it to cuda:%d", torch.cuda.current_device())
        return model.to(torch.cuda.current_device())
    if weights_location is None:
        raise ValueError(
            "the model is on the meta device, so weights_location must name the checkpoint (file, index "
            "or folder) to load; got None"
        )
    from ..big_modeling import dispatch_model, init_empty_weights

    with init_empty_weights():
        replace_with_bnb_layers(model, config, not_convert, bnb.nn)
    placement = DevicePlacement.check(
        model, _quantized_device_map(model, config, device_map, max_memory, no_split_module_classes)
    )
    offload = any(key in OFFLOAD_KEYS for key in placement.devices)
    require_offload_folder(placement.disk_modules, offload_folder, "offload_folder")
    if placement.disk_modules:
        offload_state_dict = True
    load_checkpoint_in_model(
        model,
        weights_location,
        device_map=placement,
        dtype=config.torch_dtype,
        offload_folder=offload_folder,
        offload_state_dict=offload_state_dict,
        keep_in_fp32_modules=config.keep_in_fp32_modules,
        offload_8bit_bnb=config.load_in_8bit and offload,
    )
    return dispatch_model(model, device_map=placement, offload_dir=offload_folder)
