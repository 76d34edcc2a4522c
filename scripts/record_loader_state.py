"""Record Accelerate 1.15's ``state_dict()`` of a prepared stateful DataLoader, and where it resumes.

For 0 and 2 workers, with and without dispatching: a prepared loader over 24 numbers in batches of 2
(no shuffling) is read for ``BREAK`` batches; its ``state_dict()`` (JSON: torchdata's keys as they are)
and the batches a fresh prepared loader yields after ``load_state_dict`` of it are recorded. Run with
``--lib notebook_accel --state <json>`` the same code resumes a given state and prints the batches (the
test's check that a state of ours resumes on 1.15). tests/test_loader_state.py compares.

    .venv/bin/python scripts/record_loader_state.py --python /work/.venv-accelerate/bin/python
    # writes tests/data/loader_state_1_15.json
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from _recorder import CLEAN_ENV, accelerate_version, command_line

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "loader_state_1_15.json"
_WORKER_ENV = {**CLEAN_ENV, "OMP_NUM_THREADS": "1"}
BREAK = 3
CASES = {f"workers={w}/dispatch={d}": (w, d) for w in (0, 2) for d in (False, True)}


def jsonable(value):
    """Return ``value`` with tuples as lists and tensors as lists (torchdata's states are plain otherwise)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def prepared(lib: str, workers: int, dispatch: bool):
    """Return a fresh prepared stateful loader of ``lib`` for one case."""
    from torch.utils.data import DataLoader

    module = __import__(lib)
    config = module.DataLoaderConfiguration(dispatch_batches=dispatch, use_stateful_dataloader=True)
    accelerator = module.Accelerator(cpu=True, dataloader_config=config)
    return accelerator.prepare(DataLoader(list(range(24)), batch_size=2, num_workers=workers))


def saved_state(lib: str, workers: int, dispatch: bool) -> dict:
    """Return the state_dict after ``BREAK`` batches of one case."""
    loader = prepared(lib, workers, dispatch)
    iterator = iter(loader)
    for _ in range(BREAK):
        next(iterator)
    state = loader.state_dict()
    del iterator
    return state


def resumed(lib: str, workers: int, dispatch: bool, state: dict) -> list[list[int]]:
    """Return the batches a fresh prepared loader yields after loading ``state``."""
    loader = prepared(lib, workers, dispatch)
    loader.load_state_dict(state)
    return [batch.tolist() for batch in loader]


def worker(lib: str, state_file: str | None) -> dict:
    if state_file:  # resume the given states (one per case) and report the batches
        states = json.loads(Path(state_file).read_text())
        return {name: resumed(lib, *CASES[name], states[name]) for name in CASES}
    out = {}
    for name, (workers, dispatch) in CASES.items():
        state = saved_state(lib, workers, dispatch)
        out[name] = {"state": jsonable(state), "resumed": resumed(lib, workers, dispatch, state)}
    return out


def run(python: str, lib: str, state_file: str | None = None, env: dict | None = None) -> dict:
    """Return ``worker(lib, state_file)`` run by ``python`` in a fresh interpreter."""
    argv = [python, __file__, "--worker", lib, *(["--state", state_file] if state_file else [])]
    proc = subprocess.run(argv, env={**_WORKER_ENV, **(env or {})}, capture_output=True, text=True, timeout=300,
                          cwd="/tmp")  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"{lib} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ns = command_line(
        __doc__,
        lambda ns: print(json.dumps(worker(ns.worker, ns.state))),
        "accelerate==1.15 and torchdata",
        worker_lib=True,
        hidden=("state",),
    )
    version = accelerate_version(ns.python)
    record = {"accelerate_version": version, "break": BREAK, "cases": run(ns.python, "accelerate")}
    OUT.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    sys.exit(main())
