"""The kernel's side of a launch across many nodes: 128 simulated nodes x 8 ranks (1,024) by default.

    .venv/bin/python benchmarks/bench_nodes_scale.py                       # 128 x 8, 10 s of lines
    .venv/bin/python benchmarks/bench_nodes_scale.py --nodes 16 --seconds 5

The agents are simulated (tests/nodes_sim.py): a few host processes whose agent threads speak the real
kernel<->agent protocol over the real authenticated channel, with ranks that are not processes. So
what is measured is the kernel process alone (its own CPU time, its threads and descriptors), as it
would run against 128 real nodes:

- ``join_start_s``: ``notebook_launcher(nodes=...)`` until every rank has its pid (join + one Start per node);
- ``idle_cpu_pct``: the kernel's CPU (% of one core) over ``--idle`` seconds while 1,024 idle ranks only
  send heartbeats (every 2 s, both ways) and usage figures (when they change), while the hang rule samples
  every rank's stacks every ``min(10, hang_timeout / 10)`` s (their launch function runs);
  ``idle_cpu_no_hang_rule_pct``: the same launch after ``handle.watch_for_hangs(False)``;
  ``idle_nodes_cpu_pct``: the same with the nodes layer alone (``NodeGroup``, no ``LaunchHandle``);
- ``status_ms``: ``handle.status()``, median; ``panel_snapshot_ms``: ``LaunchModel(handle).snapshot()``,
  the panel model's update from the run, median;
- ``threads``, ``fds``: the kernel's threads and open descriptors during the launch, and how many of them
  come per remote rank (``fds_per_rank``; the goal is none: the remote ranks push into one inbox per
  launch, ``launch/inbox.py``, so what is left is about one channel socket per node, 128 / 1,024);
- lines: every rank writes ``--rate`` lines/s (100) for ``--seconds``; ``lines_ok``: all arrived, in order
  per rank; ``lines_cpu_pct``: the kernel's CPU meanwhile; ``lines_late_s``: how long after ``--seconds``
  past the start the last line reached the handle (the simulated ranks count their lines from their
  agent's join, so most are due at once when the ranks start: a burst the kernel drains);
- interactive: ``start_ranks(8, nodes=...)``; ``idle_between_cells_cpu_pct``: the kernel's CPU over ``--idle``
  seconds while the 1,024 ranks wait for a command (heartbeats only: no launch function runs, so the
  hang rule samples no stacks, where ``idle_cpu_pct``'s running launch has every rank's stacks sampled every
  ``min(10, hang_timeout / 10)`` s, 6 s here); ``empty_command_ms``: ``ranks.execute("pass")`` across every
  rank, median of ``--commands`` (goal < 50 ms; ipyparallel reports 311 ms for an empty apply on 100
  engines), wall time, the simulated agents' work on this machine's cores included;
  ``empty_command_kernel_cpu_ms``: the kernel's own CPU per command (what it would cost against real
  nodes); ``interactive_threads`` and ``interactive_fds``.

Prints one JSON object. The machine's load shows in every figure: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from notebook_accel.widgets._launch_model import LaunchModel  # noqa: E402

from notebook_accel import notebook_launcher  # noqa: E402
from notebook_accel.interactive.session import start_ranks  # noqa: E402
from notebook_accel.launch.inbox import RankInbox  # noqa: E402
from notebook_accel.launch.interfaces import WorkerStart  # noqa: E402
from notebook_accel.launch.worker import WorkerSpec  # noqa: E402
from notebook_accel.nodes.remote import NodeGroup, NodeSettings  # noqa: E402
from tests.nodes_sim import SimPlacement, never_called  # noqa: E402


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _median_ms(fn, repeats: int) -> float:  # noqa: ANN001
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return round(statistics.median(samples) * 1000, 2)


def _wait_started(handle, timeout: float = 600.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not all(s.pid for s in handle.status()):
        if handle.done or time.monotonic() > deadline:
            raise RuntimeError(f"the simulated ranks did not all start: {handle.error}")
        time.sleep(0.05)


def idle(nodes: int, per_node: int, seconds: float) -> dict:
    """Join, start, then the kernel's idle CPU, status(), the panel model, threads and descriptors."""
    threads0, fds0 = threading.active_count(), _fds()
    start = time.perf_counter()
    handle = notebook_launcher(
        never_called, num_processes=per_node, nodes=SimPlacement(nodes), block=False, sinks=[]
    )
    try:
        _wait_started(handle)
        out = {"join_start_s": round(time.perf_counter() - start, 2)}
        time.sleep(2.0)  # the start's aftermath (first usage figures) settles
        cpu, wall = _cpu(), time.monotonic()
        time.sleep(seconds)
        out["idle_cpu_pct"] = round((_cpu() - cpu) / (time.monotonic() - wall) * 100, 2)
        handle.watch_for_hangs(False)  # what the hang rule's stack samples cost of that
        cpu, wall = _cpu(), time.monotonic()
        time.sleep(seconds)
        out["idle_cpu_no_hang_rule_pct"] = round((_cpu() - cpu) / (time.monotonic() - wall) * 100, 2)
        ranks = nodes * per_node
        out["threads"], out["fds"] = threading.active_count() - threads0, _fds() - fds0
        out["threads_per_node"] = round(out["threads"] / nodes, 2)
        out["fds_per_rank"] = round(out["fds"] / ranks, 2)
        out["status_ms"] = _median_ms(handle.status, 21)
        model = LaunchModel(handle)
        out["panel_snapshot_ms"] = _median_ms(model.snapshot, 11)
        model.close()
    finally:
        handle.kill()
        handle.wait(120)
    return out


