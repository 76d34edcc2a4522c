"""Record what Hugging Face Accelerate 1.15 does on the programs of ``tests/goldens_programs.py``.

The goldens in ``tests/data/goldens/`` are the facts ``tests/test_goldens.py`` holds notebook_accel
to: for every case and rank, the sample indices of each step, the losses and the final parameters.
Refresh them with the real Accelerate installed in a separate virtual environment (our library
never imports accelerate; the test suite reads only the committed JSON):

    python3 -m venv /tmp/acc && /tmp/acc/bin/pip install accelerate==1.15.0 torch==2.13.0
    python scripts/record_accelerate_goldens.py --python /tmp/acc/bin/python
    python scripts/record_accelerate_goldens.py --python /tmp/acc/bin/python --cases NAME,NAME  # only these

For 2 processes this runs ``torchrun --nproc_per_node 2`` on CPU with gloo and
``ACCELERATE_USE_CPU=1`` (without it Accelerate runs every CPU process alone, as
``DistributedType.NO``); each worker asserts that Accelerate formed ``MULTI_CPU`` with 2 processes,
runs every case and writes its results; the driver merges the ranks into ``world2.json``.

One process is recorded as a plain ``python`` process (``DistributedType.NO``), which is what
Accelerate's ``notebook_launcher(num_processes=1)`` runs and what notebook_accel's state is for
``WORLD_SIZE=1``. (Under ``torchrun --nproc_per_node 1`` Accelerate forms a one-rank ``MULTI_CPU``
group, so e.g. ``gather`` of a 0-d tensor then returns shape ``[1]``, and streams are dispatched;
notebook_accel treats a world of one as ``NO`` on purpose: no collectives for a single process.)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDENS = ROOT / "tests" / "data" / "goldens"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(out_dir: str, workdir: str, names: list[str] | None = None) -> None:
    """Run every case under the real Accelerate in this torchrun worker; write rank<R>.json."""
    import accelerate
    import accelerate.state  # noqa: F401  (the programs use A.state and A.utils)
    import accelerate.utils
    import torch

    sys.path.insert(0, str(ROOT))
    from tests.goldens_programs import run_cases

    world = int(os.environ.get("WORLD_SIZE", "1"))
    # Accelerator() (not PartialState()) is what reads ACCELERATE_USE_CPU and forms the CPU group.
    state = accelerate.Accelerator().state
    expected = "MULTI_CPU" if world > 1 else "NO"
    if str(state.distributed_type.value) != expected or state.num_processes != world:
        raise SystemExit(
            f"Accelerate formed {state.distributed_type} with {state.num_processes} processes, expected "
            f"{expected} with {world}: run with ACCELERATE_USE_CPU=1 under torchrun"
        )
    results = run_cases(
        accelerate, workdir, names, log=lambda name: print(f"case {name}", file=sys.stderr, flush=True)
    )
    meta = {"accelerate": accelerate.__version__, "torch": torch.__version__, "world_size": world}
    Path(out_dir, f"rank{os.environ.get('RANK', '0')}.json").write_text(
        json.dumps({"meta": meta, "cases": results})
    )


def _record(python: str, world: int, cases: str | None = None) -> dict:
    """Run the cases on ``world`` processes under ``python``'s Accelerate; return the merged goldens."""
    with tempfile.TemporaryDirectory() as out_dir, tempfile.TemporaryDirectory() as workdir:
        env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        cmd = [python, __file__, "--worker", out_dir, "--workdir", workdir]
        if cases:
            cmd += ["--cases", cases]
        if world > 1:
            cmd[1:1] = [
                "-m", "torch.distributed.run", "--nproc_per_node", str(world),
                "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
            ]  # fmt: skip
        subprocess.run(cmd, check=True, env=env, cwd=ROOT)
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
    cases = {name: [rank["cases"][name] for rank in ranks] for name in ranks[0]["cases"]}
    return {"meta": ranks[0]["meta"], "cases": cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="interpreter with accelerate==1.15.0")
    parser.add_argument("--worlds", default="1,2", help="comma-separated world sizes to record")
    parser.add_argument(
        "--cases", help="comma-separated case names to (re)record; the other recorded cases are kept"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.workdir, args.cases.split(",") if args.cases else None)
        return
    GOLDENS.mkdir(parents=True, exist_ok=True)
    for world in (int(w) for w in args.worlds.split(",")):
        goldens = _record(args.python, world, args.cases)
        path = GOLDENS / f"world{world}.json"
        if args.cases and path.is_file():
            kept = json.loads(path.read_text())
            goldens = {**kept, "cases": {**kept["cases"], **goldens["cases"]}}
        path.write_text(json.dumps(goldens, indent=1, sort_keys=True) + "\n")
        print(f"wrote {path.relative_to(ROOT)}: {len(goldens['cases'])} cases")


if __name__ == "__main__":
    main()
