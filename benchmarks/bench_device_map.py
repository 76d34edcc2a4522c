"""infer_auto_device_map: notebook_accel vs Accelerate (run in its own venv, same machine, same run).

    .venv/bin/python benchmarks/bench_device_map.py [--quick]

Cases: a GPT-like meta model with 192 blocks (~2,116 modules) split 4 ways; 96 blocks (the device-map
widget's slider case); 5,000 / 10,000 / 20,000 leaf Linear modules split 4 ways (linearity). Accelerate is
measured if /work/.venv-accelerate/bin/python (or $ACCELERATE_PYTHON) exists; the maps are also compared.
Prints the best (min) of several runs per case: the machine is shared, and both sides are measured alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ACCELERATE_PYTHON = os.environ.get("ACCELERATE_PYTHON", "/work/.venv-accelerate/bin/python")

# Run as "worker <impl> <json cases>": time one implementation in this process, print JSON.
_WORKER = r"""
import json, statistics, sys, time
sys.path.insert(0, {here!r})
import torch
torch.set_num_threads(1)
from _models import gpt_meta, leaves_meta
impl = sys.argv[1]
if impl == "accelerate":
    from accelerate.utils import infer_auto_device_map, compute_module_sizes
else:
    sys.path.insert(0, {root!r})
    from notebook_accel.utils import infer_auto_device_map, compute_module_sizes
import logging, warnings
logging.disable(logging.WARNING); warnings.simplefilter("ignore")
out = {{}}
for case in json.loads(sys.argv[2]):
    kind, n, repeat = case
    model = gpt_meta(n) if kind == "gpt" else leaves_meta(n)
    total = compute_module_sizes(model)[""]
    budget = {{i: total // 4 + total // 50 for i in range(4)}}
    budget["cpu"] = total
    no_split = ["Block"] if kind == "gpt" else None
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        dm = infer_auto_device_map(model, max_memory=dict(budget), no_split_module_classes=no_split)
        times.append(time.perf_counter() - t)
    out[f"{{kind}}-{{n}}"] = {{"seconds": min(times), "median": statistics.median(times), "map": {{k: str(v) for k, v in dm.items()}},
                            "modules": sum(1 for _ in model.modules())}}
print("RESULT" + json.dumps(out))
"""


def _run(python: str, impl: str, cases: list) -> dict:
    code = _WORKER.format(here=HERE, root=ROOT)
    proc = subprocess.run(
        [python, "-c", code, impl, json.dumps(cases)],
        capture_output=True,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{impl} benchmark failed:\n{proc.stderr[-3000:]}")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


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
