"""extract_model_from_parallel, save, wait_for_everyone, small helpers, install_xla and load_and_quantize_model."""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import io
import os
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

from notebook_accel.integrations import xla as xla_module
from notebook_accel.integrations.quantization import bnb as bnb_module
from notebook_accel.utils import (
    BnbQuantizationConfig,
    FullyShardedDataParallelPlugin,
    extract_model_from_parallel,
    get_pretty_name,
    install_xla,
    load_and_quantize_model,
    merge_dicts,
    save,
    wait_for_everyone,
)
from notebook_accel.utils.environment import patch_environment
from tests._dist import run_distributed

# ---------------------------------------------------------------------------------------------- unwrap


def test_unwrap_data_parallel_and_compile() -> None:
    model = nn.Linear(2, 2)
    assert extract_model_from_parallel(nn.DataParallel(model)) is model
    compiled = torch.compile(model)  # building the wrapper does not compile anything
    assert extract_model_from_parallel(compiled) is compiled
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is model
    compiled_dp = torch.compile(nn.DataParallel(model))
    unwrapped = extract_model_from_parallel(compiled_dp)
    assert unwrapped is compiled_dp and unwrapped._orig_mod is model
    assert (
        extract_model_from_parallel(nn.DataParallel(torch.compile(model)), keep_torch_compile=False) is model
    )


def test_unwrap_removes_the_fp32_forward_wrapper() -> None:
    model = nn.Linear(2, 2)
    original = model.forward
    model._original_forward = original
    model.forward = lambda x: original(x).float()
    kept = extract_model_from_parallel(model)
    assert "forward" in kept.__dict__
    plain = extract_model_from_parallel(model, keep_fp32_wrapper=False)
    assert "forward" not in plain.__dict__ and "_original_forward" not in plain.__dict__
    # an instance-level forward installed before the wrapper (e.g. by a hook) is restored, not dropped
    hooked = nn.Linear(2, 2)
    hook_forward = types.MethodType(lambda self, x: x, hooked)
    hooked.forward = hook_forward
    hooked._original_forward = hook_forward
    hooked.forward = lambda x: x * 2
    assert extract_model_from_parallel(hooked, keep_fp32_wrapper=False).forward is hook_forward


def _ddp_worker():
    from notebook_accel.state import PartialState

    PartialState()
    inner = nn.Linear(3, 3)
    ddp = nn.parallel.DistributedDataParallel(inner)
    compiled = torch.compile(ddp)
    from torch.distributed.fsdp import FullyShardedDataParallel

    sharded_inner = nn.Linear(3, 3)
    kwargs = FullyShardedDataParallelPlugin(
        sync_module_states=False
    ).to_fsdp_kwargs()  # the sync needs GPU memory
    sharded = FullyShardedDataParallel(sharded_inner, device_id=torch.device("cpu"), **kwargs)
    return (
        extract_model_from_parallel(ddp) is inner,
        extract_model_from_parallel(compiled, keep_torch_compile=False) is inner,
        extract_model_from_parallel(compiled)._orig_mod is inner,
        extract_model_from_parallel(sharded) is sharded_inner,
    )


def test_unwrap_real_ddp_and_fsdp_on_two_ranks() -> None:
    assert run_distributed(_ddp_worker, nprocs=2) == [(True, True, True, True)] * 2


# ---------------------------------------------------------------------------------------------- save


def test_save_torch_and_safetensors_single_process(tmp_path) -> None:
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}
    save(state, tmp_path / "sub" / "model.bin")
    loaded = torch.load(tmp_path / "sub" / "model.bin", weights_only=True)
    assert torch.equal(loaded["w"], state["w"])
    save(state, str(tmp_path / "model.safetensors"), safe_serialization=True)
    from safetensors import safe_open
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "model.safetensors")["b"], state["b"])
    with safe_open(tmp_path / "model.safetensors", "pt") as fh:
        assert fh.metadata() == {"format": "pt"}
    buffer = io.BytesIO()
    save({"x": 1}, buffer)
    buffer.seek(0)
    assert torch.load(buffer) == {"x": 1}
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "sub"]  # no temporary files left


def test_save_refuses_non_state_dict_for_safetensors(tmp_path) -> None:
    with pytest.raises(TypeError, match="needs a state dict mapping str to torch.Tensor"):
        save({"step": 3}, tmp_path / "x.safetensors", safe_serialization=True)
    assert not (tmp_path / "x.safetensors").exists()


def test_save_failure_leaves_no_partial_file(tmp_path) -> None:
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle me")

    (tmp_path / "keep.pt").write_bytes(b"previous")
    with pytest.raises(RuntimeError, match="cannot pickle me"):
        save({"x": Unpicklable()}, tmp_path / "keep.pt")
    assert (tmp_path / "keep.pt").read_bytes() == b"previous"
    assert os.listdir(tmp_path) == ["keep.pt"]


