"""``Nodes``: which machines a launch runs on and how to reach them, built by keyword, checked once, frozen.

``notebook_launcher(..., nodes=...)`` and ``start_ranks(..., nodes=...)`` take the short forms
(``"slurm"``, ``"slurm:<jobid>"``, a list of host names) or a ``Nodes``; ``Nodes.of`` turns any of them
into a ``Nodes``, so every check of a per-node option lives here and a bad option is refused before any
engine is asked to start anything. Where the nodes are and which address reaches them is decided later,
by the placement engine (``nodes/placement.py``).
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["ENGINES", "Nodes"]

ENGINES = ("slurm", "ssh")
"""The placement engines: ``srun`` steps in a Slurm allocation, ``ssh`` to each host."""

DEFAULT_JOIN_TIMEOUT = 60.0
DEFAULT_HEARTBEAT = 2.0

_FORMS = (
    'nodes="slurm" (every node of the allocation this kernel runs in), nodes="slurm:<jobid>" (another '
    'allocation), nodes=["host-a", "host-b"] (SSH to each host), or nodes=Nodes(...)'
)
# Slurm job ids: plain, array (1234_5) and heterogeneous (1234+0) jobs.
_JOB_ID = re.compile(r"^[0-9]+(?:[_+][0-9]+)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Linux interface names: at most 15 bytes, no whitespace, no slash.
_INTERFACE = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _strings(name: str, value: object, what: str) -> tuple[str, ...]:
    """Return ``value`` (a list or tuple of strings) as a tuple; a bare string or anything else raises."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"Nodes({name}={value!r}): {name} is a list of {what}, e.g. {name}=[...]")
    items = tuple(value)
    bad = [item for item in items if not isinstance(item, str)]
    if bad:
        raise TypeError(f"Nodes({name}=...): every item is a string; {bad[0]!r} is a {type(bad[0]).__name__}")
    return items


def _check_hosts(hosts: tuple[str, ...]) -> None:
    if not hosts:
        raise ValueError(
            "Nodes(hosts=[]): name at least one host, or hosts=None for every node of a Slurm allocation"
        )
    for host in hosts:
        # A leading '-' would reach ssh/srun as an option, whitespace would split the command line.
        if not host or host.startswith("-") or any(c.isspace() for c in host):
            raise ValueError(
                f"Nodes(hosts=...): {host!r} is not a host name (empty, whitespace, or starting with '-'); "
                "give names as ssh or Slurm knows them, e.g. hosts=['gpu-a', 'user@gpu-b']"
            )
    repeated = sorted({host for host in hosts if hosts.count(host) > 1})
    if repeated:
        raise ValueError(
            f"Nodes(hosts=...): {', '.join(repeated)} listed more than once; each node runs num_processes ranks, "
            "so raise num_processes instead of repeating a host"
        )


def _check_address(address: str) -> None:
    try:
        ipaddress.ip_address(address)
        return
    except ValueError:
        pass
    if not _INTERFACE.match(address):
        raise ValueError(
            f"Nodes(address={address!r}): not an IP address nor a network interface name; give the kernel's "
            "address that every node reaches (e.g. address='10.0.0.5') or its interface (e.g. address='ib0')"
        )


