"""The stuck-rank doctor: every live rank's Python stacks on demand, and how to read and show them.

How a stack is taken: each worker keeps a thread that appends every thread's stack to a per-rank
file when asked through a named pipe beside it (``stackdump``, started by
``worker._install_fault_reports``); ``StackCollector.collect`` asks the ranks and reads what was
appended. A rank blocked inside a C call (gloo's all_reduce) answers too, and the rank does not stop:
it goes on where it was.

What a stack says: a rank *waits* when its main thread's innermost torch.distributed frame is a
collective or point-to-point call (``all_reduce``, ``barrier``, ``recv``...; ``classify_wait``);
``RankStack.summary()`` says where it is in one phrase. ``describe_stacks`` is the one rendering of
where ranks are, used by every hang report and by the errors of a stop, a timeout or an interrupt;
each rank is named with its node when it runs on another machine. The hang rule that samples these
stacks is in ``hangs.py``. One sample costs each rank a wakeup of its answering thread and about 0.05 ms
of formatting for three threads 25 frames deep (faulthandler's dump of the same: 0.19 ms).
"""

from __future__ import annotations

import functools
import linecache
import os
import re
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .interfaces import StackSource
from .stackdump import answerer, ask

__all__ = [
    "COLLECTIVES",
    "Frame",
    "RankStack",
    "StackCollector",
    "ThreadStack",
    "classify_wait",
    "describe_stacks",
    "nodes_of",
    "parse_dump",
    "named_rank",
    "named_ranks",
]

COLLECTIVES = frozenset(
    {
        "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
        "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
        "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
        "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv", "wait",
        "init_process_group", "new_group", "destroy_process_group",
    }
)  # fmt: skip
"""torch.distributed functions in which a rank waits for its peers."""

CUDA_WAITS = frozenset({"synchronize", "wait_event", "wait_stream", "wait"})
"""torch.cuda functions (``torch.cuda.synchronize``, ``Stream``/``Event`` methods) in which a rank waits for its device."""

# Calls that block until the device finished what was queued (an nccl collective included) but leave no
# Python frame of their own: the rank's innermost Python frame is the line that made them.
_SYNC_CALL = re.compile(
    r"\.(item|tolist|cpu|numpy|wait|synchronize)\(\s*\)|\.to\(\s*['\"]cpu['\"]|\.to\(\s*device\s*=\s*['\"]cpu['\"]"
)
_SEP = os.sep
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep

_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)(?: \[.*\])? \(most recent call first\):$")
_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')
_ANSWER_SECONDS = 1.0
_SETTLE_SECONDS = 0.03  # a dump holding the worker's main line is complete once it stopped growing this long
_QUIET_SECONDS = 0.3  # one without it, once it stopped growing this long
# ``ThreadStack.runs_the_function``'s frame, as a raw dump writes it:
_MAIN_LINE = re.compile(r'^  File ".*worker\.py", line \d+ in worker_main$', re.MULTILINE)


@dataclass(frozen=True)
class Frame:
    """One Python frame of a stack."""

    filename: str
    lineno: int
    function: str

    @property
    def source(self) -> str:
        """Return the frame's source line ("" when the file cannot be read here)."""
        return linecache.getline(self.filename, self.lineno).strip()

    def where(self) -> str:
        """Return ``file.py:42`` (the base name)."""
        return f"{os.path.basename(self.filename)}:{self.lineno}"


