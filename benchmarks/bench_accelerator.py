"""Time per training step: an MLP on 2 CPU processes through Accelerator vs a hand-written DDP loop.

Both loops do the same work in the same worker processes (same model size, batch, data, optimizer)
and run step by step in alternation, so load from other programs hits both alike; the table
reports the median step time of each and their ratio (target: Accelerator / raw DDP <= 1.02).
A second table does the same for iterating a prepared (shuffled) loader against the raw
``DistributedSampler`` loader, batch by batch (target: prepared / raw <= 1.05).

    python benchmarks/bench_accelerator.py [--quick] [--steps N] [--rounds R]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

HIDDEN, FEATURES, BATCH = 256, 64, 32


def _dataset(steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * BATCH * 2, FEATURES, generator=g)
    return TensorDataset(x, x[:, :1].clone())


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 1),
    )


def _accelerator_steps(acc, model, opt, loader):
    """Yield after each Accelerator training step."""
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        yield


def _raw_steps(model, opt, loader):
    """Yield after each hand-written DDP training step."""
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield


def _interleaved(first, second) -> tuple[list[float], list[float]]:
    """Time one step of each loop in turn until both end; return the per-step times of each."""
    a_times, b_times = [], []
    clock = time.perf_counter
    while True:
        start = clock()
        try:
            next(first)
        except StopIteration:
            return a_times, b_times
        a_times.append(clock() - start)
        start = clock()
        next(second)
        b_times.append(clock() - start)


def worker(steps: int, rounds: int) -> dict[str, list[float]]:
    """Run both loops ``rounds`` times, step by step in alternation; return every step time."""
    from torch.utils.data.distributed import DistributedSampler

    from notebook_accel import Accelerator

    torch.set_num_threads(1)
    data = _dataset(steps)
    acc = Accelerator()
    model = acc.prepare(_model())
    opt, loader = acc.prepare(
        torch.optim.SGD(model.parameters(), lr=1e-3), DataLoader(data, batch_size=BATCH)
    )
    raw_model = torch.nn.parallel.DistributedDataParallel(_model())
    raw_opt = torch.optim.SGD(raw_model.parameters(), lr=1e-3)
    raw_loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=False))
    times: dict[str, list[float]] = {"accelerator": [], "raw_ddp": []}
    for r in range(rounds + 1):  # round 0 warms up
        acc_steps = _accelerator_steps(acc, model, opt, loader)
        raw_steps = _raw_steps(raw_model, raw_opt, raw_loader)
        if r % 2:
            a, b = _interleaved(acc_steps, raw_steps)
        else:
            b, a = _interleaved(raw_steps, acc_steps)
        if r:
            times["accelerator"] += a
            times["raw_ddp"] += b
    return times


def _batches(loader):
    """Yield after each batch read from ``loader`` (the batch itself is dropped)."""
    for _ in loader:
        yield


def loader_worker(batches: int, rounds: int) -> dict[str, list[float]]:
    """Iterate a prepared loader and the raw DistributedSampler one batch by batch in alternation."""
    from torch.utils.data.distributed import DistributedSampler

    from notebook_accel import Accelerator

    torch.set_num_threads(1)
    data = _dataset(batches)
    acc = Accelerator()
    prepared = acc.prepare(
        DataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    )
    raw = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=True, seed=0))
    times: dict[str, list[float]] = {"prepared": [], "raw": []}
    for r in range(rounds + 1):  # round 0 warms up
        raw.sampler.set_epoch(r)
        if r % 2:
            a, b = _interleaved(_batches(prepared), _batches(raw))
        else:
            b, a = _interleaved(_batches(raw), _batches(prepared))
        if r:
            times["prepared"] += a
            times["raw"] += b
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps and rounds (a smoke run)")
    parser.add_argument("--steps", type=int, default=200, help="training steps per round")
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds")
    args = parser.parse_args()
    steps, rounds = (40, 4) if args.quick else (args.steps, args.rounds)

    from notebook_accel import debug_launcher

    _print_comparison(
        f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-1, batch {BATCH}/process, 2 CPU processes (gloo), {steps} steps x "
        f"{rounds} rounds, interleaved",
        debug_launcher(worker, args=(steps, rounds), num_processes=2),
        {"raw_ddp": "raw DDP", "accelerator": "Accelerator"},
        ("loop", "median ms/step", 1e3, 3),
        target=1.02,
    )
    _print_comparison(
        f"\nloader iteration, shuffled, batch {BATCH}/process, {steps * 4} batches x {rounds} rounds, interleaved",
        debug_launcher(loader_worker, args=(steps * 4, rounds), num_processes=2),
        {"raw": "raw", "prepared": "prepared"},
        ("loader", "median us/batch", 1e6, 1),
        target=1.05,
    )


def _print_comparison(
    title: str, per_rank: list[dict], rows: dict[str, str], column: tuple[str, str, float, int], target: float
) -> None:
    """Print ``title``, each row's median over every rank's timings (seconds, shown scaled) and second/first."""
    first_column, heading, scale, digits = column
    median = {key: statistics.median(t for rank in per_rank for t in rank[key]) for key in rows}
    print(title)
    print(f"{first_column:<14}{heading:>16}")
    for key, label in rows.items():
        print(f"{label:<14}{median[key] * scale:>16.{digits}f}")
    base, ours = rows
    print(f"{'ratio':<14}{median[ours] / median[base]:>16.3f}   (target <= {target})")


if __name__ == "__main__":
    main()
