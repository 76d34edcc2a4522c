"""Cost of live progress bars: a 10,000-step loop with a tqdm bar on 2 workers, with the panel versus without.

    .venv/bin/python benchmarks/bench_progress.py              # 5 rounds, 10,000 steps
    .venv/bin/python benchmarks/bench_progress.py --rounds 9 --steps 20000

Each worker times its own loop (``for _ in tqdm(range(steps))`` doing a small matmul per step), in
wall time and in CPU time (``time.process_time``: what the loop itself costs, much less disturbed by
other processes on a busy machine), and returns both; the figures are medians over rounds of the
slower rank's loop.
Three settings run interleaved, round after round, in this one process:

- ``no bar``: the same loop without tqdm (the floor);
- ``text``: ``progress_bars="text"``, tqdm writes its ``\\r`` redraws to the worker's stderr pipe and
  the launcher cuts them into lines (the behaviour without a panel, and before events existed);
- ``events``: ``progress_bars="main"`` without a panel: bars travel as events on the result pipe
  (the workers' side of the cost alone);
- ``panel``: the same plus a built ``LaunchPanel`` view, which updates its ipywidgets bar (throttled)
  in this process.

``launcher_cpu_s`` is this process's CPU time during each launch (what the launcher and the panel
take from the cores the workers run on).

The goal of the events is ``panel / text <= 1.03``. Prints JSON with the medians (wall and CPU) and the
load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from notebook_accel.widgets import LaunchPanel

from notebook_accel import notebook_launcher


def _loop(steps: int, with_bar: bool) -> tuple[float, float]:
    import time as _time

    import torch
    from tqdm.auto import tqdm

    torch.set_num_threads(1)
    a = torch.randn(32, 32)
    iterator = tqdm(range(steps), desc="bench") if with_bar else range(steps)
    start, cpu = _time.perf_counter(), _time.process_time()
    for _ in iterator:
        a = torch.tanh(a @ a)  # a small step: a few microseconds, so the bar's own cost shows
    return _time.perf_counter() - start, _time.process_time() - cpu


def _run(setting: str, steps: int) -> tuple[float, float, float]:
    with_bar = setting != "no bar"
    bars = "main" if setting in ("events", "panel") else "text"
    cpu = sum(os.times()[:2])
    handle = notebook_launcher(
        _loop, (steps, with_bar), num_processes=2, block=False, sinks=[], progress_bars=bars
    )
    panel = None
    if setting == "panel":
        panel = LaunchPanel(handle, interval=0.2)
        panel.widget  # noqa: B018 - build the ipywidgets view: its updates are part of the cost
    times = handle.result(timeout=600)
    if panel is not None:
        assert panel.bars() and panel.bars()[0].n == steps, "the panel never saw the bar reach the end"
        panel.close()
    return max(t[0] for t in times), max(t[1] for t in times), sum(os.times()[:2]) - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    settings = ["no bar", "text", "events", "panel"]
    _run("text", 200)  # warm-up: imports, first fork
    samples: dict[str, list[float]] = {s: [] for s in settings}
    loop_cpu: dict[str, list[float]] = {s: [] for s in settings}
    cpu: dict[str, list[float]] = {s: [] for s in settings}
    load_before = os.getloadavg()
    started = time.perf_counter()
    for i in range(args.rounds):
        # Rotate the order each round so that no setting always runs first (or last).
        for setting in settings[i % len(settings) :] + settings[: i % len(settings)]:
            loop, worker_cpu, launcher_cpu = _run(setting, args.steps)
            samples[setting].append(loop)
            loop_cpu[setting].append(worker_cpu)
            cpu[setting].append(launcher_cpu)
    medians = {s: statistics.median(v) for s, v in samples.items()}
    cpu_medians = {s: statistics.median(v) for s, v in loop_cpu.items()}
    print(
        json.dumps(
            {
                "steps": args.steps,
                "rounds": args.rounds,
                "median_loop_s": {s: round(m, 4) for s, m in medians.items()},
                "samples_s": {s: [round(x, 4) for x in v] for s, v in samples.items()},
                "median_loop_cpu_s": {s: round(m, 4) for s, m in cpu_medians.items()},
                "cpu_panel_over_text": round(cpu_medians["panel"] / cpu_medians["text"], 4),
                "cpu_events_over_text": round(cpu_medians["events"] / cpu_medians["text"], 4),
                "launcher_cpu_s": {s: round(statistics.median(v), 3) for s, v in cpu.items()},
                "panel_over_text": round(medians["panel"] / medians["text"], 4),
                "events_over_text": round(medians["events"] / medians["text"], 4),
                "text_over_no_bar": round(medians["text"] / medians["no bar"], 4),
                "panel_over_no_bar": round(medians["panel"] / medians["no bar"], 4),
                "wall_s": round(time.perf_counter() - started, 1),
                "loadavg_before": [round(x, 2) for x in load_before],
                "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
