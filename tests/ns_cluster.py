"""A real cluster on one machine: Linux network namespaces as nodes, real sshd and Slurm daemons.

Each node is a network namespace with its own address on a bridge of our own (``10.231.N.0/24``, N
picked free per run, so runs side by side on one machine never share a subnet); the root namespace
(where the test process, "the kernel", runs) holds the bridge's ``.1`` address. Nothing outside these
addresses is ever contacted. On the nodes:

- one ``sshd`` per namespace, listening on the node's address, with a host key and a client key made
  here (``ssh_options`` carries ``-F`` to an ssh config naming each node, the key, known_hosts off);
- ``munged`` with a generated key, ``slurmctld`` in the root namespace (``SlurmctldHost`` the machine's
  hostname with the bridge address in parentheses) and one ``slurmd -N nK`` per namespace (``NodeAddr``
  the namespace's address): ``salloc -N 2 --no-shell`` gives an allocation and ``srun`` steps run inside
  the nodes' namespaces.

``NsCluster(count)`` builds ``count`` nodes (2 for most tests, 8 for tests/test_cluster_eight_nodes.py);
two clusters live side by side in one run, each with its own subnet, keys, daemons, ports and
``slurm.conf`` (only the first exports ``SLURM_CONF``, see ``export_slurm_conf``).

The namespaces share the filesystem, so every node has this repository's venv Python and source at
the same paths, as on a cluster with a shared home. ``python tests/ns_cluster.py [COUNT]`` builds one and
waits (Ctrl-C tears it down): handy for trying a launch by hand.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from notebook_accel.utils.atomic_files import _pid_alive  # one home for "is this pid alive"

__all__ = ["NsCluster", "NsClusterUnavailable", "unavailable_reason"]

_REGISTRY = Path("/run/notebook_accel_ns_cluster")
_TOOLS = (
    "ip",
    "sshd",
    "ssh",
    "ssh-keygen",
    "munged",
    "slurmctld",
    "slurmd",
    "salloc",
    "srun",
    "scontrol",
    "sinfo",
)
_SBIN = ("/usr/sbin", "/sbin")


_BUILT: list[NsCluster] = []  # clusters of this process (the session fixture's), for daemon_pids()


def daemon_pids() -> set[int]:
    """Return the pids of every cluster daemon this process started and of their descendants.

    The daemons are children of the test process for the whole session; the leak checks of the
    launcher tests (``launcher_helpers.live_children``) leave them out.
    """
    found: set[int] = set()
    for cluster in _BUILT:
        for process in cluster._daemons.values():
            if process.poll() is not None:
                continue
            found.add(process.pid)
            try:
                found.update(child.pid for child in psutil.Process(process.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
    return found


class NsClusterUnavailable(RuntimeError):
    """This machine cannot build the namespace cluster (not root, no ``ip netns``, a package missing)."""


def _which(tool: str) -> str | None:
    return shutil.which(tool) or next(
        (f"{d}/{tool}" for d in _SBIN if os.access(f"{d}/{tool}", os.X_OK)), None
    )


def unavailable_reason() -> str | None:
    """Return why this machine cannot build the cluster, or None when it can."""
    if sys.platform != "linux":
        return "the namespace cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the namespace cluster needs root (ip netns, daemons); run the suite as root, as CI does"
    missing = [tool for tool in _TOOLS if _which(tool) is None]
    if missing:
        return (
            f"the namespace cluster needs {', '.join(missing)}: "
            "apt-get install slurm-wlm munge openssh-server openssh-client iproute2"
        )
    probe = f"nacprobe{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"`ip netns add` fails here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(argv: list[str], **kwargs) -> str:
    """Run ``argv``; return its stdout; raise naming the command and its stderr when it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}"
        )
    return done.stdout


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _claim_subnet() -> int:
    """Return a subnet number N of 10.231.N.0/24 that no live run uses, removing a dead run's leftovers."""
    _REGISTRY.mkdir(mode=0o700, exist_ok=True)
    for number in range(1, 250):
        slot = _REGISTRY / str(number)
        try:
            slot.mkdir()
        except FileExistsError:
            owner = slot / "pid"
            try:
                pid = int(owner.read_text())
            except (OSError, ValueError):
                # A slot being claimed right now, or one whose owner died before writing its pid.
                if time.time() - slot.stat().st_mtime < 60:
                    continue
                pid = -1
            if pid > 0 and _pid_alive(pid):
                continue
            _remove_network(number, count=_leftover_count(number))
            shutil.rmtree(slot, ignore_errors=True)
            try:
                slot.mkdir()
            except FileExistsError:
                continue
        (slot / "pid").write_text(str(os.getpid()))
        return number
    raise NsClusterUnavailable(f"no free 10.231.N.0/24 subnet left: {_REGISTRY} lists 249 live runs")


