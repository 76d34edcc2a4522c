"""Wall time of a 2-process CPU launch, side by side with the fork floor (and Accelerate if present).

    .venv/bin/python benchmarks/bench_launch.py            # 15 launches each, + kernel, + Accelerate
    .venv/bin/python benchmarks/bench_launch.py --quick    # 10 launches, no kernel

The launched function initialises the state (PartialState()), all-reduces a small tensor and returns.
"fork floor" forks 2 processes that exit at once (os.fork + waitpid), "mp floor" does the same with
multiprocessing fork Processes; both are measured interleaved with the launches, in the same process. Accelerate's
notebook_launcher runs in the Accelerate venv (``$ACCELERATE_PYTHON`` or ``.venv-accelerate``: benchmarks/README.md)
when present.
Everything runs on the CPU with gloo; the medians are over repeated launches after one warm-up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

from _worker import ACCELERATE_PYTHON, ROOT

ACCEL_PY = Path(ACCELERATE_PYTHON)

# The same source runs here, in a kernel and under Accelerate (``LIB`` names the package).
_TIMING_CODE = """
import contextlib, io, json, os, time, statistics
import torch, torch.distributed as dist
from {lib} import notebook_launcher, PartialState

def work():
    state = PartialState()
    t = torch.ones(4)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return state.num_processes, t[0].item()

PORT = {port}

def noop():
    return None

def _floor():
    # 2 processes forked from this same process, exiting at once: the cost no launcher can avoid.
    pids = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)

def _mp_floor():
    # The same with multiprocessing's fork Processes (what Accelerate's launcher builds on).
    import multiprocessing as mp
    procs = [mp.get_context("fork").Process(target=os._exit, args=(0,)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()

def _measure(n):
    # Interleaved, so that load from other programs on the machine hits both columns alike.
    times, floors, mp_floors, noops, seen = [], [], [], [], None
    for i in range(n + 1):
        start = time.perf_counter()
        _floor()
        floor = time.perf_counter() - start
        start = time.perf_counter()
        _mp_floor()
        mp_floor = time.perf_counter() - start
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            out = notebook_launcher(work, num_processes=2, **PORT)
        elapsed = time.perf_counter() - start
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            notebook_launcher(noop, num_processes=2, **PORT)
        noop_time = time.perf_counter() - start
        if i:  # the first launch warms imports up
            times.append(elapsed)
            noops.append(noop_time)
            floors.append(floor)
            mp_floors.append(mp_floor)
        seen = out
    return times, floors, mp_floors, noops, seen
"""


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _best(values: list[float]) -> float:
    """Return the mean of the fastest quarter (at least one) of ``values``."""
    k = max(1, len(values) // 4)
    return statistics.fmean(sorted(values)[:k])


def ours(n: int) -> tuple:
    namespace: dict = {}
    exec(_TIMING_CODE.format(lib="notebook_accel", port={}), namespace)
    return namespace["_measure"](n)


def accelerate(n: int) -> tuple | None:
    if not ACCEL_PY.exists():
        return None
    # Accelerate's port is fixed (29500 unless given): give it a free one, or a busy 29500 fails it.
    port = {"use_port": str(_free_port())}
    code = _TIMING_CODE.format(lib="accelerate", port=port) + f"\nprint('JSON', json.dumps(_measure({n})))\n"
    proc = subprocess.run([str(ACCEL_PY), "-c", code], capture_output=True, text=True, timeout=600)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON ")]
    if not line:
        print(f"(Accelerate run failed: {proc.stderr.strip().splitlines()[-1:]})")
        return None
    return tuple(json.loads(line[0][5:]))


def in_kernel(n: int) -> tuple | None:
    try:
        import jupyter_client  # noqa: F401
    except ImportError:
        return None
    sys.path.insert(0, ROOT)
    from tests.launcher_helpers import StartedKernel

    kernel = StartedKernel()
    try:
        code = (
            _TIMING_CODE.format(lib="notebook_accel", port={})
            + f"\nprint('JSON', json.dumps(_measure({n})))\n"
        )
        messages = kernel.cell(textwrap.dedent(code), timeout=600)
        out = [m["content"]["text"] for m in messages if m["msg_type"] == "stream"]
        line = [ln for ln in "".join(out).splitlines() if ln.startswith("JSON ")]
        return tuple(json.loads(line[0][5:])) if line else None
    finally:
        kernel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 launches, skip the kernel run")
    parser.add_argument("-n", type=int, default=None, help="launches per variant (default 15, quick 10)")
    args = parser.parse_args()
    n = args.n or (10 if args.quick else 15)
    import torch

    torch.set_num_threads(1)
    results = [("notebook_accel.notebook_launcher", ours(n))]
    if not args.quick:
        results.append(("notebook_accel, from an ipykernel", in_kernel(n)))
    results.append(("accelerate.notebook_launcher (1.15)", accelerate(n)))
    print(f"median of {n} launches, 2 CPU workers (PartialState + all_reduce), {os.cpu_count()} CPU cores")
    print("fork floor: 2 x fork + exit + waitpid from the same process, interleaved with the launches")
    print("mp floor: the same with 2 multiprocessing fork Processes (start + join), also interleaved")
    print("best: the fastest quarter of the rounds (robust when other programs load the machine)")
    head = f"{'variant':36} {'median s':>9} {'floor':>7} {'mp floor':>8} {'x floor':>7} {'x mp':>5}"
    print(head + f" {'best s':>7} {'x floor':>7} {'x mp':>5}  returned")
    for name, res in results:
        if res is None:
            print(f"{name:36} {'n/a':>9}")
            continue
        times, floors, mp_floors, noops, seen = res
        med, floor, mp_floor = (statistics.median(v) for v in (times, floors, mp_floors))
        best, best_floor, best_mp = (_best(v) for v in (times, floors, mp_floors))
        print(
            f"{name:36} {med:9.4f} {floor:7.4f} {mp_floor:8.4f} {med / floor:7.2f} {med / mp_floor:5.2f} "
            f"{best:7.4f} {best / best_floor:7.2f} {best / best_mp:5.2f}  {seen}"
        )
        nmed = statistics.median(noops)
        print(
            f"{'  same, function returning None':36} {nmed:9.4f} {'':7} {'':8} {nmed / floor:7.2f} "
            f"{nmed / mp_floor:5.2f} {_best(noops):7.4f} {_best(noops) / best_floor:7.2f} {_best(noops) / best_mp:5.2f}"
        )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
