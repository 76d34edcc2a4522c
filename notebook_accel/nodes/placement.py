"""Placement engines: start one agent per node with the engine the user already has (``srun``, ``ssh``).

A ``Placement`` answers four questions for the kernel side: which nodes (``hosts``, node 0 first),
which address of this machine the nodes reach (``kernel_address``), how to start a command on a node
(``start``: a ``subprocess.Popen`` with stdin, stdout and stderr pipes), and what the engine said when
a node never joined (``failure``: its own stderr and exit code, quoted). Nothing here starts a daemon:
``SlurmPlacement`` runs one ``srun`` step per node inside the allocation, ``SshPlacement`` one ``ssh``.

Each placement drains the engine's stderr in a thread into a bounded tail (so a chatty engine never
blocks on a full pipe); ``failure`` quotes that tail. The agent's stdin and stdout are the caller's.
"""

from __future__ import annotations

import abc
import contextlib
import ipaddress
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence

from .spec import Nodes

__all__ = ["Placement", "PlacementError", "SlurmPlacement", "SshPlacement", "placement_for"]

logger = logging.getLogger(__name__)

AGENT_MODULE = "notebook_accel.nodes.agent"
_TAIL_BYTES = 16_384  # the end of an engine's stderr kept for the error message
_QUOTED_LINES = 12  # lines of it quoted in the error (ssh's or srun's message is in the last few)
_COMMAND_TIMEOUT = (
    30.0  # scontrol / ssh -G answer in milliseconds; a hung controller should not hang us forever
)


class PlacementError(RuntimeError):
    """The engine cannot place ranks as asked (outside an allocation, a host not in it, no srun/ssh)."""


class _StderrTail:
    """Read a pipe to its end in a daemon thread, keeping the last ``_TAIL_BYTES`` bytes."""

    def __init__(self, pipe, label: str) -> None:
        self._pipe = pipe
        self._data = bytearray()
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, name=f"notebook_accel-{label}-stderr", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        fd = self._pipe.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            with self._lock:
                self._data += chunk
                del self._data[:-_TAIL_BYTES]

    def text(self, wait: float = 0.0) -> str:
        """Return the tail read so far (after waiting up to ``wait`` seconds for the pipe's end)."""
        self.thread.join(wait)
        with self._lock:
            return self._data.decode("utf-8", "replace")


def _quote_tail(text: str) -> str:
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[-_QUOTED_LINES:]) if lines else "(nothing on stderr)"


def _run_command(argv: list[str], what: str) -> str:
    """Return ``argv``'s stdout; raise PlacementError quoting its stderr when it fails or is missing."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT)
    except FileNotFoundError:
        raise PlacementError(
            f"{what} needs `{argv[0]}` on this machine's PATH, and it is not there"
        ) from None
    except subprocess.TimeoutExpired:
        raise PlacementError(
            f"{what}: `{shlex.join(argv)}` gave no answer in {_COMMAND_TIMEOUT:.0f} s"
        ) from None
    if done.returncode != 0:
        raise PlacementError(
            f"{what}: `{shlex.join(argv)}` failed (exit {done.returncode}): {_quote_tail(done.stderr)}"
        )
    return done.stdout


def _interface_address(name: str) -> str | None:
    import psutil  # a dependency of the launcher (usage figures); imported where it is needed

    for address in psutil.net_if_addrs().get(name, []):
        if address.family == socket.AF_INET:
            return address.address
    return None


def _route_address(host_address: str) -> str:
    """Return this machine's address on the route to ``host_address`` (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in host_address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host_address, 9))
        return probe.getsockname()[0]


def _resolve(name: str) -> str | None:
    try:
        return socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, IndexError, UnicodeError):
        return None


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


