"""TPU launches (Colab / Kaggle TPU runtimes) through torch_xla's own multiprocessing."""

from __future__ import annotations

import os
from typing import Any

from .plan import LaunchPlan
from .worker import _reset_state, to_cpu

__all__ = ["launch_xla"]


def _xla_entry(index: int, function, args, env: dict[str, str], results) -> None:
    os.environ.update(env)
    _reset_state()
    results[index] = to_cpu(function(*args))


def launch_xla(function, args: tuple, plan: LaunchPlan) -> list[Any]:
    """Return per-process values after ``xmp.spawn`` of ``function`` on the TPU cores."""
    try:
        import torch_xla.distributed.xla_multiprocessing as xmp
    except ImportError as exc:
        raise ImportError(
            f"a TPU runtime was detected ({plan.platform}) but launching on it needs torch_xla: "
            "pip install torch_xla (matching your torch version), or switch the runtime to CPU/GPU"
        ) from exc
    import multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        xmp.spawn(
            _xla_entry,
            args=(function, args, plan.env, results),
            nprocs=plan.num_processes,
            start_method=plan.start_method,
        )
        return [results.get(i) for i in range(plan.num_processes)]
