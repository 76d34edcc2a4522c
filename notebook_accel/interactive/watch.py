"""Watching one command's busy ranks: when waiting ranks are deadlocked, and when they wait for honest work.

The rule (the guide's "When a command hangs" says the same):

- A rank is *waiting* when its main thread sits in a torch.distributed collective or point-to-point
  call (``barrier``, ``all_reduce``, ``recv``...). Any other rank is *busy*: computing, reading,
  writing or sleeping, which a stack cannot tell apart.
- On nccl a collective returns at once and its wait shows up in a later synchronisation with the
  device (``torch.cuda.synchronize``, ``.item()``, ``work.wait()``). A GPU-bound loop spends nearly
  all its time there too, so such a rank counts as waiting only while some rank of the command has
  raised (the collective-failure case); otherwise it is busy, and never given up.
- A waiting rank made *progress* between two samples when it moved to another wait or line, or read
  or wrote bytes (a gloo collective that completes does); a busy rank, and a line of output, are
  progress.
- Some rank idle (it raised, finished, or was not asked) while every busy rank waits without progress
  at two samples in a row: the group is given up at once (in about two seconds): the idle rank will
  never join.
- No rank idle: the group is given up once every rank waits and none has made progress for
  ``hang_timeout`` seconds (a deadlock: ranks in ``recv`` from each other, collectives called in
  different orders).
- A rank waiting for ``hang_timeout`` while another is busy (a ``main_process_first()`` step, a
  checkpoint written by one rank) is reported once, with where the busy ranks are and their stacks,
  and the command goes on: only Stop ends it.

Stacks are sampled in a thread of their own, so the command loop keeps printing and reading replies;
sampling starts once the busy ranks have been silent for a second, and a sample that finds a busy
rank doubles the interval to the next (up to a tenth of ``hang_timeout``, 1-10 s).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..launch.doctor import COLLECTIVES, RankStack

__all__ = ["GRACE_SECONDS", "ProgressWatch", "StackSampler", "Verdict"]

logger = logging.getLogger(__name__)

GRACE_SECONDS = 1.0  # silence (no line, no reply) before the busy ranks' stacks are looked at
_FAST_SECONDS = 0.5  # between samples while a rank is idle and the busy ones wait
_WAIT_SECONDS = 1.0  # between samples while every rank waits


@dataclass(frozen=True)
class _Position:
    wait: str | None
    where: str | None
    io: int | None
    dump: int


@dataclass(frozen=True)
class Verdict:
    """What one sample concluded: ``"broken"`` (an idle rank will never join), ``"deadlock"`` or ``"report"``."""

    kind: str
    where: str
    """``rank 0 in barrier, rank 1 in recv``: the waiting ranks and their waits."""
    stacks: dict[int, RankStack]
    busy: tuple[int, ...] = ()
    waited: float = 0.0


def _position(stack: RankStack | None, device_sync: bool) -> _Position | None:
    if stack is None or not stack.answered:
        return None  # unknown: counted as busy, never as a reason to give up
    frame = stack.user_frame()
    where = f"{frame.filename}:{frame.lineno}" if frame is not None else None
    return _Position(stack.collective(device_sync), where, stack.io, len(stack.dump.encode()))


def _stalled(before: _Position | None, now: _Position | None) -> bool:
    """Return True when a rank sat in the same wait at the same line at both samples, moving no byte between."""
    if before is None or now is None or now.wait is None:
        return False
    if (before.wait, before.where) != (now.wait, now.where):
        return False
    if before.io is None or now.io is None:
        return True
    return now.io - before.io - now.dump <= 0  # its own stack dump is the only write allowed


class ProgressWatch:
    """Decides, sample by sample, whether the busy ranks of one command are deadlocked (see the module)."""

    def __init__(self, hang_timeout: float, started: float, device_sync: bool = False) -> None:
        self.timeout = hang_timeout
        self.device_sync = device_sync
        self.quiet = min(10.0, max(1.0, hang_timeout / 10))
        self._started = started
        self._next_sample = 0.0
        self._interval = _FAST_SECONDS
        self._before: dict[int, _Position | None] = {}
        self._wait_since: dict[int, float] = {}
        self._progress_at: float | None = None
        self.reported = False

    def due(self, now: float, last_sign: float, idle_since: float | None) -> bool:
        """Return True when a sample is due: busy ranks silent since ``last_sign`` for the grace period.

        ``idle_since``: when some rank of the group first had nothing to do (None: none has).
        """
        if now < self._next_sample or now - max(self._started, last_sign) < GRACE_SECONDS:
            return False
        if idle_since is not None:
            return now - idle_since >= GRACE_SECONDS
        return self.timeout != float("inf")  # without one, only an idle rank can make waiting certain

    def observe(
        self,
        now: float,
        stacks: dict[int, RankStack],
        pending: set[int],
        idle: bool,
        last_sign: float,
        raised: bool = False,
    ) -> Verdict | None:
        """Record one sample of the ``pending`` ranks' stacks; return what it shows, or None to keep waiting.

        ``idle``: some rank of the group has nothing to do; ``raised``: some rank's command raised.
        """
        positions = {r: _position(stacks.get(r), self.device_sync) for r in pending}
        waiting = {
            r
            for r, p in positions.items()
            if p is not None and p.wait is not None and (p.wait in COLLECTIVES or raised)
        }
        busy = sorted(set(pending) - waiting)
        stalled = {r for r in waiting if _stalled(self._before.get(r), positions[r])}
        for r in waiting - stalled:
            self._wait_since[r] = now  # first seen waiting there: counted from now, never longer
        for r in busy:
            self._wait_since.pop(r, None)
        if busy or waiting - stalled or self._progress_at is None:
            self._progress_at = now
        self._progress_at = max(self._progress_at, last_sign)
        self._before = positions
        if busy:
            self._interval = min(self.quiet, self._interval * 2)
        else:
            self._interval = _FAST_SECONDS if idle else _WAIT_SECONDS
        self._next_sample = now + self._interval
        where = ", ".join(f"rank {r} in {positions[r].wait}" for r in sorted(waiting))
        if not busy and waiting and stalled == waiting:
            if idle:
                return Verdict("broken", where, stacks)
            if now - self._progress_at >= self.timeout:
                return Verdict("deadlock", where, stacks, waited=now - self._progress_at)
        if busy and waiting and not self.reported:
            longest = now - min(self._wait_since[r] for r in waiting)
            if longest >= self.timeout:
                self.reported = True
                return Verdict("report", where, stacks, tuple(busy), longest)
        return None


def report_text(verdict: Verdict, timeout: float) -> str:
    """Return the one report of honest work: who waits, where the busy ranks are, their stacks."""
    lines = [
        f"{verdict.where} (for {verdict.waited:.0f} s) while rank(s) {list(verdict.busy)} are busy; a busy rank "
        f"is not a hang, so the command goes on (Stop ends it). It is given up only when no rank has made "
        f"progress for hang_timeout={timeout:g} s.",
        "Where each rank was:",
    ]
    lines += [f"  rank {r}: {s.summary()}" for r, s in sorted(verdict.stacks.items())]
    for r in verdict.busy:
        stack = verdict.stacks.get(r)
        if stack is not None and stack.threads:
            lines += ["", f"Stacks of rank {r} (pid {stack.pid}):", stack.text]
    return "\n".join(lines)


class StackSampler:
    """Takes the ranks' stacks in a thread of its own, one sample at a time: the command loop never waits for it."""

    def __init__(self, take: Callable[[], dict[int, RankStack]]) -> None:
        self._take = take
        self._thread: threading.Thread | None = None
        self._result: tuple[float, dict[int, RankStack]] | None = None

    @property
    def running(self) -> bool:
        """Return True while a sample is being taken."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Begin a sample (nothing when one is being taken)."""
        if self.running:
            return
        self._thread = threading.Thread(target=self._run, name="notebook_accel-rank-stacks", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            stacks = self._take()
        except Exception:  # the stacks are a help, never a reason to hang or to fail a command
            logger.exception("could not take the ranks' stacks")
            stacks = {}
        self._result = (time.monotonic(), stacks)

    def result(self) -> tuple[float, dict[int, RankStack]] | None:
        """Return ``(when, stacks)`` of the sample finished since the last call, or None."""
        result, self._result = self._result, None
        return result
