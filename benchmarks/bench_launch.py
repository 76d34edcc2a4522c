"""Wall time of a 2-process CPU launch, side by side with the fork floor (and Accelerate if present).

    .venv/bin/python benchmarks/bench_launch.py            # 15 launches each, + kernel, + Accelerate
    .venv/bin/python benchmarks/bench_launch.py --quick    # 10 launches, no kernel

The launched function initialises the state (PartialState()), all-reduces a small tensor and returns.
"fork floor" forks 2 processes that exit at once (os.fork + waitpid), in the same run. Accelerate's
notebook_launcher runs in /work/.venv-accelerate (a separate venv, never a dependency) when present.
Everything runs on the CPU with gloo; the medians are over repeated launches after one warm-up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import textwrap
from pathlib import Path

ACCEL_PY = Path("/work/.venv-accelerate/bin/python")

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

def _measure(n):
    # Interleaved, so that load from other programs on the machine hits both columns alike.
    times, floors, seen = [], [], None
    for i in range(n + 1):
        start = time.perf_counter()
        _floor()
        floor = time.perf_counter() - start
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            out = notebook_launcher(work, num_processes=2)
        if i:  # the first launch warms imports up
            times.append(time.perf_counter() - start)
            floors.append(floor)
        seen = out
    return times, floors, seen
"""


def ours(n: int) -> tuple[list[float], list[float], object]:
    namespace: dict = {}
    exec(_TIMING_CODE.format(lib="notebook_accel"), namespace)
    return namespace["_measure"](n)


def accelerate(n: int) -> tuple[list[float], list[float], object] | None:
    if not ACCEL_PY.exists():
        return None
    code = _TIMING_CODE.format(lib="accelerate") + f"\nprint('JSON', json.dumps(_measure({n})))\n"
    proc = subprocess.run([str(ACCEL_PY), "-c", code], capture_output=True, text=True, timeout=600)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON ")]
    if not line:
        print(f"(Accelerate run failed: {proc.stderr.strip().splitlines()[-1:]})")
        return None
    return tuple(json.loads(line[0][5:]))


def in_kernel(n: int) -> tuple[list[float], list[float], object] | None:
    try:
        import jupyter_client
    except ImportError:
        return None
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel(extra_arguments=["--HistoryManager.enabled=False"])
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        out: list[str] = []
        code = _TIMING_CODE.format(lib="notebook_accel") + f"\nprint('JSON', json.dumps(_measure({n})))\n"

        def hook(msg):
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])

        kc.execute_interactive(textwrap.dedent(code), timeout=600, output_hook=hook)
        line = [ln for ln in "".join(out).splitlines() if ln.startswith("JSON ")]
        return tuple(json.loads(line[0][5:])) if line else None
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


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
    print(f"{'variant':38} {'launch s':>9} {'floor s':>8} {'x floor':>8}  returned")
    for name, res in results:
        if res is None:
            print(f"{name:38} {'n/a':>9}")
            continue
        times, floors, seen = res
        med, floor = statistics.median(times), statistics.median(floors)
        print(f"{name:38} {med:9.4f} {floor:8.4f} {med / floor:8.2f}  {seen}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
