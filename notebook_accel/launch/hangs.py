"""The one hang rule, for launched ranks (``notebook_launcher``) and interactive ones (``%%ranks``) alike.

The rule (the guide's "A stuck rank" and "When a command hangs" say the same):

- A rank is *waiting* when its main thread sits in a torch.distributed collective or point-to-point
  call (``barrier``, ``all_reduce``, ``recv``...). Any other rank is *busy*: computing, reading,
  writing or sleeping, which a stack cannot tell apart.
- On nccl a collective returns at once and its wait shows up in a later synchronisation with the
  device (``torch.cuda.synchronize``, ``.item()``, ``work.wait()``). A GPU-bound loop spends nearly
  all its time there too, so such a rank counts as waiting only while some rank has raised (the
  collective-failure case of interactive ranks); otherwise it is busy, and never given up.
- A waiting rank made *progress* between two samples when it moved to another wait or line, or read
  or wrote bytes (a gloo collective that completes does); a busy rank, and a line of output, are
  progress.
- Some rank *idle* (a launched rank that has ended; an interactive rank that raised, finished its
  command or was not asked) while every busy rank waits without progress at two samples in a row:
  the run is given up at once (in about two seconds): the idle rank will never join.
- No rank idle: the run is given up once every rank waits and none has made progress for
  ``hang_timeout`` seconds (a deadlock: ranks in ``recv`` from each other, collectives called in
  different orders).
- A rank waiting for ``hang_timeout`` while another is busy (a ``main_process_first()`` step, a
  checkpoint written by one rank) is honest work: reported once, with where every rank is and the
  busy ranks' stacks, and the run goes on (a launch with ``on_hang="stop"`` stops there).

``ProgressWatch`` applies the rule sample by sample; ``StackSampler`` takes the samples in a thread
of its own, so the thread that reads the ranks' output and replies never waits for a stack;
``SampledWatch`` joins the two for a caller (``LaunchHandle``, an interactive command) that checks now
and then. Sampling
starts once the ranks have been silent (no line, no event, no reply) for a second, and a sample that
finds a busy rank doubles the interval to the next (up to a tenth of ``hang_timeout``, 1-10 s). The
reports and errors render through ``doctor.describe_stacks``, which names each rank's node.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .doctor import COLLECTIVES, RankStack, describe_stacks, named_rank, named_ranks, nodes_of
from .errors import RankFailure

__all__ = [
    "DEADLOCK_NOTE",
    "GRACE_SECONDS",
    "LaunchWatch",
    "ProgressWatch",
    "SampledWatch",
    "StackSampler",
    "Verdict",
    "give_up_reason",
    "launch_outcome",
    "returned_note",
    "report_text",
]

logger = logging.getLogger(__name__)

GRACE_SECONDS = 1.0  # silence (no line, no reply) before the busy ranks' stacks are looked at
_FAST_SECONDS = 0.5  # between samples while a rank is idle and the busy ones wait
_WAIT_SECONDS = 1.0  # between samples while every rank waits
_LANDING_SECONDS = 0.02  # how often a caller looks for a sample being taken (one takes some 10-50 ms)
DEADLOCK_NOTE = "every rank waits for another and none has moved, so none will return"
_LAUNCH_GOES_ON = (
    'a busy rank is not a hang, so the launch goes on (on_hang="stop" would stop it here). It is ended only '
    "when no rank has made progress for hang_timeout={timeout:g} s"
)


@dataclass(frozen=True)
class _Position:
    wait: str | None
    where: str | None
    io: int | None


@dataclass(frozen=True)
class Verdict:
    """What one sample concluded: ``"broken"`` (an idle rank will never join), ``"deadlock"`` or ``"report"``."""

    kind: str
    where: str
    """``rank 0 in barrier, rank 1 (n2) in recv``: the waiting ranks (and their nodes) and their waits."""
    stacks: dict[int, RankStack]
    """The sample's stacks: every rank's that was asked (for the report and the error)."""
    busy: tuple[int, ...] = ()
    waited: float = 0.0


def _position(stack: RankStack | None, device_sync: bool) -> _Position | None:
    if stack is None or not stack.answered:
        return None  # unknown: counted as busy, never as a reason to give up
    frame = stack.user_frame()
    where = f"{frame.filename}:{frame.lineno}" if frame is not None else None
    return _Position(stack.collective(device_sync), where, stack.io)


def _stalled(before: _Position | None, now: _Position | None) -> bool:
    """Return True when a rank sat in the same wait at the same line at both samples, moving no byte between."""
    if before is None or now is None or now.wait is None:
        return False
    if (before.wait, before.where) != (now.wait, now.where):
        return False
    if before.io is None or now.io is None:
        return True
    return now.io - before.io <= 0  # taking its stacks is left out of it (doctor.io_bytes)


class ProgressWatch:
    """Decides, sample by sample, whether the busy ranks of a run are deadlocked (see the module)."""

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

    @property
    def next_sample(self) -> float:
        """Return when the next sample may be taken at the earliest (``time.monotonic()``)."""
        return self._next_sample

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
        """Record one sample of the ``pending`` (busy) ranks' stacks; return what it shows, or None to keep waiting.

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
        self._plan_next(now, bool(busy), idle)
        where = ", ".join(f"{named_rank(r, stacks[r].node)} in {positions[r].wait}" for r in sorted(waiting))
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

    def _plan_next(self, now: float, busy: bool, idle: bool) -> None:
        if busy:  # a long silent computation is sampled ever more rarely
            self._interval = min(self.quiet, self._interval * 2)
        else:
            self._interval = _FAST_SECONDS if idle else _WAIT_SECONDS
        self._next_sample = now + self._interval