@dataclass(frozen=True)
class ThreadStack:
    """One thread's frames, innermost first."""

    ident: str
    current: bool
    frames: tuple[Frame, ...]

    def render(self) -> str:
        """Return the thread as faulthandler prints it, each frame followed by its source line as in a traceback.

        The launcher's frames below the worker's main function are left out.
        """
        frames = self.frames
        for i, frame in enumerate(frames):
            if frame.function == "worker_main" and frame.filename.endswith("worker.py"):
                frames = frames[: i + 1]
                break
        lines = [f"{'Current thread' if self.current else 'Thread'} {self.ident} (most recent call first):"]
        for f in frames:
            lines.append(f'  File "{f.filename}", line {f.lineno} in {f.function}')
            source = f.source
            if source:
                lines.append(f"    {source}")
        return "\n".join(lines)

    @property
    def runs_the_function(self) -> bool:
        """Return True for the thread running the launched function (the worker's main line)."""
        return any(f.function == "worker_main" and f.filename.endswith("worker.py") for f in self.frames)


@dataclass(frozen=True)
class RankStack:
    """Every thread's stack of one rank at ``time`` (``answered`` False: no dump came back in time).

    ``text`` is what to read: every thread, each frame with its source line. ``dump`` is the raw dump
    in faulthandler's format (file, line and function only).
    """

    rank: int
    pid: int | None
    threads: tuple[ThreadStack, ...]
    dump: str
    time: float = field(default_factory=time.time)
    answered: bool = True
    io: int | None = None
    """Bytes the rank had read and written through system calls (``/proc/<pid>/io``), just after the dump,
    less those of its stacks answering thread (``io_bytes``)."""
    node: str | None = None
    """The host the rank runs on, in a launch across nodes (``nodes=``)."""

    @functools.cached_property
    def text(self) -> str:
        """Return every thread's stack, the main one first, each frame followed by its source line."""
        ordered = sorted(self.threads, key=lambda t: not t.runs_the_function)
        return "\n\n".join(thread.render() for thread in ordered)

    @property
    def main(self) -> ThreadStack | None:
        """Return the thread running the launched function (else the first one)."""
        for thread in self.threads:
            if thread.runs_the_function:
                return thread
        return self.threads[0] if self.threads else None

    def collective(self, device_sync: bool = False) -> str | None:
        """Return what the main thread waits in for its peers (``"all_reduce"``), or None when it does not wait.

        With ``device_sync`` (ranks on CUDA with nccl, whose collectives return before they complete)
        a synchronisation with the device counts too: ``"torch.cuda.synchronize"``, ``".item()"``.
        """
        main = self.main
        return classify_wait(main.frames, device_sync) if main is not None else None

    def user_frame(self) -> Frame | None:
        """Return the innermost frame of the main thread outside torch and notebook_accel."""
        main = self.main
        for frame in main.frames if main else ():
            path = frame.filename
            if f"{os.sep}torch{os.sep}" not in path and f"{os.sep}notebook_accel{os.sep}" not in path:
                return frame
        return main.frames[0] if main and main.frames else None

    def summary(self) -> str:
        """Return where the rank is, in one phrase: ``in all_reduce (train.py:40)`` or ``at train.py:42 (time.sleep(9))``."""
        if not self.answered:
            return "did not answer (its stacks could not be taken)"
        frame = self.user_frame()
        collective = self.collective()
        if collective is not None:
            return f"in {collective}" + (f" ({frame.where()})" if frame else "")
        if frame is None:
            return "in no Python frame"
        source = frame.source
        return f"in {frame.function} at {frame.where()}" + (f" ({source})" if source else "")


def classify_wait(frames: tuple[Frame, ...], device_sync: bool = False) -> str | None:
    """Return the wait a stack (innermost frame first) sits in, or None when it is elsewhere (computing, sleeping).

    A torch.distributed collective or point-to-point call is named by its function (``"barrier"``,
    ``"recv"``). With ``device_sync``, also a wait for the device: a ``torch.cuda`` synchronisation
    (``"torch.cuda.synchronize"``), or, since ``tensor.item()`` and ``work.wait()`` are C calls with
    no Python frame, a user line whose innermost call is one of those (``".item()"``, ``".wait()"``).
    """
    for frame in frames:
        path = frame.filename
        if f"{_SEP}torch{_SEP}distributed{_SEP}" in path and frame.function in COLLECTIVES:
            return frame.function
        if device_sync and f"{_SEP}torch{_SEP}cuda{_SEP}" in path and frame.function in CUDA_WAITS:
            return f"torch.cuda.{frame.function}"
    if device_sync and frames and not _is_library(frames[0].filename):
        match = _SYNC_CALL.search(frames[0].source)
        if match is not None:
            return f".{match.group(1)}()" if match.group(1) else '.to("cpu")'
    return None


