"""``load_and_quantize_model``: quantize a model with bitsandbytes, then load and dispatch its weights.

The bitsandbytes pieces (library check, layers to keep, swapping ``nn.Linear`` layers) are in
:mod:`notebook_accel.utils.bnb`; this module adds what needs the hooks: loading a meta model's
checkpoint along a device map and dispatching it. ``notebook_accel.utils`` lists it.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from ...big_modeling.dispatch import dispatch_model
from ...big_modeling.empty import init_empty_weights
from ...utils.checkpoint_io.checkpoints import load_checkpoint_in_model
from ...utils.configs import BnbQuantizationConfig
from ...utils.device_planning.devices import OFFLOAD_KEYS, device_key
from ...utils.device_planning.placement import DevicePlacement, require_offload_folder
from . import bnb

__all__ = ["load_and_quantize_model"]

logger = logging.getLogger(__name__)


def _load_quantized(
    model: nn.Module,
    config: BnbQuantizationConfig,
    placement: DevicePlacement,
    weights_location: str | os.PathLike,
    offload_folder: str | os.PathLike | None,
    offload_state_dict: bool,
) -> nn.Module:
    """Return the meta ``model`` (layers already swapped) with its checkpoint loaded and dispatched."""
    offload = any(key in OFFLOAD_KEYS for key in placement.devices)
    require_offload_folder(placement.disk_modules, offload_folder, "offload_folder")
    load_checkpoint_in_model(
        model,
        weights_location,
        device_map=placement,
        dtype=config.torch_dtype,
        offload_folder=offload_folder,
        offload_state_dict=offload_state_dict or bool(placement.disk_modules),
        keep_in_fp32_modules=config.keep_in_fp32_modules,
        offload_8bit_bnb=config.load_in_8bit and offload,
    )
    return dispatch_model(model, device_map=placement, offload_dir=offload_folder)


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

    Args:
        model: The model to quantize (with weights, or on the meta device).
        bnb_quantization_config: A ``BnbQuantizationConfig``: 8 or 4 bits and which modules stay unquantized.
        weights_location: Where a meta model's weights are read from (file, index or folder).
        device_map: Module name -> device for a meta model, or a strategy name.
        no_split_module_classes: Module classes a planned map keeps on one device.
        max_memory: Device -> memory budget for a planned map.
        offload_folder: Folder of the weights mapped to "disk".
        offload_state_dict: Stage the CPU weights on disk while loading.
    """
    if not isinstance(bnb_quantization_config, BnbQuantizationConfig):
        raise TypeError(
            "bnb_quantization_config must be a BnbQuantizationConfig, e.g. BnbQuantizationConfig(load_in_8bit=True); "
            f"got {type(bnb_quantization_config).__name__}"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = bnb_quantization_config
    library = bnb.require_bnb(config)
    skip = list(config.skip_modules) if config.skip_modules is not None else bnb.default_skip_modules(model)
    if config.load_in_4bit and isinstance(device_map, dict):
        skip.extend(name for name, dev in device_map.items() if device_key(dev) in OFFLOAD_KEYS)
    not_convert = skip + list(config.keep_in_fp32_modules or [])
    if not any(p.device.type == "meta" for p in model.parameters()):
        bnb.replace_linear_layers(model, config, not_convert, library.nn)
        bnb.set_unquantized_dtypes(model, config, library.nn)
        logger.info("quantized the loaded model; moving it to cuda:%d", torch.cuda.current_device())
        return model.to(torch.cuda.current_device())
    if weights_location is None:
        raise ValueError(
            "the model is on the meta device, so weights_location must name the checkpoint (file, index "
            "or folder) to load; got None"
        )
    with init_empty_weights():
        bnb.replace_linear_layers(model, config, not_convert, library.nn)
    quantized_map = bnb.get_quantized_model_device_map(
        model, config, device_map, max_memory, no_split_module_classes
    )
    placement = DevicePlacement.check(model, quantized_map)
    return _load_quantized(model, config, placement, weights_location, offload_folder, offload_state_dict)
