"""accelerate.utils.deepspeed: config parsing and queries, placeholders, the engine wrappers; DeepSpeed itself is not needed."""

from __future__ import annotations

import base64
import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch

from notebook_accel.utils import DistributedType
from notebook_accel.utils.deepspeed import (
    DeepSpeedEngineWrapper,
    DummyOptim,
    DummyScheduler,
    HfDeepSpeedConfig,
    get_active_deepspeed_plugin,
    map_pytorch_optim_to_deepspeed,
)

ZERO3 = {
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "none"},
    },
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": False},
}


@pytest.mark.parametrize("form", ["dict", "file", "base64"])
def test_config_sources_and_queries(tmp_path, form):
    source = {"dict": ZERO3}.get(form)
    if form == "file":
        source = tmp_path / "ds.json"
        source.write_text(json.dumps(ZERO3))
        source = str(source)
    elif form == "base64":
        source = base64.urlsafe_b64encode(json.dumps(ZERO3).encode()).decode()
    config = HfDeepSpeedConfig(source)
    assert config.is_zero3() and not config.is_zero2() and config.is_offload()
    assert config.get_value("zero_optimization.stage") == 3
    assert config.get_value("zero_optimization.nope", 7) == 7 and config.get_value("a.b.c", 7) == 7
    assert config.find_config_node("zero_optimization.offload_param.device") == ({"device": "cpu"}, "device")
    assert config.find_config_node("x.y") == (None, "y")
    # Facts recorded from Accelerate 1.15: "auto" counts as true; a missing key is neither true nor false.
    assert config.is_true("fp16.enabled") and config.is_false("bf16.enabled")
    assert not config.is_true("nope") and not config.is_false("nope")


def test_offload_needs_zero2_or_3_and_a_real_device():
    assert HfDeepSpeedConfig(
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}
    ).is_offload()
    assert not HfDeepSpeedConfig(
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}
    ).is_offload()
    assert not HfDeepSpeedConfig(
        {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    ).is_offload()
    empty = HfDeepSpeedConfig({})
    assert empty._stage == -1 and not empty.is_offload()


def test_config_is_a_copy_and_sub_trees_can_be_deleted():
    original = json.loads(json.dumps(ZERO3))
    config = HfDeepSpeedConfig(original)
    config.del_config_sub_tree("zero_optimization.offload_param")
    assert "offload_param" not in config.config["zero_optimization"] and original == ZERO3
    config.del_config_sub_tree("zero_optimization.nope.x")  # absent, not required: nothing happens
    with pytest.raises(ValueError, match=r"Can't find zero_optimization.nope.x entry in the config"):
        config.del_config_sub_tree("zero_optimization.nope.x", must_exist=True)


@pytest.mark.parametrize(
    "source, exc, match",
    [
        (
            "/no/such/ds.json",
            ValueError,
            r"Expected a string path to an existing deepspeed config.*/no/such/ds.json",
        ),
        (5, TypeError, r"HfDeepSpeedConfig takes a dict, a path to a JSON file .* not int 5"),
        (
            {"zero_optimization": {"stage": 4}},
            ValueError,
            r"zero_optimization.stage=4 is not a ZeRO stage: use 0, 1, 2, 3",
        ),
    ],
)
def test_bad_configs_raise(source, exc, match):
    with pytest.raises(exc, match=match):
        HfDeepSpeedConfig(source)


def test_bad_json_file_raises(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        HfDeepSpeedConfig(str(path))


def test_dummies_keep_their_arguments():
    params = list(torch.nn.Linear(2, 2).parameters())
    optim = DummyOptim(params, lr=0.1, foo=1)
    assert (optim.params, optim.lr, optim.weight_decay, optim.kwargs) == (params, 0.1, 0, {"foo": 1})
    sched = DummyScheduler(optim, total_num_steps=10, warmup_num_steps=2, bar=3)
    assert (sched.optimizer, sched.total_num_steps, sched.warmup_num_steps, sched.kwargs) == (
        optim,
        10,
        2,
        {"bar": 3},
    )
    with pytest.raises(TypeError, match="lr_scheduler_callable must be a function optimizer -> scheduler"):
        DummyScheduler(optim, lr_scheduler_callable=5)


def test_map_optimizer_validates_then_names_deepspeed():
    params = list(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(TypeError, match="takes a torch optimizer, not int"):
        map_pytorch_optim_to_deepspeed(3)
    with pytest.raises(ValueError, match="SGD has no DeepSpeed CPU equivalent: use torch.optim.Adam, AdamW"):
        map_pytorch_optim_to_deepspeed(torch.optim.SGD(params, lr=0.1))
    if importlib.util.find_spec("deepspeed") is None:
        with pytest.raises(ImportError, match="pip install deepspeed"):
            map_pytorch_optim_to_deepspeed(torch.optim.AdamW(params, lr=0.1))


def test_active_plugin():
    plugin = object()
    state = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, deepspeed_plugin=plugin)
    assert get_active_deepspeed_plugin(state) is plugin
    with pytest.raises(
        ValueError, match="Couldn't retrieve the active `DeepSpeedPlugin` as none were enabled"
    ):
        get_active_deepspeed_plugin(
            SimpleNamespace(distributed_type=DistributedType.NO, deepspeed_plugin=None)
        )


class _FakeEngine:
    def __init__(self):
        self.calls = []

    def set_gradient_accumulation_boundary(self, is_boundary):
        self.calls.append(("boundary", is_boundary))

    def backward(self, loss, **kwargs):
        self.calls.append(("backward", kwargs))
        loss.backward()

    def step(self):
        self.calls.append(("step",))

    def get_global_grad_norm(self):
        return torch.tensor(2.5)


def test_engine_wrapper_steps_only_at_the_boundary():
    engine = _FakeEngine()
    wrapper = DeepSpeedEngineWrapper(engine)
    weight = torch.ones(2, requires_grad=True)
    wrapper.backward(weight.sum(), sync_gradients=False, retain_graph=True)
    wrapper.backward(weight.sum())
    assert engine.calls == [
        ("boundary", False),
        ("backward", {"retain_graph": True}),
        ("boundary", True),
        ("backward", {}),
        ("step",),
    ]
    assert wrapper.get_global_grad_norm() == 2.5
