"""``Nodes``: the short forms ``Nodes.of`` accepts, the defaults, and every refusal naming its value."""

from __future__ import annotations

import dataclasses

import pytest

import notebook_accel
from notebook_accel.nodes import Nodes


def test_the_short_forms() -> None:
    assert Nodes.of("slurm") == Nodes(engine="slurm")
    assert Nodes.of("slurm:1234") == Nodes(engine="slurm", job_id="1234")
    assert Nodes.of("slurm:1234_7").job_id == "1234_7"
    ssh = Nodes.of(["gpu-a", "user@gpu-b"])
    assert (ssh.engine, ssh.hosts) == ("ssh", ("gpu-a", "user@gpu-b"))
    assert Nodes.of(("gpu-a",)).hosts == ("gpu-a",)
    given = Nodes(hosts=["x"], python="/opt/py")
    assert Nodes.of(given) is given


def test_defaults_and_normalisation() -> None:
    nodes = Nodes()
    assert (nodes.engine, nodes.hosts, nodes.job_id, nodes.python, nodes.workdir, nodes.address) == (
        "slurm",
        None,
        None,
        None,
        None,
        None,
    )
    assert (nodes.join_timeout, nodes.heartbeat, nodes.env, nodes.ssh_options) == (60.0, 2.0, {}, ())
    # hosts given: SSH by default; a Slurm job id may be an int; lists become tuples; env is copied.
    env = {"A": "1"}
    nodes = Nodes(hosts=["a", "b"], ssh_options=["-p", "22"], env=env, join_timeout=5, heartbeat=0.5)
    env["B"] = "2"
    assert (nodes.engine, nodes.hosts, nodes.ssh_options, nodes.env) == (
        "ssh",
        ("a", "b"),
        ("-p", "22"),
        {"A": "1"},
    )
    assert isinstance(nodes.join_timeout, float) and nodes.heartbeat == 0.5
    assert Nodes(job_id=77).job_id == "77"
    assert Nodes(engine="slurm", hosts=["n1"]).hosts == ("n1",)
    assert Nodes(address="10.1.2.3").address == "10.1.2.3" and Nodes(address="ib0").address == "ib0"
    assert "Nodes" in notebook_accel.__all__ and notebook_accel.Nodes is Nodes
    with pytest.raises(dataclasses.FrozenInstanceError):
        nodes.hosts = ("c",)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("ssh", ValueError, r"nodes='ssh' is not one of the forms: nodes=\"slurm\""),
        (
            "gpu-a,gpu-b",
            ValueError,
            r"nodes='gpu-a,gpu-b' is not one of the forms.*\[\"host-a\", \"host-b\"\]",
        ),
        ("slurm:", ValueError, r"nodes='slurm:' is not one of the forms"),
        ("slurm:abc", ValueError, r"job_id='abc'\): not a Slurm job id"),
        (3, TypeError, r"nodes=3 \(a int\) is not one of the forms"),
        ({"hosts": ["a"]}, TypeError, r"\(a dict\) is not one of the forms.*Nodes\(\.\.\.\)"),
        ([], ValueError, r"hosts=\[\]\): name at least one host"),
        (["a", 3], TypeError, r"every item is a string; 3 is a int"),
    ],
)
def test_of_refuses_other_forms(value: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Nodes.of(value)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"hosts": "a,b"}, TypeError, r"hosts='a,b'\): hosts is a list of host names"),
        ({"hosts": ["-oProxyCommand=x"]}, ValueError, r"'-oProxyCommand=x' is not a host name"),
        ({"hosts": ["a b"]}, ValueError, r"'a b' is not a host name"),
        ({"hosts": ["a", "b", "a"]}, ValueError, r"a listed more than once.*raise num_processes"),
        ({"engine": "pbs"}, ValueError, r"engine='pbs'\): engine is one of 'slurm', 'ssh'"),
        ({"engine": "ssh"}, ValueError, r"engine='ssh'\): name the hosts"),
        ({"hosts": ["a"], "job_id": "12"}, ValueError, r"job_id='12'\) with engine='ssh'"),
        ({"job_id": "12;rm"}, ValueError, r"job_id='12;rm'\): not a Slurm job id"),
        ({"ssh_options": ["-p", "2"]}, ValueError, r"with engine='slurm': srun places the ranks"),
        ({"hosts": ["a"], "ssh_options": "-p 2"}, TypeError, r"ssh_options='-p 2'\): ssh_options is a list"),
        ({"env": ["A=1"]}, TypeError, r"env=\['A=1'\]\): env is a dict"),
        ({"env": {"A-B": "1"}}, ValueError, r"'A-B' is not an environment variable name"),
        (
            {"env": {"N": 3}},
            TypeError,
            r"the value of N is a int \(3\); give a string, e.g. env=\{'N': '3'\}",
        ),
        ({"python": ""}, ValueError, r"python=''\): give the Python to run"),
        ({"workdir": "rel/dir"}, ValueError, r"workdir='rel/dir'\): give an absolute directory"),
        ({"address": "not an address"}, ValueError, r"address='not an address'\): not an IP address nor"),
        ({"address": 10}, TypeError, r"address=10\): address is a string"),
        ({"join_timeout": 0}, ValueError, r"join_timeout=0\): join_timeout is a number of seconds above 0"),
        ({"heartbeat": float("nan")}, ValueError, r"heartbeat=nan\): heartbeat is a number of seconds"),
        ({"heartbeat": True}, ValueError, r"heartbeat=True\)"),
    ],
)
def test_bad_options_are_refused_naming_the_field(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Nodes(**kwargs)
