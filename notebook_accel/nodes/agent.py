"""The per-node agent (``python -m notebook_accel.nodes.agent``): starts this node's ranks for the kernel and relays them.

A placement engine (``srun`` or ``ssh``) starts it on each node; the kernel writes the bootstrap
line (JSON: kernel address and port, the launch's secret in hex, node index, heartbeat) on its
stdin, so the secret is on no command line. It connects back, proves the secret (``channel``), then
reports its versions and serves the kernel's messages:

- ``("start", spec, sys_path, id)``: start one rank with the launcher's own ``start_worker("spawn", ...)``
  (the function travels by value in ``spec.payload``); its stdout, stderr and result pipe are
  relayed as ``("out", id, kind, bytes)`` / ``("eof", id, kind)``, its end as ``("exit", id, code)``
  (``id`` names one start of a rank: a restarted rank is a new one);
- ``("signal", id, signum)``: to the rank's process group (stop, interrupt, kill);
- ``("stacks", request, ids)``: ``STACKS_SIGNAL`` to those ranks, their dumps sent back as ``RankStack``s;
- ``("listen", token)``: a Unix socket here whose connections travel as streams to the kernel
  (``open_stream`` / ``stream`` / ``close_stream``), for the interactive ranks;
- ``("hb",)``: heartbeats, sent back as often; ``("end",)``: end the ranks and exit.

It ends its ranks and exits when the connection closes or the kernel is silent for
``LOST_AFTER`` heartbeats (the kernel was killed, restarted, or cut off).
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import logging
import os
import platform
import queue
import selectors
import signal
import socket
import sys
import tempfile
import threading
import time
import types
from dataclasses import replace
from typing import Any

import psutil

from ..launch.doctor import StackCollector
from ..launch.plan import threads_per_worker
from ..launch.procs import WorkerProcess, start_worker
from ..launch.usage import UsageSampler
from ..launch.worker import WorkerSpec
from .channel import Channel, ChannelError, connect_channel

__all__ = ["LOST_AFTER", "RELAY_ENV_PREFIX", "Agent", "local_versions", "main", "route_interface"]

logger = logging.getLogger(__name__)

LOST_AFTER = 5
"""Heartbeats of silence after which the other side counts as lost."""
RELAY_ENV_PREFIX = "NOTEBOOK_ACCEL_RELAY_"
"""A rank finds the Unix socket of relay ``token`` in ``$NOTEBOOK_ACCEL_RELAY_<token>``."""
_READ = 1 << 16


def local_versions() -> dict[str, str]:
    """Return the versions a node must share with the kernel: Python (major.minor), torch, notebook-accel."""
    versions = {"python": ".".join(platform.python_version_tuple()[:2])}
    for distribution in ("torch", "notebook-accel"):
        try:
            versions[distribution] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            versions[distribution] = "not installed"
    return versions


def _gpu_count() -> int:
    """Return this node's visible CUDA devices; 0 without importing torch where no NVIDIA driver is loaded."""
    if not os.path.exists("/proc/driver/nvidia/gpus"):
        return 0
    import torch

    return torch.cuda.device_count()


