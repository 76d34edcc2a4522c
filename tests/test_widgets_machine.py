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
