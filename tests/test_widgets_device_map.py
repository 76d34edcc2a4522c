"""DeviceMapExplorer: maps equal the core's for each strategy, controls recompute, exports code."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from notebook_accel.widgets import DeviceMapExplorer
from notebook_accel.widgets._machine import MachineInfo

from notebook_accel.utils.device_planning.device_map import resolve_device_map
from notebook_accel.utils.device_planning.sizes import compute_module_sizes, convert_file_size_to_int

MiB = 1024**2
GiB = 1024**3


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


class TinyGPT(nn.Module):
    def __init__(self, n: int = 8, d: int = 128, vocab: int = 1000) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(Block(d) for _ in range(n))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight


@pytest.fixture
def gpt() -> nn.Module:
    with torch.device("meta"):
        return TinyGPT()


BUDGET = {0: "2MiB", 1: "2MiB", "cpu": "2MiB"}


def _explorer(model, **kw) -> DeviceMapExplorer:
    machine = MachineInfo(ram_total=GiB, ram_available=GiB, disk_free=GiB)
    return DeviceMapExplorer(model, max_memory=kw.pop("max_memory", dict(BUDGET)), machine=machine, **kw)


@pytest.mark.parametrize("strategy", ["auto", "balanced", "balanced_low_0", "sequential"])
def test_map_is_the_cores_for_each_strategy(gpt, strategy):
    ex = _explorer(gpt, strategy=strategy)
    expected = resolve_device_map(gpt, strategy, dict(BUDGET), ["Block"])
    assert ex.device_map == expected
    usage = ex.usage()
    assert sum(u["weights"] for u in usage.values()) == compute_module_sizes(gpt)[""]
    assert set(usage) >= {0, 1, "cpu"}
    assert ex.unmapped() == []


def test_suggestions_ties_tree_and_unmapped(gpt):
    ex = _explorer(gpt)
    assert ex.suggested_no_split == ["Block"] and ex.no_split_module_classes == ["Block"]
    ties = ex.tie_groups()
    home = str(ex.device_of("wte.weight"))
    assert ties == [{"parameters": ["lm_head.weight", "wte.weight"], "devices": [home], "split": False}]
    ex.device_map["lm_head"] = "disk" if home != "disk" else "cpu"
    assert ex.tie_groups()[0]["split"] is True
    tree = {node["name"]: node for node in ex.tree()}
    assert tree["(model)"]["class"] == "TinyGPT" and len(tree["(model)"]["devices"]) >= 3
    assert tree["h.0"]["devices"] == [str(ex.device_of("h.0"))]
    assert max(node["depth"] for node in ex.tree()) == 3
    del ex.device_map["ln_f"]
    assert ex.unmapped() == ["ln_f.weight", "ln_f.bias"]
    assert "unmapped" in ex._extras_html()


def test_controls_recompute(gpt):
    ex = _explorer(gpt, strategy="sequential")
    before = dict(ex.device_map)
    assert ex.widget is not None
    # Slider and text are linked; moving the slider recomputes the map.
    ex._w_sliders[0].value = 0.5  # MiB: the model is under 1 GiB
    assert ex._w_texts[0].value == pytest.approx(0.5)
    assert ex.max_memory[0] == MiB // 2
    assert ex.device_map != before
    assert ex.usage()[0]["weights"] <= MiB // 2 and ex.usage()[0]["free"] == 0
    ex._w_texts[1].value = 4  # typing into the text box moves the slider too
    assert ex.max_memory[1] == 4 * MiB
    assert ex.device_map == resolve_device_map(
        gpt, "sequential", {0: MiB // 2, 1: 4 * MiB, "cpu": 2 * MiB}, ["Block"]
    )
    # dtype halves every size
    full = ex.usage()
    ex._w_dtype.value = "float16"
    assert ex.dtype == "float16" and ex.sizes()[""] == compute_module_sizes(gpt)[""] // 2
    assert sum(u["weights"] for u in ex.usage().values()) < sum(u["weights"] for u in full.values())
    # no-split classes and strategy
    ex._w_no_split.value = []
    assert ex.no_split_module_classes == []
    ex._w_strategy.value = "balanced"
    assert ex.strategy == "balanced"
    assert ex.device_map == resolve_device_map(gpt, "balanced", dict(ex.max_memory), [], dtype="float16")
    assert ex._w_code.value == ex.to_code()
    assert ex._w_timing.value.startswith("map computed in")
    assert ex._w_chart.value[:4] == b"\x89PNG"
    assert ex.last_compute_seconds > 0


def test_slider_unit_and_step_follow_the_model_size(gpt):
    ex = _explorer(gpt, strategy="sequential")  # about 7 MiB, budgets of 2 MiB
    assert ex.slider_unit == ("MiB", MiB)
    top, step = ex.slider_range()
    size_mib = compute_module_sizes(gpt)[""] / MiB
    assert top == pytest.approx(1.2 * size_mib) and step == pytest.approx(top / 200) and step < 0.1
    assert ex.widget is not None
    slider = ex._w_sliders[0]
    assert slider.description == "0 (MiB)" and slider.value == pytest.approx(2.0)
    assert slider.max == pytest.approx(top) and slider.step == pytest.approx(step)
    # One step moves the budget by a fraction of a layer, and the map follows.
    slider.value = 2.0 - 10 * step
    assert ex.max_memory[0] == round((2.0 - 10 * step) * MiB)
    assert ex.device_map == resolve_device_map(
        gpt, "sequential", {0: ex.max_memory[0], 1: 2 * MiB, "cpu": 2 * MiB}, ["Block"]
    )
    # set_budget() stays in GiB and moves the slider, extending it past its end.
    ex.set_budget(1, 3 / 1024)
    assert ex.max_memory[1] == 3 * MiB and ex._w_sliders[1].value == pytest.approx(3.0)
    ex.set_budget("cpu", 64 / 1024)
    assert ex._w_sliders["cpu"].value == pytest.approx(64.0) and ex._w_sliders["cpu"].max >= 64
    assert ex.max_memory["cpu"] == 64 * MiB
    with torch.device("meta"):
        big = TinyGPT(n=24, d=2048, vocab=32000)  # about 5 GiB in float32
    ex = _explorer(big, max_memory={0: "2GiB", "cpu": "8GiB"})
    assert ex.slider_unit == ("GiB", GiB)
    top, step = ex.slider_range()
    assert top == pytest.approx(16.0) and step == pytest.approx(0.08)
    assert ex.widget is not None and ex._w_sliders["cpu"].description == "cpu (GiB)"
    ex._w_sliders[0].value = 1.5
    assert ex.max_memory[0] == int(1.5 * GiB)


def test_dtype_dropdown_labels_as_stored(gpt):
    ex = _explorer(gpt)
    assert ex.widget is not None
    assert ex._w_dtype.label == "as stored" and ex.dtype is None
    assert ex._w_dtype.options[0] == ("as stored", "as stored")
    ex._w_dtype.value = "bfloat16"
    assert ex.dtype == "bfloat16" and ex._w_dtype.label == "bfloat16"
    ex._w_dtype.label = "as stored"
    assert ex.dtype is None and ex.sizes()[""] == compute_module_sizes(gpt)[""]
    ex.dtype = "float16"  # set from code: the dropdown follows
    assert ex._w_dtype.label == "float16"
    assert _explorer(gpt, dtype="int8").widget is not None


def test_controls_set_from_code_show_in_the_view_and_replan_once(gpt):
    ex = _explorer(gpt, strategy="sequential")
    assert ex.widget is not None
    plans = []
    replan = ex.recompute
    ex.recompute = lambda: (plans.append(1), replan())
    ex.strategy = "balanced_low_0"
    ex.no_split_module_classes = []
    # The buttons and tags follow; their handlers see the value the model has and plan nothing more.
    assert ex._w_strategy.value == "balanced_low_0" and list(ex._w_no_split.value) == []
    assert len(plans) == 2
    ex._w_strategy.value = "auto"  # the user's click plans once too
    assert ex.strategy == "auto" and len(plans) == 3
    # A size keeps its number and unit on one line in the usage table beside the chart.
    assert "\xa0MiB" in ex._w_usage.value and " MiB" not in ex._w_usage.value


def test_to_code_round_trips(gpt):
    ex = _explorer(gpt, max_memory={0: "1536KiB", "cpu": "2GiB"})
    scope: dict = {}
    exec(ex.to_code(), scope)
    assert scope["device_map"] == ex.device_map
    assert {k: convert_file_size_to_int(v) for k, v in scope["max_memory"].items()} == ex.max_memory


def test_static_views(gpt):
    ex = _explorer(gpt)
    page = ex._repr_html_()
    assert "DeviceMapExplorer" in page and "data:image/png;base64," in page and "tied: lm_head.weight" in page
    text = repr(ex)
    assert text.startswith("DeviceMapExplorer(TinyGPT, strategy='auto'") and "disk" in text


def test_bad_arguments_raise(gpt):
    with pytest.raises(ValueError, match="strategy='fastest' is not a device-map strategy.*balanced_low_0"):
        _explorer(gpt, strategy="fastest")
    with pytest.raises(ValueError, match="Unsupported dtype 'int4'.*choose one of"):
        _explorer(gpt, dtype="int4")
    with pytest.raises(ValueError, match=r"\['Blok'\] are not classes of this model.*'Block'"):
        _explorer(gpt, no_split_module_classes=["Blok"])
    with pytest.raises(TypeError, match="list of class names, got the string"):
        _explorer(gpt, no_split_module_classes="Block")
    with pytest.raises(ValueError, match="cannot budget 'disk'"):
        _explorer(gpt, max_memory={"disk": "1GiB"})
    with pytest.raises(ValueError, match="negative"):
        _explorer(gpt, max_memory={0: -1})
    with pytest.raises(ValueError, match="non-empty dict"):
        _explorer(gpt, max_memory={})
    with pytest.raises(ValueError, match=r"is not a device"):
        _explorer(gpt, max_memory={1.5: 10})
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        DeviceMapExplorer("gpt2")
    ex = _explorer(gpt)
    with pytest.raises(ValueError, match="Unknown device 3: this explorer budgets"):
        ex.set_budget(3, 1.0)
    with pytest.raises(ValueError, match="must be >= 0 GiB"):
        ex.set_budget(0, -1.0)
    with pytest.raises(ValueError, match="is not a device-map strategy"):
        ex.strategy = "nope"


def test_the_streaming_budget_is_planned_and_shown_as_the_first_gpus_reserve():
    with torch.device("meta"):
        model = TinyGPT(n=8, d=64, vocab=64)
    block = compute_module_sizes(model)["h.0"]
    ex = _explorer(model, max_memory={0: 5 * block, "cpu": GiB}, strategy="sequential")
    before = ex.usage()[0]
    ex.streaming_budget = 3 * block
    after = ex.usage()[0]
    assert after["reserved"] >= 3 * block > before["reserved"]
    assert after["weights"] + after["reserved"] <= 5 * block < before["weights"] + 3 * block
    assert ex.plan.streaming_budget == 3 * block
    assert "lookahead = " in ex.to_code() and "streaming lookahead" in ex._repr_html_()
    assert "reserved (largest layer / lookahead)" in repr(ex)
    with pytest.raises(ValueError, match=r"streaming_budget='lots' is not a size"):
        ex.streaming_budget = "lots"
    ex.streaming_budget = None
    assert ex.usage()[0] == before
