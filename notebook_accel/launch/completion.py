"""How a caller waits for a launch and reads its outcome: one home for both kinds of handle.

A ``LaunchHandle`` (one group of workers) and a ``RestartingHandle`` (tries of a group until one
succeeds) are each finished once by their supervising thread, which sets ``_error`` (or leaves it
None) and then ``_done``; waiting, the error and the results read the same way for both.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from .errors import LaunchError

__all__ = ["Completion"]

logger = logging.getLogger(__name__)


class Completion(ABC):
    """``done``, ``error``, ``wait()``, ``result()`` and done callbacks, over the state a handle sets up."""

    _done: threading.Event
    _error: LaunchError | None
    _thread: threading.Thread | None
    _lock: threading.RLock
    _done_callbacks: list[Callable[[Any], None]]
    _on_finish: Callable[[], None] | None

    @property
    def done(self) -> bool:
        """Return True once the run has ended and is cleaned up."""
        return self._done.is_set()

    @property
    def error(self) -> LaunchError | None:
        """Return the run's error once done (None while running or after success)."""
        return self._error if self.done else None

    def wait(self, timeout: float | None = None) -> bool:
        """Return True when the run finished within ``timeout`` seconds (None: wait for it)."""
        if not self._done.wait(timeout):
            return False
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        return True

    def result(self, timeout: float | None = None) -> list:
        """Return each rank's return value (index = rank); raise the run's LaunchError if it failed."""
        if not self.wait(timeout):
            raise TimeoutError(
                f"the launch is still running after {timeout} s; call result() again or stop()"
            )
        if self._error is not None:
            raise self._error
        return self._results()

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(handle)`` when the run is done (at once if it already is)."""
        with self._lock:
            if not self.done:
                self._done_callbacks.append(fn)
                return
        fn(self)

    def _complete(self) -> None:
        """Run the clean-up, mark the run done, then call the done callbacks (each failure logged)."""
        if self._on_finish is not None:
            try:
                self._on_finish()
            except Exception:
                logger.exception("launch clean-up failed")
        with self._lock:
            self._done.set()
            callbacks, self._done_callbacks = self._done_callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                logger.exception("done callback %r failed", fn)

    @abstractmethod
    def _results(self) -> list:
        """Return the successful run's per-rank values (each handle knows where they are)."""
