"""The machinery behind ``notebook_launcher``: plan, worker processes, output, supervision, errors.

The public entry points are ``notebook_accel.launchers.notebook_launcher`` and ``debug_launcher``;
this package holds what they are made of, so that tests and panels can use the pieces directly.
"""

from .errors import LaunchError, RankFailure
from .handle import LaunchHandle, RankStatus
from .output import LogDirSink, OutputLine, PrintSink
from .plan import LaunchPlan, resolve_plan
from .restarts import Attempt, RestartingHandle
from .states import State

__all__ = [
    "Attempt",
    "LaunchError",
    "LaunchHandle",
    "LaunchPlan",
    "LogDirSink",
    "OutputLine",
    "PrintSink",
    "RankFailure",
    "RankStatus",
    "RestartingHandle",
    "State",
    "resolve_plan",
]
