"""What the stuck-rank doctor costs a launch that does not hang: silent ranks, with and without hang detection.

    .venv/bin/python benchmarks/bench_doctor.py [--seconds 20] [--rounds 3]

Two CPU ranks run a matmul loop for a fixed time and print nothing (the case in which the launcher
samples stacks: once a rank has been silent for hang_timeout / 10, once a second), then all-reduce
their iteration counts. Each round runs the same launch with ``hang_timeout=math.inf`` (detection
off) and with ``hang_timeout=10`` (sampling starts after 1 s of silence: about one stack dump per rank
per second for the whole run), interleaved, so that other load on the machine hits both alike. The
figure is the ratio of iterations per second (1.00 = no cost), and how many dumps were taken.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from notebook_accel.launch import doctor  # noqa: E402
from notebook_accel.launchers import notebook_launcher  # noqa: E402


def _work(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    a = torch.randn(128, 128)
    done, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            a = torch.tanh(a @ a)
        done += 20
    total = torch.tensor([float(done)])
    dist.all_reduce(total)
    dist.destroy_process_group()
    return total.item() / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dumps = []
    original = doctor.StackCollector.collect

    def counting(self, targets):
        dumps.append(len(targets))
        return original(self, targets)

    doctor.StackCollector.collect = counting
    off, on = [], []
    for _ in range(args.rounds):
        off.append(
            notebook_launcher(_work, (args.seconds,), num_processes=2, sinks=[], hang_timeout=math.inf)[0]
        )
        before = len(dumps)
        on.append(notebook_launcher(_work, (args.seconds,), num_processes=2, sinks=[], hang_timeout=10.0)[0])
        per_launch = len(dumps) - before
    ratio = statistics.median(o / f for o, f in zip(on, off))
    print(f"load average: {os.getloadavg()}")
    print(f"iterations/s, detection off: {[round(x) for x in off]}")
    print(f"iterations/s, detection on (hang_timeout=10): {[round(x) for x in on]}")
    print(f"stack samples per launch with detection on: {per_launch} (each asks every live rank once)")
    print(f"median ratio on/off: {ratio:.3f}")


if __name__ == "__main__":
    main()
