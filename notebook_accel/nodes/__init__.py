"""Several machines: one kernel drives ranks on every node of a Slurm allocation or an SSH host list.

``spec`` holds the user's ``Nodes``; ``placement`` asks the engine (``srun``, ``ssh``) to start one agent
per node. ``channel`` is the authenticated connection, ``agent`` the per-node process
(``python -m notebook_accel.nodes.agent``), ``remote`` the kernel's ``NodeGroup``, ``workers`` the
remote ranks behind the launcher's own interfaces, ``relay`` the Unix-socket streams of the
interactive ranks, ``plan`` the launch plan across nodes.
"""

from __future__ import annotations

from .spec import Nodes

__all__ = ["Nodes"]
