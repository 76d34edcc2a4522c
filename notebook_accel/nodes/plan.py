"""From ``nodes=`` to a joined ``NodeGroup`` and the ``LaunchPlan`` of a launch across those nodes.

``num_processes`` counts ranks per node (torchrun's ``--nproc-per-node``; on GPUs the default is one
per device of the node with the fewest). The ranks always start as fresh interpreters there (spawn
semantics: the function travels by value), rendezvous at the kernel's address (the kernel hosts the
TCPStore, as on one machine), and get torchrun's variables with ``NODE_RANK`` set.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .._lazy import LazyModule
from ..launch.interfaces import WorkerBackend
from ..launch.plan import LaunchPlan, resolve_plan
from ..launch.procs import LocalProcesses
from ..launch.request import LaunchRequest
from .placement import Placement, placement_for
from .remote import NodeGroup, NodeSettings

__all__ = ["join_nodes", "node_plan", "place_ranks", "placement_of"]

# The public ``Nodes``: loaded when a launch names nodes.
_spec = LazyModule("notebook_accel.nodes.spec")


def placement_of(nodes: Any) -> Any:
    """Return the placement of ``nodes``: a ``Placement`` as given, else the engine ``Nodes.of(nodes)`` names."""
    if isinstance(nodes, Placement):
        return nodes
    return placement_for(_spec.Nodes.of(nodes))


def join_nodes(nodes: Any) -> NodeGroup:
    """Return the joined agents of every node ``nodes`` names (NodeJoinError naming a node that did not join)."""
    placement = placement_of(nodes)
    return NodeGroup.join(placement, NodeSettings.of(getattr(placement, "nodes", None)))


def node_plan(request: LaunchRequest, group: NodeGroup) -> LaunchPlan:
    """Return the plan of ``request`` across ``group``'s nodes: ``num_processes`` ranks on each."""
    plan = resolve_plan(replace(request, start_method="spawn", nodes=None), gpus=group.gpus)
    if plan.backend == "xla":
        raise ValueError(
            "nodes= runs ranks with gloo or nccl; a TPU launch goes through torch_xla on one machine: leave nodes=None"
        )
    return replace(
        plan,
        master_addr=group.address,
        num_nodes=len(group.hosts),
        node_rank=0,
        hosts=group.hosts,
        in_process=False,
        distributed_type="MULTI_GPU" if plan.device_type == "cuda" else "MULTI_CPU",
        start_method="spawn",
    )


def place_ranks(request: LaunchRequest, plan: LaunchPlan | None = None) -> tuple[LaunchPlan, WorkerBackend]:
    """Return the plan of ``request``'s ranks and the backend they run on: every launch's one ``nodes=`` branch.

    Without ``request.nodes``: processes on this machine, under ``plan`` (resolved here when None).
    With it: the agents joined on every node it names, and the plan across them (the agents end if
    the plan fails).
    """
    if request.nodes is None:
        return (resolve_plan(request) if plan is None else plan), LocalProcesses()
    group = join_nodes(request.nodes)
    try:
        return node_plan(request, group), group
    except BaseException:
        group.close()
        raise
