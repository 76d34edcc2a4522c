"""Panels' import hygiene and the machine query (cgroup-capped RAM, GPUs without CUDA init, disk)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from notebook_accel.widgets._machine import _cgroup_memory, machine_info


def test_import_and_models_stay_headless_and_never_touch_cuda():
    code = """
import sys, torch
import notebook_accel.widgets as w
assert sorted(w.__all__) == ["DeviceMapExplorer", "LaunchPanel", "MemoryEstimator", "OffloadMonitor"]
assert "ipywidgets" not in sys.modules and "matplotlib" not in sys.modules
est = w.MemoryEstimator(torch.nn.Linear(4, 4), sample_input=(2, 4))
ex = w.DeviceMapExplorer(torch.nn.Sequential(torch.nn.Linear(4, 4)))
repr(est), repr(ex)
assert "ipywidgets" not in sys.modules and "matplotlib" not in sys.modules, "models must not import the view"
assert not torch.cuda.is_initialized()
est.widget
assert "ipywidgets" in sys.modules
assert not torch.cuda.is_initialized()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_cgroup_v2_limit_caps_ram(tmp_path):
    (tmp_path / "memory.max").write_text("1073741824\n")
    (tmp_path / "memory.current").write_text("268435456\n")
    assert _cgroup_memory(str(tmp_path)) == (1 << 30, 1 << 28)
    info = machine_info(tmp_path / "offload" / "not-yet", cgroup_root=str(tmp_path))
    assert info.cgroup_limit == 1 << 30
    assert info.ram_total <= 1 << 30 and info.ram_available <= (1 << 30) - (1 << 28)
    assert info.disk_free > 0 and info.disk_path.endswith("not-yet")


def test_cgroup_v1_and_unlimited(tmp_path):
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(str(2 << 30))
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text(str(1 << 30))
    assert _cgroup_memory(str(tmp_path)) == (2 << 30, 1 << 30)
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(str(9223372036854771712))  # v1's "no limit"
    assert _cgroup_memory(str(tmp_path)) == (None, None)
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("max\n")
    assert _cgroup_memory(str(v2)) == (None, None)
    assert machine_info(cgroup_root=str(v2)).cgroup_limit is None


def test_display_outside_a_notebook_prints_the_text_view(capsys):
    from notebook_accel.widgets import MemoryEstimator

    est = MemoryEstimator(torch.nn.Linear(8, 8))
    est.display()
    assert capsys.readouterr().out.startswith("MemoryEstimator(Linear, activations: rule of thumb")
    assert est._widget is None  # no kernel: no widget was built


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_memory_is_read_without_initialising_cuda():
    code = """
import torch
from notebook_accel.widgets._machine import machine_info
info = machine_info()
assert len(info.gpus) == torch.cuda.device_count()
assert all(g.total and g.free and g.free <= g.total for g in info.gpus), info.gpus
assert not torch.cuda.is_initialized()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


class _FakeNvml:
    """Four GPUs; physical GPU i has (i + 1) GiB total, i + 1 bytes free, compute capability (7 + i, 5)."""

    def __init__(self, count: int = 4) -> None:
        self.count = count
        self.initialised = 0

    def nvmlInit_v2(self):
        self.initialised += 1
        return 0

    def nvmlShutdown(self):
        self.initialised -= 1
        return 0

    def nvmlDeviceGetCount_v2(self, ref):
        ref._obj.value = self.count
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, ref):
        if index.value >= self.count:
            return 1
        ref._obj.value = 100 + index.value
        return 0

    def nvmlDeviceGetMemoryInfo(self, handle, ref):
        ref._obj.total, ref._obj.free = (handle.value - 99) * 2**30, handle.value - 99
        return 0

    def nvmlDeviceGetName(self, handle, buf, size):
        buf.value = f"Fake {handle.value - 100}".encode()
        return 0

    def nvmlDeviceGetCudaComputeCapability(self, handle, major, minor):
        major._obj.value, minor._obj.value = 7 + handle.value - 100, 5
        return 0


def test_gpus_are_read_through_the_cores_nvml_query_in_torch_order(monkeypatch):
    import ctypes

    from notebook_accel.widgets._machine import GpuInfo, _nvml_gpus

    from notebook_accel.utils.imports import _nvml_compute_capability

    fake = _FakeNvml()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [g.name for g in _nvml_gpus()] == ["Fake 0", "Fake 1", "Fake 2", "Fake 3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 0,9")  # out-of-range entries are dropped
    assert _nvml_gpus() == [GpuInfo(0, "Fake 2", 3 * 2**30, 3), GpuInfo(1, "Fake 0", 2**30, 1)]
    assert _nvml_compute_capability(0) == (9, 5) and _nvml_compute_capability(1) == (7, 5)
    assert _nvml_compute_capability(2) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234")  # UUIDs: NVML indices unknown, caller falls back
    assert _nvml_gpus() is None and _nvml_compute_capability(0) is None
    assert fake.initialised == 0, "NVML must be shut down after every query"
