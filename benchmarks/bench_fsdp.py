"""FSDP2 training step against a DDP step and raw ``fully_shard`` on 2 CPU processes: time and memory per rank.

One launch times all three: the same transformer-like model (4 blocks) wrapped with torch's DDP, sharded
by hand with torch's ``fully_shard`` (each block, then the root: the reference for what FSDP2 itself
costs), and prepared by ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...))``
sharding the same modules, stepped in rotation so load from other programs hits all alike; the median
step time of each and the ratios are reported. Memory per rank is the bytes of parameters, gradients
and optimizer state each rank holds (local shards for FSDP2) after a step, and, from a separate launch
per engine, how far each rank's resident memory rose above the prepared model during 3 training steps
(Linux VmHWM). ``--wrap size`` shards as the plugin's size_based_wrap (min_num_params=100k) instead,
which also shards each block's two Linear layers on their own.

    python benchmarks/bench_fsdp.py [--quick] [--steps N] [--rounds R] [--wrap blocks|size]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

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


ENGINES = ("ddp", "raw", "fsdp2")
_LABELS = {"ddp": "DDP", "raw": "fully_shard", "fsdp2": "FSDP2 (ours)"}


def _plugin(wrap: str):
    from notebook_accel.utils import FullyShardedDataParallelPlugin

    if wrap == "size":
        return FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="size_based_wrap", min_num_params=100_000
        )
    return FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["_Block"]
    )


def _engine(name: str, wrap: str) -> tuple[nn.Module, torch.optim.Optimizer, Callable]:
    """Return ``(model, optimizer, backward)`` of one engine, ready to train (AdamW for all)."""
    if name == "fsdp2":
        from notebook_accel import Accelerator

        acc = Accelerator(fsdp_plugin=_plugin(wrap))
        model = _model()
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        return model, opt, acc.backward
    if name == "raw":
        from torch.distributed.fsdp import fully_shard

        model = _model()
        for module in reversed(list(model.modules())):  # children before their parents
            if isinstance(module, _Block) or (wrap == "size" and _over_100k(module)):
                fully_shard(module)
        fully_shard(model)
    else:
        from notebook_accel import PartialState

        PartialState()  # the process group, as the Accelerator engines get it
        model = nn.parallel.DistributedDataParallel(_model())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), torch.Tensor.backward


def _over_100k(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and module.weight.numel() > 100_000


def timing_worker(steps: int, rounds: int, wrap: str) -> dict:
    """Return the step times of every engine, stepped in rotation, and each one's state bytes."""
    torch.set_num_threads(1)
    engines = {name: _engine(name, wrap) for name in ENGINES}
    times: dict[str, list[float]] = {name: [] for name in ENGINES}
    for r in range(rounds + 1):  # round 0 warms up
        for step in range(steps):
            shift = (r * steps + step) % len(ENGINES)
            for name in ENGINES[shift:] + ENGINES[:shift]:
                model, opt, backward = engines[name]
                elapsed = _step(model, opt, backward, step)
                if r:
                    times[name].append(elapsed)
    state = {f"{name}_bytes": _state_bytes(m, o) for name, (m, o, _) in engines.items()}
    return {**times, **state}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def memory_worker(name: str, wrap: str) -> float:
    """Return the MiB this rank's resident memory rose above the prepared model at its peak in 3 steps.

    Linux's peak counter (VmHWM) is reset once the model is prepared (``/proc/self/clear_refs``), so
    the figure is what training adds: gradients, optimizer state, all-gathered layers, activations.
    """
    torch.set_num_threads(1)
    model, opt, backward = _engine(name, wrap)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    for step in range(3):
        _step(model, opt, backward, step)
    return (_status_kib("VmHWM") - before) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps and rounds (a smoke run)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds")
    parser.add_argument(
        "--wrap", choices=("blocks", "size"), default="blocks", help="which modules are sharded"
    )
    args = parser.parse_args()
    steps, rounds = (6, 2) if args.quick else (args.steps, args.rounds)

    from notebook_accel import debug_launcher

    per_rank = debug_launcher(timing_worker, args=(steps, rounds, args.wrap), num_processes=2)
    peaks = {name: debug_launcher(memory_worker, args=(name, args.wrap), num_processes=2) for name in ENGINES}
    median = {name: statistics.median(t for rank in per_rank for t in rank[name]) for name in ENGINES}
    params = sum(p.numel() for p in _model().parameters())
    print(
        f"{BLOCKS} blocks of width {WIDTH} ({params / 1e6:.1f} M parameters, AdamW), batch {BATCH}/process, "
        f"2 CPU processes (gloo, 1 thread each), {steps} steps x {rounds} rounds, rotating; sharded: {args.wrap}"
    )
    print(f"{'engine':<14}{'median ms/step':>16}{'state MiB rank0/rank1':>26}{'training peak MiB r0/r1':>26}")
    for name in ENGINES:
        state = "/".join(f"{rank[f'{name}_bytes'] / 2**20:.1f}" for rank in per_rank)
        peak = "/".join(f"{mib:.1f}" for mib in peaks[name])
        print(f"{_LABELS[name]:<14}{median[name] * 1e3:>16.2f}{state:>26}{peak:>26}")
    print(f"{'ratio FSDP2 (ours) / fully_shard step':<40}{median['fsdp2'] / median['raw']:>8.3f}")
    print(f"{'ratio FSDP2 (ours) / DDP step':<40}{median['fsdp2'] / median['ddp']:>8.3f}")
    print(f"{'ratio fully_shard / DDP step':<40}{median['raw'] / median['ddp']:>8.3f}")


if __name__ == "__main__":
    main()
