"""Collapsing identical lines at scale: 1,024 simulated ranks at 100 lines per second each, into the cell's sink.

    .venv/bin/python benchmarks/bench_collapse.py                    # 1,024 ranks, 5 s of output
    .venv/bin/python benchmarks/bench_collapse.py --ranks 128 --seconds 2 --realtime 3

Every rank prints one line every 10 ms (100 lines/s, 102,400 lines/s in all): on even ticks the line
every rank prints alike (``step N loss X``, read up to ``--jitter`` ms apart, as ranks leaving a
collective are), on odd ticks a line of its own: rank 0 a line only it prints (``saved checkpoint N``),
every other rank a line whose text differs per rank (``rank R: N samples/s``).

"simulated": the lines are fed to ``launch.collapse.Collapser`` in arrival order on a simulated clock
(the delays are the rule's, independent of this machine's speed). "cpu_us_per_line" is the process CPU
time of that feeding divided by the lines fed: alone (nothing printed), through a ``PrintSink`` writing
to /dev/null, and, as the reference, a plain ``PrintSink`` printing every line (``collapse_output=False``).
The "added delay" of a line is when it was printed minus when it was read, per kind (median, 99th
percentile, max), and the same after the first second: the first lines of each kind wait up to the
window before the collapser knows their shape; after that a shared line waits for the last rank to
print it (the jitter) and a line of one rank only for its rank's shared line before it.
"--realtime S": the launch's real sink (``CollapsingPrinter``, its timer thread, the monotonic clock)
fed at the real rate for S seconds from one thread; its delays include this machine's scheduling.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import time

from notebook_accel.launch.collapse import DEFAULT_WINDOW, Collapser, CollapsingPrinter
from notebook_accel.launch.output import OutputLine, PrintSink

_KINDS = ("shared", "one rank's own", "different per rank")


def _schedule(ranks: int, seconds: float, jitter_ms: float, seed: int) -> list[tuple[float, int, str, str]]:
    """Return (time, rank, kind, text) of every line, in arrival order."""
    rng = random.Random(seed)
    events = []
    for tick in range(int(seconds * 100)):
        start = tick / 100
        shared = tick % 2 == 0
        loss = rng.random()
        for rank in range(ranks):
            at = start + rng.random() * jitter_ms / 1000
            if shared:
                events.append((at, rank, _KINDS[0], f"step {tick // 2} loss {loss:.4f}"))
            elif rank == 0:
                events.append((at, rank, _KINDS[1], f"saved checkpoint {tick // 2}"))
            else:
                events.append((at, rank, _KINDS[2], f"rank {rank}: {rng.randint(900, 1100)} samples/s"))
    events.sort()
    return events


class _Delays:
    """Record, per kind, how long each rank's copy of a line waited between read and print."""

    def __init__(self, ranks: int, start: float = 0.0) -> None:
        self.waiting: list[collections.deque[tuple[float, str]]] = [collections.deque() for _ in range(ranks)]
        self.delays: dict[str, list[tuple[float, float]]] = {kind: [] for kind in _KINDS}
        self.start = start  # the clock's reading at the first line
        self.printed = 0

    def read(self, rank: int, at: float, kind: str) -> None:
        self.waiting[rank].append((at, kind))

    def shown(self, ranks: tuple[int, ...], now: float) -> None:
        self.printed += 1
        for rank in ranks:
            at, kind = self.waiting[rank].popleft()
            self.delays[kind].append((at - self.start, now - at))

    def summary(self) -> dict:
        """Return per kind: median, 99th percentile and max of the delays, and of those after the first second."""
        out = {}
        for kind, pairs in self.delays.items():
            out[kind] = {"lines": len(pairs), **_stats(d for _, d in pairs)}
            out[kind]["after_the_first_s"] = _stats(d for at, d in pairs if at >= 1.0)
        return out


def _stats(delays) -> dict:  # noqa: ANN001 - any iterable of seconds
    d = sorted(delays)
    if not d:
        return {}
    ms = [round(x * 1000, 2) for x in (statistics.median(d), d[int(len(d) * 0.99)], d[-1])]
    return dict(zip(("median_ms", "p99_ms", "max_ms"), ms))


