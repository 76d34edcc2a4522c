"""What importing the public entry points costs on top of torch, from ``python -X importtime``.

    .venv/bin/python benchmarks/bench_import.py [--runs 5]

Each statement runs ``--runs`` times in a fresh interpreter as
``python -X importtime -c "import torch; <statement>"``. torch is imported first so that its own
cost (seconds, and the same for every statement) is booked on the ``torch`` line; the figure is the
sum of the cumulative times of every other top-level import, i.e. what the statement adds on top of
torch (our modules, safetensors, and whatever heavy library they drag in). The median of the runs is
reported, with the modules that should not be on the path (the process state, sympy, FSDP) when the
statement loaded them. Runs of all statements are interleaved so that other load hits them alike;
note the load average printed at the top and bottom.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

STATEMENTS = (
    "import notebook_accel",
    "import notebook_accel.utils",
    "from notebook_accel import load_checkpoint_and_dispatch",
    "from notebook_accel import init_empty_weights",
    "from notebook_accel import dispatch_model",
    "from notebook_accel import infer_auto_device_map",
    "from notebook_accel import cpu_offload, disk_offload",
    "from notebook_accel import Accelerator",
)
# Loaded by the big-model path only through a chain that does not belong there.
WATCHED = ("notebook_accel.state", "sympy", "torch.distributed.fsdp")


def _run(statement: str) -> tuple[float, list[str]]:
    """Return (milliseconds added on top of torch, watched modules loaded) for one fresh interpreter."""
    code = f"import torch\n{statement}\nimport sys\nprint([m for m in {WATCHED!r} if m in sys.modules])"
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, check=True
    )
    total_us = 0
    for line in out.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line.split("|")
        # Top-level imports have no indentation after the "| " separator.
        if not name[1:].startswith(" ") and name.strip() != "torch":
            total_us += int(cumulative)
    return total_us / 1000, eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own print


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    times: dict[str, list[float]] = {s: [] for s in STATEMENTS}
    watched: dict[str, list[str]] = {}
    for _ in range(args.runs):
        for statement in STATEMENTS:
            ms, loaded = _run(statement)
            times[statement].append(ms)
            watched[statement] = loaded
    for statement in STATEMENTS:
        median = statistics.median(times[statement])
        print(
            f"{median:8.1f} ms on top of torch  {statement}  (loads {', '.join(watched[statement]) or '-'})"
        )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
