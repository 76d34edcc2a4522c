"""``State``: the one vocabulary of where a rank stands, shared by the launch handle, interactive ranks and panels.

A launched rank goes ``STARTING -> RUNNING -> SUCCEEDED | FAILED | STOPPED``. An interactive rank
(``Ranks.status()``) is ``IDLE`` between commands, ``RUNNING`` one, ``FAILED`` when its last command
raised (it is alive), ``DEAD`` once its process ended; a group of interactive ranks that cannot go on
is ``BROKEN``. The values are the plain words, and a member is a ``str``: ``status.state == "running"``
holds, and ``str()``, ``format()`` and f-strings print the word itself (``running``): ``__str__`` gives
the value, and ``Enum.__format__`` follows an overridden ``__str__`` on every Python we support (without
it, a ``str`` mixin ``Enum`` prints ``State.RUNNING`` on 3.11).
"""

from __future__ import annotations

import enum

__all__ = ["State"]


class State(str, enum.Enum):
    """Where one rank (or an interactive group) stands; compares equal to its lowercase word."""

    STARTING = "starting"
    RUNNING = "running"
    IDLE = "idle"
    """An interactive rank waiting for its next command."""
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    """A launched rank that raised or died; an interactive rank whose last command raised."""
    STOPPED = "stopped"
    """Stopped by the user, a ``timeout``, an interrupt or the hang rule."""
    DEAD = "dead"
    """An interactive rank whose process ended."""
    BROKEN = "broken"
    """An interactive group that cannot go on (a rank died or hung): ``restart()`` recovers."""

    def __str__(self) -> str:
        return self.value

    @property
    def live(self) -> bool:
        """Return True for a launched rank that has not ended yet (starting or running)."""
        return self in (State.STARTING, State.RUNNING)
