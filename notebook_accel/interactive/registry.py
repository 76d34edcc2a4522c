"""Which ranks run in this kernel: the current ones (those ``%ranks`` drives) and every started group.

``session.current()`` reads :func:`get_current`; ``start_ranks`` and ``Ranks.restart`` make their
ranks current (under :data:`lock`, so two starts cannot both win), ``Ranks.stop`` forgets them. The
ranks still running when the kernel exits are stopped then (they would also end with it, a moment later).
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Any

__all__ = ["forget", "get_current", "lock", "set_current", "started"]

logger = logging.getLogger(__name__)

lock = threading.RLock()
"""Held while the current ranks are chosen."""
_current: Any = None
_live: weakref.WeakSet[Any] = weakref.WeakSet()


def get_current() -> Any:
    """Return the ranks made current last (stopped or not), or None."""
    return _current


def set_current(ranks: Any) -> None:
    """Make ``ranks`` the current ones."""
    global _current
    with lock:
        _current = ranks


def started(ranks: Any) -> None:
    """Remember ``ranks`` as running: they are stopped when the kernel exits."""
    _live.add(ranks)


def forget(ranks: Any) -> None:
    """Forget stopped ``ranks`` (no longer current, nothing to stop at exit)."""
    global _current
    _live.discard(ranks)
    with lock:
        if _current is ranks:
            _current = None


@atexit.register
def _stop_live_ranks() -> None:
    # The kernel is shutting down: end the ranks (they would also end with it, a moment later).
    for ranks in list(_live):
        try:
            ranks.stop()
        except Exception:
            logger.debug("stopping ranks at exit failed", exc_info=True)
