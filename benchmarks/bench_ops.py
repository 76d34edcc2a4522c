"""Data operations vs raw torch.distributed, 2 CPU processes (gloo), in the same run.

    python benchmarks/bench_ops.py [--quick] [--iters N]

For gather, reduce (mean), broadcast and pad_across_processes, on one 1 MiB float32 tensor and on a
dict of 100 small tensors, it times notebook_accel's operation and the raw torch.distributed code
doing the same work (for the dict: one collective per tensor, the obvious loop), interleaved round by
round so that machine noise hits both alike, and prints median times (rank 0), the ratio of the
medians ours / raw and the ratio of the fastest rounds (less sensitive to a loaded machine). Targets: <= 1.05x for the single tensor; for the dict, coalescing into one flat buffer per
dtype should make ours faster than the per-tensor loop (ratio < 1). A second table gives the wrappers'
own cost per call, measured with the collectives replaced by local copies (noise-free).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---------------------------------------------------------------------------------------------
# raw torch.distributed baselines (what a user would write by hand)


def raw_gather(t: torch.Tensor, world: int) -> torch.Tensor:
    out = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype)
    _all_gather_into(out, t)
    return out


def raw_reduce(t: torch.Tensor, world: int) -> torch.Tensor:
    out = t.clone()
    dist.all_reduce(out)
    return out.div_(world)


def raw_broadcast(t: torch.Tensor, world: int) -> torch.Tensor:
    dist.broadcast(t, src=0)
    return t


def raw_pad(t: torch.Tensor, world: int) -> torch.Tensor:
    size = torch.tensor([t.shape[0]])
    sizes = torch.empty(world, dtype=torch.int64)
    _all_gather_into(sizes, size)
    largest = int(sizes.max())
    if largest == t.shape[0]:
        return t
    out = t.new_zeros((largest, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def _each(fn: Callable) -> Callable:
    def loop(data: dict, world: int) -> dict:
        return {k: fn(v, world) for k, v in data.items()}

    return loop


# ---------------------------------------------------------------------------------------------


def _time_pair(raw: Callable, ours: Callable, rounds: int, warmup: int) -> tuple[float, float, float, float]:
    """Return (median raw, median ours, min raw, min ours) seconds, timed alternately after a barrier."""
    for _ in range(warmup):
        raw()
        ours()
    times: dict[str, list[float]] = {"raw": [], "ours": []}
    for i in range(rounds):
        order = (("raw", raw), ("ours", ours)) if i % 2 == 0 else (("ours", ours), ("raw", raw))
        for name, fn in order:
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return (
        statistics.median(times["raw"]),
        statistics.median(times["ours"]),
        min(times["raw"]),
        min(times["ours"]),
    )


def _worker(rank: int, world: int, port: int, rounds: int, queue) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ.pop("ACCELERATE_DEBUG_MODE", None)
    torch.set_num_threads(1)
    from notebook_accel import PartialState
    from notebook_accel.utils import broadcast, gather, pad_across_processes, reduce

    PartialState()  # initialises the gloo group from the environment
    torch.manual_seed(rank)
    big = torch.randn(1024, 256)  # 1 MiB of float32
    ragged = torch.randn(1024 - rank, 256)  # pad_across_processes has padding to do on rank 1
    small = {f"t{i}": torch.randn(64) for i in range(100)}
    small_ragged = {f"t{i}": torch.randn(64 - rank) for i in range(100)}
    cases = [
        ("gather", "1 MiB tensor", lambda: raw_gather(big, world), lambda: gather(big)),
        ("gather", "dict of 100", lambda: _each(raw_gather)(small, world), lambda: gather(small)),
        ("reduce", "1 MiB tensor", lambda: raw_reduce(big, world), lambda: reduce(big)),
        ("reduce", "dict of 100", lambda: _each(raw_reduce)(small, world), lambda: reduce(small)),
        ("broadcast", "1 MiB tensor", lambda: raw_broadcast(big, world), lambda: broadcast(big)),
        ("broadcast", "dict of 100", lambda: _each(raw_broadcast)(small, world), lambda: broadcast(small)),
        (
            "pad_across_processes",
            "1 MiB tensor",
            lambda: raw_pad(ragged, world),
            lambda: pad_across_processes(ragged),
        ),
        (
            "pad_across_processes",
            "dict of 100",
            lambda: _each(raw_pad)(small_ragged, world),
            lambda: pad_across_processes(small_ragged),
        ),
    ]
    rows = []
    for op, case, raw, ours in cases:
        rows.append((op, case, *_time_pair(raw, ours, rounds, warmup=max(3, rounds // 10))))
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def wrapper_overhead(number: int) -> list[tuple[str, float, float]]:
    """Return (op, raw us, ours us) per call with the collectives replaced by local copies.

    Machine noise on a shared box swamps differences of a few microseconds in the real 2-process
    timings; with the transport taken out, what remains is the Python cost of the wrappers.
    """
    import timeit

    from notebook_accel.utils import operations as ops

    def fake_gather(out: torch.Tensor, inp: torch.Tensor) -> None:
        out.view(2, -1).copy_(inp.reshape(1, -1).expand(2, -1))

    saved = (
        ops._world,
        ops._all_gather_into,
        dist.all_reduce,
        dist.broadcast,
        globals()["_all_gather_into"],
    )
    fake_world = {
        "num_processes": 2,
        "process_index": 0,
        "distributed_type": "MULTI_CPU",
        "debug": False,
        "backend": "gloo",
        "device": torch.device("cpu"),
    }
    ops._world = lambda: fake_world  # the collectives read the process world through _world()
    ops._all_gather_into = globals()["_all_gather_into"] = fake_gather
    dist.all_reduce = dist.broadcast = lambda *args, **kwargs: None
    try:
        small = torch.randn(64)
        rows = []
        for op, raw, ours in [
            ("gather", lambda: raw_gather(small, 2), lambda: ops.gather(small)),
            ("reduce", lambda: raw_reduce(small, 2), lambda: ops.reduce(small)),
            ("broadcast", lambda: raw_broadcast(small, 2), lambda: ops.broadcast(small)),
            ("pad_across_processes", lambda: raw_pad(small, 2), lambda: ops.pad_across_processes(small)),
        ]:
            raw_times, ours_times = [], []
            for _ in range(7):  # alternate so that load changes hit both alike
                raw_times.append(timeit.timeit(raw, number=number))
                ours_times.append(timeit.timeit(ours, number=number))
            raw_t, ours_t = min(raw_times) / number, min(ours_times) / number
            rows.append((op, raw_t * 1e6, ours_t * 1e6))
        return rows
    finally:
        ops._world, ops._all_gather_into, dist.all_reduce, dist.broadcast, _ = saved
        globals()["_all_gather_into"] = saved[4]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds (a smoke run, noisy figures)")
    parser.add_argument(
        "--iters", type=int, default=None, help="timed rounds per case (default 200, quick 20)"
    )
    args = parser.parse_args(argv)
    rounds = args.iters or (20 if args.quick else 200)
    world = 2
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, rounds, queue)) for r in range(world)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=1800)
    for p in procs:
        p.join()
    print(f"torch {torch.__version__}, {world} processes, gloo, {rounds} rounds per case, median of rank 0")
    print(f"{'operation':<22}{'data':<14}{'raw (us)':>11}{'ours (us)':>11}{'ours/raw':>10}{'min ratio':>11}")
    for op, case, raw_s, ours_s, raw_min, ours_min in rows:
        print(
            f"{op:<22}{case:<14}{raw_s * 1e6:>11.1f}{ours_s * 1e6:>11.1f}{ours_s / raw_s:>9.2f}x"
            f"{ours_min / raw_min:>10.2f}x"
        )
    print()
    print(
        "wrapper cost per call, collectives replaced by local copies (one 64-element tensor, min of 7 alternated repeats)"
    )
    print(f"{'operation':<22}{'raw (us)':>11}{'ours (us)':>11}{'overhead (us)':>15}")
    for op, raw_us, ours_us in wrapper_overhead(2000 if args.quick else 20000):
        print(f"{op:<22}{raw_us:>11.2f}{ours_us:>11.2f}{ours_us - raw_us:>15.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
