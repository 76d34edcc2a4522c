"""Record which samplers ``set_epoch(n)`` on a prepared DataLoader reaches, under Accelerate 1.15 (or ours).

A user's own batch sampler with ``set_epoch`` (a ``BatchSampler`` subclass, or a plain iterable of index
lists), with and without a sampler that has ``set_epoch`` inside it, with and without dispatching; each
case prints the ``epoch`` each one holds after ``set_epoch(3)`` and after an iteration. Run in one
process and in two (gloo, through torchrun). tests/test_loader_epoch.py runs the same cases on ours.

    .venv/bin/python scripts/record_loader_epoch.py --python /work/.venv-accelerate/bin/python
    # writes tests/data/loader_set_epoch_1_15.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _recorder import CLEAN_ENV, accelerate_version, command_line

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "loader_set_epoch_1_15.json"
_WORKER_ENV = {**CLEAN_ENV, "OMP_NUM_THREADS": "1"}


def cases(lib: str) -> dict:
    """Return ``{case: {"batch_sampler": epoch, "sampler": epoch or None}}`` for this process."""
    import torch.distributed as dist
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    module = __import__(lib)

    class EpochSampler(SequentialSampler):
        epoch = -1

        def set_epoch(self, epoch):
            self.epoch = epoch

    class EpochBatchSampler(BatchSampler):
        epoch = -1

        def set_epoch(self, epoch):
            self.epoch = epoch

    class PlainBatches:  # an iterable of index lists, no BatchSampler subclass
        epoch = -1

        def __init__(self, n):
            self.n = n

        def __iter__(self):
            return iter([[i, i + 1] for i in range(0, self.n, 2)])

        def __len__(self):
            return self.n // 2

        def set_epoch(self, epoch):
            self.epoch = epoch

    makers = {
        "batch_sampler_only": lambda: EpochBatchSampler(SequentialSampler(range(8)), 2, False),
        "both": lambda: EpochBatchSampler(EpochSampler(range(8)), 2, False),
        "plain_batches": lambda: PlainBatches(8),
    }
    out = {}
    for name, make in makers.items():
        for dispatch in (False, True):
            config = module.DataLoaderConfiguration(dispatch_batches=dispatch)
            acc = module.Accelerator(cpu=True, dataloader_config=config)
            batches = make()
            loader = acc.prepare(DataLoader(list(range(8)), batch_sampler=batches))
            loader.set_epoch(3)
            inner = getattr(batches, "sampler", None)
            key = f"{name}/dispatch={dispatch}"
            out[key] = {"batch_sampler": batches.epoch, "sampler": getattr(inner, "epoch", None)}
            for _ in loader:
                pass
            out[key + "/after_iteration"] = {
                "batch_sampler": batches.epoch,
                "sampler": getattr(inner, "epoch", None),
            }
    if dist.is_initialized():
        dist.barrier()
    return out


def run(python: str, lib: str, processes: int, env: dict[str, str] | None = None) -> list[dict]:
    """Return one ``cases(lib)`` per rank, run with ``python`` in 1 process or ``processes`` through torchrun."""
    with tempfile.TemporaryDirectory() as folder:
        base = [python, __file__, "--worker", lib, "--out", folder]
        if processes > 1:
            base = [python, "-m", "torch.distributed.run", f"--nproc_per_node={processes}", "--master_port=0",
                    "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", *base[1:]]  # fmt: skip
        proc = subprocess.run(base, env={**_WORKER_ENV, **(env or {})}, capture_output=True, text=True, timeout=300,
                              cwd="/tmp")  # fmt: skip
        if proc.returncode:
            raise RuntimeError(f"{lib} in {processes} processes failed:\n{proc.stderr[-3000:]}")
        return [json.loads(Path(folder, f"{rank}.json").read_text()) for rank in range(processes)]


def _worker(ns: argparse.Namespace) -> None:
    rank = int(os.environ.get("RANK", "0"))
    Path(ns.out, f"{rank}.json").write_text(json.dumps(cases(ns.worker)))


def main() -> None:
    ns = command_line(__doc__, _worker, worker_lib=True, hidden=("out",))
    version = accelerate_version(ns.python)
    record = {"accelerate_version": version, "one_process": run(ns.python, "accelerate", 1),
              "two_processes": run(ns.python, "accelerate", 2)}  # fmt: skip
    OUT.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    sys.exit(main())
