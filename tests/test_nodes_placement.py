"""The placement engines against the real daemons of the namespace cluster (tests/ns_cluster.py).

SSH and Slurm each start a command on n1 and n2 that prints the address it has there (its namespace's,
so the command really ran on that node), reads its stdin and sees Nodes.env and Nodes.workdir; the
kernel's address is the bridge's; each way a node cannot start names the node and quotes the engine.
"""

from __future__ import annotations

import re
import sys

import pytest

from notebook_accel.nodes.placement import PlacementError, SlurmPlacement, SshPlacement, placement_for
from notebook_accel.nodes.spec import Nodes

pytestmark = pytest.mark.cluster

# Prints the address this process has on the route to the kernel, the working directory, one
# environment variable and the first line of its stdin: what a node's agent needs from the engine.
PROBE = (
    "import os, socket, sys\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect((sys.argv[1], 9))\n"
    "print(s.getsockname()[0], os.getcwd(), os.environ.get('NAC_PROBE'), sys.stdin.readline().strip())\n"
)


def _probe(placement, index: int, host: str, kernel: str) -> list[str]:
    popen = placement.start(index, host, [sys.executable, "-c", PROBE, kernel])
    out, _ = popen.communicate(b"hello from the kernel\n", timeout=60)
    assert popen.returncode == 0, placement.failure(index, host, popen)
    return out.decode().strip().split(maxsplit=3)


def _start_and_fail(placement, host: str) -> str:
    popen = placement.start(1, host, [placement.python, "-c", "import notebook_accel"])
    popen.stdin.close()
    popen.wait(timeout=60)
    return placement.failure(1, host, popen)


@pytest.fixture()
def ssh_nodes(ns_cluster):
    return Nodes(
        hosts=ns_cluster.nodes,
        ssh_options=ns_cluster.ssh_options,
        env={"NAC_PROBE": "ssh-env"},
        workdir="/tmp",
    )


@pytest.fixture(scope="module")
def allocation(ns_cluster):
    job_id = ns_cluster.allocate()
    yield job_id
    ns_cluster.release(job_id)


def test_ssh_runs_on_each_node(ns_cluster, ssh_nodes) -> None:
    placement = placement_for(ssh_nodes)
    assert isinstance(placement, SshPlacement)
    hosts = placement.hosts()
    assert hosts == ["n1", "n2"]
    kernel = placement.kernel_address()
    assert kernel == ns_cluster.bridge_address
    for index, host in enumerate(hosts):
        assert _probe(placement, index, host, kernel) == [
            ns_cluster.addresses[host],
            "/tmp",
            "ssh-env",
            "hello from the kernel",
        ]


def test_slurm_runs_a_step_on_each_node(ns_cluster, allocation, monkeypatch) -> None:
    # Inside the allocation, as a Jupyter server started by salloc/sbatch sees it.
    for key, value in ns_cluster.allocation_env(allocation).items():
        monkeypatch.setenv(key, value)
    placement = placement_for(Nodes(engine="slurm", env={"NAC_PROBE": "srun-env"}, workdir="/tmp"))
    assert isinstance(placement, SlurmPlacement)
    assert placement.hosts() == ["n1", "n2"]
    kernel = placement.kernel_address()
    assert kernel == ns_cluster.bridge_address
    for index, host in enumerate(["n2", "n1"]):
        assert _probe(placement, index, host, kernel) == [
            ns_cluster.addresses[host],
            "/tmp",
            "srun-env",
            "hello from the kernel",
        ]
    # Nodes.env reaches the step through srun's environment, never its command line.
    argv, env = placement.command("n1", ["true"])
    assert env["NAC_PROBE"] == "srun-env" and not any("srun-env" in part for part in argv)


def test_slurm_by_job_id_from_outside_the_allocation(ns_cluster, allocation, monkeypatch) -> None:
    for key in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(key, raising=False)
    placement = placement_for(Nodes(engine="slurm", job_id=allocation, hosts=["n2"]))
    assert placement.hosts() == ["n2"]
    assert placement.kernel_address() == ns_cluster.bridge_address
    assert _probe(placement, 0, "n2", ns_cluster.bridge_address)[0] == ns_cluster.addresses["n2"]


