"""FSDP2 training step against a DDP step on 2 CPU processes: time per step and each rank's memory.

One launch times both: the same transformer-like model (4 blocks) wrapped once with torch's DDP and
once by ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))``, stepped in
alternation so load from other programs hits both alike; the median step time of each and their
ratio are reported. Memory per rank is the bytes of parameters, gradients and optimizer state each
rank holds (local shards for FSDP2) after a step, and, from a separate launch per engine, how far
each rank's resident memory rose above the prepared model during 3 training steps (Linux VmHWM).

    python benchmarks/bench_fsdp.py [--quick] [--steps N] [--rounds R]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from torch import nn

WIDTH, BLOCKS, BATCH = 512, 4, 16


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[_Block() for _ in range(BLOCKS)], nn.Linear(WIDTH, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 1, generator=g)


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Return the bytes of parameters, gradients and optimizer state this rank holds."""
    total = 0
    for p in model.parameters():
        total += _local_bytes(p) + (_local_bytes(p.grad) if p.grad is not None else 0)
    for state in opt.state.values():
        total += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def _step(model: nn.Module, opt: torch.optim.Optimizer, backward, step: int) -> float:
    x, y = _batch(step)
    start = time.perf_counter()
    backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def _accelerator(fsdp2: bool):
    from notebook_accel import Accelerator
    from notebook_accel.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="size_based_wrap", min_num_params=100_000
    )
    return Accelerator(fsdp_plugin=plugin if fsdp2 else None)


def timing_worker(steps: int, rounds: int) -> dict:
    """Return the step times of both engines, stepped in alternation, and each one's state bytes."""
    torch.set_num_threads(1)
    acc = _accelerator(fsdp2=True)
    fsdp = _model()
    fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-4)
    fsdp, fsdp_opt = acc.prepare(fsdp, fsdp_opt)
    ddp = nn.parallel.DistributedDataParallel(_model())
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    times: dict[str, list[float]] = {"fsdp2": [], "ddp": []}
    for r in range(rounds + 1):  # round 0 warms up
        for step in range(steps):
            order = (("fsdp2", fsdp, fsdp_opt, acc.backward), ("ddp", ddp, ddp_opt, torch.Tensor.backward))
            for name, model, opt, backward in order if (r + step) % 2 else order[::-1]:
                elapsed = _step(model, opt, backward, step)
                if r:
                    times[name].append(elapsed)
    return {**times, "fsdp2_bytes": _state_bytes(fsdp, fsdp_opt), "ddp_bytes": _state_bytes(ddp, ddp_opt)}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def memory_worker(fsdp2: bool) -> float:
    """Return the MiB this rank's resident memory rose above the prepared model at its peak in 3 steps.

    Linux's peak counter (VmHWM) is reset once the model is prepared (``/proc/self/clear_refs``), so
    the figure is what training adds: gradients, optimizer state, all-gathered layers, activations.
    """
    torch.set_num_threads(1)
    acc = _accelerator(fsdp2)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    for step in range(3):
        _step(model, opt, acc.backward, step)
    return (_status_kib("VmHWM") - before) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps and rounds (a smoke run)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds")
    args = parser.parse_args()
    steps, rounds = (4, 1) if args.quick else (args.steps, args.rounds)

    from notebook_accel import debug_launcher

    per_rank = debug_launcher(timing_worker, args=(steps, rounds), num_processes=2)
    peaks = {
        name: debug_launcher(memory_worker, args=(name == "FSDP2",), num_processes=2)
        for name in ("DDP", "FSDP2")
    }
    fsdp = statistics.median(t for rank in per_rank for t in rank["fsdp2"])
    ddp = statistics.median(t for rank in per_rank for t in rank["ddp"])
    params = sum(p.numel() for p in _model().parameters())
    print(
        f"{BLOCKS} blocks of width {WIDTH} ({params / 1e6:.1f} M parameters, AdamW), batch {BATCH}/process, "
        f"2 CPU processes (gloo), {steps} steps x {rounds} rounds, alternating"
    )
    print(f"{'engine':<8}{'median ms/step':>16}{'state MiB rank0/rank1':>26}{'training peak MiB r0/r1':>26}")
    for name, key, median in (("DDP", "ddp", ddp), ("FSDP2", "fsdp2", fsdp)):
        state = "/".join(f"{rank[f'{key}_bytes'] / 2**20:.1f}" for rank in per_rank)
        peak = "/".join(f"{mib:.1f}" for mib in peaks[name])
        print(f"{name:<8}{median * 1e3:>16.2f}{state:>26}{peak:>26}")
    print(f"{'ratio FSDP2 / DDP step':<24}{fsdp / ddp:>8.3f}")


if __name__ == "__main__":
    main()
