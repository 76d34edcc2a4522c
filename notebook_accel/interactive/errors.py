"""Errors of the interactive ranks: a command that failed on some ranks, and a group that cannot go on."""

from __future__ import annotations

from typing import Any

from ..launch.errors import LaunchError, RankFailure

__all__ = ["NoRanksError", "RankError"]


class RankError(LaunchError):
    """A command failed on some ranks: ``failures`` lists them, root cause first, each with its traceback.

    ``broken`` is False when the ranks are alive and their namespaces intact (the next command
    works); True when the group could not go on (a rank died, or ranks waited in a collective for
    one that will not join) and was stopped: ``Ranks.restart()`` forks new ranks. ``results`` holds
    every targeted rank's ``CellResult`` (``ok`` False for the failed ones).
    """

    def __init__(
        self,
        failures: list[RankFailure],
        summary: str | None = None,
        stacks: str | None = None,
        *,
        broken: bool = False,
        results: list[Any] | None = None,
    ) -> None:
        super().__init__(failures, summary, stacks)
        self.name = "ranks"
        self.broken = broken
        self.results = list(results or [])

    def _render_traceback_(self) -> list[str]:
        # IPython's hook for how an exception is shown: the kernel-side frames (the magic, the command
        # plumbing) say nothing about the ranks' code; the message holds the ranks' own tracebacks.
        return [f"{type(self).__name__}: {self}"]


class NoRanksError(RuntimeError):
    """No ranks to run on: none were started, or they were stopped."""