def _save_worker(folder: str, on_each_node: bool):
    from notebook_accel.state import PartialState

    rank = PartialState().process_index
    save({"rank": torch.tensor(rank)}, os.path.join(folder, f"out_{rank}.pt"), save_on_each_node=on_each_node)
    wait_for_everyone()
    return sorted(os.listdir(folder))


def test_save_only_on_main_process(tmp_path) -> None:
    results = run_distributed(_save_worker, nprocs=2, args=(str(tmp_path / "main"), False))
    assert results == [["out_0.pt"], ["out_0.pt"]]


def test_save_on_each_node(tmp_path) -> None:
    # Two single-process "nodes": every rank is the local main process of its node.
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    (tmp_path / "nodes").mkdir()
    results = run_distributed(_save_worker, nprocs=2, args=(str(tmp_path / "nodes"), True), env=env)
    assert results == [["out_0.pt", "out_1.pt"]] * 2


def _barrier_worker(folder: str):
    import time

    from notebook_accel.state import PartialState

    rank = PartialState().process_index
    if rank == 1:
        time.sleep(0.3)
        open(os.path.join(folder, "rank1_was_here"), "w").close()
    wait_for_everyone()
    return os.path.exists(os.path.join(folder, "rank1_was_here"))


def test_wait_for_everyone_is_a_barrier(tmp_path) -> None:
    assert run_distributed(_barrier_worker, nprocs=2, args=(str(tmp_path),)) == [True, True]


def test_wait_for_everyone_single_process(monkeypatch) -> None:
    import torch.distributed as dist

    from notebook_accel.state import PartialState

    def no_barrier(*args, **kwargs):
        raise AssertionError("a single process must not enter a barrier")

    monkeypatch.setattr(dist, "barrier", no_barrier)
    assert wait_for_everyone() is None
    assert PartialState().initialized  # it went through the process state
    calls = []
    monkeypatch.setattr(PartialState, "wait_for_everyone", lambda self: calls.append(self.num_processes))
    wait_for_everyone()
    assert calls == [1]


# ---------------------------------------------------------------------------------------------- helpers


def test_merge_dicts() -> None:
    destination = {"a": {"x": 1, "y": 2}, "b": 1, "c": 5}
    result = merge_dicts({"a": {"y": 3, "z": {"k": 1}}, "b": 2, "c": {"n": 1}}, destination)
    assert result is destination
    assert result == {"a": {"x": 1, "y": 3, "z": {"k": 1}}, "b": 2, "c": {"n": 1}}


def test_get_pretty_name() -> None:
    assert get_pretty_name(nn.Linear) == "Linear"
    assert get_pretty_name(nn.Linear(1, 1)) == "Linear"
    assert get_pretty_name(test_merge_dicts) == "test_merge_dicts"


# ---------------------------------------------------------------------------------------------- install_xla


def test_install_xla_outside_colab_raises(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    for key in [k for k in os.environ if k.startswith("COLAB_")]:
        monkeypatch.delenv(key)
    with pytest.raises(RuntimeError, match=r"only installs in Google Colab.*torch_xla\[tpu\]"):
        install_xla()


def test_install_xla_in_colab_runs_pip(monkeypatch) -> None:
    commands = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, check: commands.append((cmd, check)))
    monkeypatch.setattr(xla_module.importlib.metadata, "version", lambda name: "2.5.1+cu121")
    with patch_environment(COLAB_RELEASE_TAG="release-colab_20241101"):
        install_xla()
        install_xla(upgrade=True)
    pip = [xla_module.sys.executable, "-m", "pip", "install"]
    wheel = [*pip, "torch_xla[tpu]~=2.5.0", "-f", "https://storage.googleapis.com/libtpu-releases/index.html"]
    assert commands == [(wheel, True), ([*pip, "--upgrade", "torch"], True), (wheel, True)]


# ---------------------------------------------------------------------------------------------- bnb


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.norm(self.body(x)))


class _FakeLinear8bitLt(nn.Linear):
    def __init__(self, in_features, out_features, bias, has_fp16_weights=True, threshold=0.0):
        super().__init__(in_features, out_features, bias)
        self.threshold = threshold


class _FakeLinear4bit(nn.Linear):
    def __init__(
        self, in_features, out_features, bias, compute_dtype, compress_statistics=True, quant_type="fp4"
    ):
        super().__init__(in_features, out_features, bias)
        self.quant_type = quant_type


_FAKE_BNB = types.SimpleNamespace(
    nn=types.SimpleNamespace(Linear8bitLt=_FakeLinear8bitLt, Linear4bit=_FakeLinear4bit)
)


def test_load_and_quantize_model_validates_inputs() -> None:
    with pytest.raises(TypeError, match="must be a BnbQuantizationConfig"):
        load_and_quantize_model(_Net(), {"load_in_8bit": True})
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        load_and_quantize_model("model", BnbQuantizationConfig(load_in_8bit=True))


