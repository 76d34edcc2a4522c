"""Interactive ranks: a process group kept alive between cells, run code on it a cell at a time.

``ranks = start_ranks(2)`` forks two ranks from the kernel (they start with its imports, functions
and variables) into one process group (gloo on CPU, nccl on CUDA) and keeps them waiting for work;
``ranks.run("x = torch.ones(2) * rank; x")`` runs code in every rank's own persistent namespace
and returns the last expression's value per rank; ``ranks.run(fn, *args)`` calls a function there;
``push``/``pull`` move values between the kernel and the ranks; ``stop()`` ends them.

Errors: a command raising on some rank raises ``RankError`` here (that rank's traceback first);
the ranks stay alive unless ``error.broken`` says the group could not go on (a rank died, or the
others waited in a collective for it), and then ``restart()`` forks new ranks. ``execute`` raises
the same way; ``RankError.results`` holds every targeted rank's ``CellResult``. ^C (the Stop
button) interrupts the busy ranks and raises KeyboardInterrupt; the namespaces stay.

Background: ``job = ranks.submit(code_or_fn, ...)`` (``%%ranks --bg``) returns a ``Job`` at once; its
output lands in the cell that started it, ``job.result()`` waits and raises as ``run`` would,
``job.stop()`` interrupts it. While it runs, other commands on the ranks raise ``JobRunningError``.
"""

from __future__ import annotations

import sys

from .errors import NoRanksError, RankError
from .jobs import Job, JobRunningError
from .rank_shell import NoInputOnRanksError
from .session import CellResult, Ranks, RankState, current, require_current, start_ranks
from .stale import StaleGlobalWarning
from .values import ValueOnRankError

__all__ = [
    "CellResult",
    "Job",
    "JobRunningError",
    "NoInputOnRanksError",
    "NoRanksError",
    "RankError",
    "RankState",
    "Ranks",
    "StaleGlobalWarning",
    "ValueOnRankError",
    "current",
    "interactive",
    "require_current",
    "start_ranks",
]

# ``notebook_accel.interactive`` is served by the package's lazy table, which takes each public name
# from the module it lists: this package lists itself.
interactive = sys.modules[__name__]
