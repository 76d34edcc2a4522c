"""The kernel's view of ranks that run on other nodes, with the interfaces ``LaunchHandle`` already supervises.

``RemoteWorkerProcess`` is a ``launch.interfaces.WorkerProcess``: its stdout, stderr and result
pipe are real local pipes, written by the node's channel thread as the agent relays the bytes, and
its ``sentinel`` is a pipe that becomes readable when the agent reports the exit. So the handle's
supervisor, output, events, errors and restarts work unchanged. ``RemoteStacks`` is the group's
``StackSource`` (the agent signals its local ranks and sends the dumps back), and ``RemoteUsage`` its
``UsageSource`` (the agent samples CPU and memory where the rank runs).
"""

from __future__ import annotations

import errno
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from ..launch.doctor import RankStack
from ..launch.interfaces import StackSource, UsageSource, WorkerProcess
from ..utils._worker_channel import FRAME_HEADER
from .protocol import Signal

__all__ = ["NODE_LOST", "RemoteStacks", "RemoteUsage", "RemoteWorkerProcess"]

NODE_LOST = "NodeLost"
"""The exception type named in a rank's failure when its node (or its agent) was lost."""
_MAX_PAD = 1 << 24
_REAP_SECONDS = 10.0  # how long kill_and_reap waits for the agent's word before counting the rank lost


class RemoteWorkerProcess(WorkerProcess):
    """A rank on another node: ``WorkerProcess``'s interface over the agent's messages."""

    def __init__(self, node: Any, rank: int, out_w: int, err_w: int, res_w: int, wid: int) -> None:
        self.node, self.rank, self.wid = node, rank, wid
        self.pid: int | None = None
        self.exitcode: int | None = None
        self._fds = {
            name: os.dup(fd) for name, fd in (("stdout", out_w), ("stderr", err_w), ("result", res_w))
        }
        self.sentinel, self._sentinel_w = os.pipe()
        self._lock = threading.Lock()
        self._frame_left = 0  # bytes still to come of the result frame being relayed
        self._frame_header = b""

    # --------------------------------------------------------- fed by the node's channel thread

    def feed(self, kind: str, data: bytes) -> None:
        """Write relayed bytes into the local pipe the handle reads (blocks while it is full)."""
        with self._lock:
            fd = self._fds.get(kind)
            if fd is None:
                return
            if kind == "result":
                self._track_frames(data)
            _write_all(fd, data)

    def _track_frames(self, data: bytes) -> None:
        """Follow the result stream's frame boundaries (lengths only), so a lost node's note never splits a frame."""
        view = memoryview(data)
        while view:
            if self._frame_left:
                step = min(self._frame_left, len(view))
                self._frame_left -= step
                view = view[step:]
                continue
            need = FRAME_HEADER.size - len(self._frame_header)
            self._frame_header += bytes(view[:need])
            view = view[need:]
            if len(self._frame_header) == FRAME_HEADER.size:
                (self._frame_left,) = FRAME_HEADER.unpack(self._frame_header)
                self._frame_header = b""

    def end_stream(self, kind: str) -> None:
        """Close the local pipe of ``kind`` (the rank closed its end)."""
        with self._lock:
            fd = self._fds.pop(kind, None)
        if fd is not None:
            os.close(fd)

    def exited(self, code: int | None) -> None:
        """Record the exit code the agent reported and wake the supervisor."""
        if self.exitcode is not None:
            return
        self.exitcode = code if code is not None else -signal.SIGKILL
        try:
            os.write(self._sentinel_w, b"x")
        except OSError:
            pass

    def lost(self, reason: str) -> None:
        """The node is gone: the rank fails with ``reason`` (unless it already ended), its pipes close."""
        with self._lock:
            fd = self._fds.get("result")
            if fd is not None and self.exitcode is None:
                # A truncated frame is completed with zeros (it fails to unpickle), then the note follows.
                pad = self._frame_left
                if self._frame_header:  # a header cut short: zeros complete it, then its body
                    missing = FRAME_HEADER.size - len(self._frame_header)
                    (body,) = FRAME_HEADER.unpack(self._frame_header + b"\0" * missing)
                    pad = missing + body
                note = pickle.dumps(("err", NODE_LOST, reason, ""))
                if pad <= _MAX_PAD:  # else the exit by SIGKILL tells it
                    try:
                        _write_all(fd, b"\0" * pad + FRAME_HEADER.pack(len(note)) + note)
                    except OSError:
                        pass
                self._frame_left, self._frame_header = 0, b""
        for kind in ("stdout", "stderr", "result"):
            self.end_stream(kind)
        self.exited(-signal.SIGKILL)

    # --------------------------------------------------------- WorkerProcess's interface

    def poll(self) -> int | None:
        """Return the exit code once the agent reported it (negative: the signal that ended it)."""
        return self.exitcode

    def signal_group(self, signum: int) -> None:
        """Have the agent send ``signum`` to the rank's process group on its node."""
        if self.exitcode is None:
            self.node.send_quietly(Signal(self.wid, signum))

    def kill_and_reap(self) -> None:
        """SIGKILL the rank's group through the agent; return once it reported the end (or is lost)."""
        self.signal_group(signal.SIGKILL)
        deadline = time.monotonic() + _REAP_SECONDS
        while self.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.exitcode is None:
            self.lost(f"node {self.node.host} did not confirm that rank {self.rank} ended")

    def kill_leftovers(self) -> None:
        """Nothing to do here: the agent already ended what the rank left in its group."""

    def close(self) -> None:
        """Release the local pipe ends and the sentinel; the node forgets this rank."""
        self.node.procs.pop(self.wid, None)
        for kind in ("stdout", "stderr", "result"):
            self.end_stream(kind)
        for fd in (self.sentinel, self._sentinel_w):
            if fd is not None:
                os.close(fd)
        self.sentinel = self._sentinel_w = None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # the handle closed its end (finished): nothing reads it any more
                return
            raise