def test_load_and_quantize_model_needs_bitsandbytes_and_cuda(monkeypatch) -> None:
    from notebook_accel.utils import imports

    config = BnbQuantizationConfig(load_in_8bit=True)
    if not imports.is_bnb_available():
        with pytest.raises(ImportError, match="requires `bitsandbytes`"):
            load_and_quantize_model(_Net(), config)
    monkeypatch.setattr(imports, "is_bnb_available", lambda: True)
    monkeypatch.setattr(imports, "is_cuda_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        load_and_quantize_model(_Net(), config)
    # Too old a bitsandbytes for the mode (pre-releases of the minimum count as older).
    monkeypatch.setattr(imports, "is_cuda_available", lambda: True)
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))
    versions = {"bitsandbytes": "0.39.0.dev0"}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: versions[name])
    four = BnbQuantizationConfig(load_in_4bit=True)
    with pytest.raises(ImportError, match=r"4bit quantization needs bitsandbytes>=0.39.0, found 0.39.0.dev0"):
        bnb_module.require_bnb(four)
    assert bnb_module.require_bnb(config) is sys.modules["bitsandbytes"]  # 8-bit needs only 0.37.2
    versions["bitsandbytes"] = "0.43.1+cu121"
    assert bnb_module.require_bnb(four) is sys.modules["bitsandbytes"]


def test_replace_with_bnb_layers_respects_skip_and_fp32() -> None:
    model = _Net()
    eight = BnbQuantizationConfig(load_in_8bit=True, llm_int8_threshold=4.0)
    skip = bnb_module.default_skip_modules(model)
    assert skip == ["head"]
    assert bnb_module.replace_linear_layers(model, eight, skip, _FAKE_BNB.nn) == 2
    assert isinstance(model.body[0], _FakeLinear8bitLt) and model.body[0].threshold == 4.0
    assert type(model.head) is nn.Linear and not model.body[0].weight.requires_grad
    four = BnbQuantizationConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", keep_in_fp32_modules=["norm"])
    model = _Net()
    assert bnb_module.replace_linear_layers(model, four, ["body.2", "head"], _FAKE_BNB.nn) == 1
    assert model.body[0].quant_type == "nf4" and type(model.body[2]) is nn.Linear
    bnb_module.set_unquantized_dtypes(model, four, _FAKE_BNB.nn)
    assert model.norm.weight.dtype is torch.float32 and model.head.weight.dtype is torch.float16
    assert model.body[0].weight.dtype is torch.float32  # left for bitsandbytes to quantize


def test_meta_model_is_replaced_loaded_and_dispatched(tmp_path, monkeypatch) -> None:
    from safetensors.torch import save_file

    from notebook_accel.big_modeling import init_empty_weights

    reference = _Net()
    save_file(reference.state_dict(), tmp_path / "model.safetensors")
    # A stand-in bitsandbytes whose layers are plain nn.Linear subclasses, so the whole path runs on CPU.
    fake = types.ModuleType("bitsandbytes")
    fake.__spec__ = importlib.machinery.ModuleSpec("bitsandbytes", None)
    fake.nn = _FAKE_BNB.nn
    monkeypatch.setitem(sys.modules, "bitsandbytes", fake)
    monkeypatch.setattr(bnb_module, "require_bnb", lambda config: fake)
    with init_empty_weights():
        model = _Net()
    config = BnbQuantizationConfig(load_in_8bit=True, skip_modules=["head"], keep_in_fp32_modules=["norm"])
    with pytest.raises(ValueError, match="weights_location must name the checkpoint"):
        load_and_quantize_model(model, config)
    with pytest.raises(ValueError, match=r"device_map='everywhere' is not a device-map strategy"):
        load_and_quantize_model(model, config, weights_location=tmp_path, device_map="everywhere")
    quantized = load_and_quantize_model(model, config, weights_location=tmp_path, device_map={"": "cpu"})
    assert isinstance(quantized.body[0], _FakeLinear8bitLt) and type(quantized.head) is nn.Linear
    assert quantized.body[0].weight.device.type == "cpu"
    assert torch.allclose(quantized.body[0].weight.float(), reference.body[0].weight, atol=1e-3)
    assert quantized.norm.weight.dtype is torch.float32


def test_bnb_helpers_of_1_15(monkeypatch) -> None:
    from notebook_accel.utils import BnbQuantizationConfig

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    assert bnb_module.get_keys_to_not_convert(model) == ["1"]  # the output head stays in full precision
    assert bnb_module.get_parameter_device(model) == torch.device("cpu")
    with pytest.raises(ValueError, match="ReLU has no parameters"):
        bnb_module.get_parameter_device(nn.ReLU())
    assert not bnb_module.has_4bit_bnb_layers(model)
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        bnb_module.replace_with_bnb_layers(model, BnbQuantizationConfig(load_in_8bit=True))
    monkeypatch.setattr(bnb_module, "require_bnb", lambda config: _FAKE_BNB)
    out = bnb_module.replace_with_bnb_layers(model, BnbQuantizationConfig(load_in_8bit=True))
    assert out is model and isinstance(model[0], _FakeLinear8bitLt) and type(model[1]) is nn.Linear
