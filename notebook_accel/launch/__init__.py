"""The machinery behind ``notebook_launcher``: plan, worker processes, output, supervision, errors.

The public entry points are ``notebook_accel.launchers.notebook_launcher`` and ``debug_launcher``;
this package holds what they are made of, so that tests and panels can use the pieces directly.
"""

from .._lazy import attach

# Served lazily: a process that needs only some of the machinery (a node's agent reads ``doctor``,
# ``procs``, ``supervisor``) does not import torch through ``errors`` (``tests/test_nodes_agent.py``).
_TABLE = {
    "Attempt": ".restarts",
    "LaunchError": ".errors",
    "LaunchHandle": ".handle",
    "LaunchPlan": ".plan",
    "LogDirSink": ".output",
    "OutputLine": ".output",
    "PrintSink": ".output",
    "RankFailure": ".errors",
    "RankStatus": ".handle",
    "RestartingHandle": ".restarts",
    "State": ".states",
    "resolve_plan": ".plan",
}

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
__getattr__, __dir__ = attach(__name__, _TABLE)