def route_interface(address: str) -> str | None:
    """Return the name of this machine's network interface on the route to ``address`` (None if unknown)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # UDP: no packet is sent, the kernel only picks the route
            local = probe.getsockname()[0]
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == local for a in addrs):
            return name
    return None


class _LocalRank:
    """One rank this agent started: its process, pipe read ends and usage figures."""

    def __init__(self, rank: int, proc: WorkerProcess, wid: int) -> None:
        self.rank, self.proc, self.wid = rank, proc, wid
        self.fds: dict[int, str] = {}
        self.exited = False
        self.usage = types.SimpleNamespace(pid=proc.pid, cpu_percent=None, rss=None, peak_rss=None)


class Agent:
    """Serves one kernel connection until it ends; ``serve()`` returns the reason."""

    def __init__(self, channel: Channel, node: int, heartbeat: float, kernel_address: str) -> None:
        self.channel, self.node, self.heartbeat = channel, node, heartbeat
        self.ranks: dict[int, _LocalRank] = {}
        self.sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.collector = StackCollector()
        self.sampler = UsageSampler()
        self.last_heard = time.monotonic()
        self.ended: str | None = None
        self.env: dict[str, str] = {}
        iface = route_interface(kernel_address)
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if iface and name not in os.environ:
                # The interface that reaches the kernel: the host name may resolve to one the peers cannot reach.
                self.env[name] = iface
        self._relays: dict[str, tuple[socket.socket, str]] = {}
        self._streams: dict[int, socket.socket] = {}
        self._stream_ids = itertools.count(1)

    # ---------------------------------------------------------------- threads

    def serve(self) -> str:
        """Relay until the kernel ends the session or is lost; end every rank; return why it ended."""
        reader = threading.Thread(target=self._read_kernel, name="agent-reader", daemon=True)
        reader.start()
        next_beat = 0.0
        try:
            while self.ended is None:
                now = time.monotonic()
                if now >= next_beat:
                    self._send(("hb",))
                    next_beat = now + self.heartbeat
                if now - self.last_heard > LOST_AFTER * self.heartbeat:
                    self.ended = f"the kernel was silent for {now - self.last_heard:.1f} s"
                    break
                for key, _ in self.sel.select(min(self.heartbeat, 0.5)):
                    self._on_ready(key)
                self._run_tasks()
                if self.sampler.due(time.monotonic()):
                    self._send_usage()
        finally:
            self._shutdown()
        return self.ended

    def _read_kernel(self) -> None:
        try:
            while self.ended is None:
                message = self.channel.recv()
                self.last_heard = time.monotonic()
                self._dispatch(message)
        except ChannelError as exc:
            self.ended = self.ended or f"the connection to the kernel closed ({exc})"
        except Exception as exc:  # a bug here must not leave ranks running unsupervised
            logger.exception("agent reader failed")
            self.ended = self.ended or f"the agent failed: {exc!r}"
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _later(self, task: Any) -> None:
        """Run ``task()`` on the relay thread (the one that owns the selector)."""
        self._tasks.put(task)
        self._wake()

    def _run_tasks(self) -> None:
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                return
            task()

    def _send(self, message: tuple) -> None:
        try:
            self.channel.send(message)
        except ChannelError as exc:
            self.ended = self.ended or f"the connection to the kernel closed ({exc})"

    # ---------------------------------------------------------------- kernel messages

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "hb":
            return
        if kind == "start":
            self._later(lambda: self._start(*message[1:]))
        elif kind == "signal":
            local = self.ranks.get(message[1])  # by the start's id: a restarted rank is another process
            if local is not None and not local.exited:
                local.proc.signal_group(message[2])
        elif kind == "stacks":
            threading.Thread(target=self._stacks, args=message[1:], daemon=True).start()
        elif kind == "listen":
            self._later(lambda: self._listen(message[1]))
        elif kind == "stream":
            conn = self._streams.get(message[1])
            if conn is not None:
                try:
                    conn.sendall(message[2])
                except OSError:
                    self._later(lambda: self._close_stream(message[1], tell=True))
        elif kind == "close_stream":
            self._later(lambda: self._close_stream(message[1], tell=False))
        elif kind == "end":
            self.ended = "the kernel ended the session"
        else:
            logger.warning("agent: unknown message %r ignored", kind)

    def _start(self, spec: WorkerSpec, sys_path: list[str], wid: int) -> None:
        for entry in sys_path:  # the kernel's own entries that exist here (a shared file system)
            if entry not in sys.path and os.path.isdir(entry):
                sys.path.append(entry)
        local_count = sum(1 for r in self.ranks.values() if not r.exited) + 1
        stacks_path = self.collector.path(spec.rank)
        if os.path.exists(stacks_path):
            # The file of this rank's previous attempt: it would say "handler installed" to the collector
            # before the new process has one, and STACKS_SIGNAL would kill it.
            os.unlink(stacks_path)
        spec = replace(
            spec,
            env={**self.env, **spec.env},
            parent_pid=os.getpid(),  # the ranks die with this agent
            close_fds=(),
            stacks_path=stacks_path,
            store_ports=(),
            num_threads=threads_per_worker(max(local_count, int(spec.env.get("LOCAL_WORLD_SIZE", "1")))),
        )
        pipes = {name: os.pipe() for name in ("stdout", "stderr", "result")}
        try:
            proc = start_worker("spawn", spec, *(pipes[n][1] for n in ("stdout", "stderr", "result")))
        except Exception as exc:
            for read_end, write_end in pipes.values():
                os.close(read_end)
                os.close(write_end)
            self._send(("start_failed", wid, f"{type(exc).__name__}: {exc}"))
            return
        local = self.ranks[wid] = _LocalRank(spec.rank, proc, wid)
        for name, (read_end, write_end) in pipes.items():
            os.close(write_end)
            os.set_blocking(read_end, False)
            local.fds[read_end] = name
            self.sel.register(read_end, selectors.EVENT_READ, ("pipe", (local, name)))
        if proc.sentinel is not None:
            self.sel.register(proc.sentinel, selectors.EVENT_READ, ("exit", local))
        self.sampler.sample(local.usage)
        self._send(("started", wid, proc.pid))

    def _stacks(self, request_id: int, wids: list[int]) -> None:
        targets = {
            local.rank: (local.proc.pid, local.proc.sentinel)
            for wid in wids
            if (local := self.ranks.get(wid)) is not None and not local.exited
        }
        try:
            stacks = self.collector.collect(targets) if targets else {}
        except OSError:
            stacks = {}
        self._send(("stacks", request_id, stacks))

    def _listen(self, token: str) -> None:
        directory = tempfile.mkdtemp(prefix="notebook_accel-relay-")
        path = os.path.join(directory, "s")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(64)
        self._relays[token] = (listener, path)
        self.env[RELAY_ENV_PREFIX + token] = path
        self.sel.register(listener, selectors.EVENT_READ, ("accept", token))
        self._send(("listening", token, path))

    # ---------------------------------------------------------------- local events

    def _on_ready(self, key: selectors.SelectorKey) -> None:
        kind, data = key.data
        if kind == "wake":
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        elif kind == "pipe":
            self._on_pipe(key.fd, *data)
        elif kind == "exit":
            self.sel.unregister(key.fd)
            self._on_exit(data)
        elif kind == "accept":
            conn, _ = key.fileobj.accept()
            stream_id = next(self._stream_ids)
            self._streams[stream_id] = conn
            self.sel.register(conn, selectors.EVENT_READ, ("conn", stream_id))
            self._send(("open_stream", data, stream_id))
        elif kind == "conn":
            try:
                chunk = key.fileobj.recv(_READ)
            except OSError:
                chunk = b""
            if chunk:
                self._send(("stream", data, chunk))
            else:
                self._close_stream(data, tell=True)

    def _on_pipe(self, fd: int, local: _LocalRank, name: str) -> None:
        try:
            chunk = os.read(fd, _READ)
        except BlockingIOError:
            return
        if chunk:
            self._send(("out", local.wid, name, chunk))
            return
        self.sel.unregister(fd)
        os.close(fd)
        del local.fds[fd]
        self._send(("eof", local.wid, name))
        self._maybe_forget(local)

    def _on_exit(self, local: _LocalRank) -> None:
        local.proc.kill_leftovers()  # what the rank started, while its group id is still certainly ours
        while local.proc.poll() is None:
            time.sleep(0.001)
        local.exited = True
        self.sampler.sample(local.usage)
        self.sampler.forget(local.proc.pid)
        self._send(("exit", local.wid, local.proc.exitcode))
        self._maybe_forget(local)

    def _maybe_forget(self, local: _LocalRank) -> None:
        """Release a rank that ended and whose pipes are drained (a restart starts a new one)."""
        if local.exited and not local.fds and self.ranks.get(local.wid) is local:
            local.proc.close()
            del self.ranks[local.wid]

    def _send_usage(self) -> None:
        figures = {}
        for local in list(self.ranks.values()):
            if not local.exited:
                self.sampler.sample(local.usage)
                figures[local.rank] = {k: v for k, v in vars(local.usage).items() if k != "pid"}
        if figures:
            self._send(("usage", figures))

    def _close_stream(self, stream_id: int, tell: bool) -> None:
        conn = self._streams.pop(stream_id, None)
        if conn is None:
            return
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
        if tell:
            self._send(("close_stream", stream_id))

    def _shutdown(self) -> None:
        """End every rank (SIGKILL to its group), close what is open, tell the kernel if it still listens."""
        for local in list(self.ranks.values()):
            if not local.exited:
                local.proc.kill_and_reap()
                local.exited = True
            for fd in local.fds:
                os.close(fd)
            local.fds.clear()
            local.proc.close()
        for stream_id in list(self._streams):
            self._close_stream(stream_id, tell=False)
        for listener, path in self._relays.values():
            listener.close()
            try:
                os.unlink(path)
                os.rmdir(os.path.dirname(path))
            except OSError:
                pass
        self.collector.close()
        self.sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.channel.close()


def _read_bootstrap() -> dict[str, Any]:
    line = sys.stdin.buffer.readline()
    if not line:
        raise SystemExit(
            "notebook_accel agent: no bootstrap on stdin (it is started by the kernel, not by hand)"
        )
    boot = json.loads(line)
    boot["secret"] = bytes.fromhex(boot["secret"])
    return boot


def main() -> int:
    """Run one agent: bootstrap from stdin, connect back, serve; return the exit code."""
    logging.basicConfig(level=logging.WARNING, format="notebook_accel agent: %(message)s")
    boot = _read_bootstrap()
    address = (boot["address"], int(boot["port"]))
    try:
        channel = connect_channel(address, boot["secret"], timeout=float(boot.get("connect_timeout", 30)))
    except (OSError, ChannelError) as exc:
        print(
            f"notebook_accel agent: cannot reach the kernel at {address[0]}:{address[1]}: {exc}",
            file=sys.stderr,
        )
        return 2
    del boot["secret"]
    info = {"host": socket.gethostname(), "pid": os.getpid(), "gpus": _gpu_count(), "python": sys.executable}
    try:
        channel.send(("hello", int(boot["node"]), local_versions(), info))
    except ChannelError as exc:
        print(f"notebook_accel agent: the kernel closed the connection: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # interrupts reach the ranks through the kernel only
    agent = Agent(channel, int(boot["node"]), float(boot["heartbeat"]), boot["address"])
    reason = agent.serve()
    logger.info("agent of node %s ended: %s", boot["node"], reason)
    return 0


if __name__ == "__main__":
    sys.exit(main())
