"""The tracker interface: ``GeneralTracker``, the ``on_main_process`` guard and the helpers the trackers share.

Split from ``tracking`` so that the service trackers (``tracking.services``) and the registry
(``tracking``) build on one base; ``notebook_accel.tracking`` re-exports every public name here.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

from ..state import PartialState

__all__ = ["GeneralTracker", "on_main_process"]

logger = logging.getLogger(__name__)


def _require(module: str, pip_name: str, tracker: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"log_with={tracker!r} requires `{pip_name}`: pip install {pip_name}") from exc


class GeneralTracker:
    """Base of the trackers: ``store_init_configuration``, ``log``, ``finish`` and ``tracker``.

    Subclasses set ``name``, ``requires_logging_directory`` and ``main_process_only`` (whether
    only the main process creates it). ``GeneralTracker(_blank=True)`` is a tracker that does
    nothing, handed out on processes where the real one does not run.
    """

    name: str = ""
    requires_logging_directory: bool = False
    main_process_only: bool = True
    run: Any = None  # the service's run object, set by ``start()``

    def __init__(self, _blank: bool = False) -> None:
        # The base class supplies defaults for every attribute; an empty name means a subclass set none.
        if not _blank and not type(self).name:
            raise TypeError(
                f"{type(self).__name__} must define the class attributes name, requires_logging_directory "
                "and main_process_only"
            )
        self._blank = _blank

    @property
    def tracker(self) -> Any:
        """Return the underlying run object of the service (None for a blank tracker)."""
        return getattr(self, "run", None)

    def start(self) -> None:
        """Open the run: ``Accelerator.init_trackers`` calls it on the processes that log.

        As in Accelerate 1.15, building a tracker only records its arguments; nothing talks to the
        service (no run, no API key asked, no file written) before ``start()``. A second call does nothing.
        """

    def _active(self) -> Any:
        """Return the run ``start()`` opened; raise RuntimeError naming the tracker when it was not started."""
        if self.run is None:
            raise RuntimeError(
                f"{type(self).__name__} has no run yet: call tracker.start() first "
                "(Accelerator.init_trackers starts the trackers of log_with)"
            )
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the hyper-parameters of the run."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` (name -> number, string or object the service understands) at ``step``."""

    def finish(self) -> None:
        """Close the run and flush what is buffered."""


def logging_dir_message(name: str) -> str:
    """Return the error text for tracker ``name`` started without a logging directory (1.15's first line)."""
    return (
        f"Logging with `{name}` requires a `logging_dir` to be passed in.\n"
        "Pass Accelerator(project_dir=...) or ProjectConfiguration(logging_dir=...)."
    )


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    return value


def on_main_process(function: Callable) -> Callable:
    """Return a tracker method that runs on the main process only when its tracker has ``main_process_only``.

    The process is asked at call time, so decorating does not build the process state.
    """

    @functools.wraps(function)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False) and not PartialState().is_main_process:
            return None
        return function(self, *args, **kwargs)

    return wrapper
