"""Failures of a launch: one ``RankFailure`` per failed rank, gathered in one ``LaunchError``.

Like torch elastic's ``ChildFailedError``, the error names the root cause (the earliest failure) first
and shows its own traceback in full; like ipyparallel's ``CompositeError``, the other failures are
listed briefly, with a cap on how many tracebacks are shown.
"""

from __future__ import annotations

import signal as _signal
from dataclasses import dataclass, field

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

__all__ = ["LaunchError", "RankFailure", "death_notes"]

# How many of the non-root failures get a traceback excerpt in ``str(LaunchError)``.
_SHOWN_TRACEBACKS = 2
_EXCERPT_LINES = 6
_SHOWN_TAIL = 15  # stderr lines of a rank killed by a signal shown before a fatal-error dump (or alone)

# Messages of errors that a rank raises *because* a peer died (a collective losing its peer); such a
# failure is a consequence, so a signal death or a genuine exception close in time ranks before it.
_COLLATERAL_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "gloo",
    "nccl",
    "socket",
    "timed out",
    "connection refused",
)


# Errors whose cause lies in the launching process, not in the rank's code: (part of the message, what to do).
_CAUSES_IN_THE_CALLER = (
    (
        "autograd's threading in combination with fork-based multiprocessing",
        "this process ran a backward pass before the ranks were forked, and on a machine with a GPU autograd "
        "then keeps threads that a forked process cannot use. Restart the kernel and launch before any cell "
        'calls .backward(), or start the ranks with start_method="spawn" (notebook_launcher, debug_launcher, start_ranks)',
    ),
    (
        "Cannot re-initialize CUDA in forked subprocess",
        'CUDA was initialised in this process before the ranks were forked. Pass start_method="spawn", or '
        "restart the kernel and launch before anything touches CUDA",
    ),
)


@dataclass
class RankFailure:
    """What went wrong on one rank: the exception it raised, or the signal/exit code it died with."""

    rank: int
    pid: int | None
    exc_type: str
    """Qualified name of the exception type (``"ValueError"``), or ``"Signal"`` / ``"ExitCode"``."""
    message: str
    traceback: str
    """The worker's own formatted traceback ("" when the process died without one)."""
    exitcode: int | None = None
    signal: str | None = None
    """Name of the signal that ended the process (``"SIGKILL"``), when it died of one."""
    time: float = field(default=0.0, repr=False)
    """``time.monotonic()`` in the parent when the failure was seen (orders the failures)."""
    node: str | None = None
    """The host the rank ran on, in a launch across nodes (``nodes=``)."""

    @property
    def collateral(self) -> bool:
        """Return True when this looks like a consequence of another rank's death (lost peer)."""
        if self.signal is not None:
            return False
        text = f"{self.exc_type} {self.message}".lower()
        return any(marker in text for marker in _COLLATERAL_MARKERS)

    def advice(self) -> str | None:
        """Return what to do when the failure is caused by the launching process (None otherwise)."""
        return next((fix for part, fix in _CAUSES_IN_THE_CALLER if part in self.message), None)

    def headline(self) -> str:
        """Return a one-line summary: rank, pid (and node), type and message."""
        where = f", on {self.node}" if self.node else ""
        return f"rank {self.rank} (pid {self.pid}{where}) {self.exc_type}: {self.message}"


def signal_name(signum: int) -> str:
    """Return the name of ``signum`` (``"SIGKILL"``), or ``"signal N"`` when unknown."""
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def death_notes(lines: list[str]) -> str:
    """Return the last stderr lines of a rank killed by a signal: what it said, then faulthandler's stacks."""
    fatal = max((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), default=None)
    if fatal is None:
        return "\n".join(lines[-_SHOWN_TAIL:])
    dump = [line for line in lines[fatal:] if not line.startswith("Extension modules:")]
    return "\n".join(lines[max(0, fatal - _SHOWN_TAIL) : fatal] + dump)


def order_failures(failures: list[RankFailure], window: float = 2.0) -> list[RankFailure]:
    """Return ``failures`` with the root cause first: the earliest, unless it is collateral.

    A rank that loses its peer in a collective raises a few milliseconds after the peer was killed,
    sometimes before the parent notices the death; within ``window`` seconds a non-collateral
    failure therefore wins over a collateral one.
    """
    ordered = sorted(failures, key=lambda f: f.time)
    if not ordered:
        return ordered
    first = ordered[0]
    if first.collateral:
        for candidate in ordered[1:]:
            if not candidate.collateral and candidate.time - first.time <= window:
                ordered.remove(candidate)
                ordered.insert(0, candidate)
                break
    return ordered


class LaunchError(ChildFailedError, RuntimeError):
    """A launch failed: ``.failures`` lists every failed rank, root cause first.

    It is a torch elastic ``ChildFailedError`` (what Accelerate's launchers raise), so code written
    for Accelerate catches it; ``get_first_failure()`` gives the root cause's rank and failure.
    """

    def __init__(
        self, failures: list[RankFailure], summary: str | None = None, stacks: str | None = None
    ) -> None:
        self.name = "notebook_launcher"
        self.failures = list(failures)  # type: ignore[assignment]  (a list here, root cause first)
        self.summary = summary
        self.stacks = stacks
        """Where each rank was when the launch was stopped, interrupted or timed out (their stacks)."""
        text = self._render()
        # ChildFailedError.__init__ wants torch's ProcessFailure records read from error files; our
        # ranks report through pipes, so the message is built here instead.
        RuntimeError.__init__(self, f"{text}\n\n{stacks}" if stacks else text)

    def get_first_failure(self) -> tuple[int, RankFailure | None]:
        """Return ``(rank, failure)`` of the root cause (``(-1, None)`` when no rank failed)."""
        root = self.root_cause
        return (root.rank, root) if root is not None else (-1, None)

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        """Return the message: the root cause (rank, pid, type, traceback) first, then the others."""
        return str(self)

    @property
    def root_cause(self) -> RankFailure | None:
        """Return the earliest failure (the one that made the launch fail), if any."""
        return self.failures[0] if self.failures else None

    def _render(self) -> str:
        if not self.failures:
            return self.summary or "launch failed"
        root = self.failures[0]
        n = len(self.failures)
        lines = [f"{root.headline()}" + (f"  [{self.summary}]" if self.summary else "")]
        if root.traceback:
            lines += ["", f"Traceback of rank {root.rank}:", root.traceback.rstrip()]
        if root.advice():
            lines += ["", f"Cause: {root.advice()}."]
        if n > 1:
            lines += ["", f"{n - 1} other rank(s) also failed:"]
            for i, other in enumerate(self.failures[1:]):
                lines.append(f"  - {other.headline()}")
                if i < _SHOWN_TRACEBACKS and other.traceback:
                    tail = other.traceback.rstrip().splitlines()[-_EXCERPT_LINES:]
                    lines += [f"      {t}" for t in tail]
            hidden = max(0, n - 1 - _SHOWN_TRACEBACKS)
            if hidden:
                lines.append(f"  ({hidden} more traceback(s) hidden; see LaunchError.failures)")
        return "\n".join(lines)
