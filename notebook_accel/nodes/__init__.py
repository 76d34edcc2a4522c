"""Several machines: one kernel drives ranks on every node of a Slurm allocation or an SSH host list.

``spec`` holds the user's ``Nodes``; ``placement`` asks the engine (``srun``, ``ssh``) to start one agent
per node. The kernel side, the agent and their channel build on these.
"""

from __future__ import annotations

from .spec import Nodes

__all__ = ["Nodes"]