def _is_library(path: str) -> bool:
    """Return True for a frame of torch, of ours, of an installed package or of the standard library."""
    parts = ("torch", __name__.partition(".")[0], "site-packages", "dist-packages")  # ours: this package
    return any(f"{_SEP}{part}{_SEP}" in path for part in parts) or path.startswith(_STDLIB)


def parse_dump(text: str) -> tuple[ThreadStack, ...]:
    """Return the threads of one faulthandler dump (``all_threads=True``), frames innermost first."""
    threads: list[ThreadStack] = []
    ident, current, frames = None, False, []
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            if ident is not None:
                threads.append(ThreadStack(ident, current, tuple(frames)))
            ident, current, frames = header.group(2), header.group(1) == "Current thread", []
            continue
        frame = _FRAME.match(line)
        if frame and ident is not None:
            frames.append(Frame(frame.group(1), int(frame.group(2)), frame.group(3)))
    if ident is not None:
        threads.append(ThreadStack(ident, current, tuple(frames)))
    return tuple(threads)


class StackCollector(StackSource):
    """The per-rank stacks files of one launch, and taking every live rank's stacks at once."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="notebook_accel-stacks-")
        self._lock = threading.Lock()

    def path(self, rank: int) -> str:
        """Return the file rank ``rank``'s worker dumps its stacks into."""
        return os.path.join(self.directory, f"rank_{rank}.txt")

    def collect(self, targets: dict[int, int]) -> dict[int, RankStack]:
        """Return ``{rank: RankStack}`` for ``targets`` (``{rank: pid}``), within about a second.

        After ``close()`` (the launch ended) it returns {}.
        """
        with self._lock:
            if not os.path.isdir(self.directory):
                return {}
            start: dict[int, int] = {}
            answerers: dict[int, int | None] = {}
            for rank in targets:
                path = self.path(rank)
                if not os.path.exists(path):  # the worker's answering thread has not started yet
                    continue
                size = os.path.getsize(path)
                answerers[rank] = answerer(path)
                if ask(path):
                    start[rank] = size
            texts = _wait_for_dumps({rank: self.path(rank) for rank in start}, start)
        now = time.time()
        out = {}
        for rank, pid in sorted(targets.items()):
            text = texts.get(rank)
            threads = parse_dump(text) if text else ()
            io = io_bytes(pid, leave_out=answerers.get(rank))
            out[rank] = RankStack(rank, pid, threads, text or "", now, answered=bool(threads), io=io)
        return out

    def closed(self) -> bool:
        """Return True once ``close()`` removed the stacks files (the launch ended)."""
        return not os.path.isdir(self.directory)

    def close(self) -> None:
        """Remove the stacks files, once a collection under way (the hang rule's, a user's) has read them."""
        with self._lock:
            for name in os.listdir(self.directory) if os.path.isdir(self.directory) else ():
                os.unlink(os.path.join(self.directory, name))
            if os.path.isdir(self.directory):
                os.rmdir(self.directory)


def io_bytes(pid: int, leave_out: int | None = None) -> int | None:
    """Return the bytes ``pid`` has read plus written through system calls so far (None where unknown).

    ``leave_out``: a thread of ``pid`` (native id) whose bytes do not count: the rank's stacks answering
    thread (``stackdump.answerer``), so that taking a rank's stacks never reads as the rank's progress.
    """
    total = _io_counted(f"/proc/{pid}/io")
    if total is None or leave_out is None:
        return total
    own = _io_counted(f"/proc/{pid}/task/{leave_out}/io")
    return total - own if own is not None else total


