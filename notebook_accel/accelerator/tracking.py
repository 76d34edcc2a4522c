"""Experiment-tracker verbs of the Accelerator: init_trackers, log, get_tracker, end_training.

A mixin of :class:`notebook_accel.accelerator.Accelerator`; the trackers are in :mod:`notebook_accel.tracking`.
"""

from __future__ import annotations

from typing import Any

from .._lazy import LazyModule

__all__: list[str] = []

# The trackers (and their services' probes) load when the accelerator first starts or looks one up.
_tracking = LazyModule("notebook_accel.tracking")


class _TrackingMixin:
    """init_trackers, get_tracker, log, end_training over ``self.log_with``."""

    def init_trackers(
        self, project_name: str, config: dict[str, Any] | None = None, init_kwargs: dict | None = None
    ) -> None:
        """Start the ``log_with`` trackers for ``project_name`` and record ``config`` in them."""
        if not self.log_with and not init_kwargs:
            self.trackers = []  # nothing to start: the trackers need not even be imported
            return
        self.trackers = _tracking.start_trackers(
            self.log_with, project_name, self.logging_dir, self.is_main_process, config, init_kwargs or {}
        )

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """Return the tracker called ``name`` (its service run object with ``unwrap``)."""
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        wanted = {str(getattr(t, "name", t)) for t in self.log_with}
        if name in wanted:
            return _tracking.GeneralTracker(_blank=True)  # a process where that tracker does not run
        raise ValueError(f"no tracker named {name!r}; started trackers: {[t.name for t in self.trackers]}")

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Send ``values`` to every started tracker (``log_kwargs[name]`` as extra arguments)."""
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def end_training(self) -> None:
        """Finish every tracker and close the process group (left to the launcher under a fork launch).

        ``self.trackers`` keeps the finished trackers, as in 1.15 (what they wrote stays readable there);
        ``init_trackers`` replaces them.
        """
        for tracker in self.trackers:
            tracker.finish()
        self.state.destroy_process_group()
