"""infer_auto_device_map: notebook_accel vs Accelerate (run in its own venv, same machine, same run).

    .venv/bin/python benchmarks/bench_device_map.py [--quick]

Cases: a GPT-like meta model with 192 blocks (~2,116 modules) split 4 ways; 96 blocks (the device-map
widget's slider case); 5,000 / 10,000 / 20,000 leaf Linear modules split 4 ways (linearity). Accelerate is
measured if ``$ACCELERATE_PYTHON`` (or ``.venv-accelerate/bin/python`` in the checkout) exists; the maps are also compared.
Prints the best (min) of several runs per case: the machine is shared, and both sides are measured alike.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from _worker import ACCELERATE_PYTHON, run_worker, worker_source

_WORKER = worker_source(
    ".utils",
    "infer_auto_device_map, compute_module_sizes",
    r"""
import json, statistics, time
from _models import gpt_meta, leaves_meta
out = {}
for case in json.loads(sys.argv[2]):
    kind, n, repeat = case
    model = gpt_meta(n) if kind == "gpt" else leaves_meta(n)
    total = compute_module_sizes(model)[""]
    budget = {i: total // 4 + total // 50 for i in range(4)}
    budget["cpu"] = total
    no_split = ["Block"] if kind == "gpt" else None
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        dm = infer_auto_device_map(model, max_memory=dict(budget), no_split_module_classes=no_split)
        times.append(time.perf_counter() - t)
    out[f"{kind}-{n}"] = {"seconds": min(times), "median": statistics.median(times), "map": {k: str(v) for k, v in dm.items()},
                            "modules": sum(1 for _ in model.modules())}
print("RESULT" + json.dumps(out))
""",
)


def _run(python: str, impl: str, cases: list) -> dict:
    return run_worker(python, _WORKER, impl, json.dumps(cases))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats, skip the 20,000-leaf case")
    args = parser.parse_args()
    fast_repeat, slow_repeat = (5, 1) if args.quick else (21, 3)
    cases = [["gpt", 192, fast_repeat], ["gpt", 96, fast_repeat], ["leaves", 5000, slow_repeat],
             ["leaves", 10000, slow_repeat]]  # fmt: skip
    if not args.quick:
        cases.append(["leaves", 20000, slow_repeat])
    ours = _run(sys.executable, "notebook_accel", cases)
    theirs = _run(ACCELERATE_PYTHON, "accelerate", cases) if os.path.exists(ACCELERATE_PYTHON) else {}
    print(
        f"{'case':<16}{'modules':>9}{'notebook_accel':>16}{'Accelerate':>12}{'speed-up':>10}{'same map':>10}"
    )
    for key, mine in ours.items():
        other = theirs.get(key)
        acc = f"{other['seconds'] * 1000:.1f} ms" if other else "n/a"
        ratio = f"{other['seconds'] / mine['seconds']:.1f}x" if other else "n/a"
        same = ("yes" if other["map"] == mine["map"] else "NO") if other else "n/a"
        print(
            f"{key:<16}{mine['modules']:>9}{mine['seconds'] * 1000:>13.1f} ms{acc:>12}{ratio:>10}{same:>10}"
        )
    leaf = {int(k.split("-")[1]): v["seconds"] for k, v in ours.items() if k.startswith("leaves")}
    if len(leaf) > 1:
        lo, hi = min(leaf), max(leaf)
        print(f"linearity: {hi // lo}x the leaves took {leaf[hi] / leaf[lo]:.2f}x the time")


if __name__ == "__main__":
    time.sleep(0)
    main()