def _names(number: int, index: int) -> tuple[str, str, str]:
    """Return (namespace, veth in the root namespace, its peer) of node ``index`` of run ``number``."""
    return f"nac{number}n{index}", f"nac{number}v{index}", f"nac{number}p{index}"


def _leftover_count(number: int) -> int:
    """Return the highest node index of run ``number`` that still has a namespace or a veth here (0: none)."""
    found = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found += " ".join(path.name for path in Path("/etc/netns").glob(f"nac{number}n*"))
    indexes = [int(i) for i in re.findall(rf"\bnac{number}[nv](\d+)\b", found)]
    return max(indexes, default=0)


def _remove_network(number: int, count: int) -> None:
    """Delete the namespaces (killing what still runs in them), veths and bridge of run ``number``."""
    for index in range(1, count + 1):
        namespace, veth, _ = _names(number, index)
        _kill_namespace(namespace)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)
    subprocess.run(["ip", "link", "del", f"nac{number}br"], capture_output=True)


def _namespace_pids(namespace: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _kill_namespace(namespace: str) -> list[int]:
    """SIGKILL every process in ``namespace``; return their pids."""
    pids = _namespace_pids(namespace)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


class NsCluster:
    """Nodes ``n1``..``nK`` as network namespaces with sshd and slurmd, built by ``start()``, ended by ``close()``.

    ``export_slurm_conf``: set ``SLURM_CONF`` in this process's environment for as long as the cluster
    lives, so that every Slurm client started here talks to it. A second cluster of the same session
    passes False: its own calls (``allocate``, ``release``, ...) name its configuration, and a test of
    it sets ``SLURM_CONF`` from ``client_env()`` for what it starts itself.
    """

    def __init__(self, count: int = 2, *, export_slurm_conf: bool = True) -> None:
        reason = unavailable_reason()
        if reason:
            raise NsClusterUnavailable(reason)
        if not 1 <= count <= 90:
            raise ValueError(
                f"NsCluster(count={count!r}): give 1 to 90 nodes (they take .2 up of one /24 subnet, "
                "below the .99 that no node may have)"
            )
        self.count = count
        self.export_slurm_conf = export_slurm_conf
        self.number = _claim_subnet()
        self.root = Path(tempfile.mkdtemp(prefix=f"nac-cluster{self.number}-"))
        self.nodes = [f"n{i}" for i in range(1, count + 1)]
        self.bridge = f"nac{self.number}br"
        self.bridge_address = f"10.231.{self.number}.1"
        self.addresses = {node: f"10.231.{self.number}.{i + 1}" for i, node in enumerate(self.nodes, start=1)}
        self.namespaces = {node: _names(self.number, i)[0] for i, node in enumerate(self.nodes, start=1)}
        self.ssh_config = self.root / "ssh_config"
        self.ssh_options: tuple[str, ...] = ("-F", str(self.ssh_config))
        self.slurm_conf = self.root / "slurm" / "slurm.conf"
        self._daemons: dict[str, subprocess.Popen] = {}
        _BUILT.append(self)
        self._jobs: list[str] = []
        self._saved_env: dict[str, str | None] = {}

    # ----- building
    def start(self) -> NsCluster:
        """Build the network, the keys and the daemons; return self once every node is idle in Slurm."""
        try:
            self._build_network()
            self._start_ssh()
            self._start_slurm()
        except BaseException:
            self.close()
            raise
        return self

    def _build_network(self) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for index, node in enumerate(self.nodes, start=1):
            namespace, veth, peer = _names(self.number, index)
            _run(["ip", "netns", "add", namespace])
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", peer])
            _run(["ip", "link", "set", peer, "netns", namespace])
            _run(["ip", "link", "set", veth, "master", self.bridge])
            _run(["ip", "link", "set", veth, "up"])
            inside = ["ip", "-n", namespace]
            _run([*inside, "link", "set", peer, "name", "eth0"])
            _run([*inside, "addr", "add", f"{self.addresses[node]}/24", "dev", "eth0"])
            _run([*inside, "link", "set", "eth0", "up"])
            _run([*inside, "link", "set", "lo", "up"])
            _run([*inside, "route", "add", "default", "via", self.bridge_address])
            self._write_hosts(namespace, node)

    def _write_hosts(self, namespace: str, node: str) -> None:
        # `ip netns exec` bind-mounts /etc/netns/<namespace>/hosts over /etc/hosts for what it starts (the
        # daemons, hence every step and ssh session): as on a real node, the machine's own name resolves to
        # the node's address (gloo binds the address of the host name), and the other nodes resolve by name.
        folder = Path("/etc/netns") / namespace
        folder.mkdir(parents=True, exist_ok=True)
        others = [f"{address} {name}" for name, address in self.addresses.items() if name != node]
        lines = [
            "127.0.0.1 localhost",
            f"{self.addresses[node]} {socket.gethostname()} {node}",
            *others,
            f"{self.bridge_address} nac-kernel",  # the root namespace, where the kernel runs
            "",
        ]
        (folder / "hosts").write_text("\n".join(lines))
        # No name server inside: a look-up of a name outside the cluster fails at once (refused on the node's
        # own loopback) instead of waiting for a server nothing here may contact.
        (folder / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

    def _start_ssh(self) -> None:
        keys = self.root / "ssh"
        keys.mkdir(mode=0o700)
        for name in ("host_key", "client_key"):
            _run(
                [
                    "ssh-keygen",
                    "-q",
                    "-t",
                    "ed25519",
                    "-N",
                    "",
                    "-C",
                    f"nac-cluster-{name}",
                    "-f",
                    str(keys / name),
                ]
            )
        shutil.copy(keys / "client_key.pub", keys / "authorized_keys")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        lines = []
        for node in self.nodes:
            lines += [
                f"Host {node}",
                f"    HostName {self.addresses[node]}",
            ]
            config = keys / f"sshd_{node}.conf"
            config.write_text(
                "\n".join(
                    [
                        f"ListenAddress {self.addresses[node]}",
                        "Port 22",
                        f"HostKey {keys / 'host_key'}",
                        f"AuthorizedKeysFile {keys / 'authorized_keys'}",
                        f"PidFile {keys / f'sshd_{node}.pid'}",
                        "PermitRootLogin prohibit-password",
                        "PasswordAuthentication no",
                        "KbdInteractiveAuthentication no",
                        "UsePAM no",
                        "StrictModes no",
                        "PrintMotd no",
                        "LogLevel ERROR",
                        "MaxStartups 100:30:200",
                        "",
                    ]
                )
            )
            self._spawn(
                f"sshd {node}",
                ["ip", "netns", "exec", self.namespaces[node], _which("sshd"), "-D", "-e", "-f", str(config)],
                keys / f"sshd_{node}.log",
            )
        # Two hosts that fail as real ones do: nothing listens on port 1 of n2 (ssh: Connection refused), and
        # no node has the .99 address of the bridge (ssh: No route to host, after ARP gives up).
        lines += [
            "Host refusing",
            f"    HostName {self.addresses[self.nodes[-1]]}",
            "    Port 1",
            "Host silent",
            f"    HostName 10.231.{self.number}.99",
            "    ConnectTimeout 3",
        ]
        lines += [
            "Host *",
            "    User root",
            f"    IdentityFile {keys / 'client_key'}",
            "    IdentitiesOnly yes",
            "    StrictHostKeyChecking no",
            "    UserKnownHostsFile /dev/null",
            "    GlobalKnownHostsFile /dev/null",
            "    LogLevel ERROR",
            "    ConnectTimeout 5",
            "",
        ]
        self.ssh_config.write_text("\n".join(lines))
        for node in self.nodes:
            self._wait_for(
                lambda node=node: self.ssh(node, "true", check=False).returncode == 0, f"sshd on {node}"
            )

    def _slurm_conf_text(self, slurm: Path, ctld_port: int, slurmd_port: int) -> str:
        cpus = os.cpu_count() or 1
        nodes = [
            f"NodeName={n} NodeAddr={self.addresses[n]} CPUs={cpus} RealMemory=1000 State=UNKNOWN"
            for n in self.nodes
        ]
        return "\n".join(
            [
                f"ClusterName=nac{self.number}",
                f"SlurmctldHost={socket.gethostname()}({self.bridge_address})",
                f"SlurmctldPort={ctld_port}",
                f"SlurmdPort={slurmd_port}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={self.root / 'munge' / 'munge.socket'}",
                f"StateSaveLocation={slurm / 'state'}",
                f"SlurmdSpoolDir={slurm / 'spool-%n'}",
                f"SlurmctldPidFile={slurm / 'slurmctld.pid'}",
                f"SlurmdPidFile={slurm / 'slurmd-%n.pid'}",
                f"SlurmctldLogFile={slurm / 'slurmctld.log'}",
                f"SlurmdLogFile={slurm / 'slurmd-%n.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/linear",
                "SchedulerType=sched/builtin",
                "MpiDefault=none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "ReturnToService=2",
                "SlurmdTimeout=30",
                "InactiveLimit=0",
                "KillWait=2",
                "MinJobAge=2",
                "PlugStackConfig=/dev/null",
                *nodes,
                # Several allocations may share the nodes (the tests hold one per module, the benchmark its own).
                "PartitionName=nac Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8",
                "",
            ]
        )

    def _start_slurm(self) -> None:
        munge = self.root / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn(
            "munged",
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={munge / 'munge.socket'}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--log-file={munge / 'munged.log'}",
                f"--seed-file={munge / 'seed'}",
            ],
            munge / "munged.out",
        )
        self._wait_for(lambda: (munge / "munge.socket").exists(), "munged's socket")
        slurm = self.slurm_conf.parent
        (slurm / "state").mkdir(parents=True)
        self.slurm_conf.write_text(self._slurm_conf_text(slurm, _free_port(), _free_port()))
        (slurm / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        # The Slurm clients (salloc, srun, scontrol, and the placement engine under test) read SLURM_CONF.
        if self.export_slurm_conf:
            self._set_env("SLURM_CONF", str(self.slurm_conf))
        self._spawn(
            "slurmctld",
            [_which("slurmctld"), "-D", "-c", "-f", str(self.slurm_conf)],
            slurm / "slurmctld.out",
        )
        for node in self.nodes:
            self._start_slurmd(node)
        self._wait_for(self._all_idle, "every node idle in sinfo", timeout=30 + 10 * self.count)

    def _start_slurmd(self, node: str) -> None:
        slurm = self.slurm_conf.parent
        self._spawn(
            f"slurmd {node}",
            [
                "ip",
                "netns",
                "exec",
                self.namespaces[node],
                _which("slurmd"),
                "-D",
                "-N",
                node,
                "-f",
                str(self.slurm_conf),
            ],
            slurm / f"slurmd-{node}.out",
        )

    def _all_idle(self) -> bool:
        done = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.client_env()
        )
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return all(states.get(node) == "idle" for node in self.nodes)

    def _spawn(self, name: str, argv: list[str], log: Path) -> subprocess.Popen:
        with open(log, "ab") as out:
            process = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self._daemons[name] = process
        return process

    def _wait_for(self, ready, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [name for name, p in self._daemons.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise NsClusterUnavailable(
                    f"the namespace cluster did not come up: waiting for {what}; "
                    f"dead daemons: {dead or 'none'}; logs under {self.root}"
                )
            time.sleep(0.2)

    def _set_env(self, key: str, value: str) -> None:
        self._saved_env.setdefault(key, os.environ.get(key))
        os.environ[key] = value

    # ----- using it
    def client_env(self) -> dict[str, str]:
        """Return this process's environment with ``SLURM_CONF`` naming this cluster (for its Slurm clients)."""
        return {**os.environ, "SLURM_CONF": str(self.slurm_conf)}

    def ssh(
        self, node: str, command: str, check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess:
        """Run ``command`` on ``node`` over ssh; return the finished process."""
        done = subprocess.run(
            ["ssh", *self.ssh_options, "-o", "BatchMode=yes", node, command],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"ssh {node} {command!r}: {done.stderr.strip()}")
        return done

    def exec_in(self, node: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``node``'s namespace directly (no engine); return the finished process."""
        return subprocess.run(
            ["ip", "netns", "exec", self.namespaces[node], *argv], capture_output=True, text=True, **kwargs
        )

    def allocate(self, count: int | None = None) -> str:
        """Return the job id of a new ``salloc -N count --no-shell`` allocation (released at ``close()``)."""
        count = count or self.count
        done = subprocess.run(
            ["salloc", "-N", str(count), "--no-shell", "--immediate=30", "-J", "nac-test"],
            capture_output=True,
            text=True,
            timeout=60,
            env=self.client_env(),
        )
        found = re.search(r"Granted job allocation (\d+)", done.stderr)
        if not found:
            raise RuntimeError(f"salloc -N {count} --no-shell gave no allocation: {done.stderr.strip()}")
        self._jobs.append(found.group(1))
        return found.group(1)

    def release(self, job_id: str) -> None:
        """Cancel allocation ``job_id`` (its steps end with it)."""
        subprocess.run(["scancel", job_id], capture_output=True, env=self.client_env())
        if job_id in self._jobs:
            self._jobs.remove(job_id)

    def allocation_env(self, job_id: str) -> dict[str, str]:
        """Return the variables salloc's shell would set inside allocation ``job_id``."""
        shown = _run(["scontrol", "show", "job", job_id], env=self.client_env())
        nodelist = re.search(r"\bNodeList=(\S+)", shown).group(1)
        return {
            "SLURM_JOB_ID": job_id,
            "SLURM_JOBID": job_id,
            "SLURM_JOB_NODELIST": nodelist,
            "SLURM_NNODES": re.search(r"\bNumNodes=(\d+)", shown).group(1),
            "SLURM_CONF": str(self.slurm_conf),
        }

    def pids(self, node: str) -> list[int]:
        """Return every process running in ``node``'s namespace (the daemons included)."""
        return _namespace_pids(self.namespaces[node])

    def daemon_pids(self, node: str) -> set[int]:
        """Return the pids of ``node``'s sshd and slurmd (and the ``ip netns exec`` they replaced)."""
        return {p.pid for name, p in self._daemons.items() if name.endswith(f" {node}") and p.poll() is None}

    def workload_pids(self, node: str) -> list[int]:
        """Return the processes in ``node``'s namespace other than its sshd and slurmd."""
        daemons = self.daemon_pids(node)
        return [pid for pid in self.pids(node) if pid not in daemons]

    def python_pids(self, node: str) -> list[int]:
        """Return the Python processes in ``node``'s namespace (agents and ranks; no daemon is one)."""
        found = []
        for pid in self.pids(node):
            with contextlib.suppress(OSError):
                if "python" in os.path.basename(os.readlink(f"/proc/{pid}/exe")):
                    found.append(pid)
        return found

    def listening(self, node: str) -> set[str]:
        """Return the TCP and Unix addresses listening in ``node``'s namespace (``ss -Hlntx``)."""
        done = self.exec_in(node, ["ss", "-Hlntx"], timeout=30)
        return {" ".join(line.split()[4:5]) for line in done.stdout.splitlines() if line.strip()}

    def link_down(self, node: str) -> None:
        """Cut ``node`` off the bridge: no packet passes, no connection is closed."""
        _run(["ip", "-n", self.namespaces[node], "link", "set", "eth0", "down"])

    def link_up(self, node: str) -> None:
        """Reconnect ``node`` after ``link_down``."""
        _run(["ip", "-n", self.namespaces[node], "link", "set", "eth0", "up"])
        _run(["ip", "-n", self.namespaces[node], "route", "replace", "default", "via", self.bridge_address])

    def kill_node(self, node: str) -> list[int]:
        """SIGKILL every process of ``node`` (its daemons too), as a crash would; return their pids."""
        return _kill_namespace(self.namespaces[node])

    def revive(self, node: str) -> None:
        """Restart ``node``'s sshd and slurmd after ``kill_node``; return once both answer."""
        keys = self.root / "ssh"
        self._spawn(
            f"sshd {node}",
            [
                "ip",
                "netns",
                "exec",
                self.namespaces[node],
                _which("sshd"),
                "-D",
                "-e",
                "-f",
                str(keys / f"sshd_{node}.conf"),
            ],
            keys / f"sshd_{node}.log",
        )
        self._start_slurmd(node)
        self._wait_for(lambda: self.ssh(node, "true", check=False).returncode == 0, f"sshd on {node}")

    # ----- ending
    def close(self) -> None:
        """Release allocations, stop the daemons by pid, delete namespaces, bridge and files."""
        for job_id in list(self._jobs):
            self.release(job_id)
        for process in reversed(list(self._daemons.values())):
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for process in self._daemons.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self._daemons.clear()
        _remove_network(self.number, self.count)
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(_REGISTRY / str(self.number), ignore_errors=True)

    def __enter__(self) -> NsCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    with NsCluster(int(sys.argv[1]) if len(sys.argv) > 1 else 2) as cluster:
        print(f"nodes {cluster.addresses}, bridge {cluster.bridge_address}")
        print(f"export SLURM_CONF={cluster.slurm_conf}; ssh {' '.join(cluster.ssh_options)} n1")
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