class RemoteStacks(StackSource):
    """The stack source of remote ranks: each agent takes its ranks' stacks."""

    def __init__(self, ask: Callable[[dict[int, int]], dict[int, RankStack]]) -> None:
        self._ask = ask
        self._closed = False

    def path(self, rank: int) -> str:
        """Return "" (the agent picks the stacks file on the rank's node)."""
        return ""

    def collect(self, targets: dict[int, tuple[int, int | None]]) -> dict[int, RankStack]:
        """Return ``{rank: RankStack}`` for ``targets`` from their agents; a rank not answered has ``answered`` False."""
        got = self._ask({rank: pid for rank, (pid, _) in targets.items()})
        now = time.time()
        return {
            rank: got.get(rank) or RankStack(rank, pid, (), "", now, answered=False)
            for rank, (pid, _) in sorted(targets.items())
        }

    def closed(self) -> bool:
        """Return True once closed."""
        return self._closed

    def close(self) -> None:
        """Nothing to remove here (each agent removes its stacks files)."""
        self._closed = True


class RemoteUsage(UsageSource):
    """The usage source of remote ranks: the figures the agents sampled, by rank."""

    def __init__(self, figures: dict[int, dict[str, Any]]) -> None:
        self._figures = figures
        self._next = 0.0

    def due(self, now: float) -> bool:
        """Return True about once a second (the agents send their samples as often)."""
        if now < self._next:
            return False
        self._next = now + 1.0
        return True

    def sample(self, status: Any) -> None:
        """Copy the rank's latest figures from its agent into ``status``."""
        figures = self._figures.get(status.rank)
        if not figures:
            return
        for key in ("cpu_percent", "rss"):
            if figures.get(key) is not None:
                setattr(status, key, figures[key])
        peaks = [x for x in (status.peak_rss, figures.get("peak_rss"), figures.get("rss")) if x is not None]
        if peaks:
            status.peak_rss = max(peaks)

    def forget(self, pid: int | None) -> None:
        """Nothing cached per pid here."""
