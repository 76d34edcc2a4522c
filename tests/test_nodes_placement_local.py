"""The placement engines' checks that need no cluster: the kernel's address and the missing engine."""

from __future__ import annotations

import shutil

import pytest

from notebook_accel.nodes.placement import PlacementError, SlurmPlacement, SshPlacement, placement_for
from notebook_accel.nodes.spec import Nodes

needs_ssh = pytest.mark.skipif(
    shutil.which("ssh") is None, reason="needs the ssh client (ssh -G reads its config)"
)


@needs_ssh
def test_every_node_local_gives_the_loopback_address() -> None:
    # `ssh -G` only prints the configuration: nothing is contacted.
    assert SshPlacement(Nodes(hosts=["localhost"])).kernel_address() == "127.0.0.1"


def test_a_named_address_or_interface_wins() -> None:
    assert SshPlacement(Nodes(hosts=["a"], address="10.9.8.7")).kernel_address() == "10.9.8.7"
    assert SshPlacement(Nodes(hosts=["a"], address="lo")).kernel_address() == "127.0.0.1"
    with pytest.raises(
        PlacementError, match=r"address='nope0'\): this machine has no IPv4 interface 'nope0' \(it has .*lo"
    ):
        SshPlacement(Nodes(hosts=["a"], address="nope0")).kernel_address()


def test_a_missing_engine_is_named(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(
        PlacementError, match=r"nodes='slurm' needs Slurm's srun and scontrol on this machine's PATH"
    ):
        placement_for("slurm")
    with pytest.raises(
        PlacementError, match=r"nodes=\['a'\] places ranks with ssh, and there is no ssh on PATH"
    ):
        placement_for(["a"])


def test_outside_an_allocation_is_refused_before_any_slurm_command(monkeypatch) -> None:
    for key in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(
        PlacementError, match=r"not inside a Slurm allocation \(SLURM_JOB_ID is not set\).*salloc -N 2"
    ):
        SlurmPlacement(Nodes.of("slurm")).hosts()
