"""Tied (shared) parameters: find them, tie them again, and check they share a device."""

from __future__ import annotations

import logging
from typing import Union

import torch
from torch import nn

from .placement import DeviceLookup

__all__ = ["check_tied_parameters_on_same_device", "find_tied_parameters", "retie_parameters"]

logger = logging.getLogger(__name__)


def find_tied_parameters(model: nn.Module, **kwargs: object) -> list[list[str]]:
    """Return the groups of parameter names that share one ``Parameter`` object, each group sorted.

    Groups come in the order their first member appears in the model. Identity of the ``Parameter`` is used
    (not data pointers), so meta models work.
    """
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [sorted(set(names)) for names in groups.values() if len(set(names)) > 1]


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module = model
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part)
    return module, leaf


def retie_parameters(model: nn.Module, tied_params: list[list[str]]) -> None:
    """Make every name of each group in ``tied_params`` point to the same parameter again.

    The shared value is the first member not on the meta device (a group entirely on meta is left alone).
    """
    for group in tied_params:
        source = None
        for name in group:
            module, leaf = _owner(model, name)
            param = getattr(module, leaf)
            if param.device.type != "meta":
                source = param
                break
        if source is None:
            continue
        for name in group:
            module, leaf = _owner(model, name)
            if leaf in module._parameters:
                module._parameters[leaf] = source
            else:
                setattr(module, leaf, source)


def check_tied_parameters_on_same_device(
    tied_params: list[list[str]], device_map: dict[str, Union[int, str, torch.device]]
) -> bool:
    """Return True when each tied group lands on one device under ``device_map``; warn (and return False) if not."""
    ok = True
    lookup = DeviceLookup(device_map)
    for group in tied_params:
        devices = {name: lookup(name) for name in group}
        if len({str(d) for d in devices.values()}) > 1:
            ok = False
            logger.warning(
                "Tied parameters are on different devices: %s. Please modify your custom device map or set "
                "`device_map='auto'`.",
                devices,
            )
    return ok