def _io_counted(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            fields = dict(line.split(": ", 1) for line in f.read().splitlines() if ": " in line)
        return int(fields["rchar"]) + int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return None


def _wait_for_dumps(paths: dict[int, str], start: dict[int, int]) -> dict[int, str]:
    """Return each rank's dump once complete: written up to the worker's main line, or quiet for long.

    The main thread comes last (``stackdump.format_stacks``, as faulthandler does), so the worker's main
    line (the thread running ``worker_main``, its first) ends a dump: a dump that holds it and stopped
    growing is complete. One that stopped growing without it (written in parts on a busy machine, or a
    rank outside the function) is taken once quiet for ``_QUIET_SECONDS``.
    """
    deadline = time.monotonic() + _ANSWER_SECONDS
    seen: dict[int, tuple[int, float]] = {}  # rank -> (size, since when)
    read: dict[int, tuple[int, str]] = {}  # rank -> (size, text) last read
    texts: dict[int, str] = {}
    while len(texts) < len(paths) and time.monotonic() < deadline:
        time.sleep(0.005)
        now = time.monotonic()
        for rank, path in paths.items():
            if rank in texts:
                continue
            size = os.path.getsize(path)
            last_size, since = seen.get(rank, (start[rank], now))
            if size != last_size or rank not in seen:
                seen[rank] = (size, now if size != last_size else since)
                continue
            if size == start[rank] or now - since < _SETTLE_SECONDS:
                continue
            if read.get(rank, (None,))[0] != size:
                with open(path, "rb") as f:
                    f.seek(start[rank])
                    read[rank] = (size, f.read(size - start[rank]).decode("utf-8", "replace"))
            text = read[rank][1]
            if _MAIN_LINE.search(text) or now - since >= _QUIET_SECONDS:
                texts[rank] = text
    return texts


def named_rank(rank: int, node: str | None = None) -> str:
    """Return ``rank 3`` or, for a rank on another node, ``rank 3 (n2)``."""
    return f"rank {rank} ({node})" if node else f"rank {rank}"


def named_ranks(ranks: Iterable[int], nodes: Mapping[int, str | None]) -> str:
    """Return ``rank(s) [0, 2]`` or, with nodes, ``rank(s) 0 (n1), 2 (n2)`` (``nodes``: each rank's host, if any)."""
    ranks = sorted(ranks)
    if not any(nodes.get(r) for r in ranks):
        return f"rank(s) {ranks}"
    return "rank(s) " + ", ".join(f"{r} ({nodes[r]})" if nodes.get(r) else str(r) for r in ranks)


def nodes_of(stacks: Mapping[int, RankStack]) -> dict[int, str | None]:
    """Return each rank's host as its stacks name it (None on this machine)."""
    return {rank: stack.node for rank, stack in stacks.items()}


def describe_stacks(stacks: Mapping[int, RankStack], show: Iterable[int] | None = None) -> str:
    """Return each rank's one-phrase position, then the full stacks of the ranks in ``show`` (default: all).

    The one rendering of where ranks are, for every report and error (hang reports, a deadlock, a
    stop, a timeout, an interrupt): each rank named with its node when it has one (``rank 3 (n2)``,
    ``Stacks of rank 3 (pid 42, on n2)``).
    """
    lines = ["Where each rank was:"]
    lines += [
        f"  {named_rank(rank, stack.node)}: {stack.summary()}" for rank, stack in sorted(stacks.items())
    ]
    shown = set(stacks) if show is None else set(show)
    for rank, stack in sorted(stacks.items()):
        if stack.threads and rank in shown:
            where = f", on {stack.node}" if stack.node else ""
            lines += ["", f"Stacks of rank {rank} (pid {stack.pid}{where}):", stack.text]
    return "\n".join(lines)
