"""DeepSpeedPlugin's methods recorded from Accelerate 1.15: is_auto, ZeRO-3 init, selection, weakref, MoE leaves.

deepspeed and (the DeepSpeed side of) transformers cannot run here: the tests that reach them inject
fake modules that record the calls.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from notebook_accel import AcceleratorState
from notebook_accel.utils import DeepSpeedPlugin, imports

_CONFIG = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": 5},
}


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    for name in ("ACCELERATE_DEEPSPEED_ZERO3_INIT", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):
        monkeypatch.delenv(name, raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)


def test_is_auto_reads_the_dotted_config_key() -> None:
    plugin = DeepSpeedPlugin(hf_ds_config=_CONFIG)
    assert plugin.is_auto("train_batch_size") is True
    assert plugin.is_auto("zero_optimization.stage3_prefetch_bucket_size") is True
    assert plugin.is_auto("zero_optimization.reduce_bucket_size") is False
    assert plugin.is_auto("zero_optimization.stage") is False
    assert plugin.is_auto("no_such_key") is False and plugin.is_auto("no.such.key") is False


def test_is_zero3_init_enabled_needs_the_flag_and_stage_3() -> None:
    assert DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True).is_zero3_init_enabled() is True
    assert DeepSpeedPlugin(zero_stage=3, zero3_init_flag=False).is_zero3_init_enabled() is False
    assert DeepSpeedPlugin(zero_stage=2, zero3_init_flag=True).is_zero3_init_enabled() is False
    edited = DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True)
    edited.deepspeed_config["zero_optimization"]["stage"] = 2  # the config decides, not the field
    assert edited.is_zero3_init_enabled() is False


def test_select_only_through_the_state_which_keeps_one_plugin_selected() -> None:
    first, second = DeepSpeedPlugin(zero_stage=2), DeepSpeedPlugin(zero_stage=1)
    assert first.selected is False
    with pytest.raises(ValueError, match=r"AcceleratorState\(\)\.select_deepspeed_plugin\(name\)"):
        first.select()
    assert first.selected is False
    state = AcceleratorState(deepspeed_plugin={"first": first, "second": second})
    assert (first.selected, second.selected) == (True, False)
    state.select_deepspeed_plugin("second")
    assert (first.selected, second.selected) == (False, True)
    assert state.deepspeed_plugin is second
    second.select(_from_accelerator_state=True)
    assert second.selected is True


class _FakeHfDeepSpeedConfig:
    made: list[dict] = []

    def __init__(self, config: dict) -> None:
        self.config = config
        _FakeHfDeepSpeedConfig.made.append(config)


@pytest.fixture
def fake_transformers(monkeypatch):
    _FakeHfDeepSpeedConfig.made = []
    integrations = types.ModuleType("transformers.integrations")
    integrations.HfDeepSpeedConfig = _FakeHfDeepSpeedConfig
    package = types.ModuleType("transformers")
    package.integrations = integrations
    monkeypatch.setitem(sys.modules, "transformers", package)
    monkeypatch.setitem(sys.modules, "transformers.integrations", integrations)
    monkeypatch.setattr(imports, "is_transformers_available", lambda: True)
    monkeypatch.setattr(imports, "is_deepspeed_available", lambda: True)
    return _FakeHfDeepSpeedConfig


def test_set_deepspeed_weakref_hands_transformers_a_config_deepspeed_accepts(fake_transformers) -> None:
    plugin = DeepSpeedPlugin(hf_ds_config=_CONFIG, zero3_init_flag=True)
    plugin.set_deepspeed_weakref()
    (given,) = fake_transformers.made
    assert plugin.dschf.config is given
    # "auto" sizes become placeholders (DeepSpeed's parser refuses "auto"); the plugin's config is untouched
    assert given["gradient_accumulation_steps"] == 1 and given["train_micro_batch_size_per_gpu"] == 1
    assert "train_batch_size" not in given
    assert plugin.deepspeed_config["train_batch_size"] == "auto"
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == "auto"


def test_selecting_a_zero3_init_plugin_sets_the_weakref(fake_transformers) -> None:
    plain, zero3 = DeepSpeedPlugin(zero_stage=2), DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True)
    AcceleratorState(deepspeed_plugin={"plain": plain, "zero3": zero3})
    assert fake_transformers.made == [] and not hasattr(plain, "dschf")
    AcceleratorState().select_deepspeed_plugin("zero3")
    assert len(fake_transformers.made) == 1 and zero3.dschf.config["zero_optimization"]["stage"] == 3


def test_set_deepspeed_weakref_without_transformers(monkeypatch) -> None:
    monkeypatch.setattr(imports, "is_transformers_available", lambda: False)
    DeepSpeedPlugin(zero_stage=3, zero3_init_flag=False).set_deepspeed_weakref()  # nothing to register
    with pytest.raises(ImportError, match=r"zero3_init_flag=True .*pip install transformers"):
        DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True).set_deepspeed_weakref()


class _Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(2, 2)


class _Router(torch.nn.Module):
    pass


def _moe_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(2, 2), _Experts(), _Router(), _Experts())


def test_set_moe_leaf_modules_marks_the_named_classes(monkeypatch) -> None:
    calls = []
    utils_module = types.ModuleType("deepspeed.utils")
    utils_module.set_z3_leaf_modules = lambda model, classes: calls.append((model, classes))
    package = types.ModuleType("deepspeed")
    package.utils = utils_module
    monkeypatch.setitem(sys.modules, "deepspeed", package)
    monkeypatch.setitem(sys.modules, "deepspeed.utils", utils_module)
    monkeypatch.setattr(imports, "is_deepspeed_available", lambda: True)
    model = _moe_model()
    DeepSpeedPlugin(zero_stage=3).set_moe_leaf_modules(model)
    assert calls == []  # no transformer_moe_cls_names: nothing to mark
    DeepSpeedPlugin(zero_stage=3, transformer_moe_cls_names="_Experts, _Router").set_moe_leaf_modules(model)
    assert calls == [(model, [_Experts, _Router])]
    with pytest.raises(ValueError, match=r"names \['Mixtral'\] but the model has no module of that class"):
        DeepSpeedPlugin(zero_stage=3, transformer_moe_cls_names="_Experts,Mixtral").set_moe_leaf_modules(
            model
        )


def test_set_moe_leaf_modules_without_deepspeed_names_it(monkeypatch) -> None:
    monkeypatch.setattr(imports, "is_deepspeed_available", lambda: False)
    plugin = DeepSpeedPlugin(zero_stage=3, transformer_moe_cls_names="_Experts")
    with pytest.raises(ImportError, match=r"pip install deepspeed"):
        plugin.set_moe_leaf_modules(_moe_model())
