"""What importing the public entry points costs on top of torch, from ``python -X importtime``.

    .venv/bin/python benchmarks/bench_import.py [--runs 5] [--baseline REV] [--from-source]

Each statement runs ``--runs`` times in a fresh interpreter as
``python -X importtime -c "import torch; <statement>"``. torch is imported first so that its own
cost (seconds, and the same for every statement) is booked on the ``torch`` line; the figure is the
sum of the cumulative times of the top-level imports after it (not the interpreter's start-up), i.e.
what the statement adds on top of torch (our modules, safetensors, and whatever heavy library they
drag in). The median of the runs is reported, with the modules that should not be on the path (the
process state, sympy, FSDP) when the statement loaded them. Runs of all statements are interleaved so
that other load hits them alike; note the load average printed at the top and bottom. ``--baseline
REV`` also measures the package as it was at git revision REV (exported to a temporary folder put
first on ``PYTHONPATH``), run for run interleaved with the working tree's, and prints the ratio.

Side by side with Accelerate 1.15 (installed in the same environment): ``from notebook_accel import
Accelerator; Accelerator(cpu=True)`` and the same line with ``accelerate``, run after run in fresh
interpreters, timed with ``time.perf_counter`` inside the process: the whole (torch included) and
what the line adds after ``import torch``. torch is the same for both and is most of the whole, so the
part after torch is the figure that compares the two packages; both ratios are printed.

Bytecode: Accelerate is installed with its ``.pyc`` files (pip compiles at install), so it loads from
bytecode. Our package is an editable checkout, and with ``PYTHONDONTWRITEBYTECODE`` set (as on the
shared machine) Python never writes its ``__pycache__``: every fresh interpreter would compile our
sources again (about 100 ms of the part after torch), a cost no installed user pays. So the script
first compiles the package (``compileall``, into the ignored ``__pycache__`` folders; the
``--baseline`` export too), and both packages are measured as installed. ``--from-source`` removes
those folders instead and measures our package from source against Accelerate from bytecode, as the
figures taken before this step did.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
# The same user line with each package, compared side by side.
SIDE_BY_SIDE = {
    "notebook_accel": "from notebook_accel import Accelerator; Accelerator(cpu=True)",
    "accelerate": "from accelerate import Accelerator; Accelerator(cpu=True)",
}
# Loaded by the big-model path only through a chain that does not belong there.
WATCHED = ("notebook_accel.state", "sympy", "torch.distributed.fsdp")


def _run(statement: str, source: str | None = None) -> tuple[float, list[str]]:
    """Return (milliseconds added on top of torch, watched modules loaded) for one fresh interpreter.

    ``source``: a folder holding another ``notebook_accel`` that shadows the installed one.
    """
    code = f"import torch\n{statement}\nimport sys\nprint([m for m in {WATCHED!r} if m in sys.modules])"
    env = dict(os.environ)
    if source is not None:  # PYTHONPATH comes before the editable install's finder
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd="/",  # not the checkout: '' on sys.path would find its notebook_accel first
    )
    total_us = 0
    after_torch = False  # the interpreter's own start-up imports (encodings, site...) come before torch
    for line in out.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line.split("|")
        # Top-level imports have no indentation after the "| " separator.
        if not name[1:].startswith(" "):
            if after_torch:
                total_us += int(cumulative)
            after_torch = after_torch or name.strip() == "torch"
    return total_us / 1000, eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own print


def _run_timed(statement: str, source: str | None = None) -> tuple[float, float]:
    """Return (seconds for the whole, seconds after ``import torch``) of ``statement`` in a fresh interpreter.

    ``source``: a folder holding another ``notebook_accel`` that shadows the installed one.
    """
    code = (
        "import time\nstart = time.perf_counter()\nimport torch\nafter_torch = time.perf_counter()\n"
        f"{statement}\nend = time.perf_counter()\nprint(end - start, end - after_torch)"
    )
    env = dict(os.environ)
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/", env=env
    )
    whole, after_torch = map(float, out.stdout.split())
    return whole, after_torch


def _side_by_side(runs: int, baseline: str | None = None, source: str | None = None) -> None:
    """Print our Accelerator line against Accelerate's, interleaved run for run, with the ratios.

    With ``baseline`` (a git revision exported to ``source``) that revision's line is timed alongside.
    """
    lines = dict(SIDE_BY_SIDE)
    if baseline is not None:
        lines[f"notebook_accel at {baseline}"] = SIDE_BY_SIDE["notebook_accel"]
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in lines}
    for _ in range(runs):
        for name, statement in lines.items():
            times[name].append(_run_timed(statement, source if name.endswith(f"at {baseline}") else None))
    whole = {name: statistics.median(t[0] for t in runs_) for name, runs_ in times.items()}
    after = {name: statistics.median(t[1] for t in runs_) for name, runs_ in times.items()}
    # The fastest run: what the line costs when other load on a shared machine hit it least.
    least = {name: min(t[1] for t in runs_) for name, runs_ in times.items()}
    for name, statement in lines.items():
        print(
            f"{whole[name] * 1000:8.1f} ms whole, {after[name] * 1000:7.1f} ms after torch "
            f"(fastest {least[name] * 1000:.1f})  {name}: {statement}"
        )
    for name in lines:
        if name != "accelerate":
            fastest = least[name] / least["accelerate"]
            print(
                f"{name} / accelerate: whole {whole[name] / whole['accelerate']:.2f}x, "
                f"after torch {after[name] / after['accelerate']:.2f}x (fastest {fastest:.2f}x)"
            )


def _compile(folder: str) -> None:
    """Write the bytecode of the ``notebook_accel`` package in ``folder``, as pip does at install."""
    package = os.path.join(folder, "notebook_accel")
    subprocess.run([sys.executable, "-m", "compileall", "-q", package], check=True, stdout=subprocess.DEVNULL)


def _clear_bytecode(folder: str) -> None:
    """Remove the ``__pycache__`` folders of the package in ``folder`` (``--from-source``)."""
    for cache in Path(folder, "notebook_accel").rglob("__pycache__"):
        shutil.rmtree(cache)


def _export(revision: str, folder: str) -> None:
    """Write the ``notebook_accel`` package as it was at git ``revision`` into ``folder``."""
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", revision, "notebook_accel"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)


def _measure(runs: int, baseline: str | None) -> tuple[dict, dict, dict]:
    """Return per-statement times for the working tree and the baseline, and what each loaded."""
    ours: dict[str, list[float]] = {s: [] for s in STATEMENTS}
    theirs: dict[str, list[float]] = {s: [] for s in STATEMENTS}
    loaded: dict[tuple[str, str], list[str]] = {}
    for _ in range(runs):
        for statement in STATEMENTS:
            ms, loaded[("ours", statement)] = _run(statement)
            ours[statement].append(ms)
            if baseline is not None:
                ms, loaded[("baseline", statement)] = _run(statement, baseline)
                theirs[statement].append(ms)
    return ours, theirs, loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--baseline", default=None, help="git revision to compare with (e.g. a commit id)")
    parser.add_argument(
        "--from-source", action="store_true", help="do not compile our package first (see the module's doc)"
    )
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    print(f"our package: {'from source' if args.from_source else 'compiled first (as installed)'}")
    with tempfile.TemporaryDirectory() as folder:
        (_clear_bytecode if args.from_source else _compile)(ROOT)
        if args.baseline is not None:
            _export(args.baseline, folder)
            if not args.from_source:
                _compile(folder)
        ours, theirs, loaded = _measure(args.runs, folder if args.baseline else None)
        side = (args.baseline, folder if args.baseline else None)
        _side_by_side(args.runs, *side)
        print("(side by side: medians of fresh interpreters, interleaved)")
    for statement in STATEMENTS:
        median = statistics.median(ours[statement])
        line = f"{median:8.1f} ms  {statement}  (loads {', '.join(loaded['ours', statement]) or '-'})"
        if args.baseline is not None:
            before = statistics.median(theirs[statement])
            heavy = ", ".join(loaded["baseline", statement]) or "-"
            line += (
                f"\n{before:8.1f} ms    at {args.baseline} (loads {heavy}); now/then = {median / before:.2f}"
            )
        print(line)
    print("(medians of the time each statement adds on top of torch)")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
