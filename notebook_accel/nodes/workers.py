"""The kernel's view of ranks that run on other nodes, with the interfaces ``LaunchHandle`` already supervises.

``RemoteWorkerProcess`` is a ``launch.interfaces.WorkerProcess`` of a pushing backend: the node's
channel thread pushes the bytes the agent relays (stdout, stderr, result), the streams' ends and the
exit into the launch's inbox (``launch.interfaces.RankEvents``), in the order the agent sent them; no
local pipe or descriptor per rank. So the handle's supervisor, output, events, errors and restarts
work unchanged. ``RemoteStacks`` is the group's ``StackSource`` (the agent signals its local ranks
and sends the dumps back), and ``RemoteUsage`` its ``UsageSource`` (the agent samples CPU and memory
where the rank runs).
"""

from __future__ import annotations

import pickle
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from ..launch.doctor import RankStack
from ..launch.interfaces import RankEvents, StackSource, UsageSource, WorkerProcess
from ..utils._worker_channel import FRAME_HEADER
from .protocol import Signal

__all__ = ["NODE_LOST", "RemoteStacks", "RemoteUsage", "RemoteWorkerProcess"]

NODE_LOST = "NodeLost"
"""The exception type named in a rank's failure when its node (or its agent) was lost."""
_MAX_PAD = 1 << 24
_REAP_SECONDS = 10.0  # how long kill_and_reap waits for the agent's word before counting the rank lost


class RemoteWorkerProcess(WorkerProcess):
    """A rank on another node: ``WorkerProcess``'s interface over the agent's messages."""

    def __init__(self, node: Any, rank: int, inbox: RankEvents, wid: int) -> None:
        self.node, self.rank, self.wid = node, rank, wid
        self.pid: int | None = None
        self.exitcode: int | None = None
        self.sentinel = None  # the exit is an event of the inbox
        self._inbox = inbox
        self._open = {"stdout", "stderr", "result"}  # the streams not ended yet
        self._lock = threading.Lock()
        self._frame_left = 0  # bytes still to come of the result frame being relayed
        self._frame_header = b""

    # --------------------------------------------------------- fed by the node's channel thread

    def feed(self, kind: str, data: bytes) -> None:
        """Push relayed bytes into the launch's inbox (waits while the handle is behind)."""
        with self._lock:
            if kind not in self._open:
                return
            if kind == "result":
                self._track_frames(data)
            self._inbox.data(self, kind, data)

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
        """Report the end of ``kind`` (the rank closed its end); once."""
        with self._lock:
            if kind in self._open:
                self._open.discard(kind)
                self._inbox.end(self, kind)

    def exited(self, code: int | None) -> None:
        """Record the exit code the agent reported and tell the supervisor."""
        with self._lock:
            if self.exitcode is not None:
                return
            self.exitcode = code if code is not None else -signal.SIGKILL
            self._inbox.exited(self)

    def lost(self, reason: str) -> None:
        """The node is gone: the rank fails with ``reason`` (unless it already ended), its streams end."""
        with self._lock:
            if "result" in self._open and self.exitcode is None:
                # A truncated frame is completed with zeros (it fails to unpickle), then the note follows.
                pad = self._frame_left
                if self._frame_header:  # a header cut short: zeros complete it, then its body
                    missing = FRAME_HEADER.size - len(self._frame_header)
                    (body,) = FRAME_HEADER.unpack(self._frame_header + b"\0" * missing)
                    pad = missing + body
                note = pickle.dumps(("err", NODE_LOST, reason, ""))
                if pad <= _MAX_PAD:  # else the exit by SIGKILL tells it
                    self._inbox.data(self, "result", b"\0" * pad + FRAME_HEADER.pack(len(note)) + note)
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
        """The node forgets this rank (what it relays later is dropped); nothing local to release."""
        self.node.procs.pop(self.wid, None)
        with self._lock:
            self._open.clear()


class RemoteStacks(StackSource):
    """The stack source of remote ranks: each agent takes its ranks' stacks."""

    def __init__(self, ask: Callable[[dict[int, int]], dict[int, RankStack]]) -> None:
        self._ask = ask
        self._closed = False

    def path(self, rank: int) -> str:
        """Return "" (the agent picks the stacks file on the rank's node)."""
        return ""

    def collect(self, targets: dict[int, int]) -> dict[int, RankStack]:
        """Return ``{rank: RankStack}`` for ``targets`` from their agents; a rank not answered has ``answered`` False."""
        got = self._ask(dict(targets))
        now = time.time()
        return {
            rank: got.get(rank) or RankStack(rank, pid, (), "", now, answered=False)
            for rank, pid in sorted(targets.items())
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
        self._copied: dict[int, dict[str, Any]] = {}  # rank -> its figures last copied (new with each Usage)

    def due(self, now: float) -> bool:
        """Return True about once a second (the agents send their samples as often)."""
        if now < self._next:
            return False
        self._next = now + 1.0
        return True

    def sample(self, status: Any) -> None:
        """Copy the rank's latest figures from its agent into ``status``; nothing when none came since the last copy.

        An idle rank's agent sends nothing new (``protocol.UsageChanges``): a thousand of them cost no copy.
        """
        figures = self._figures.get(status.rank)
        if not figures or self._copied.get(status.rank) is figures:
            return
        self._copied[status.rank] = figures
        for key in ("cpu_percent", "rss"):
            if figures.get(key) is not None:
                setattr(status, key, figures[key])
        peaks = [x for x in (status.peak_rss, figures.get("peak_rss"), figures.get("rss")) if x is not None]
        if peaks:
            status.peak_rss = max(peaks)

    def forget(self, pid: int | None) -> None:
        """Nothing cached per pid here."""
