"""Single-node fault tolerance: restart the whole group after a failed attempt, as torch elastic does.

``notebook_launcher(max_restarts=k, monitor_interval=s)`` on one machine runs the group; when a rank
fails, every rank is stopped (as always), ``s`` seconds pass and the group starts again, up to ``k``
times. Each restart is announced to the launch's sinks (the printed cell output, the panel's log and
the log directory). When every attempt failed, the last attempt's ``LaunchError`` is raised, root
cause and traceback first, with the number of attempts in its summary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from .errors import LaunchError

__all__ = ["run_with_restarts"]

logger = logging.getLogger(__name__)


def run_with_restarts(
    attempt: Callable[[int], Any],
    max_restarts: int,
    monitor_interval: float,
    announce: Callable[[str], None],
) -> Any:
    """Return what the first successful ``attempt(restart_index)`` returns, restarting after failures.

    Only a failed rank (a ``LaunchError`` naming failures) restarts the group; a timeout, a stop or
    an interrupt ends the launch as without restarts.
    """
    for restart in range(max_restarts + 1):
        try:
            return attempt(restart)
        except LaunchError as exc:
            if not exc.failures:
                raise
            if restart == max_restarts:
                if max_restarts == 0:
                    raise
                summary = f"all {max_restarts + 1} attempts failed (max_restarts={max_restarts})"
                if exc.summary:
                    summary = f"{exc.summary}; {summary}"
                raise LaunchError(exc.failures, summary=summary, stacks=exc.stacks) from exc
            headline = exc.failures[0].headline()
            logger.info("restarting the group after %s", headline)
            announce(
                f"restarting the group in {monitor_interval:g} s (restart {restart + 1} of {max_restarts}) "
                f"after {headline}"
            )
            time.sleep(monitor_interval)
    raise AssertionError("unreachable: the last attempt returns or raises")
