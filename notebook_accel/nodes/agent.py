"""The per-node agent (``python -m notebook_accel.nodes.agent``): starts this node's ranks for the kernel and relays them.

A placement engine (``srun`` or ``ssh``) starts it on each node; the kernel writes the bootstrap
line (JSON: kernel address and port, the launch's secret in hex, node index, heartbeat, protocol
version) on its stdin, so the secret is on no command line. It connects back, proves the secret
(``channel``), says ``Hello`` and serves the kernel's messages (``protocol``: the one module both
sides import):

- ``Start``: start a batch of ranks with the launcher's own ``start_worker("spawn", ...)`` (each
  function travels by value in its spec), answered by one ``Started``; their stdout, stderr and result
  pipes are relayed as ``Output`` (every chunk read in one round of the selector, in one frame),
  ``Eof``, and their end as ``Exited`` (a start's ``wid`` names it: a restarted rank is a new one);
- ``Signal``: to the rank's process group (stop, interrupt, kill);
- ``StackRequest``: those ranks asked for their stacks (``launch.stackdump``), the dumps sent back as ``Stacks``;
- ``Listen``: a Unix socket here whose connections travel as streams to the kernel
  (``OpenStream`` / ``FromStreams`` and ``ToStreams`` / ``CloseStream``: a round's bytes of every stream
  in one message), for the interactive ranks;
- ``Heartbeat``: answered at once (``protocol.OWN_BEAT_AFTER``); ``End``: end the ranks and exit.

It ends its ranks and exits when the connection closes or the kernel is silent for
``LOST_AFTER`` heartbeats (the kernel was killed, restarted, or cut off).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import selectors
import signal
import socket
import sys
import threading
import time
import types
from dataclasses import replace
from typing import Any

import psutil

from ..launch.doctor import StackCollector
from ..launch.procs import WorkerProcess, start_worker
from ..launch.supervisor import RankSupervisor
from ..launch.usage import UsageSampler
from ..launch.worker import WorkerSpec, threads_per_worker
from ..utils._wire import unix_socket_path
from . import protocol as wire
from .channel import Channel, ChannelError, connect_channel
from .protocol import OWN_BEAT_AFTER, RELAY_ENV_PREFIX

__all__ = ["Agent", "main", "route_interface"]

logger = logging.getLogger(__name__)

_READ = 1 << 16


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
        # The ranks' pipes and exits, on this selector: the supervision the kernel uses for its local ranks.
        self.pipes = RankSupervisor(self._on_data, self._on_eof, self._on_exit, selector=self.sel)
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
        self._last_sent = 0.0
        self._usage_changes = wire.UsageChanges()
        self._chunks: list[wire.Chunk] = []  # read in this round of the selector, sent as one Output
        self._stream_chunks: list[tuple[int, bytes]] = []  # relayed in this round, sent as one FromStreams

    # ---------------------------------------------------------------- threads

    def serve(self) -> str:
        """Relay until the kernel ends the session or is lost; end every rank; return why it ended."""
        reader = threading.Thread(target=self._read_kernel, name="agent-reader", daemon=True)
        reader.start()
        try:
            while self.ended is None:
                now = time.monotonic()
                if now - self._last_sent >= OWN_BEAT_AFTER * self.heartbeat:  # the kernel's beats stopped coming
                    self._send(wire.Heartbeat())
                if wire.silent(self.channel, self.last_heard, self.heartbeat, now):
                    self.ended = f"the kernel was silent for {now - self.last_heard:.1f} s"
                    break
                for key, _ in self.sel.select(min(self.heartbeat, 0.5)):
                    self._on_ready(key)
                if self.pipes.polling:  # a rank started without an exit descriptor
                    self.pipes.poll_exits()
                self._flush()
                self._run_tasks()
                if self.sampler.due(time.monotonic()):
                    self._send_usage()
        finally:
            self._shutdown()
        return self.ended

    def _read_kernel(self) -> None:
        try:
            while self.ended is None:
                message = wire.receive(self.channel, wire.TO_AGENT)
                self.last_heard = time.monotonic()
                self._dispatch(message)
        except ChannelError as exc:
            self.ended = self.ended or f"the connection to the kernel closed ({exc})"
        except wire.ProtocolError as exc:
            self.ended = self.ended or f"the kernel sent what this agent does not understand: {exc}"
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

    def _send(self, message: wire.Message) -> None:
        """Send ``message`` (from any thread); a closed connection ends the session."""
        try:
            wire.send(self.channel, message)
            self._last_sent = time.monotonic()
        except ChannelError as exc:
            self.ended = self.ended or f"the connection to the kernel closed ({exc})"

    def _emit(self, message: wire.Message) -> None:
        """Send ``message`` from the relay thread, after the output read before it (order per rank)."""
        self._flush()
        self._send(message)

    def _flush(self) -> None:
        if self._chunks:
            chunks, self._chunks = self._chunks, []
            self._send(wire.Output(chunks))
        if self._stream_chunks:
            chunks, self._stream_chunks = self._stream_chunks, []
            self._send(wire.FromStreams(chunks))

    # ---------------------------------------------------------------- kernel messages

    def _dispatch(self, message: wire.Message) -> None:
        if isinstance(message, wire.Start):
            self._later(lambda: self._start(message))
        elif isinstance(message, wire.Signal):
            local = self.ranks.get(message.wid)  # by the start's id: a restarted rank is another process
            if local is not None and not local.exited:
                local.proc.signal_group(message.signum)
        elif isinstance(message, wire.StackRequest):
            threading.Thread(target=self._stacks, args=(message,), daemon=True).start()
        elif isinstance(message, wire.Listen):
            self._later(lambda: self._listen(message.token))
        elif isinstance(message, wire.ToStreams):
            for stream_id in message.stream_ids:  # one command, the same bytes for each of these ranks
                conn = self._streams.get(stream_id)
                if conn is not None:
                    try:
                        conn.sendall(message.data)
                    except OSError:
                        self._later(lambda sid=stream_id: self._close_stream(sid, tell=True))
        elif isinstance(message, wire.CloseStream):
            self._later(lambda: self._close_stream(message.stream_id, tell=False))
        elif isinstance(message, wire.Heartbeat):
            if time.monotonic() - self._last_sent >= self.heartbeat / 2:  # any message counts as a heartbeat
                self._send(wire.Heartbeat())
        elif isinstance(message, wire.End):
            self.ended = "the kernel ended the session"

    def _start(self, start: wire.Start) -> None:
        for entry in start.sys_path:  # the kernel's own entries that exist here (a shared file system)
            if entry not in sys.path and os.path.isdir(entry):
                sys.path.append(entry)
        pids, failed = {}, {}
        for item in start.ranks:
            try:
                pids[item.wid] = self._start_rank(item.spec, item.wid)
            except Exception as exc:
                failed[item.wid] = f"{type(exc).__name__}: {exc}"
        self._emit(wire.Started(start.request, pids, failed))

    def _start_rank(self, spec: WorkerSpec, wid: int) -> int:
        """Start one rank, its pipes watched by the selector; return its pid."""
        local_count = sum(1 for r in self.ranks.values() if not r.exited) + 1
        stacks_path = self.collector.path(spec.rank)
        if os.path.exists(stacks_path):
            # The file of this rank's previous attempt: it would say "answering" to the collector before
            # the new process is (and the collector would read from the old file's end).
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
        except BaseException:
            for read_end, write_end in pipes.values():
                os.close(read_end)
                os.close(write_end)
            raise
        local = self.ranks[wid] = _LocalRank(spec.rank, proc, wid)
        for name, (read_end, write_end) in pipes.items():
            os.close(write_end)
            local.fds[read_end] = name
        self.pipes.add([local])
        self.sampler.sample(local.usage)
        return proc.pid

    def _stacks(self, request: wire.StackRequest) -> None:
        targets = {
            local.rank: local.proc.pid
            for wid in request.wids
            if (local := self.ranks.get(wid)) is not None and not local.exited
        }
        try:
            stacks = self.collector.collect(targets) if targets else {}
        except OSError:
            stacks = {}
        self._send(wire.Stacks(request.request, stacks))

    def _listen(self, token: str) -> None:
        path = unix_socket_path("notebook_accel-relay-")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(64)
        self._relays[token] = (listener, path)
        self.env[RELAY_ENV_PREFIX + token] = path
        self.sel.register(listener, selectors.EVENT_READ, ("accept", token))
        self._emit(wire.Listening(token, path))

    # ---------------------------------------------------------------- local events

    def _on_ready(self, key: selectors.SelectorKey) -> None:
        if self.pipes.dispatch(key):  # a rank's pipe or exit
            return
        kind, data = key.data
        if kind == "wake":
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        elif kind == "accept":
            conn, _ = key.fileobj.accept()
            stream_id = next(self._stream_ids)
            self._streams[stream_id] = conn
            self.sel.register(conn, selectors.EVENT_READ, ("conn", stream_id))
            self._emit(wire.OpenStream(data, stream_id))
        elif kind == "conn":
            try:
                chunk = key.fileobj.recv(_READ)
            except OSError:
                chunk = b""
            if chunk:
                self._stream_chunks.append((data, chunk))  # sent in this round's one FromStreams
            else:
                self._close_stream(data, tell=True)

    def _on_data(self, local: _LocalRank, name: str, chunk: bytes) -> None:
        self._chunks.append(wire.Chunk(local.wid, name, chunk))  # sent in this round's one Output

    def _on_eof(self, local: _LocalRank, name: str) -> None:
        self._emit(wire.Eof(local.wid, name))
        self._maybe_forget(local)

    def _on_exit(self, local: _LocalRank) -> None:
        """The rank was reaped (what it left behind killed first) by the supervisor."""
        self.sampler.sample(local.usage)
        self.sampler.forget(local.proc.pid)
        self._emit(wire.Exited(local.wid, local.proc.exitcode))
        self._maybe_forget(local)

    def _maybe_forget(self, local: _LocalRank) -> None:
        """Release a rank that ended and whose pipes are drained (a restart starts a new one)."""
        if local.exited and not local.fds and self.ranks.get(local.wid) is local:
            self.pipes.forget(local)
            local.proc.close()
            del self.ranks[local.wid]

    def _send_usage(self) -> None:
        figures = {}
        for local in list(self.ranks.values()):
            if not local.exited:
                self.sampler.sample(local.usage)
                figures[local.rank] = {k: v for k, v in vars(local.usage).items() if k != "pid"}
        figures = self._usage_changes.select(figures, time.monotonic())
        if figures:
            self._emit(wire.Usage(figures))

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
            self._emit(wire.CloseStream(stream_id))

    def _shutdown(self) -> None:
        """End every rank (SIGKILL to its group), close what is open, tell the kernel if it still listens."""
        self.pipes.close()  # kills and reaps a rank still running, closes its read ends, releases it
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
    try:
        wire.check_version(boot.get("protocol"), "the kernel")
    except wire.ProtocolVersionError as exc:
        raise SystemExit(f"notebook_accel agent: {exc}") from None
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
        wire.send(channel, wire.Hello(wire.PROTOCOL_VERSION, int(boot["node"]), wire.local_versions(), info))
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