def report_text(verdict: Verdict, consequence: str) -> str:
    """Return the one report of honest work: who waits and how long, who is busy and ``consequence``, where each rank is.

    ``consequence`` says what happens next (``"a busy rank is not a hang, so the command goes on"``).
    Every rank's position is listed, and the busy ranks' stacks (the waiting ones' say only "in barrier").
    """
    busy = named_ranks(verdict.busy, nodes_of(verdict.stacks))
    head = f"{verdict.where} (for {verdict.waited:.0f} s) while {busy} are busy; {consequence}."
    return f"{head}\n{describe_stacks(verdict.stacks, show=verdict.busy)}"


def launch_outcome(
    verdict: Verdict, timeout: float, on_hang: str, ended: Iterable[int], nodes: dict[int, str | None]
) -> tuple[str, str | None]:
    """Return what a launch shows for ``verdict`` (the text), and why it stops (None: it goes on).

    ``ended``: the ranks that have ended (a ``"broken"`` verdict's ranks wait for them); ``nodes``: each
    rank's host. Honest work goes on unless ``on_hang="stop"``; a deadlock or a wait in vain stops.
    """
    if verdict.kind == "report" and on_hang != "stop":
        return report_text(verdict, _LAUNCH_GOES_ON.format(timeout=timeout)), None
    if verdict.kind == "report":
        busy = named_ranks(verdict.busy, nodes_of(verdict.stacks))
        reason = f'at the hang report (on_hang="stop"): {verdict.where} waited {verdict.waited:.0f} s while {busy} were busy'
        return report_text(verdict, 'on_hang="stop" stops the launch at this report'), reason
    why = (
        f"{named_ranks(ended, nodes)}, which returned: a rank that has ended never joins a collective again, "
        "so the ranks waiting for it cannot go on"
    )
    reason = give_up_reason(verdict, timeout, why)
    return f"{reason}\n{describe_stacks(verdict.stacks)}", reason


def returned_note(root: RankFailure, returned: list[int], nodes: dict[int, str | None]) -> str | None:
    """Return why a launch's root cause lost its peer, when it did (a collective's error) after ranks returned.

    gloo notices a peer that ended inside most collectives by itself, and the waiting rank raises
    "Connection closed by peer": the rule's own verdict never comes, so the error says it instead.
    """
    if not root.collateral or not returned:
        return None
    return (
        f"{named_ranks(returned, nodes)} had returned: a rank that has ended never joins a collective again, so "
        f"the collective of {named_rank(root.rank, nodes.get(root.rank))} lost its peer"
    )


def give_up_reason(verdict: Verdict, timeout: float, idle: str = "") -> str:
    """Return why a ``"broken"`` or ``"deadlock"`` verdict ends the run, in one sentence.

    ``idle`` names the ranks a ``"broken"`` verdict's waiting ranks wait for, and why those will not join
    (``"rank(s) [1], which raised"``).
    """
    if verdict.kind == "broken":
        return f"{verdict.where} waits for {idle}"
    return f"deadlock: no rank has made progress for hang_timeout={timeout:g} s: {verdict.where}; {DEADLOCK_NOTE}"


