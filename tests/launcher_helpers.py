"""Shared pieces of the launcher tests: leak checks and small worker functions."""

from __future__ import annotations

import os
import threading

import psutil

# multiprocessing's own helpers (fork server, resource tracker) are shared by the whole process and
# outlive any one launch by design; everything else a launch started must be gone.
_MP_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


def live_children() -> list[psutil.Process]:
    out = []
    for child in psutil.Process().children(recursive=True):
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
