"""Where each rank of a launch stands: ``RankStatus`` (public snapshot) and ``_Rank`` (the parent's books)."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any

from .events import FrameDecoder
from .output import LineSplitter
from .procs import WorkerProcess
from .states import State

__all__ = ["RankStatus"]

_STDERR_TAIL = 300  # stderr lines kept per rank (room for a faulthandler dump of every thread)


@dataclass
class RankStatus:
    """Where one rank stands."""

    rank: int
    pid: int | None
    state: State
    """``STARTING``, ``RUNNING``, ``SUCCEEDED``, ``FAILED`` or ``STOPPED`` (a ``State``: equal to ``"running"``...)."""
    started_at: float
    ended_at: float | None = None
    exitcode: int | None = None
    last_line: str = ""
    cpu_percent: float | None = None
    """CPU % of the worker process (100 = one core), sampled about once a second; at the end its
    average over the run. None only before the rank started."""
    rss: int | None = None
    """Resident memory of the worker process in bytes (the last sample once it ended)."""
    peak_rss: int | None = None
    """Highest resident memory seen (bytes), kept after the rank ended."""
    cuda_allocated: int | None = None
    """Bytes of CUDA memory held by tensors (None unless the rank initialised CUDA)."""
    cuda_reserved: int | None = None
    """Bytes of CUDA memory reserved by the caching allocator."""
    cuda_peak: int | None = None
    """Peak of ``cuda_allocated`` (torch.cuda.max_memory_allocated)."""
    attempt: int = 1
    """Which try of the launch this rank belongs to: 2 and up after restarts (``max_restarts``)."""
    node: str | None = None
    """The host the rank runs on in a launch across nodes (``nodes=``); None on this machine."""

    def __post_init__(self) -> None:
        self.state = State(self.state)  # "running" given by hand becomes State.RUNNING


class _Rank:
    """Parent-side bookkeeping of one worker."""

    def __init__(
        self, rank: int, local_rank: int, attempt: int = 1, node: int | None = None, host: str | None = None
    ) -> None:
        self.rank, self.local_rank, self.node = rank, local_rank, node
        self.proc: WorkerProcess | None = None
        self.status = RankStatus(rank, None, State.STARTING, time.time(), attempt=attempt, node=host)
        self.fds: dict[int, str] = {}  # open parent-side read ends -> "stdout" | "stderr" | "result"
        self.splitters: dict[str, LineSplitter] = {}
        self.decoder = FrameDecoder()
        self.result_done = False
        self.exited = False
        self.value: Any = None
        self.message: tuple | None = None
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL)
        self.last_activity = time.monotonic()
