"""torchao FP8 training: which linear layers to convert (all but the first and the last), and converting them.

Choosing the layers is plain PyTorch and works anywhere; the conversion itself needs ``torchao``
(``pip install torchao``) and a GPU with FP8 matrix multiplies to be useful.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from ...utils.imports import torchao_required
from ...utils.package_checks import is_torchao_available

__all__ = [
    "convert_model_to_fp8_ao",
    "filter_first_and_last_linear_layers",
    "filter_linear_layers",
    "find_first_last_linear_layers",
    "has_ao_layers",
    "is_torchao_available",
    "torchao_required",
]


def find_first_last_linear_layers(model: nn.Module) -> tuple[str | None, str | None]:
    """Return the names of the first and the last ``nn.Linear`` of ``model`` (None when it has none).

    FP8 keeps these two in higher precision: quantizing the input and output projections tends to
    stop training from converging.
    """
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    return (names[0], names[-1]) if names else (None, None)


def filter_linear_layers(module: nn.Module, fqn: str, layers_to_filter: list[str]) -> bool:
    """Return False for what FP8 must skip: a name in ``layers_to_filter``, or a linear layer whose sizes are not multiples of 16.

    Any other module gives True (the converter only touches linear layers).
    """
    if fqn in layers_to_filter:
        return False
    if isinstance(module, nn.Linear):
        return module.in_features % 16 == 0 and module.out_features % 16 == 0
    return True


def filter_first_and_last_linear_layers(module: nn.Module, fqn: str) -> bool:
    """Return ``filter_linear_layers`` with the first and last linear layers of ``module`` filtered out."""
    first, last = find_first_last_linear_layers(module)
    return filter_linear_layers(module, fqn, layers_to_filter=[n for n in (first, last) if n is not None])


def has_ao_layers(model: nn.Module) -> bool:
    """Return whether ``model`` holds torchao ``Float8Linear`` layers (already converted)."""
    return any(
        type(m).__name__ == "Float8Linear" and type(m).__module__.startswith("torchao")
        for m in model.modules()
    )


@torchao_required
def convert_model_to_fp8_ao(
    model: nn.Module, config: Any = None, module_filter_func: Callable | None = None
) -> None:
    """Convert ``model``'s linear layers, in place, to torchao's ``Float8Linear`` (all but the first and last).

    ``module_filter_func(module, name) -> bool`` chooses the layers (default: ``filter_linear_layers``
    with the model's first and last linear layers left out); ``config`` is a ``Float8LinearConfig``.

    Args:
        model: The model whose linear layers are converted in place.
        config: A torchao ``Float8LinearConfig`` (default: torchao's).
        module_filter_func: ``(module, name) -> bool`` choosing the layers (default: all but the first and
            last linear).
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if module_filter_func is None:
        first, last = find_first_last_linear_layers(model)
        module_filter_func = functools.partial(filter_linear_layers, layers_to_filter=[first, last])
    convert_to_float8_training(
        model, config=config or Float8LinearConfig(), module_filter_fn=module_filter_func
    )
