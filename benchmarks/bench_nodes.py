"""Several machines: 2 nodes x 2 ranks on the namespace cluster, side by side with ``srun torchrun`` per node.

    sudo .venv/bin/python benchmarks/bench_nodes.py            # 5 rounds of each figure
    sudo .venv/bin/python benchmarks/bench_nodes.py --rounds 3

Builds the namespace cluster of tests/ns_cluster.py (root, ip netns, slurm-wlm, munge, openssh-server),
takes a 2-node allocation, then measures, interleaved round by round so that load from other programs
hits both columns alike:

- launch to first result: ``notebook_launcher(f, num_processes=2, nodes="slurm:<job>")`` until it returns
  (f: init the gloo group through PartialState, all_reduce a scalar, return it), against the same work
  started by hand as one ``srun --overlap -w nK torchrun --nnodes 2 --nproc-per-node 2`` per node until both
  exit (goal: ours <= 1.0x);
- all_reduce of 64 MB (16 M float32, gloo over the bridge), mean of 10 after 2 warm-ups, in each (<= 1.05x);
- 100,000 lines printed by every rank: do all 400,000 arrive, each rank's in order, and how long;
- an empty interactive cell across the nodes (``start_ranks(2, nodes=...)``, ``%%ranks`` of ``pass``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.ns_cluster import NsCluster, unavailable_reason  # noqa: E402

MB64 = 16 * 1024 * 1024  # float32 elements
LINES = 100_000

# What torchrun runs on each node: the same work as the launched functions below.
_TORCHRUN_SCRIPT = f"""
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
mode = sys.argv[1]
if mode == "first":
    t = torch.ones(1); dist.all_reduce(t)
    if dist.get_rank() == 0:
        print("RESULT", t.item(), flush=True)
else:
    x = torch.ones({MB64})
    for _ in range(2):
        dist.all_reduce(x)
    dist.barrier(); start = time.perf_counter()
    for _ in range(10):
        dist.all_reduce(x)
    elapsed = (time.perf_counter() - start) / 10
    if dist.get_rank() == 0:
        print("RESULT", elapsed, flush=True)
