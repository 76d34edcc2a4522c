"""Panels' responsiveness: DeviceMapExplorer recompute per control change on a 96-block GPT-like meta model.

    .venv/bin/python benchmarks/bench_widgets.py [--quick]

Target: the map is recomputed in < 100 ms after a slider move (the panel recomputes on every change).
"map" is the model's recompute alone (balanced budget + infer_auto_device_map); "map + view" also
redraws the built view (stacked-bar PNG, usage table, module tree HTML, code). Also times building
a MemoryEstimator for the same model (sizes for 4 dtypes) and tracing activations of a smaller one.
Prints the median of several runs per case.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _models import gpt_meta  # noqa: E402

GiB = 1024**3


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _peak_cpu_bytes(fn) -> int:  # noqa: ANN001
    """Peak live bytes of the CPU allocator while ``fn`` runs (torch profiler memory events, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def accuracy_rows(machine) -> list[tuple[str, int, int]]:  # noqa: ANN001
    """Return (case, estimated bytes, measured bytes) of one training step with Adam on CPU."""
    from notebook_accel.widgets import MemoryEstimator

    nn = torch.nn
    cases = {
        "MLP 512-1024-1024-256, batch 64": (
            lambda: nn.Sequential(
                nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 256)
            ),
            (64, 512),
        ),
        "TransformerEncoder 2x(d128,ff512), 8x64": (
            lambda: nn.TransformerEncoder(
                nn.TransformerEncoderLayer(128, 4, 512, batch_first=True), 2, enable_nested_tensor=False
            ),
            (8, 64, 128),
        ),
        "TransformerEncoder 4x(d256,ff1024), 16x128": (
            lambda: nn.TransformerEncoder(
                nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True), 4, enable_nested_tensor=False
            ),
            (16, 128, 256),
        ),
    }
    rows = []
    for name, (make, shape) in cases.items():
        est = MemoryEstimator(make(), dtypes=("float32",), sample_input=shape, machine=machine, foreach=False)

        def step(make=make, shape=shape) -> None:  # noqa: ANN001
            model = make()
            opt = torch.optim.Adam(model.parameters(), foreach=False)
            x = torch.randn(shape)
            for _ in range(2):
                opt.zero_grad(set_to_none=True)
                model(x).sum().backward()
                opt.step()

        rows.append((name, est.estimates["float32"].training, _peak_cpu_bytes(step)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    opts = parser.parse_args()
    repeats = 3 if opts.quick else 11
    torch.set_num_threads(1)
    from notebook_accel.widgets import DeviceMapExplorer, MemoryEstimator
    from notebook_accel.widgets._machine import MachineInfo

    machine = MachineInfo(ram_total=64 * GiB, ram_available=64 * GiB, disk_free=1024 * GiB)
    model = gpt_meta(96)  # ~1.4 G parameters, 1,060 modules
    n_modules = sum(1 for _ in model.modules())
    budgets = {0: "6GiB", 1: "6GiB", "cpu": "8GiB"}
    rows = []

    start = time.perf_counter()
    ex = DeviceMapExplorer(model, max_memory=budgets, machine=machine)
    rows.append(("DeviceMapExplorer build (model only)", (time.perf_counter() - start) * 1000))

    values = iter([4.0, 5.0] * repeats)
    rows.append(("budget slider move: map", _median_ms(lambda: ex.set_budget(0, next(values)), repeats)))
    strategies = iter(["sequential", "balanced", "balanced_low_0", "auto"] * repeats)
    rows.append(
        ("strategy change: map", _median_ms(lambda: setattr(ex, "strategy", next(strategies)), repeats))
    )
    dtypes = iter(["float16", None] * repeats)
    rows.append(
        (
            "dtype change: map (sizes cached after 1st)",
            _median_ms(lambda: setattr(ex, "dtype", next(dtypes)), repeats),
        )
    )

    ex.widget  # noqa: B018 - build the view so that changes also redraw it
    sliders = iter([4.0, 5.0] * repeats)
    rows.append(
        (
            "budget slider move: map + view",
            _median_ms(lambda: setattr(ex._w_sliders[0], "value", next(sliders)), repeats),
        )
    )
    rows.append(("  of which map only (last change)", ex.last_compute_seconds * 1000))

    start = time.perf_counter()
    MemoryEstimator(model, machine=machine)
    rows.append(("MemoryEstimator build, 4 dtypes, no sample", (time.perf_counter() - start) * 1000))
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)
    small = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    est = MemoryEstimator(small, dtypes=("float32",), machine=machine, sample_input=(8, 128, 256))
    batches = iter(range(9, 9 + repeats))
    rows.append(
        (
            "MemoryEstimator batch change (fwd+bwd trace x2)",
            _median_ms(lambda: setattr(est, "batch_size", next(batches)), repeats),
        )
    )

    print(
        f"96-block GPT-like meta model: {n_modules} modules, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} G params"
    )
    width = max(len(r[0]) for r in rows)
    print(f"{'case':<{width}}  median ms")
    for name, ms in rows:
        print(f"{name:<{width}}  {ms:9.1f}")

    print("\nMemoryEstimator training estimate vs measured peak of real Adam steps (CPU allocator, profiler)")
    acc = accuracy_rows(machine)
    width = max(len(r[0]) for r in acc)
    print(f"{'model':<{width}}  estimate MiB  measured MiB  error")
    for name, estimate, measured in acc:
        print(
            f"{name:<{width}}  {estimate / 2**20:12.2f}  {measured / 2**20:12.2f}  {100 * (estimate - measured) / measured:+5.1f}%"
        )


if __name__ == "__main__":
    main()
