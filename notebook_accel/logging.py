"""Multi-process aware logging: ``get_logger(__name__)`` logs once (main process) or from every rank in order.

    logger = get_logger(__name__, log_level="INFO")
    logger.info("once, from the main process")
    logger.info("from every rank", main_process_only=False)
    logger.info("every rank, rank 0 first", in_order=True)

The rank comes from the initialised ``PartialState``, else from the ``RANK`` environment variable
(so logging works before the state exists, e.g. in a worker that has not built it yet).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from .state import PartialState
from .utils.environment import _process_index

__all__ = ["MultiProcessAdapter", "get_logger"]
# Accelerate 1.15 serves these names at this path too (defined elsewhere).
__all__ += ["PartialState"]


class MultiProcessAdapter(logging.LoggerAdapter):
    """A LoggerAdapter whose log calls accept ``main_process_only=True`` and ``in_order=False``.

    ``main_process_only`` logs on the main process only; ``in_order`` makes every process log, one
    after the other by rank, with a barrier between turns (every rank must make the same call).
    """

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        """Return nothing; log ``msg`` at ``level`` on the processes selected by the two flags."""
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if in_order:
            state = PartialState()
            enabled = self.isEnabledFor(level)
            for turn in range(state.num_processes):
                if turn == state.process_index and enabled:
                    self._emit(level, msg, args, kwargs)
                state.wait_for_everyone()
            return
        if not self.isEnabledFor(level):
            return
        if not main_process_only or _process_index() == 0:
            self._emit(level, msg, args, kwargs)

    def process(self, msg: Any, kwargs: Any) -> tuple[str, Any]:
        """Return ``msg`` prefixed with ``[RANK N] `` (Accelerate 1.15's format) and ``kwargs``."""
        return f"[RANK {_process_index()}] {msg}", kwargs

    def _emit(self, level: int, msg: Any, args: tuple, kwargs: dict) -> None:
        msg, kwargs = self.process(msg, kwargs)
        # Accelerate 1.15 counts ``stacklevel`` from this adapter: the default 2 is the line that
        # called ``logger.info``, 3 that line's caller, 1 the adapter itself. findCaller skips
        # logging's own frames; one more level skips _emit(), the frame this call starts from.
        kwargs["stacklevel"] = kwargs.get("stacklevel", 2) + 1
        self.logger.log(level, msg, *args, **kwargs)

    @functools.lru_cache(None)  # noqa: B019  (the cache is the point: one warning per message)
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """Return nothing; like ``warning`` but a given message is emitted only the first time."""
        self.warning(*args, stacklevel=kwargs.pop("stacklevel", 2) + 1, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """Return a multi-process aware logger adapter for ``name``.

    ``log_level`` (e.g. "INFO") sets that logger's level; it defaults to ``ACCELERATE_LOG_LEVEL``
    when set. The root logger is never touched.
    """
    if log_level is None:
        log_level = os.environ.get("ACCELERATE_LOG_LEVEL") or None
    logger = logging.getLogger(name)
    if log_level is not None:
        level = log_level.upper() if isinstance(log_level, str) else log_level
        if isinstance(level, str) and level not in logging.getLevelNamesMapping():
            raise ValueError(
                f"log_level={log_level!r} is not a logging level; use one of DEBUG, INFO, WARNING, ERROR, CRITICAL"
            )
        logger.setLevel(level)
    return MultiProcessAdapter(logger, {})
