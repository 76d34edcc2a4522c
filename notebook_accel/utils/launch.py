"""Accelerate's ``utils.launch`` path: ``PrepareForLaunch``, the per-process wrapper a hand-written launch needs.

``notebook_launcher`` (notebook_accel.launchers) is our launcher; ``PrepareForLaunch`` is the small
piece a hand-written ``torch.multiprocessing`` launch needs: it turns the process index into the
torchrun variables before calling the function. The ``accelerate launch`` builders
(``prepare_multi_gpu_env``, ``prepare_deepspeed_cmd_env``...) and the other names 1.15 serves here live
with the command line, in ``notebook_accel.commands.launch_env``: this module serves every name of its
``__all__`` at first use. The MPI probe (``mpi_launch_prefix``) lives here, with ``which`` and
``subprocess``: the names 1.15's tests patch at this path to fake an MPI installation.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from shutil import which
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


def mpi_launch_prefix(hostfile: str, num_processes: int, num_machines: int = 1) -> list[str]:
    """Return the ``mpirun`` (or ``mpiexec``) words that start ``num_processes`` ranks over ``hostfile``'s hosts.

    mpirun is preferred to mpiexec when both are on PATH. ``<it> --version`` tells Open MPI (its own
    options: ``--hostfile``, ``--npernode``, ``--bind-to socket``) from Intel MPI, MPICH and MVAPICH
    (``-f``, ``-ppn``); each machine runs ``num_processes // num_machines`` ranks, as in 1.15. Raises
    OSError when neither program is on PATH, and CalledProcessError when ``--version`` fails.
    """
    found = [name for name in ("mpirun", "mpiexec") if which(name)]
    if not found:
        raise OSError(
            "mpirun or mpiexec were not found. Ensure that Intel MPI, Open MPI, or MVAPICH are installed. "
            f"(--mpirun_hostfile {hostfile!r} launches through MPI, and neither program is on PATH: install "
            "one, or launch without --mpirun_hostfile.)"
        )
    program = found[0]
    version = subprocess.check_output([program, "--version"])
    if isinstance(version, bytes):
        version = version.decode(errors="replace")
    per_machine = str(int(num_processes) // max(int(num_machines or 1), 1))
    if "Open MPI" in version:
        return [program, "--hostfile", str(hostfile), "--npernode", per_machine, "-n", str(num_processes),
                "--bind-to", "socket"]  # fmt: skip
    return [program, "-f", str(hostfile), "-ppn", per_machine, "-n", str(num_processes)]