class SampledWatch:
    """The rule applied to running ranks: their stacks sampled in a thread of their own, each sample judged as it lands."""

    def __init__(
        self,
        hang_timeout: float,
        started: float,
        take: Callable[[], dict[int, RankStack]],
        device_sync: bool = False,
    ) -> None:
        self.rule = ProgressWatch(hang_timeout, started, device_sync)
        self.sampler = StackSampler(take)

    def check(
        self,
        now: float,
        pending: Iterable[int],
        last_sign: float,
        idle_since: float | None,
        raised: bool = False,
    ) -> Verdict | None:
        """Return the verdict of the sample that landed since the last call (None: go on); start the next when due.

        ``pending``: the ranks still running; ``last_sign``: their last line or event; ``idle_since``: when
        some rank first had nothing to do (None: none has); ``raised``: some rank's command raised.
        """
        verdict = None
        sample = self.sampler.result()
        if sample is not None:
            when, stacks = sample
            verdict = self.rule.observe(when, stacks, set(pending), idle_since is not None, last_sign, raised)
        if verdict is None and self.rule.due(now, last_sign, idle_since):
            self.sampler.start()
        return verdict

    def next_check(self, now: float) -> float | None:
        """Return when to check again (``time.monotonic()``): soon while a sample is taken, else when the next is due.

        None: nothing planned (the caller checks at its own pace).
        """
        if self.sampler.running or self.sampler.landed:
            return now + _LANDING_SECONDS
        planned = self.rule.next_sample
        return planned if planned > now else None


class LaunchWatch:
    """The rule as a launch applies it to its ranks: turned on or off, the first end noted, verdicts told.

    The ranks are the launch's books (``ranks._Rank``): ``rank``, ``proc``, ``exited``, ``last_activity``
    and ``status.node`` are read.
    """

    def __init__(
        self,
        hang_timeout: float,
        started: float,
        take: Callable[[], dict[int, RankStack]],
        device_sync: bool,
        on_hang: str,
    ) -> None:
        self.watch = SampledWatch(hang_timeout, started, take, device_sync)
        self._take, self.on_hang = take, on_hang
        self.active = True
        self.first_end: float | None = None  # when a rank first ended: the others will never meet it again

    def set_active(self, active: bool, now: float) -> None:
        """Turn the rule on or off; turned back on, it starts afresh (what it reported stays reported)."""
        if active and not self.active:
            rule = self.watch.rule
            self.watch = SampledWatch(rule.timeout, now, self._take, rule.device_sync)
            self.watch.rule.reported = rule.reported
        self.active = active

    def next_check(self, now: float) -> float | None:
        """Return when to check again (``SampledWatch.next_check``); None while the rule is off."""
        return self.watch.next_check(now) if self.active else None

    def check(self, now: float, ranks: list) -> tuple[Verdict, str, str | None] | None:
        """Judge the live ``ranks``' last sample, start the next; return the verdict, its text and why to stop."""
        if not self.active:
            return None
        live = [r for r in ranks if r.proc is not None and not r.exited]
        if self.first_end is None and len(live) < len(ranks):
            self.first_end = now  # a rank ended: whoever waits for it from now on waits in vain
        if not live or (len(live) < 2 and self.first_end is None):
            return None  # a lone rank has no one to wait for
        last_sign = max(r.last_activity for r in live)
        verdict = self.watch.check(now, [r.rank for r in live], last_sign, self.first_end)
        if verdict is None:
            return None
        ended = [r.rank for r in ranks if r.exited]
        nodes = {r.rank: r.status.node for r in ranks}
        text, reason = launch_outcome(verdict, self.watch.rule.timeout, self.on_hang, ended, nodes)
        return verdict, text, reason


class StackSampler:
    """Takes the ranks' stacks in a thread of its own, one sample at a time: the caller never waits for it."""

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
        except Exception:  # the stacks are a help, never a reason to hang or to fail a run
            logger.exception("could not take the ranks' stacks")
            stacks = {}
        self._result = (time.monotonic(), stacks)

    @property
    def landed(self) -> bool:
        """Return True when a sample was taken and not yet read (``result()``)."""
        return self._result is not None

    def result(self) -> tuple[float, dict[int, RankStack]] | None:
        """Return ``(when, stacks)`` of the sample finished since the last call, or None."""
        result, self._result = self._result, None
        return result

    def join(self, timeout: float | None = None) -> None:
        """Wait for the sample being taken (if any) to end."""
        if self._thread is not None:
            self._thread.join(timeout)
