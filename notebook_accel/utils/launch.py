"""Accelerate's ``utils.launch`` path: ``PrepareForLaunch``, the per-process wrapper a hand-written launch needs.

``notebook_launcher`` (notebook_accel.launchers) is our launcher; ``PrepareForLaunch`` is the small
piece a hand-written ``torch.multiprocessing`` launch needs: it turns the process index into the
torchrun variables before calling the function. The ``accelerate launch`` builders
(``prepare_multi_gpu_env``, ``prepare_deepspeed_cmd_env``...) and the other names 1.15 serves here live
with the command line, in ``notebook_accel.commands.launch_env``: this module serves every name of its
``__all__`` at first use.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .._lazy import forward
from .enums import DistributedType

__getattr__, __dir__ = forward(__name__, "notebook_accel.commands.launch_env")


class PrepareForLaunch:
    """A picklable wrapper that sets one process's rank variables, then calls ``launcher(*args)``.

    Built for ``torch.multiprocessing.start_processes(PrepareForLaunch(fn, "MULTI_CPU"), args=..., nprocs=n)``:
    process ``index`` gets ``LOCAL_RANK=index`` and ``RANK = NODE_RANK * nprocs + index`` (``nprocs`` from
    ``LOCAL_WORLD_SIZE``, else ``NPROC``, else ``WORLD_SIZE``). With ``debug`` it also sets
    ``ACCELERATE_DEBUG_MODE`` so collectives check their inputs.

    Args:
        launcher: The function each process runs.
        distributed_type: How the run is distributed ("MULTI_CPU", "MULTI_GPU", ...).
        debug: Turn on the collectives' input checks (``ACCELERATE_DEBUG_MODE``).
    """

    def __init__(self, launcher: Callable, distributed_type: Any = "NO", debug: bool = False) -> None:
        if not callable(launcher):
            raise TypeError(f"PrepareForLaunch needs a function to launch, got {launcher!r}")
        if distributed_type not in DistributedType:
            raise ValueError(
                f"PrepareForLaunch: distributed_type={distributed_type!r} is not valid; "
                f"choose one of {DistributedType.list()}"
            )
        self.launcher = launcher
        self.distributed_type = DistributedType(distributed_type)
        self.debug = debug

    def __call__(self, index: int, *args: Any) -> Any:
        if self.distributed_type != DistributedType.NO or self.debug:
            local_size = (
                os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("NPROC") or os.environ.get("WORLD_SIZE")
            )
            node_rank = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", 0)))
            os.environ["LOCAL_RANK"] = str(index)
            os.environ["RANK"] = str(node_rank * int(local_size or 1) + index)
        os.environ["FORK_LAUNCHED"] = "1"
        if self.debug:
            os.environ["ACCELERATE_DEBUG_MODE"] = "true"
        return self.launcher(*args)
