"""NVIDIA TransformerEngine FP8: swapping layers for TE's and running the forward under ``fp8_autocast``.

Everything here needs ``transformer_engine`` (``pip install 'transformer_engine[pytorch]'``, an NVIDIA
Ada or Hopper GPU); ``has_transformer_engine_layers`` answers without it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...utils.imports import is_hpu_available
from ...utils.operations import GatheredParameters
from ...utils.package_checks import is_transformer_engine_available

if TYPE_CHECKING:
    from .fp8_recipes import TERecipeKwargs

__all__ = [
    "GatheredParameters",
    "apply_fp8_autowrap",
    "contextual_fp8_autocast",
    "convert_model",
    "has_transformer_engine_layers",
    "is_hpu_available",
    "is_transformer_engine_available",
]


def _te() -> Any:
    if not is_transformer_engine_available():
        raise ImportError(
            "TransformerEngine FP8 needs transformer_engine: pip install 'transformer_engine[pytorch]' "
            "(an NVIDIA Ada or Hopper GPU)"
        )
    import transformer_engine.pytorch as te

    return te


def has_transformer_engine_layers(model: nn.Module) -> bool:
    """Return whether ``model`` holds TransformerEngine layers (Linear, LayerNorm, ... of ``transformer_engine``)."""
    return any(type(m).__module__.startswith("transformer_engine") for m in model.modules())


def convert_model(
    model: nn.Module,
    to_transformer_engine: bool = True,
    _convert_linear: bool = True,
    _convert_ln: bool = True,
) -> None:
    """Swap, in place and recursively, ``nn.Linear`` / ``nn.LayerNorm`` for TE's (or back, ``to_transformer_engine=False``).

    Weights are copied; TE's layers need in/out features divisible by 16 for FP8.

    Args:
        model: The model to convert in place.
        to_transformer_engine: Towards TransformerEngine's layers (default) or back to torch's.
        _convert_linear: Convert the linear layers.
        _convert_ln: Convert the layer norms.
    """
    te = _te()
    for name, child in model.named_children():
        if to_transformer_engine and _convert_linear and isinstance(child, nn.Linear):
            new = te.Linear(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                params_dtype=child.weight.dtype,
            )
        elif to_transformer_engine and _convert_ln and isinstance(child, nn.LayerNorm):
            new = te.LayerNorm(child.normalized_shape[0], eps=child.eps, params_dtype=child.weight.dtype)
        elif not to_transformer_engine and _convert_linear and isinstance(child, te.Linear):
            new = nn.Linear(
                child.in_features, child.out_features, bias=child.bias is not None, dtype=child.weight.dtype
            )
        elif not to_transformer_engine and _convert_ln and isinstance(child, te.LayerNorm):
            new = nn.LayerNorm(child.weight.shape[0], eps=child.eps, dtype=child.weight.dtype)
        else:
            convert_model(child, to_transformer_engine, _convert_linear, _convert_ln)
            continue
        with torch.no_grad():
            new.weight.copy_(child.weight)
            if getattr(child, "bias", None) is not None:
                new.bias.copy_(child.bias)
        setattr(model, name, new.to(child.weight.device))


class _FP8Forward:
    """A module's forward run under TE's ``fp8_autocast`` while the module trains (always, with ``in_eval``).

    Called as ``forward(module, *args, **kwargs)``; it carries the wrapped forward's name and docstring
    and is picklable when that forward and the recipe are.
    """

    def __init__(self, model_forward: Callable, fp8_recipe: Any, in_eval: bool) -> None:
        functools.update_wrapper(self, model_forward)
        self.fp8_recipe = fp8_recipe
        self.in_eval = in_eval

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        active = module.training or self.in_eval
        with _te().fp8_autocast(enabled=active, fp8_recipe=self.fp8_recipe):
            return self.__wrapped__(*args, **kwargs)


def contextual_fp8_autocast(
    model_forward: Callable, fp8_recipe: Any, use_during_eval: bool = False
) -> Callable:
    """Return ``model_forward`` run under TE's ``fp8_autocast`` while training (and in eval with ``use_during_eval``).

    Args:
        model_forward: The forward to wrap.
        fp8_recipe: The TransformerEngine recipe (None: TransformerEngine's default).
        use_during_eval: Run under fp8 autocast in eval mode too.
    """
    _te()  # fail here, at wrapping time, when TransformerEngine is missing
    return _FP8Forward(model_forward, fp8_recipe, use_during_eval)


def apply_fp8_autowrap(model: nn.Module, fp8_recipe_handler: TERecipeKwargs | None) -> nn.Module:
    """Return ``model`` with its forward wrapped by ``contextual_fp8_autocast`` for ``fp8_recipe_handler``'s recipe."""
    handler = fp8_recipe_handler
    # No handler: TE picks its default recipe, and evaluation runs without FP8.
    fp8_forward = contextual_fp8_autocast(
        model.forward,
        fp8_recipe=None if handler is None else handler.to_te_recipe(),
        use_during_eval=bool(getattr(handler, "use_autocast_during_eval", False)),
    )
    model.forward = functools.partial(fp8_forward, model)
    return model