class Placement(abc.ABC):
    """Start one command per node through an engine; see the module docstring for the four questions."""

    name = "placement"

    def __init__(self, nodes: Nodes) -> None:
        self.nodes = nodes
        self._tails: dict[int, _StderrTail] = {}

    # ----- what every engine answers
    @abc.abstractmethod
    def hosts(self) -> list[str]:
        """Return the nodes to run on, node 0 first."""

    @abc.abstractmethod
    def node_address(self, host: str) -> str | None:
        """Return the IP address the engine reaches ``host`` at, or None where it cannot tell."""

    @abc.abstractmethod
    def command(self, host: str, argv: list[str]) -> tuple[list[str], dict[str, str] | None]:
        """Return the engine's argv that runs ``argv`` on ``host``, and the environment to run it with."""

    # ----- shared
    @property
    def python(self) -> str:
        """Return the Python the nodes run: ``Nodes.python``, else this kernel's (a shared filesystem)."""
        return self.nodes.python or sys.executable

    @property
    def workdir(self) -> str:
        """Return the directory agents and ranks start in: ``Nodes.workdir``, else this kernel's."""
        return self.nodes.workdir or os.getcwd()

    def agent_argv(self) -> list[str]:
        """Return the command that runs the agent on a node (``python -m notebook_accel.nodes.agent``)."""
        return [self.python, "-m", AGENT_MODULE]

    def kernel_address(self, hosts: Sequence[str] | None = None) -> str:
        """Return the address of this machine that every node reaches: ``Nodes.address``, else the route's."""
        hosts = list(hosts) if hosts is not None else self.hosts()
        if self.nodes.address is not None:
            return self._named_address(self.nodes.address)
        # The route to the first node that resolves; a loopback answer only counts when every node is local
        # (a login node's own name often resolves to 127.0.1.1, which the compute nodes cannot reach).
        seen: list[str] = []
        for host in hosts:
            address = self.node_address(host)
            if address is None:
                continue
            route = _route_address(address)
            seen.append(route)
            if not _is_loopback(route):
                return route
        if seen:
            return seen[0]
        raise PlacementError(
            f"cannot tell which address of this machine the nodes reach: none of {', '.join(hosts)} resolves here; "
            "name it: Nodes(..., address='10.0.0.5') or address='<interface>'"
        )

    def _named_address(self, address: str) -> str:
        with contextlib.suppress(ValueError):
            return str(ipaddress.ip_address(address))
        found = _interface_address(address)
        if found is None:
            import psutil

            names = ", ".join(sorted(psutil.net_if_addrs()))
            raise PlacementError(
                f"Nodes(address={address!r}): this machine has no IPv4 interface {address!r} (it has {names})"
            )
        return found

    def start(self, index: int, host: str, argv: list[str]) -> subprocess.Popen:
        """Start ``argv`` on ``host`` through the engine; return its Popen (stdin, stdout, stderr pipes)."""
        engine_argv, env = self.command(host, argv)
        logger.debug("node %d (%s): %s", index, host, shlex.join(engine_argv))
        try:
            popen = subprocess.Popen(
                engine_argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,  # the kernel's Ctrl-C/SIGINT reaches the ranks through the agent, not the engine
            )
        except FileNotFoundError:
            raise PlacementError(
                f"nodes: the {self.name} engine needs `{engine_argv[0]}` on this machine's PATH"
            ) from None
        self._tails[index] = _StderrTail(popen.stderr, f"{self.name}-{host}")
        return popen

    def stderr_text(self, index: int, wait: float = 0.0) -> str:
        """Return what node ``index``'s engine has written to stderr so far (its last 16 KB)."""
        tail = self._tails.get(index)
        return tail.text(wait) if tail is not None else ""

    def stop(self, popen: subprocess.Popen, timeout: float = 3.0) -> int:
        """End the engine process (SIGTERM, then SIGKILL after ``timeout``); return its exit code."""
        if popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                popen.send_signal(signal.SIGTERM)
            try:
                popen.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    popen.kill()
                popen.wait()
        return popen.returncode

    def failure(self, index: int, host: str, popen: subprocess.Popen) -> str:
        """Return the engine's own account of why node ``index`` (``host``) never joined: exit code and stderr."""
        running = popen.poll() is None
        if running:
            self.stop(popen)
        stderr = _quote_tail(self.stderr_text(index, wait=2.0))
        if running:
            return f"{self.name} to {host} was still running without connecting back (stopped now); its stderr: {stderr}"
        code = popen.returncode
        how = f"killed by signal {-code}" if code < 0 else f"exit {code}"
        return f"{self.describe(host)} failed ({how}): {stderr}"

    def describe(self, host: str) -> str:
        """Return how the engine reaches ``host``, for messages (``ssh n2``, ``srun -w n2 (job 12)``)."""
        return f"{self.name} {host}"


class SshPlacement(Placement):
    """One ``ssh`` per host, as the user's ssh is set up (config, keys, agent), plus ``Nodes.ssh_options``."""

    name = "ssh"

    def hosts(self) -> list[str]:
        """Return ``Nodes.hosts`` (ssh itself says whether each one exists, when started)."""
        return list(self.nodes.hosts or ())

    def node_address(self, host: str) -> str | None:
        """Return the address ssh would connect to for ``host`` (its config's HostName, resolved)."""
        try:
            shown = _run_command(
                ["ssh", "-G", *self.nodes.ssh_options, host], "nodes: reading ssh's configuration"
            )
        except PlacementError as error:
            logger.debug("ssh -G %s: %s", host, error)
            return None
        found = re.search(r"^hostname\s+(\S+)", shown, re.MULTILINE)
        return _resolve(found.group(1) if found else host.rpartition("@")[2])

    def command(self, host: str, argv: list[str]) -> tuple[list[str], dict[str, str] | None]:
        """Return ``ssh -T -o BatchMode=yes [options] host -- cd WORKDIR && exec env K=V... argv``."""
        env = [f"{key}={value}" for key, value in self.nodes.env.items()]
        remote = f"cd {shlex.quote(self.workdir)} && exec env {shlex.join([*env, *argv])}"
        # BatchMode first: ssh keeps the first value of an option, so a prompt can never block the launch.
        return ["ssh", "-T", "-o", "BatchMode=yes", *self.nodes.ssh_options, host, "--", remote], None