def test_outside_an_allocation_says_how_to_get_one(ns_cluster, monkeypatch) -> None:
    for key in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(
        PlacementError, match=r"not inside a Slurm allocation.*salloc -N 2.*nodes='slurm:<jobid>'"
    ):
        placement_for(Nodes.of("slurm")).hosts()


def test_a_host_outside_the_allocation_is_named(ns_cluster, allocation) -> None:
    placement = placement_for(Nodes(engine="slurm", job_id=allocation, hosts=["n1", "n9"]))
    with pytest.raises(
        PlacementError, match=rf"n9 is not a node of Slurm job {allocation} \(its nodes: n1, n2\)"
    ):
        placement.hosts()


def test_an_ended_job_is_named(ns_cluster) -> None:
    job_id = ns_cluster.allocate(1)
    ns_cluster.release(job_id)
    placement = placement_for(Nodes.of(f"slurm:{job_id}"))
    with pytest.raises(
        PlacementError, match=rf"Slurm job {job_id} (is (CANCELLED|COMPLETED|COMPLETING)|.*Invalid job id)"
    ):
        placement.hosts()


def test_ssh_refused_quotes_ssh(ns_cluster) -> None:
    # Nothing listens on port 1 of n2: ssh's own "Connection refused" reaches the message.
    nodes = Nodes(hosts=["n2"], ssh_options=[*ns_cluster.ssh_options, "-p", "1"])
    message = _start_and_fail(placement_for(nodes), "n2")
    assert "ssh n2 failed (exit 255)" in message
    assert f"connect to host {ns_cluster.addresses['n2']} port 1: Connection refused" in message


def test_ssh_to_a_host_that_does_not_answer_quotes_ssh(ns_cluster) -> None:
    # An address on the bridge where no node lives (ARP gets no answer): ssh gives up after ConnectTimeout.
    nodes = Nodes(
        hosts=["ghost"],
        ssh_options=[
            *ns_cluster.ssh_options,
            "-o",
            "ConnectTimeout=2",
            "-o",
            f"HostName={ns_cluster.bridge_address[:-1]}99",
        ],
    )
    message = _start_and_fail(placement_for(nodes), "ghost")
    assert "ssh ghost failed (exit 255)" in message
    assert "port 22: " in message and ("No route to host" in message or "timed out" in message)


@pytest.mark.parametrize(
    ("python", "quoted"),
    [
        ("/nonexistent/bin/python", r"/nonexistent/bin/python'?: No such file or directory"),
        ("/usr/bin/python3", r"ModuleNotFoundError: No module named 'notebook_accel'"),
    ],
)
def test_no_python_or_no_package_on_the_node_quotes_its_message(
    ns_cluster, allocation, python, quoted
) -> None:
    # workdir=/tmp: from the repository's folder, `python -c/-m` would import notebook_accel from the source.
    ssh = placement_for(
        Nodes(hosts=["n1"], ssh_options=ns_cluster.ssh_options, python=python, workdir="/tmp")
    )
    message = _start_and_fail(ssh, "n1")
    assert message.startswith("ssh n1 failed (exit ") and re.search(quoted, message), message
    srun = placement_for(Nodes(engine="slurm", job_id=allocation, python=python, workdir="/tmp"))
    srun.hosts()
    message = _start_and_fail(srun, "n2")
    assert message.startswith(f"srun -w n2 (Slurm job {allocation}) failed (exit ") and re.search(
        quoted, message
    ), message


def test_a_step_refused_by_a_dead_slurmd_quotes_srun(ns_cluster, allocation) -> None:
    # n2's slurmd is gone (slurmctld has not noticed yet): srun's launch on n2 fails, and srun says so.
    [slurmd] = [p for name, p in ns_cluster._daemons.items() if name == "slurmd n2"]
    slurmd.kill()
    slurmd.wait()
    try:
        placement = placement_for(Nodes(engine="slurm", job_id=allocation))
        placement.hosts()
        message = _start_and_fail(placement, "n2")
        assert message.startswith(f"srun -w n2 (Slurm job {allocation}) failed"), message
        assert "srun: error:" in message, message
    finally:
        ns_cluster._start_slurmd("n2")