def idle_nodes(nodes: int, per_node: int, seconds: float) -> dict:
    """The kernel's idle CPU with the nodes layer alone: a joined ``NodeGroup`` whose ranks started, no handle."""
    placement = SimPlacement(nodes)
    group = NodeGroup.join(placement, NodeSettings.of(placement.nodes))
    inbox, starts = RankInbox(), []  # the ranks push into it (NodeGroup.pushes): nothing per rank here
    for rank in range(nodes * per_node):
        env = {"NODE_RANK": str(rank // per_node), "RANK": str(rank)}
        spec = WorkerSpec(rank=rank, local_rank=rank % per_node, env=env, num_threads=1, backend="gloo",
                          dry_run_port=None, function=never_called, args=())  # fmt: skip
        starts.append(WorkerStart(spec, None, None, None, inbox))
    procs = []
    try:
        procs = group.start("spawn", starts)
        time.sleep(2.0)
        cpu, wall = _cpu(), time.monotonic()
        time.sleep(seconds)
        return {"idle_nodes_cpu_pct": round((_cpu() - cpu) / (time.monotonic() - wall) * 100, 2)}
    finally:
        group.close()
        for proc in procs:
            proc.close()
        inbox.close()


def lines(nodes: int, per_node: int, rate: float, seconds: float) -> dict:
    """Every rank writes ``rate`` lines/s for ``seconds``: all of them, in order per rank, and the kernel's CPU."""
    ranks = nodes * per_node
    expected, bad = [0] * ranks, set()
    last_line = [0.0]

    def on_line(line) -> None:  # noqa: ANN001
        if line.text != f"r{line.rank} {expected[line.rank]}":
            bad.add(line.rank)
        expected[line.rank] += 1
        last_line[0] = time.monotonic()

    placement = SimPlacement(nodes, rate=rate, seconds=seconds)
    handle = notebook_launcher(never_called, num_processes=per_node, nodes=placement, block=False, sinks=[])
    unsubscribe = handle.subscribe(on_line)
    try:
        _wait_started(handle)
        cpu, wall = _cpu(), time.monotonic()
        handle.wait(seconds + 600)
        cpu_pct = (_cpu() - cpu) / (time.monotonic() - wall) * 100
        # The simulated ranks write their last line ``seconds`` after their agent joined, about ``wall``.
        late = max(0.0, last_line[0] - (wall + seconds))
    finally:
        unsubscribe()
        handle.kill()
        handle.wait(120)
    want = int(rate * seconds)
    return {
        "lines_per_s": round(rate * ranks),
        "lines_ok": not bad and all(n == want for n in expected) and handle.error is None,
        "lines_received": sum(expected),
        "lines_expected": want * ranks,
        "lines_cpu_pct": round(cpu_pct, 1),
        "lines_late_s": round(late, 2),
    }


def interactive(nodes: int, per_node: int, commands: int, idle_seconds: float) -> dict:
    """The kernel's CPU between cells (the ranks wait for a command), then an empty command across every rank."""
    threads0, fds0 = threading.active_count(), _fds()
    start = time.perf_counter()
    ranks = start_ranks(per_node, nodes=SimPlacement(nodes, mode="interactive"), hang_timeout=600)
    try:
        out = {"interactive_start_s": round(time.perf_counter() - start, 2)}
        ranks.execute("pass")  # warm-up
        time.sleep(2.0)
        cpu, wall = _cpu(), time.monotonic()
        time.sleep(idle_seconds)
        out["idle_between_cells_cpu_pct"] = round((_cpu() - cpu) / (time.monotonic() - wall) * 100, 2)
        cpu = _cpu()
        out["empty_command_ms"] = _median_ms(lambda: ranks.execute("pass"), commands)
        # The kernel's own share (the simulated agents share this machine's cores; real ones would not).
        out["empty_command_kernel_cpu_ms"] = round((_cpu() - cpu) / commands * 1000, 1)
        out["interactive_threads"] = threading.active_count() - threads0
        out["interactive_fds"] = _fds() - fds0
    finally:
        ranks.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of idle CPU measured")
    parser.add_argument("--rate", type=float, default=100.0, help="lines a second each rank writes")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long the ranks write lines")
    parser.add_argument("--commands", type=int, default=11, help="empty commands timed")
    parser.add_argument("--skip", nargs="*", default=[], choices=["idle", "lines", "interactive"])
    args = parser.parse_args()
    figures = {"nodes": args.nodes, "ranks": args.nodes * args.per_node, "cpus": os.cpu_count(),
               "load": round(os.getloadavg()[0], 1)}  # fmt: skip
    try:
        if "idle" not in args.skip:
            figures.update(idle(args.nodes, args.per_node, args.idle))
            figures.update(idle_nodes(args.nodes, args.per_node, args.idle))
        if "lines" not in args.skip:
            figures.update(lines(args.nodes, args.per_node, args.rate, args.seconds))
        # Whatever cyclic garbage the lines phase left is collected here, not during the commands. (Its ended
        # launch, 512,000 lines of history, sat in reference cycles until a full collection, which cost 1.2 s
        # of CPU during the commands; since 2026-11-29 a dropped launch is freed at once.)
        gc.collect()
        if "interactive" not in args.skip:
            figures.update(interactive(args.nodes, args.per_node, args.commands, args.idle))
    finally:  # what was measured, even when a later part failed
        print(json.dumps(figures, indent=1), flush=True)


if __name__ == "__main__":
    main()
