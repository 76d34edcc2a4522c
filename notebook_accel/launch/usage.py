"""Resource use per rank: CPU % and resident memory sampled by the launcher, device memory from the worker.

The launcher samples each running worker with psutil about once a second (cheaper than asking the
worker, and it works for a rank stuck in a collective). A worker reports what only it can see as
``"usage"`` events: CUDA memory allocated/reserved (from a one-per-second thread, once CUDA is
initialised), and, as it ends, its peak resident memory and its average CPU % over the whole run,
so a rank that finished between two samples still has its figures.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from typing import Any

import psutil

from ..utils._worker_channel import send_event
from .interfaces import UsageSource

__all__ = ["UsageSampler", "apply_usage", "final_usage", "start_device_reporter"]

SAMPLE_SECONDS = 1.0


def _peak_rss(pid: int) -> int | None:
    """Return the process's peak resident memory in bytes (Linux's VmHWM), or None where unknown."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


class UsageSampler(UsageSource):
    """Samples CPU % and RSS of the workers at most once per ``interval`` seconds."""

    def __init__(self, interval: float = SAMPLE_SECONDS) -> None:
        self.interval = interval
        self._procs: dict[int, psutil.Process] = {}
        self._next = 0.0

    def due(self, now: float) -> bool:
        """Return True when ``now`` (time.monotonic()) is time for the next sample."""
        if now < self._next:
            return False
        self._next = now + self.interval
        return True

    def sample(self, status: Any) -> None:
        """Update ``status`` (a RankStatus of a running rank) with its process's CPU %, RSS and peak RSS."""
        pid = status.pid
        if pid is None:
            return
        try:
            proc = self._procs.get(pid)
            if proc is None:
                proc = self._procs[pid] = psutil.Process(pid)
                proc.cpu_percent(None)  # the first call only starts the measurement: 0.0
            cpu = proc.cpu_percent(None)
            rss = proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            self._procs.pop(pid, None)
            return
        if rss == 0:
            # A process that has exited but is not reaped yet (a zombie) reads as 0 bytes resident: its
            # figures are those it sent as it ended (``final_usage``) or the last live sample, never these.
            return
        status.cpu_percent = cpu
        status.rss = rss
        peak = _peak_rss(pid)
        status.peak_rss = max(x for x in (status.peak_rss, rss, peak) if x is not None)

    def forget(self, pid: int | None) -> None:
        """Drop the cached process object of an ended worker."""
        self._procs.pop(pid, None)


def apply_usage(status: Any, payload: dict[str, Any]) -> None:
    """Copy what a worker reported about itself into its RankStatus (peaks only ever grow)."""
    for key in ("cuda_allocated", "cuda_reserved", "cpu_percent", "rss"):
        if payload.get(key) is not None:
            setattr(status, key, payload[key])
    for key, current in (("peak_rss", "rss"), ("cuda_peak", "cuda_allocated")):
        seen = [
            x for x in (payload.get(key), getattr(status, key), getattr(status, current)) if x is not None
        ]
        if seen:  # two measures of one peak (VmHWM, ru_maxrss): never below what was seen
            setattr(status, key, max(seen))


# -- worker side ----------------------------------------------------------------------------------


def _cuda_figures() -> dict[str, int] | None:
    cuda = sys.modules.get("torch.cuda")
    try:
        if cuda is None or not cuda.is_initialized():
            return None  # never initialise CUDA just to measure it
        return {
            "cuda_allocated": int(cuda.memory_allocated()),
            "cuda_reserved": int(cuda.memory_reserved()),
            "cuda_peak": int(cuda.max_memory_allocated()),
        }
    except Exception:  # torch still being imported by the main thread (a spawned worker): next time
        return None


def start_device_reporter(interval: float = SAMPLE_SECONDS) -> threading.Event:
    """Start a daemon thread sending CUDA memory figures each ``interval`` s; return the event that stops it."""
    stop = threading.Event()

    def report() -> None:
        while not stop.wait(interval):
            figures = _cuda_figures()
            if figures is not None and not send_event("usage", figures):
                return

    threading.Thread(target=report, name="notebook_accel-usage", daemon=True).start()
    return stop


def final_usage(started: float, cpu_started: float) -> dict[str, Any]:
    """Return this worker's figures at its end: peak and current RSS, average CPU % since ``started``."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = os.times()
    wall = time.monotonic() - started
    figures: dict[str, Any] = {
        # ru_maxrss is in KiB on Linux, in bytes on macOS
        "peak_rss": int(peak if sys.platform == "darwin" else peak * 1024),
        "rss": psutil.Process().memory_info().rss,
        "cpu_percent": 100.0 * (times.user + times.system - cpu_started) / wall if wall > 0 else None,
    }
    figures.update(_cuda_figures() or {})
    return figures