class SlurmPlacement(Placement):
    """One ``srun`` step per node inside the allocation (``--overlap``: it shares the nodes with the ranks)."""

    name = "srun"

    def __init__(self, nodes: Nodes) -> None:
        super().__init__(nodes)
        self._job_id: str | None = None
        self._addresses: dict[str, str | None] = {}

    def job_id(self) -> str:
        """Return the allocation's job id: ``Nodes.job_id``, else this kernel's ``SLURM_JOB_ID``."""
        job_id = self.nodes.job_id or os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID")
        if not job_id:
            raise PlacementError(
                "nodes='slurm': this kernel is not inside a Slurm allocation (SLURM_JOB_ID is not set). Start "
                "Jupyter in one (salloc -N 2 ..., or a JupyterHub / Open OnDemand session on 2 nodes), or pass "
                "the job id of an allocation you hold: nodes='slurm:<jobid>' (squeue --me lists them)"
            )
        return job_id

    def _allocation_hosts(self, job_id: str) -> list[str]:
        nodelist = None
        if not self.nodes.job_id and os.environ.get("SLURM_JOB_NODELIST"):
            nodelist = os.environ["SLURM_JOB_NODELIST"]
        else:
            shown = _run_command(["scontrol", "show", "job", job_id], f"nodes: reading Slurm job {job_id}")
            state = re.search(r"\bJobState=(\S+)", shown)
            if state and state.group(1) != "RUNNING":
                raise PlacementError(
                    f"nodes: Slurm job {job_id} is {state.group(1)}, not RUNNING: its nodes cannot run steps; "
                    "pass the id of a running allocation (squeue --me -t running)"
                )
            found = re.search(r"\bNodeList=(\S+)", shown)
            nodelist = found.group(1) if found else ""
        names = _run_command(
            ["scontrol", "show", "hostnames", nodelist], "nodes: expanding the allocation's node list"
        )
        return names.split()

    def hosts(self) -> list[str]:
        """Return the allocation's nodes (or ``Nodes.hosts``, each checked to be one of them)."""
        job_id = self.job_id()
        allocated = self._allocation_hosts(job_id)
        self._job_id = job_id
        if self.nodes.hosts is None:
            return allocated
        unknown = [host for host in self.nodes.hosts if host not in allocated]
        if unknown:
            raise PlacementError(
                f"nodes: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a node of Slurm job {job_id} "
                f"(its nodes: {', '.join(allocated)}); name nodes of the allocation, or hosts=None for all of them"
            )
        return list(self.nodes.hosts)

    def node_address(self, host: str) -> str | None:
        """Return ``host``'s ``NodeAddr`` from ``scontrol show node``, resolved."""
        if host not in self._addresses:
            try:
                shown = _run_command(["scontrol", "show", "node", host], f"nodes: reading Slurm node {host}")
                found = re.search(r"\bNodeAddr=(\S+)", shown)
                self._addresses[host] = _resolve(found.group(1) if found else host)
            except PlacementError as error:
                logger.debug("scontrol show node %s: %s", host, error)
                self._addresses[host] = None
        return self._addresses[host]

    def command(self, host: str, argv: list[str]) -> tuple[list[str], dict[str, str] | None]:
        """Return ``srun --jobid J --nodes 1 --ntasks 1 -w host --overlap ... argv`` and its environment."""
        job_id = self._job_id or self.job_id()
        engine = [
            "srun", "--jobid", job_id, "--nodes", "1", "--ntasks", "1", "-w", host, "--overlap",
            "--kill-on-bad-exit=1", "--quiet", "--job-name", "notebook_accel-agent",
            "--chdir", self.workdir, "--export", "ALL",
        ]  # fmt: skip
        # srun carries its own environment to the step (--export ALL), so Nodes.env never shows in any argv.
        env = {**os.environ, **self.nodes.env}
        return [*engine, *argv], env

    def describe(self, host: str) -> str:
        """Return ``srun -w host (job J)`` for messages."""
        return f"srun -w {host} (Slurm job {self._job_id or self.nodes.job_id or '?'})"


def placement_for(nodes: Nodes) -> Placement:
    """Return the placement engine ``nodes.engine`` names (``Nodes.of`` turns the short forms into a Nodes)."""
    nodes = Nodes.of(nodes)
    if nodes.engine == "slurm":
        if shutil.which("srun") is None:
            raise PlacementError(
                "nodes='slurm' needs Slurm's srun and scontrol on this machine's PATH (module load slurm?), "
                "or use SSH: nodes=['host-a', 'host-b']"
            )
        return SlurmPlacement(nodes)
    if shutil.which("ssh") is None:
        raise PlacementError(
            f"nodes={list(nodes.hosts or ())!r} places ranks with ssh, and there is no ssh on PATH"
        )
    return SshPlacement(nodes)