dist.destroy_process_group()
"""


def first_result() -> float:
    """Return the sum of a scalar all_reduce over the launch's ranks (through PartialState's group)."""
    import torch
    import torch.distributed as dist

    from notebook_accel import PartialState

    PartialState()
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def all_reduce_64mb() -> float:
    """Return the mean seconds of 10 all_reduces of 64 MB after 2 warm-ups."""
    import torch
    import torch.distributed as dist

    from notebook_accel import PartialState

    PartialState()
    x = torch.ones(MB64)
    for _ in range(2):
        dist.all_reduce(x)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(10):
        dist.all_reduce(x)
    return (time.perf_counter() - start) / 10


def many_lines(n: int) -> int:
    """Print ``n`` numbered lines; return how many."""
    rank = int(os.environ["RANK"])
    for i in range(n):
        print(f"{rank} {i}")
    return n


def torchrun(cluster: NsCluster, job_id: str, script: Path, mode: str) -> tuple[float, str]:
    """Return (wall seconds, rank 0's RESULT) of one ``srun torchrun`` per node, started at once by hand."""
    port = 29400 + (os.getpid() + int(time.time())) % 500
    master = cluster.addresses[cluster.nodes[0]]
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            [
                "srun",
                "--jobid",
                job_id,
                "-N",
                "1",
                "-n",
                "1",
                "-w",
                node,
                "--overlap",
                "--quiet",
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--node-rank",
                str(rank),
                "--master-addr",
                master,
                "--master-port",
                str(port),
                str(script),
                mode,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank, node in enumerate(cluster.nodes)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    elapsed = time.perf_counter() - start
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"srun torchrun failed ({p.returncode}): {err[-2000:]}")
    result = next(
        line.split()[1] for out, _ in outs for line in out.splitlines() if line.startswith("RESULT")
    )
    return elapsed, result


def ours(job_id: str, function, *args) -> tuple[float, list]:
    """Return (wall seconds, per-rank results) of ``notebook_launcher`` over the allocation's 2 nodes."""
    from notebook_accel import Nodes, notebook_launcher

    start = time.perf_counter()
    results = notebook_launcher(
        function, args, num_processes=2, nodes=Nodes(engine="slurm", job_id=job_id), sinks=[]
    )
    return time.perf_counter() - start, results


def lines_check(job_id: str) -> str:
    """Return a line saying whether every rank's 100,000 lines arrived, in order, and how fast."""
    from notebook_accel import Nodes, notebook_launcher

    got: dict[int, list[str]] = {}

    def sink(line) -> None:
        got.setdefault(line.rank, []).append(line.text)

    start = time.perf_counter()
    notebook_launcher(
        many_lines, (LINES,), num_processes=2, nodes=Nodes(engine="slurm", job_id=job_id), sinks=[sink]
    )
    elapsed = time.perf_counter() - start
    complete = all(
        [text.strip() for text in got.get(rank, [])] == [f"{rank} {i}" for i in range(LINES)]
        for rank in range(4)
    )
    counts = {rank: len(texts) for rank, texts in sorted(got.items())}
    return f"{LINES:,} lines x 4 ranks: {'all arrived, in order' if complete else 'MISSING/OUT OF ORDER'} {counts} in {elapsed:.2f} s"


def interactive_cell(job_id: str, rounds: int) -> str:
    """Return the median wall time of an empty ``%%ranks`` cell over 2 nodes x 2 ranks, or why not measured."""
    try:
        from notebook_accel import Nodes, start_ranks

        ranks = start_ranks(2, nodes=Nodes(engine="slurm", job_id=job_id))
    except TypeError as error:  # start_ranks without nodes=: interactive ranks across nodes have not landed
        return f"not measured: start_ranks(2, nodes=...) is not available here ({error})"
    try:
        ranks.execute("pass")
        times = []
        for _ in range(max(20, rounds)):
            start = time.perf_counter()
            ranks.execute("pass")
            times.append(time.perf_counter() - start)
        return f"{statistics.median(times) * 1000:.2f} ms median of {len(times)} (min {min(times) * 1000:.2f} ms)"
    finally:
        ranks.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each figure (default 5)")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        sys.exit(f"cannot build the namespace cluster: {reason}")
    with NsCluster(2) as cluster:
        job_id = cluster.allocate()
        script = cluster.root / "torchrun_job.py"
        script.write_text(_TORCHRUN_SCRIPT)
        ours(job_id, first_result)  # warm-up: imports, the page cache
        torchrun(cluster, job_id, script, "first")
        launch = {"ours": [], "torchrun": []}
        reduce = {"ours": [], "torchrun": []}
        for _ in range(args.rounds):
            launch["ours"].append(ours(job_id, first_result)[0])
            launch["torchrun"].append(torchrun(cluster, job_id, script, "first")[0])
        for _ in range(max(1, args.rounds // 2)):
            reduce["ours"].append(max(ours(job_id, all_reduce_64mb)[1]))
            reduce["torchrun"].append(float(torchrun(cluster, job_id, script, "allreduce")[1]))
        print(
            f"2 nodes x 2 ranks (network namespaces on one machine, {os.cpu_count()} CPU cores), gloo over a bridge"
        )
        for name, figures, goal in (
            ("launch to first result", launch, 1.0),
            ("all_reduce 64 MB", reduce, 1.05),
        ):
            a, b = statistics.median(figures["ours"]), statistics.median(figures["torchrun"])
            print(
                f"{name:24} ours {a:8.3f} s   srun torchrun {b:8.3f} s   ratio {a / b:5.2f}x (goal <= {goal}x)"
            )
        print(lines_check(job_id))
        print(f"empty interactive cell: {interactive_cell(job_id, args.rounds)}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
