"""MemoryEstimator: size arithmetic, activation tracing accuracy against real steps, verdicts, view."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
from notebook_accel.widgets import MemoryEstimator
from notebook_accel.widgets._activations import trace_activations
from notebook_accel.widgets._machine import GpuInfo, MachineInfo

MiB = 1024**2
GiB = 1024**3


def _machine(ram: int = 64 * GiB, disk: int = 1024 * GiB, gpus: tuple = ()) -> MachineInfo:
    return MachineInfo(ram_total=ram, ram_available=ram, disk_free=disk, gpus=gpus)


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 256)
    )


def _transformer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(128, 4, 512, batch_first=True, dropout=0.1)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


class _TiedLM(nn.Module):
    """Token ids in, logits out; the output head shares the embedding's weight; batch norm buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(1000, 64)
        self.body = nn.Sequential(nn.Linear(64, 64), nn.GELU())
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(64, 1000, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(self.wte(ids))))


def _peak_cpu_bytes(fn) -> int:
    """Return the peak of live bytes the CPU allocator handed out while ``fn`` ran.

    The torch profiler (``profile_memory=True``) records every allocation and free of the c10 CPU
    allocator with its size; the running sum of those, in time order, is the live tensor memory,
    and its maximum the peak. Unlike process RSS this ignores the malloc arena's caching, thread
    stacks and the profiler itself, so it is exact and identical from run to run.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize(
    "make, sample",
    [(_mlp, (64, 512)), (_transformer, (8, 64, 128)), (_TiedLM, torch.zeros(4, 16, dtype=torch.long))],
    ids=["mlp", "transformer", "tied-lm"],
)
def test_training_estimate_matches_a_real_step(make, sample):
    torch.manual_seed(0)
    model = make()
    est = MemoryEstimator(model, dtypes=("float32",), sample_input=sample, machine=_machine(), foreach=False)
    estimate = est.estimates["float32"]
    assert estimate.activations_measured

    def two_steps():
        # Built inside the measured region, so the peak counts the weights as the estimate does;
        # two steps so that the second backward runs with Adam's moments already allocated.
        torch.manual_seed(0)
        m = make()
        opt = torch.optim.Adam(m.parameters(), foreach=False)
        x = sample.clone() if isinstance(sample, torch.Tensor) else torch.randn(sample)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            m(x).sum().backward()
            opt.step()

    measured = _peak_cpu_bytes(two_steps)
    assert abs(estimate.training - measured) / measured < 0.20, (
        estimate.training,
        measured,
        estimate.training_items,
    )


def test_inference_estimate_matches_a_real_forward():
    est = MemoryEstimator(_mlp(), dtypes=("float32",), sample_input=(256, 512), machine=_machine())

    def forward():
        m = _mlp().eval()
        with torch.no_grad():
            m(torch.randn(256, 512))

    measured = _peak_cpu_bytes(forward)
    assert abs(est.estimates["float32"].inference - measured) / measured < 0.20


def test_sizes_and_training_items_per_dtype():
    model = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 10))
    est = MemoryEstimator(model, machine=_machine(), foreach=False)
    n = 1000 * 1000 + 1000 + 1000 * 10 + 10
    fp32, fp16, int8, int4 = (est.estimates[d] for d in ("float32", "float16", "int8", "int4"))
    assert (
        fp32.total_size == 4 * n
        and fp16.total_size == 2 * n
        and int8.total_size == n
        and int4.total_size == n // 2
    )
    assert fp32.largest_layer == 4 * (1000 * 1000 + 1000) and fp32.largest_layer_names == ["0"]
    assert fp32.inference == int(4 * n * 1.2) and not fp32.activations_measured
    items = fp32.training_items
    assert (
        items["weights"] == items["gradients"] == items["adam_exp_avg"] == items["adam_exp_avg_sq"] == 4 * n
    )
    assert items["master_weights"] == 0
    assert (
        items["optimizer_step_temporaries"] == 2 * 4 * 1000 * 1000
    )  # per-tensor Adam: sqrt + divide of the largest
    assert fp32.training == 4 * n * 4 + 2 * 4 * 1000 * 1000
    # Mixed precision: half weights and gradients, fp32 moments and master weights.
    assert fp16.training_items["master_weights"] == 4 * n and fp16.training_items["gradients"] == 2 * n
    assert fp16.training == 2 * n + 3 * 4 * n + 2 * n + 2 * 4 * 1000 * 1000
    assert int8.training is None and int4.training is None
    # foreach Adam (the CUDA default) needs a temporary as large as all parameters.
    assert (
        MemoryEstimator(model, dtypes=("float32",), machine=_machine(), foreach=True)
        .estimates["float32"]
        .training_items["optimizer_step_temporaries"]
        == 4 * n
    )


def test_factory_runs_under_init_empty_weights_and_no_split_is_suggested():
    est = MemoryEstimator(_transformer, dtypes=("bfloat16",), machine=_machine())
    assert all(p.device.type == "meta" for p in est.model.parameters())
    assert est.no_split_module_classes == ["TransformerEncoderLayer"]
    assert est.estimates["bfloat16"].largest_layer_names == ["layers.0", "layers.1"]


def test_batch_size_changes_activation_memory_via_widget():
    est = MemoryEstimator(
        _mlp(), dtypes=("float32", "float16"), sample_input=torch.zeros(4, 512), machine=_machine()
    )
    small = est.estimates["float32"].training_items["activations"]
    view = est.widget
    assert est._w_batch.value == 4 and not est._w_batch.disabled
    est._w_batch.value = 64
    assert est.batch_size == 64
    large = est.estimates["float32"].training_items["activations"]
    assert large > small
    # Activations in half precision are half as large (same shapes, 2-byte elements).
    half = est.estimates["float16"].training_items["activations"]
    assert half < 0.75 * large
    assert view is est.widget


def test_verdicts_and_generated_code():
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])  # ~8 MiB in fp32, 1 MiB layers
    # CPU only, 4 MiB of RAM: fp32 needs the disk, int8 fits.
    est = MemoryEstimator(model, machine=_machine(ram=4 * MiB, disk=GiB), headroom=1.0)
    assert est.estimates["float32"].verdict == "fits with disk offload"
    assert est.estimates["float32"].style == "warning"
    assert 'offload_folder="offload"' in est.estimates["float32"].code.replace("'", '"')
    assert est.estimates["int8"].verdict == "fits"
    assert "load_in_8bit=True" in est.estimates["int8"].code
    assert est.estimates["float32"].training_fits is False and est.estimates["int8"].training_fits is None
    # One GPU with 4 MiB free and enough RAM: fp32 offloads to the CPU, no disk.
    gpu = (GpuInfo(0, "fake", 16 * MiB, 8 * MiB),)
    est = MemoryEstimator(model, machine=_machine(gpus=gpu), headroom=0.5)
    fp32 = est.estimates["float32"]
    assert fp32.verdict == "fits with CPU offload" and fp32.style == "info"
    assert "offload_folder" not in fp32.code and "max_memory={0: '4MiB'" in fp32.code
    assert est.estimates["float16"].verdict == "fits with CPU offload"  # 4 MiB * 1.2 > 4 MiB
    assert est.estimates["int4"].verdict == "fits" and est.estimates["int4"].style == "success"
    big = MemoryEstimator(model, machine=_machine(gpus=(GpuInfo(0, "fake", GiB, GiB),)))
    assert big.estimates["float32"].training_fits is True and big.estimates["float32"].verdict == "fits"
    compile(est.estimates["float16"].code, "<code>", "exec")
    # Loads on the GPU but a training step does not fit: never a plain "fits".
    fits_to_load = MemoryEstimator(model, machine=_machine(gpus=(GpuInfo(0, "fake", GiB, 20 * MiB),)))
    fp32 = fits_to_load.estimates["float32"]
    assert fp32.verdict == "fits" and fp32.training_fits is False
    assert fp32.inference_verdict == "fits (inference only)" and fp32.training_verdict == "does not fit"
    row = dict(zip(fits_to_load._HEADERS, fits_to_load.rows()[0]))
    assert row["loading / inference"] == "fits (inference only)" and row["training step"] == "does not fit"
    assert "fits (inference only)" in fits_to_load._repr_html_() and "does not fit" in repr(fits_to_load)
    assert big.estimates["float32"].inference_verdict == "fits"
    # Nowhere near enough: does not fit, and the code says why.
    est = MemoryEstimator(model, machine=_machine(ram=MiB, disk=MiB))
    assert est.estimates["float32"].verdict == "does not fit" and est.estimates["float32"].style == "danger"
    assert est.estimates["float32"].code.startswith("# float32:")


def test_views_render():
    est = MemoryEstimator(_mlp(), sample_input=(2, 512), machine=_machine())
    page = est._repr_html_()
    assert "<table>" in page and "data:image/png;base64," in page and "fits" in page
    text = repr(est)
    assert "MemoryEstimator(Sequential, activations: measured)" in text and "int4" in text
    assert est.widget is not None
    est._w_dtype.value = "int4"
    assert est._w_verdict.description == "loading / inference: fits (inference only)"
    assert est._w_verdict.button_style == "success"
    assert est._w_training.description == "training: n/a: quantised" and est._w_training.button_style == ""
    assert "load_in_4bit=True" in est._w_code.value
    est._w_dtype.value = "float32"
    fp32 = est.estimates["float32"]
    assert fp32.training_fits is True and est._w_verdict.description == "loading / inference: fits"
    assert est._w_training.description == "training: fits" and est._w_training.button_style == "success"
    assert est._w_chart.value[:4] == b"\x89PNG"


def test_bad_arguments_raise():
    model = _mlp()
    with pytest.raises(ValueError, match="Unsupported dtype 'float8'.*choose one of"):
        MemoryEstimator(model, dtypes=("float8",), machine=_machine())
    with pytest.raises(TypeError, match="dtype must be a string or torch.dtype"):
        MemoryEstimator(model, dtypes=(8,), machine=_machine())
    with pytest.raises(ValueError, match="dtypes is empty"):
        MemoryEstimator(model, dtypes=(), machine=_machine())
    with pytest.raises(ValueError, match="headroom must be in"):
        MemoryEstimator(model, headroom=1.5, machine=_machine())
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        MemoryEstimator(model, sample_input=(2, 512), batch_size=0, machine=_machine())
    with pytest.raises(TypeError, match="must be a tensor or a shape"):
        MemoryEstimator(model, sample_input="text", machine=_machine())
    with pytest.raises(ValueError, match="0-d tensor"):
        MemoryEstimator(model, sample_input=torch.tensor(1.0), machine=_machine())
    with pytest.raises(ValueError, match="non-positive dimension"):
        MemoryEstimator(model, sample_input=(0, 512), machine=_machine())
    with pytest.raises(TypeError, match="returned int, not a torch.nn.Module"):
        MemoryEstimator(lambda: 3, machine=_machine())
    with pytest.raises(
        RuntimeError,
        match=r"Tracing Sequential on sample_input \(2, 3\) failed with RuntimeError.*sample_input=None",
    ):
        MemoryEstimator(model, sample_input=(2, 3), machine=_machine())  # wrong feature size
    with pytest.raises(TypeError, match="needs a torch.nn.Module or a function"):
        MemoryEstimator("gpt2", machine=_machine())
    est = MemoryEstimator(model, sample_input={"input": (2, 512)}, machine=_machine())
    assert est.estimates["float32"].activations_measured  # keyword inputs
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        est.batch_size = -1


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(8, 6)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.a(a) * self.b(b)


def test_two_positional_inputs_are_traced_like_two_keyword_inputs():
    model = _TwoInputs()
    # Two shapes given positionally: each is one input (a pair of shapes is no (shape, dtype) spec).
    positional = trace_activations(model, [(2, 4), (2, 8)])
    assert positional == trace_activations(model, {"a": (2, 4), "b": (2, 8)})
    assert positional.inputs == 2 * (4 + 8) * 4
    assert positional.gradients == sum(p.numel() * 4 for p in model.parameters())
    # batch_size replaces dimension 0 of every input, and both inputs keep their own feature size.
    assert trace_activations(model, [(2, 4), torch.zeros(2, 8)], batch_size=5).inputs == 5 * (4 + 8) * 4


# The model alone, with the GUI libraries blocked (importing any raises ImportError): every figure the view shows.
_NO_WIDGETS = textwrap.dedent(
    """
    import json, sys
    for name in ("ipywidgets", "matplotlib", "IPython"):
        sys.modules[name] = None
    import torch.nn as nn
    from notebook_accel.widgets._machine import MachineInfo
    from notebook_accel.widgets._memory_model import MemoryModel

    mlp = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 256))
    gib = 1024**3
    model = MemoryModel(mlp, sample_input=(2, 512), machine=MachineInfo(ram_total=64 * gib, ram_available=64 * gib, disk_free=1024 * gib, gpus=()))
    before = model.training_table()
    model.batch_size = 64
    print(json.dumps({
        "rows": model.rows(), "training": [before, model.training_table()], "chart": model.chart_series(),
        "machine": model.machine_line(), "sample_batch": model.sample_batch(),
        "gui": [n for n in ("ipywidgets", "matplotlib", "IPython") if sys.modules[n] is not None],
    }))
    """
)


def test_model_without_ipywidgets_shows_what_the_view_shows():
    run = subprocess.run([sys.executable, "-c", _NO_WIDGETS], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["gui"] == [] and got["sample_batch"] == 2
    view = MemoryEstimator(_mlp(), sample_input=(2, 512), machine=_machine())
    heads, items = view.training_table()
    assert got["training"][0] == [heads, items] and heads == ["training item", "float32", "float16"]
    assert [row[0] for row in items][:2] == ["weights", "gradients"]
    view.batch_size = 64
    assert got["rows"] == view.rows() and [list(t) for t in got["training"][1]] == list(view.training_table())
    assert got["training"][1] != got["training"][0]  # a bigger batch: more activation memory
    labels, series, lines = got["chart"]
    assert labels == ["float32", "float16", "int8", "int4"] and sorted(series) == [
        "inference",
        "training",
        "weights",
    ]
    assert series["training"][2:] == [0, 0] and lines == {"RAM available": 64.0}
    assert got["machine"] == view.machine_line() and got["machine"].startswith("This machine: RAM 64.00 GiB")
