"""FP8 layer selection (torchao) and TransformerEngine entry points: plain-PyTorch parts run, engines are named."""

from __future__ import annotations

import pytest
from torch import nn

from notebook_accel.integrations.fp8.recipes import TERecipeKwargs
from notebook_accel.utils.ao import (
    convert_model_to_fp8_ao,
    filter_first_and_last_linear_layers,
    filter_linear_layers,
    find_first_last_linear_layers,
    has_ao_layers,
)
from notebook_accel.utils.transformer_engine import (
    apply_fp8_autowrap,
    contextual_fp8_autocast,
    convert_model,
    has_transformer_engine_layers,
)


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 8), nn.Linear(32, 16))


def test_first_and_last_linear_layers_are_kept_out() -> None:
    model = _model()
    assert find_first_last_linear_layers(model) == ("0", "4")
    assert find_first_last_linear_layers(nn.ReLU()) == (None, None)
    verdicts = {name: filter_linear_layers(m, name, ["0"]) for name, m in model.named_modules()}
    # "0" is listed, "3" has 8 output features (not divisible by 16); other modules pass.
    assert verdicts == {"": True, "0": False, "1": True, "2": True, "3": False, "4": True}
    # Called on one layer, that layer is its own first and last linear layer (named "").
    assert filter_first_and_last_linear_layers(nn.Linear(16, 16), "0")
    assert not filter_first_and_last_linear_layers(nn.Linear(16, 16), "")
    assert not filter_first_and_last_linear_layers(nn.Sequential(nn.Linear(16, 16)), "0")
    assert not filter_first_and_last_linear_layers(nn.Linear(16, 8), "x")
    assert not has_ao_layers(model)


def test_engines_are_named_when_missing() -> None:
    with pytest.raises(ImportError, match="pip install torchao"):
        convert_model_to_fp8_ao(_model())
    assert not has_transformer_engine_layers(_model())
    with pytest.raises(ImportError, match=r"pip install 'transformer_engine\[pytorch\]'"):
        convert_model(_model())
    with pytest.raises(ImportError, match="transformer_engine"):
        contextual_fp8_autocast(_model().forward, None)
    with pytest.raises(ImportError, match="transformer_engine"):
        apply_fp8_autowrap(_model(), TERecipeKwargs())


def test_fp8_autowrap_runs_the_forward_under_te_autocast_while_training(monkeypatch) -> None:
    import contextlib
    from types import SimpleNamespace

    import torch

    from notebook_accel.integrations.fp8 import (
        transformer_engine,  # the home of _te (utils.transformer_engine is its face)
    )

    seen = []

    @contextlib.contextmanager
    def fp8_autocast(enabled, fp8_recipe):
        seen.append((enabled, fp8_recipe))
        yield

    monkeypatch.setattr(transformer_engine, "_te", lambda: SimpleNamespace(fp8_autocast=fp8_autocast))
    recipe = object()
    model = nn.Linear(2, 2)
    original, x = model.forward, torch.ones(1, 2)
    assert (
        apply_fp8_autowrap(
            model, SimpleNamespace(to_te_recipe=lambda: recipe, use_autocast_during_eval=False)
        )
        is model
    )
    assert torch.equal(model(x), original(x)) and seen == [(True, recipe)]
    model.eval()
    model(x)
    assert seen[-1] == (False, recipe)  # evaluation runs without FP8 unless asked
    in_eval = nn.Linear(2, 2).eval()
    apply_fp8_autowrap(in_eval, SimpleNamespace(to_te_recipe=lambda: recipe, use_autocast_during_eval=True))
    in_eval(x)
    assert seen[-1] == (True, recipe)
    apply_fp8_autowrap(nn.Linear(2, 2), None)(x)  # no handler: TE's default recipe, while training
    assert seen[-1] == (True, None)
    wrapped = contextual_fp8_autocast(original, recipe)
    assert wrapped.__wrapped__ is original and wrapped.__name__ == "forward"
