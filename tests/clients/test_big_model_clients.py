"""transformers and peft big-model loading on notebook_accel (after install_as_accelerate), against the plain model.

One fresh interpreter runs every scenario of tests/clients/_big_model_scenarios.py (a tiny Llama built
from a config, saved single-file and sharded; nothing downloaded) and reports JSON; each test checks
one scenario. The plain in-memory model of the same run is the reference: logits must be equal, the
output must not be on meta, and no tensor that the device map keeps on the CPU may be left on meta
(disk-offloaded weights stay on meta between forwards by design, as in Accelerate).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.clients._subproc import last_line, run_python

pytest.importorskip("transformers")
REAL_INSTALLED = importlib.util.find_spec("accelerate") is not None
SCENARIO = "from tests.clients._big_model_scenarios import main; main({mode!r})"


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> dict:
    # peft 0.21 writes the adapter's offloaded weights to the offload path with its leading "/" dropped,
    # i.e. relative to the working directory: run where that lands in a temporary folder.
    cwd = tmp_path_factory.mktemp("cwd")
    return json.loads(last_line(run_python(SCENARIO.format(mode="ours"), cwd=cwd)))


def _ok(results: dict, name: str) -> dict:
    got = results[name]
    assert "error" not in got, got.get("error")
    return got


def _assert_equal_and_not_meta(got: dict, devices: list[str]) -> None:
    assert got["max_diff"] == 0.0
    assert got["out_device"] == "cpu"
    assert got["on_meta_not_disk"] == []
    assert got["devices"] == devices


def test_runs_on_notebook_accel(ours):
    assert ours["accelerate"] == "notebook_accel"
    assert sum(name.endswith(".safetensors") for name in ours["shards"]) >= 3  # really sharded


@pytest.mark.parametrize("device_map", ["auto", "sequential", "balanced"])
@pytest.mark.parametrize("budget", ["no budget", "budget"])
def test_from_pretrained_device_map(ours, device_map, budget):
    got = _ok(ours, f"from_pretrained[{device_map},{budget}]")
    if budget == "budget":
        _assert_equal_and_not_meta(got, ["cpu", "disk"])
        assert got["disk_on_meta"] > 0  # really offloaded, not silently loaded on the CPU
    else:
        _assert_equal_and_not_meta(got, ["cpu"])


def test_explicit_map_with_disk_entries(ours):
    got = _ok(ours, "explicit_disk_map")
    _assert_equal_and_not_meta(got, ["cpu", "disk"])
    assert got["device_map"]["model.layers.1"] == "disk" and got["device_map"]["lm_head"] == "disk"
    assert got["disk_on_meta"] == got["disk_tensors"] > 0


def test_greedy_generate_on_offloaded_model(ours):
    got = _ok(ours, "generate_offloaded")
    assert got["same"] is True and got["devices"] == ["cpu", "disk"]


@pytest.mark.parametrize("case", ["sharded,auto", "single,sequential"])
def test_init_empty_weights_and_load_checkpoint_and_dispatch(ours, case):
    got = _ok(ours, f"load_checkpoint_and_dispatch[{case}]")
    _assert_equal_and_not_meta(got, ["cpu", "disk"])


def test_peft_lora_on_dispatched_partly_offloaded_base(ours):
    got = _ok(ours, "peft_lora_on_offloaded")
    assert got["lora_changes_output"] > 1e-3  # the adapter matters, so equality is not trivial
    _assert_equal_and_not_meta(got, ["cpu", "disk"])
    assert got["disk_on_meta"] > 0


def test_map_naming_a_missing_module_raises_value_error(ours):
    # As 1.15: the unknown key only warns (naming it and the closest names); the parameters it leaves
    # without a device raise.
    got = _ok(ours, "missing_module_map")
    assert got["type"] == "ValueError"
    assert "does not give any device for the following parameters: lm_head.weight" in got["message"]


@pytest.mark.skipif(
    not REAL_INSTALLED, reason="needs the real accelerate installed (the clients extra pulls it)"
)
def test_device_maps_match_the_real_accelerate(ours, tmp_path):
    real = json.loads(last_line(run_python(SCENARIO.format(mode="real"), cwd=tmp_path)))
    assert real["accelerate"] == "accelerate"
    compared = 0
    for name, got in ours.items():
        theirs = real.get(name)
        # Where Accelerate 1.15 itself fails (a "disk" budget in get_balanced_memory), there is nothing to compare.
        if (
            isinstance(got, dict)
            and "device_map" in got
            and isinstance(theirs, dict)
            and "device_map" in theirs
        ):
            assert got["device_map"] == theirs["device_map"], name
            compared += 1
    assert compared >= 8
    # The same exception for a map naming a module the model lacks: the parameters left without a device.
    assert real["missing_module_map"]["type"] == ours["missing_module_map"]["type"] == "ValueError"
    assert real["missing_module_map"]["message"] == ours["missing_module_map"]["message"]
