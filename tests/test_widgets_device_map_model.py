"""The device-map explorer's model without any widget: built with ipywidgets blocked, its map the core's,
and every figure the view shows (usage, reserve for the streaming budget, chart data, code) read from it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
from notebook_accel.widgets._base import _fmt_bytes
from notebook_accel.widgets._device_map_model import USAGE_HEADERS, DeviceMapModel, device_style
from notebook_accel.widgets._machine import MachineInfo

from notebook_accel.utils.device_planning.device_map import resolve_device_map
from notebook_accel.utils.device_planning.sizes import compute_module_sizes, convert_file_size_to_int

MiB = 1024**2
GiB = 1024**3

# Blocks the GUI libraries (an import of any raises ImportError), builds the model over a meta GPT-like
# model with a tied head, moves its controls, and prints what it says (and the core's maps) as JSON.
_NO_WIDGETS = textwrap.dedent(
    """
    import json, sys
    for name in ("ipywidgets", "matplotlib", "IPython"):
        sys.modules[name] = None

    import torch
    import torch.nn as nn
    from notebook_accel.utils.device_planning.device_map import resolve_device_map
    from notebook_accel.utils.device_planning.sizes import compute_module_sizes
    from notebook_accel.widgets._device_map_model import DeviceMapModel
    from notebook_accel.widgets._machine import MachineInfo


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(64)
            self.mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))


    class TinyGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(64, 64)
            self.h = nn.ModuleList(Block() for _ in range(8))
            self.lm_head = nn.Linear(64, 64, bias=False)
            self.lm_head.weight = self.wte.weight


    with torch.device("meta"):
        gpt = TinyGPT()
    block = compute_module_sizes(gpt)["h.0"]
    budgets = {0: 5 * block, "cpu": 2 * block}
    machine = MachineInfo(ram_total=2**30, ram_available=2**30, disk_free=2**30)
    model = DeviceMapModel(gpt, max_memory=budgets, strategy="sequential", machine=machine)
    before = {"map": model.device_map == resolve_device_map(gpt, "sequential", budgets, ["Block"]),
              "usage": {str(d): u for d, u in model.usage().items()}}
    model.streaming_budget = 3 * block
    expected = resolve_device_map(gpt, "sequential", budgets, ["Block"], streaming_budget=3 * block)
    scope = {}
    exec(model.to_code(), scope)
    labels, series, limits = model.chart_series()
    out = {
        "block": block,
        "before": before,
        "map": model.device_map == expected,
        "code": [scope["device_map"] == model.device_map, scope["lookahead"], "max_memory" in scope],
        "usage": {str(d): u for d, u in model.usage().items()},
        "rows": model.usage_rows(),
        "chart": [labels, series, limits, model.slider_unit],
        "summary": model.summary(),
        "ties": model.tie_groups(),
        "unmapped": model.unmapped(),
        "tree": [[n["name"], n["depth"], n["devices"]] for n in model.tree()][:3],
        "gui": [n for n in ("ipywidgets", "matplotlib", "IPython") if sys.modules[n] is not None],
        "view": "notebook_accel.widgets.device_map_explorer" in sys.modules,
    }
    print(json.dumps(out))
    """
)


def test_model_with_ipywidgets_blocked_plans_the_cores_map_and_the_streaming_reserve() -> None:
    run = subprocess.run([sys.executable, "-c", _NO_WIDGETS], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["gui"] == [] and got["view"] is False
    block = got["block"]
    assert got["before"]["map"] and got["map"] and got["code"][0] and got["code"][2]
    assert convert_file_size_to_int(got["code"][1]) == 3 * block  # the lookahead to paste
    # Before the streaming budget GPU 0 keeps room for the largest layer; after, for 3 blocks streamed ahead,
    # within the same 5-block budget: fewer blocks stay on it, and the rest of the budget is free.
    gpu_before, gpu, cpu = got["before"]["usage"]["0"], got["usage"]["0"], got["usage"]["cpu"]
    assert gpu["reserved"] == 3 * block > gpu_before["reserved"]
    assert gpu["budget"] == 5 * block and gpu["weights"] + gpu["reserved"] + gpu["free"] == 5 * block
    assert gpu["weights"] < gpu_before["weights"]
    assert cpu["budget"] == 2 * block and cpu["weights"] + cpu["reserved"] + cpu["free"] == 2 * block
    assert got["usage"]["disk"]["budget"] == 0 and got["usage"]["disk"]["free"] == 0
    assert list(got["usage"]) == ["0", "cpu", "disk"]
    # The usage table's rows and the chart's bars (in the slider's unit, MiB for this small model) say the same.
    assert [row[0] for row in got["rows"]] == ["0", "cpu", "disk"] and len(got["rows"][0]) == len(
        USAGE_HEADERS
    )
    assert got["rows"][0][2:4] == [_fmt_bytes(gpu["weights"]), _fmt_bytes(3 * block)]
    labels, series, limits, unit = got["chart"]
    assert labels == ["0", "cpu", "disk"] and unit == ["MiB", MiB]
    assert series["reserved"][0] == pytest.approx(3 * block / MiB)
    assert series["weights"][0] == pytest.approx(gpu["weights"] / MiB) and limits[2] is None
    assert limits[:2] == pytest.approx([5 * block / MiB, 2 * block / MiB])
    assert got["summary"] == (
        f"TinyGPT, strategy sequential, dtype as stored, no split ['Block'], "
        f"streaming lookahead {_fmt_bytes(3 * block)}"
    )
    home = got["ties"][0]["devices"]
    assert got["ties"] == [{"parameters": ["lm_head.weight", "wte.weight"], "devices": home, "split": False}]
    assert got["unmapped"] == [] and got["tree"][0][:2] == ["(model)", 0]
    assert sorted(got["tree"][0][2]) == ["0", "cpu", "disk"] and got["tree"][1][0] == "wte"


class Block(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


class _Counting(DeviceMapModel):
    """The model with its redraw hook counted, as the view's redraws would be."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        self.changes = 0
        super().__init__(*args, **kwargs)

    def _changed(self) -> None:
        self.changes += 1