def _simulated(events: list, ranks: int, window: float) -> dict:
    delays = _Delays(ranks)
    clock = [0.0]
    collapser = Collapser(range(ranks), window, lambda line, shown: delays.shown(shown, clock[0]))
    lines = [(at, OutputLine(rank, "stdout", text, at), kind) for at, rank, kind, text in events]
    for at, line, kind in lines:
        delays.read(line.rank, at, kind)
    cpu = time.process_time()
    for at, line, _ in lines:
        clock[0] = at
        collapser.feed(line, at)
    collapser.flush()
    cpu = time.process_time() - cpu
    return {
        "cpu_us_per_line": round(cpu / len(lines) * 1e6, 2),
        "lines_read": len(lines),
        "lines_printed": delays.printed,
        "added_delay": delays.summary(),
    }


def _printing_cpu(events: list, ranks: int, window: float | None) -> float:
    """Return the CPU microseconds per line of a PrintSink to /dev/null, collapsing or not."""
    with open(os.devnull, "w") as null:
        printer = PrintSink(stdout=null, num_processes=ranks)
        lines = [(at, OutputLine(rank, "stdout", text, at)) for at, rank, _, text in events]
        cpu = time.process_time()
        if window is None:
            for _, line in lines:
                printer.write(line)
        else:
            collapser = Collapser(range(ranks), window, printer.write)
            for at, line in lines:
                collapser.feed(line, at)
            collapser.flush()
        return (time.process_time() - cpu) / len(lines) * 1e6


class _TimedSink(PrintSink):
    """A PrintSink noting when each line is printed (from whichever thread prints it)."""

    def __init__(self, delays: _Delays, **kwargs) -> None:
        super().__init__(**kwargs)
        self.delays = delays

    def write(self, line: OutputLine, ranks: tuple[int, ...] = ()) -> None:
        self.delays.shown(tuple(ranks) or (line.rank,), time.monotonic())
        super().write(line, ranks)


def _realtime(events: list, ranks: int, window: float, seconds: float) -> dict:
    """Feed the launch's real sink at the real rate; return the delays and the CPU it took."""
    delays = _Delays(ranks)
    events = [e for e in events if e[0] < seconds]
    with open(os.devnull, "w") as null:
        sink = CollapsingPrinter(_TimedSink(delays, stdout=null, num_processes=ranks), range(ranks), window)
        behind = 0.0
        cpu = time.process_time()
        start = delays.start = time.monotonic()
        for at, rank, kind, text in events:
            late = start + at - time.monotonic()
            if late > 0:
                time.sleep(late)
            else:
                behind = max(behind, -late)
            now = time.monotonic()
            delays.read(rank, now, kind)
            sink(OutputLine(rank, "stdout", text, now))
        sink.close()
        cpu = time.process_time() - cpu
    return {
        "seconds": seconds,
        "lines_read": len(events),
        "cpu_percent_of_one_core": round(cpu / seconds * 100, 1),
        "feeder_fell_behind_ms": round(behind * 1000, 1),
        "added_delay": delays.summary(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=5.0, help="simulated seconds of output")
    parser.add_argument(
        "--jitter", type=float, default=20.0, help="ms over which the ranks print a shared line"
    )
    parser.add_argument("--window", type=float, default=DEFAULT_WINDOW)
    parser.add_argument("--realtime", type=float, default=0.0, help="also feed the real sink for this many s")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    load_before = os.getloadavg()
    events = _schedule(args.ranks, args.seconds, args.jitter, args.seed)
    result = {
        "ranks": args.ranks,
        "lines_per_s_per_rank": 100,
        "window_s": args.window,
        "jitter_ms": args.jitter,
        "simulated": _simulated(events, args.ranks, args.window),
    }
    collapsed = _printing_cpu(events, args.ranks, args.window)
    plain = _printing_cpu(events, args.ranks, None)
    result["printing_cpu_us_per_line"] = {
        "collapsed": round(collapsed, 2),
        "every_line_printed": round(plain, 2),
        "ratio_collapsed_over_every_line": round(collapsed / plain, 2),
    }
    if args.realtime:
        result["realtime"] = _realtime(events, args.ranks, args.window, args.realtime)
    result["loadavg_before"] = [round(x, 2) for x in load_before]
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
