"""Shared pieces of the launcher tests: leak checks, a collecting sink and a started ipykernel."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterator

import psutil

from notebook_accel.launch import OutputLine
from tests.ns_cluster import daemon_pids

# multiprocessing's own helpers (fork server, resource tracker) are shared by the whole process and
# outlive any one launch by design; everything else a launch started must be gone.
_MP_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


def live_children() -> list[psutil.Process]:
    out = []
    cluster = daemon_pids()  # the namespace cluster's daemons live for the whole session, by design
    for child in psutil.Process().children(recursive=True):
        if child.pid in cluster:
            continue
        try:
            cmd = " ".join(child.cmdline())
            if child.status() == psutil.STATUS_ZOMBIE:
                out.append(child)
            elif not any(h in cmd for h in _MP_HELPERS):
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def _mp_helper_fds() -> set[str]:
    """Descriptors multiprocessing keeps open towards its fork server and resource tracker."""
    import multiprocessing.forkserver as fs
    import multiprocessing.resource_tracker as rt

    fds = {getattr(fs._forkserver, "_forkserver_alive_fd", None), getattr(rt._resource_tracker, "_fd", None)}
    return {str(fd) for fd in fds if fd is not None}


def fd_count() -> int:
    return len(set(os.listdir("/proc/self/fd")) - _mp_helper_fds())


_LABEL = re.compile(r"\[(?:\S+ )?ranks? ([\d,\-]+)(?:, attempt \d+)?\] ")


def label_ranks(spans: str) -> list[int]:
    """Return the ranks a label's set names (``"0-3,5"``: [0, 1, 2, 3, 5])."""
    ranks: list[int] = []
    for part in spans.split(","):
        first, _, last = part.partition("-")
        ranks.extend(range(int(first), int(last or first) + 1))
    return ranks


def printed_lines(out: str) -> list[tuple[list[int], str]]:
    """Return ``(ranks, text)`` of each labelled line of the printed ``out`` (``[ranks 0,1] x``: ([0, 1], "x"))."""
    shown = []
    for line in out.splitlines():
        match = _LABEL.match(line)
        if match is not None:
            shown.append((label_ranks(match[1]), line[match.end() :]))
    return shown


def printed_by(out: str, text: str) -> list[int]:
    """Return the ranks whose line ``text`` the printed ``out`` shows, each once per copy, in label order.

    A line several ranks printed alike may be shown once (``[ranks 0,1] text``) or per rank, depending
    on how far apart they printed it; this reads both.
    """
    return [rank for ranks, shown in printed_lines(out) if shown == text for rank in ranks]


def shows(expected: str | Callable[[str], bool], out: str) -> bool:
    """Return whether printed ``out`` holds the text ``expected`` (or ``expected(out)`` says it shows what it wants)."""
    return expected(out) if callable(expected) else expected in out


def warm_up_store() -> None:
    """Create and drop one TCPStore server: its first use opens a process-wide pipe pair for good."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5), wait_for_workers=False)
    del store


class Snapshot:
    """Children, open fds and threads before a launch, to compare after it."""

    def __init__(self) -> None:
        warm_up_store()
        # The thread that does the launcher's forks lives as long as the process, by design.
        from notebook_accel.launch.procs import _FORKER

        _FORKER.start()
        self.fds = fd_count()
        self.threads = {t.ident for t in threading.enumerate()}

    def assert_clean(self) -> None:
        assert live_children() == [], f"processes left behind: {live_children()}"
        leaked = [
            t
            for t in threading.enumerate()
            if t.ident not in self.threads and t.name.startswith("notebook_accel")
        ]
        assert leaked == [], f"threads left behind: {leaked}"
        assert fd_count() <= self.fds, (
            f"open fds grew from {self.fds} to {fd_count()}: {os.listdir('/proc/self/fd')}"
        )


class Collect:
    """A sink keeping every line and the launcher's announcements (each also passed to ``on_announce``)."""

    def __init__(self, on_announce: Callable[[str], None] | None = None) -> None:
        self.lines: list[OutputLine] = []
        self.announced: list[str] = []
        self._on_announce = on_announce

    def __call__(self, line: OutputLine) -> None:
        self.lines.append(line)

    def announce(self, text: str) -> None:
        self.announced.append(text)
        if self._on_announce is not None:
            self._on_announce(text)

    def texts(self, rank: int | None = None, stream: str | None = None) -> list[str]:
        """Return the texts of the lines of ``rank`` on ``stream`` (None: every rank, every stream)."""
        return [
            ln.text
            for ln in self.lines
            if (rank is None or ln.rank == rank) and (stream is None or ln.stream == stream)
        ]


def wait_until(
    predicate: Callable[[], object],
    timeout: float = 60.0,
    what: str = "the condition",
    interval: float = 0.05,
) -> float:
    """Return the seconds it took for ``predicate()`` to hold; fail naming ``what`` after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout:.0f} s"
        time.sleep(interval)
    return time.monotonic() - start


class StartedKernel:
    """A started ipykernel with a ready client (``self.km``, ``self.kc``); ``close()`` shuts it down."""

    def __init__(self) -> None:
        import jupyter_client

        self.km = jupyter_client.KernelManager(kernel_name="python3")
        # IPython's history database opens and closes files on its own schedule: off, to count fds.
        self.km.start_kernel(extra_arguments=["--HistoryManager.enabled=False"])
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.reply: dict = {}

    def cell(self, code: str, timeout: float = 60) -> Iterator[dict]:
        """Yield the iopub messages of ``code`` run as one cell, until the kernel is idle after it.

        Once the cell ended, its shell reply is in ``self.reply`` (other cells' messages are passed over:
        e.g. ``wait_for_ready``'s extra kernel_info replies).
        """
        msg_id = self.kc.execute(code)
        deadline = time.monotonic() + timeout
        while True:
            msg = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
            yield msg
        reply = self.kc.get_shell_msg(timeout=timeout)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=timeout)
        self.reply = reply

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)