def _check_seconds(name: str, value: object) -> float:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"Nodes({name}={value!r}): {name} is a number of seconds above 0")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class Nodes:
    """Which machines a launch runs on, the engine that places the ranks there, and per-node options."""

    hosts: tuple[str, ...] | None = None
    """Host names, node 0 first. SSH: as the user's ssh knows them. Slurm: a subset of the allocation's
    nodes (None: all of them)."""
    engine: str | None = None
    """``"slurm"`` or ``"ssh"``; None: ``"ssh"`` when ``hosts`` are given, else ``"slurm"``."""
    job_id: str | None = None
    """Slurm: the allocation to place the steps in; None: the one this kernel runs in (``SLURM_JOB_ID``)."""
    ssh_options: tuple[str, ...] = ()
    """SSH: extra ``ssh`` arguments, e.g. ``("-i", "~/.ssh/cluster", "-p", "2222")``."""
    python: str | None = None
    """The Python to run on every node; None: this kernel's ``sys.executable`` (a shared filesystem)."""
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    """Environment variables set for the agent and every rank on every node."""
    workdir: str | None = None
    """The absolute directory the agents and ranks start in; None: this kernel's working directory."""
    address: str | None = None
    """An IP address or interface name of this machine that agents and ranks use to reach it; None: the
    address on the route to the first node."""
    join_timeout: float = DEFAULT_JOIN_TIMEOUT
    """Seconds every node's agent has to connect back before the launch fails, naming the missing node."""
    heartbeat: float = DEFAULT_HEARTBEAT
    """Seconds between heartbeats; silence for 5 of them means the node (or the kernel) is lost."""

    def __post_init__(self) -> None:
        hosts = None if self.hosts is None else _strings("hosts", self.hosts, "host names")
        if hosts is not None:
            _check_hosts(hosts)
        engine = self.engine if self.engine is not None else ("slurm" if hosts is None else "ssh")
        if engine not in ENGINES:
            raise ValueError(f"Nodes(engine={engine!r}): engine is one of {', '.join(map(repr, ENGINES))}")
        if engine == "ssh" and hosts is None:
            raise ValueError(
                "Nodes(engine='ssh'): name the hosts to reach, e.g. Nodes(hosts=['gpu-a', 'gpu-b'])"
            )
        job_id = self._checked_job_id(engine)
        ssh_options = _strings("ssh_options", self.ssh_options, "ssh arguments")
        if ssh_options and engine != "ssh":
            raise ValueError(
                f"Nodes(ssh_options={list(ssh_options)!r}) with engine='slurm': srun places the ranks, so ssh "
                "options would be ignored; drop them, or use engine='ssh' with hosts=[...]"
            )
        object.__setattr__(self, "hosts", hosts)
        object.__setattr__(self, "engine", engine)
        object.__setattr__(self, "job_id", job_id)
        object.__setattr__(self, "ssh_options", ssh_options)
        object.__setattr__(self, "env", self._checked_env())
        self._check_paths()
        if self.address is not None:
            if not isinstance(self.address, str):
                raise TypeError(
                    f"Nodes(address={self.address!r}): address is a string (an IP or interface name)"
                )
            _check_address(self.address)
        object.__setattr__(self, "join_timeout", _check_seconds("join_timeout", self.join_timeout))
        object.__setattr__(self, "heartbeat", _check_seconds("heartbeat", self.heartbeat))

    def _checked_job_id(self, engine: str) -> str | None:
        job_id = self.job_id
        if job_id is None:
            return None
        if engine != "slurm":
            raise ValueError(
                f"Nodes(job_id={job_id!r}) with engine={engine!r}: a job id names a Slurm allocation"
            )
        if isinstance(job_id, int) and not isinstance(job_id, bool):
            job_id = str(job_id)
        if not isinstance(job_id, str) or not _JOB_ID.match(job_id):
            raise ValueError(
                f"Nodes(job_id={job_id!r}): not a Slurm job id; give the number squeue shows, e.g. job_id='1234'"
            )
        return job_id

    def _checked_env(self) -> dict[str, str]:
        if not isinstance(self.env, Mapping):
            raise TypeError(f"Nodes(env={self.env!r}): env is a dict of variable names to string values")
        env = dict(self.env)
        for key, value in env.items():
            if not isinstance(key, str) or not _ENV_NAME.match(key):
                raise ValueError(
                    f"Nodes(env=...): {key!r} is not an environment variable name (letters, digits, _)"
                )
            if not isinstance(value, str):
                raise TypeError(
                    f"Nodes(env=...): the value of {key} is a {type(value).__name__} ({value!r}); "
                    f"give a string, e.g. env={{{key!r}: {str(value)!r}}}"
                )
        return env

    def _check_paths(self) -> None:
        if self.python is not None and (not isinstance(self.python, str) or not self.python.strip()):
            raise ValueError(
                f"Nodes(python={self.python!r}): give the Python to run on the nodes, e.g. python='/opt/venv/bin/python'"
            )
        if self.workdir is not None and (
            not isinstance(self.workdir, str) or not self.workdir.startswith("/")
        ):
            raise ValueError(
                f"Nodes(workdir={self.workdir!r}): give an absolute directory that exists on every node, "
                "e.g. workdir='/home/me/project'"
            )

    @classmethod
    def of(cls, value: object) -> Nodes:
        """Return ``value`` as a ``Nodes``: ``"slurm"``, ``"slurm:<jobid>"``, a list of host names, or a ``Nodes``."""
        if isinstance(value, Nodes):
            return value
        if isinstance(value, str):
            engine, _, job_id = value.partition(":")
            if engine == "slurm" and not _:
                return cls(engine="slurm")
            if engine == "slurm" and job_id:
                return cls(engine="slurm", job_id=job_id)
            raise ValueError(f"nodes={value!r} is not one of the forms: {_FORMS}")
        if isinstance(value, (list, tuple)):
            return cls(hosts=tuple(value), engine="ssh")
        raise TypeError(f"nodes={value!r} (a {type(value).__name__}) is not one of the forms: {_FORMS}")
