"""Small pieces around the shared-state singletons: a per-thread shared dict, and "is it built yet?"."""

from __future__ import annotations

import threading
from typing import Any

from .process import AcceleratorState

__all__ = ["ThreadLocalSharedDict", "do_nothing", "is_initialized"]


class ThreadLocalSharedDict:
    """A descriptor holding one dict shared by every instance of a class (one per thread when ``thread_local``).

    ``obj._shared_state`` and ``Cls._shared_state`` give the same dict; assigning through an instance
    replaces it. Assigning on the class replaces the descriptor itself, so change the dict in place
    (``_shared_state.clear()``). Per-thread storage serves PyTorch/XLA's multithreaded (PJRT) mode,
    where each thread drives one device.
    """

    def __init__(self, thread_local: bool = False) -> None:
        self._thread_local = threading.local() if thread_local else None
        self._shared: dict[str, Any] = {}

    @property
    def _storage(self) -> dict[str, Any]:
        if self._thread_local is None:
            return self._shared
        if not hasattr(self._thread_local, "storage"):
            self._thread_local.storage = {}
        return self._thread_local.storage

    def __get__(self, obj: Any, objtype: Any = None) -> dict[str, Any]:
        return self._storage

    def __set__(self, obj: Any, value: dict[str, Any]) -> None:
        if self._thread_local is None:
            self._shared = value
        else:
            self._thread_local.storage = value


def do_nothing(*args: Any, **kwargs: Any) -> None:
    """Return None, whatever it is given (a stand-in where a callback is optional)."""
    return None


def is_initialized() -> bool:
    """Return whether an ``AcceleratorState`` has been built (by an ``Accelerator``), without building one."""
    return bool(AcceleratorState._shared_state)