@pytest.fixture
def blocks() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*(Block() for _ in range(6)))


def _model(module: nn.Module, **kw) -> _Counting:
    machine = MachineInfo(ram_total=GiB, ram_available=GiB, disk_free=GiB)
    return _Counting(module, machine=machine, **kw)


def test_each_control_replans_once_and_a_refused_value_changes_nothing(blocks) -> None:
    block = compute_module_sizes(blocks)["0"]
    budgets = {0: 2 * block, 1: 2 * block, "cpu": 2 * block}
    model = _model(blocks, max_memory=budgets, strategy="sequential")
    assert model.changes == 0 and model.plan is not None  # building plans once, without a redraw
    model.set_budget(0, 3 * block / GiB)
    assert model.changes == 1 and model.max_memory[0] == 3 * block
    model.strategy = "balanced"
    model.dtype = torch.float16
    model.no_split_module_classes = []
    model.streaming_budget = "1MiB"
    assert model.changes == 5 and (model.strategy, model.dtype, model.streaming_budget) == (
        "balanced",
        "float16",
        MiB,
    )
    assert model.device_map == resolve_device_map(
        blocks, "balanced", dict(model.max_memory), [], dtype="float16", streaming_budget=MiB
    )
    with pytest.raises(ValueError, match="is not a device-map strategy"):
        model.strategy = "fastest"
    with pytest.raises(ValueError, match=r"\['Blok'\] are not classes of this model.*'Block'"):
        model.no_split_module_classes = ["Blok"]
    with pytest.raises(ValueError, match="Unknown device 'disk': this explorer budgets"):
        model.set_budget("disk", 1.0)
    assert model.changes == 5 and model.strategy == "balanced" and model.no_split_module_classes == []


def test_the_chart_stacks_to_the_planned_budget_and_marks_the_budget_set(blocks) -> None:
    block = compute_module_sizes(blocks)["0"]
    model = _model(blocks, max_memory={0: 4 * block, 1: 4 * block, "cpu": GiB}, strategy="balanced_low_0")
    labels, series, limits = model.chart_series()
    usage = model.usage()
    assert labels == ["0", "1", "cpu"] and limits == pytest.approx([4 * block / MiB, 4 * block / MiB, 1024.0])
    for i, device in enumerate(usage):
        stacked = sum(series[part][i] for part in ("weights", "reserved", "free"))
        assert stacked == pytest.approx(model.effective_max_memory[device] / MiB)
    # balanced_low_0 plans GPU 0 below the budget set: its bar stops under its dashed line.
    assert model.effective_max_memory[0] < model.max_memory[0]


def test_device_styles() -> None:
    assert [device_style(d) for d in ("0", "cuda:1", "mps", "cpu", "disk", "unmapped", "meta")] == [
        "success",
        "success",
        "success",
        "warning",
        "danger",
        "",
        "info",
    ]
