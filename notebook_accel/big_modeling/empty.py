"""Building a model without allocating its weights: ``init_empty_weights`` / ``init_on_device``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..utils.environment import parse_flag_from_env

__all__ = ["init_empty_weights", "init_on_device"]


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Yield a context in which new modules get their parameters on the meta device (no memory used).

    ``include_buffers`` (default: env ``ACCELERATE_INIT_INCLUDE_BUFFERS``, else False) puts buffers
    on the meta device too. Load weights into such a model with ``load_checkpoint_and_dispatch``.
    """
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


@contextlib.contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool | None = None) -> Iterator[None]:
    """Yield a context in which new modules get their parameters (and optionally buffers) on ``device``."""
    if include_buffers is None:
        include_buffers = parse_flag_from_env("ACCELERATE_INIT_INCLUDE_BUFFERS")
    device = torch.device(device)
    if include_buffers:
        # Every tensor factory call allocates on ``device``: buffers and parameters alike.
        with device:
            yield
        return

    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device != device:
            cls = type(param)
            moved = cls(param.detach().to(device), requires_grad=param.requires_grad)
            moved.__dict__.update(param.__dict__)
            module._parameters[name] = moved

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original
