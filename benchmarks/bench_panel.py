"""The launch panel's model at many ranks: what a line costs it, and what one update of the view reads.

    .venv/bin/python benchmarks/bench_panel.py                 # 16, 128 and 1024 ranks (8 a node)
    .venv/bin/python benchmarks/bench_panel.py --ranks 1024 --lines 200000

No launch: a stand-in of the run's read-only view with N ranks on N/8 nodes feeds the model
(``widgets._launch_model.LaunchModel``, no widgets) lines round robin, as the supervising thread would.
- ``line_us``: one line into the model (its per-rank and merged ``OutputHistory`` stores), and
  ``line_vs_deque``: that over appending the same line to a plain per-rank deque (the panel's store
  before it used ``OutputHistory``). 1024 ranks at 100 lines/s each is 102,400 lines/s: ``line_us``
  times 0.1024 is the share of a core the model takes then.
- ``snapshot_ms``: ``snapshot()``, everything an update shows but the lines (rows, node groups, state,
  bars, texts) from one ``status()``; ``status_html_ms``: its table as HTML; ``merged_ms``: the newest
  500 merged lines, prefixed. Medians of several runs; prints JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
import timeit

from notebook_accel.widgets._launch_model import LaunchModel
from notebook_accel.widgets._launch_render import status_html

from notebook_accel.launch.output import OutputLine
from notebook_accel.launch.ranks import RankStatus


class _Run:
    """The members of the run's read-only view the model reads, for ``n`` running ranks, 8 a node."""

    done, error, hang_report, dropped_lines, live_bar_ranks = False, None, None, 0, None
    attempt, max_restarts, restarting, attempts, metrics = 1, 0, False, [], []

    def __init__(self, n: int) -> None:
        now = time.time()
        self.statuses = [RankStatus(r, 1000 + r, "running", now, node=f"n{r // 8}") for r in range(n)]
        self.num_processes = n
        self.subscribers: list = []

    def status(self) -> list[RankStatus]:
        return [RankStatus(**vars(s)) for s in self.statuses]

    def subscribe(self, callback):  # noqa: ANN001, ANN201
        self.subscribers.append(callback)
        return lambda: None

    def subscribe_events(self, _callback):  # noqa: ANN001, ANN201
        return lambda: None

    def add_done_callback(self, _callback) -> None:  # noqa: ANN001
        return None

    def lines(self, rank=None) -> list:  # noqa: ANN001
        return []

    def bars(self, rank=None, live_only=False) -> list:  # noqa: ANN001
        return []

    def stacks(self) -> dict:
        return {}

    def stop(self) -> None:
        return None

    kill = stop


def _median_ms(fn, repeats: int = 7) -> float:  # noqa: ANN001
    return statistics.median(timeit.repeat(fn, number=1, repeat=repeats)) * 1000


def measure(n: int, count: int) -> dict:
    """Return the figures of one rank count."""
    run = _Run(n)
    model = LaunchModel(run)
    lines = [OutputLine(i % n, "stdout", f"step {i} loss {1 / (i + 1):.4f}", 0.0) for i in range(count)]
    (feed,) = run.subscribers
    start = time.perf_counter()
    for line in lines:
        feed(line)
    model_s = time.perf_counter() - start
    deques = {r: collections.deque(maxlen=model.max_lines) for r in range(n)}
    start = time.perf_counter()
    for line in lines:
        deques[line.rank].append(line)
    deque_s = time.perf_counter() - start
    snap = model.snapshot()
    return {
        "ranks": n,
        "line_us": round(model_s / count * 1e6, 2),
        "line_vs_deque": round(model_s / deque_s, 1),
        "snapshot_ms": round(_median_ms(model.snapshot), 2),
        "status_html_ms": round(_median_ms(lambda: status_html(snap)), 2),
        "merged_ms": round(_median_ms(lambda: model.merged_lines(500)), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 128, 1024])
    parser.add_argument("--lines", type=int, default=100_000)
    args = parser.parse_args()
    print(json.dumps([measure(n, args.lines) for n in args.ranks], indent=1))


if __name__ == "__main__":
    main()
