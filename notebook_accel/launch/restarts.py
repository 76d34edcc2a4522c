"""Single-node fault tolerance: restart the whole group after a failed attempt, as torch elastic does.

``notebook_launcher(max_restarts=k, monitor_interval=s)`` on one machine runs the group; when a rank
fails, every rank is stopped (as always), ``s`` seconds pass and a new group starts, up to ``k``
times. :class:`RestartingHandle` is the one handle of the whole run, blocking or not: it starts each
attempt (a :class:`LaunchHandle`), forwards its lines (tagged with the attempt) and events, keeps an
:class:`Attempt` record per ended try, announces each restart to the sinks and ends with the
successful attempt's values or the last attempt's ``LaunchError`` (root cause and traceback first).

Only a failed rank restarts the group. A stop, a kill or an interrupt (^C) ends the run without a
restart, during an attempt or during the wait before the next one; so does ``timeout``, which
covers the whole run (restarts and waits included), not each attempt.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .completion import Completion
from .doctor import RankStack
from .errors import LaunchError
from .events import BarState
from .handle import LaunchHandle, RankStatus
from .interfaces import RunView
from .output import OutputHistory, OutputLine
from .plan import LaunchPlan
from .states import State
from .views import OutputRecord

__all__ = ["Attempt", "RestartingHandle"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Attempt:
    """One ended try of a launch with ``max_restarts``: how it ended and, when it failed, why."""

    number: int
    """1 for the first group, 2 for the first restart, ..."""
    state: State
    """``SUCCEEDED``, ``FAILED`` (a rank failed) or ``STOPPED`` (stop, interrupt, timeout, hang)."""
    started_at: float
    """``time.time()`` when the group started."""
    ended_at: float
    """``time.time()`` when its last rank had ended."""
    rank: int | None = None
    """The root cause's rank (None unless a rank failed or timed out)."""
    exitcode: int | None = None
    """The root cause's exit code (negative: killed by that signal)."""
    failure: str = ""
    """The root cause's one-line summary: rank, pid, exception type and message."""
    error: LaunchError | None = field(default=None, repr=False, compare=False)
    """The attempt's own error, traceback included (None when it succeeded)."""

    def line(self) -> str:
        """Return one line: ``attempt 1 failed at 10:02:03 after 1.2 s: rank 1 (pid 42) ValueError: ... (exit code 1)``."""
        when = time.strftime("%H:%M:%S", time.localtime(self.ended_at))
        text = f"attempt {self.number} {self.state} at {when} after {self.ended_at - self.started_at:.1f} s"
        if self.failure:
            text += f": {self.failure}"
        return text + (f" (exit code {self.exitcode})" if self.exitcode is not None else "")


def _record(handle: LaunchHandle, started_at: float) -> Attempt:
    error = handle.error
    statuses = {s.rank: s for s in handle.status()}
    if error is None:
        return Attempt(handle.attempt, State.SUCCEEDED, started_at, time.time())
    state = State.FAILED if any(s.state == State.FAILED for s in statuses.values()) else State.STOPPED
    root = error.root_cause
    if root is None:
        return Attempt(
            handle.attempt, state, started_at, time.time(), failure=error.summary or "", error=error
        )
    # A rank that raised has a failure without an exit code; its process's code is in its status.
    exitcode = root.exitcode if root.exitcode is not None else statuses[root.rank].exitcode
    return Attempt(
        handle.attempt,
        state,
        started_at,
        time.time(),
        rank=root.rank,
        exitcode=exitcode,
        failure=root.headline(),
        error=error,
    )


class _OfCurrentTry:
    """A member of ``RestartingHandle`` that is its current (or last) try's ``LaunchHandle``'s own, read from it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, run: RestartingHandle | None, owner: type | None = None) -> Any:
        if run is None:
            return self
        return getattr(run._handle(), self.name)


class RestartingHandle(Completion, OutputRecord, RunView):
    """A launch with ``max_restarts``: the same interface as :class:`LaunchHandle`, over every attempt.

    ``status()``, ``pids``, ``stacks()``, ``bars()``, ``metrics`` and ``hang_report`` are those of
    the current (or last) attempt; ``lines()`` and ``subscribe()`` cover every attempt, each
    ``OutputLine`` carrying its ``attempt``. ``attempt`` is the current try's number, ``restarts``
    how many groups were started after the first, ``attempts`` the records of the ended tries, and
    ``subscribe_events`` also sends ``("restart", -1, Attempt)`` when a failed try is followed by a
    new one. ``result()`` gives the successful attempt's values or raises the last ``LaunchError``.
    """

    def __init__(
        self,
        start_attempt: Callable[[int, float], LaunchHandle],
        max_restarts: int,
        monitor_interval: float,
        *,
        timeout: float | None = None,
        sinks: Sequence[Callable[[OutputLine], None]] = (),
        on_finish: Callable[[], None] | None = None,
    ) -> None:
        self.max_restarts = max_restarts
        """How many times a failed group is restarted (the run makes at most ``max_restarts + 1`` tries)."""
        self.monitor_interval = monitor_interval
        """Seconds between a failed try's end and the next try's start."""
        self._start_attempt = start_attempt  # (attempt number, run start) -> started, unsupervised handle
        self._timeout = timeout
        self._sinks = list(sinks)
        self._on_finish = on_finish
        self._lock = threading.RLock()
        self._wake = threading.Event()  # set by stop()/kill(): ends the wait before a restart at once
        self._done = threading.Event()
        self._history = OutputHistory()  # bounded in lines and bytes (output.HISTORY_*)
        self._detach: tuple[Callable[[], None], ...] = ()  # the current try's unsubscribers
        self._subscribers: list[Callable[[OutputLine], None]] = []
        self._event_subscribers: list[Callable[[str, int, Any], None]] = []
        self._done_callbacks: list[Callable[[RestartingHandle], None]] = []
        self._attempts: list[Attempt] = []
        self._current: LaunchHandle | None = None
        self._current_started = 0.0
        self._stop_reason: str | None = None
        self._error: LaunchError | None = None
        self._values: list | None = None
        self._thread: threading.Thread | None = None
        self._started = time.monotonic()
        self.restarting = False
        """True while waiting ``monitor_interval`` before the next try."""

    # ------------------------------------------------------------------ the run

    @property
    def attempt(self) -> int:
        """Return the number of the current (or last) try: 1, then 2 after the first restart, ..."""
        return self._current.attempt if self._current is not None else 1

    @property
    def restarts(self) -> int:
        """Return how many times the group was restarted so far."""
        return self.attempt - 1

    @property
    def attempts(self) -> list[Attempt]:
        """Return the records of the tries that ended, oldest first."""
        with self._lock:
            return list(self._attempts)

    def _results(self) -> list:
        return list(self._values or [])

    def stop(self, grace: float = 1.0) -> None:
        """Stop the run: the current try's workers as ``LaunchHandle.stop`` does, and no restart. Idempotent."""
        current = self._request_stop("stopped by the user")
        if current is not None:
            current.stop(grace)

    def kill(self) -> None:
        """Stop the run with SIGKILL to the current try's workers, and no restart."""
        current = self._request_stop("killed by the user")
        if current is not None:
            current.kill()

    def __repr__(self) -> str:
        if self._current is None:
            return "<RestartingHandle (not started)>"
        states = collections.Counter(s.state for s in self.status())
        summary = ", ".join(f"{n} {state}" for state, n in states.items())
        tries = f"attempt {self.attempt}/{self.max_restarts + 1}"
        return f"<RestartingHandle {self.run_id} {self.num_processes} process(es), {tries}: {summary}>"

    # ------------------------------------------------------------------ the current try

    # The current (or last) try's own members, read from its LaunchHandle (``_OfCurrentTry``): its plan
    # (the rendezvous port changes with each try), run id and log files (every try writes there), pids,
    # status() (``RankStatus.attempt`` says which try), hang report, metrics and metrics_frame() (a
    # restart starts a new list), bars() and the ranks whose bars are shown live.
    plan: LaunchPlan = _OfCurrentTry()
    run_id: str = _OfCurrentTry()
    log_files: dict[int, dict[str, str]] = _OfCurrentTry()
    num_processes: int = _OfCurrentTry()
    pids: list[int | None] = _OfCurrentTry()
    status: Callable[[], list[RankStatus]] = _OfCurrentTry()
    hang_report: str | None = _OfCurrentTry()
    metrics: list[dict[str, Any]] = _OfCurrentTry()
    metrics_frame: Callable[[], Any] = _OfCurrentTry()
    bars: Callable[..., list[BarState]] = _OfCurrentTry()
    live_bar_ranks: set[int] | None = _OfCurrentTry()

    def stacks(self) -> dict[int, RankStack]:
        """Return every live rank's current Python stacks ({} between tries and once done)."""
        return {} if self.done else self._handle().stacks()

    def subscribe_events(self, callback: Callable[[str, int, Any], None]) -> Callable[[], None]:
        """Call ``callback(kind, rank, state)`` for every try's events and each ``"restart"``; return the unsubscribe function."""
        with self._lock:
            self._event_subscribers.append(callback)
        return lambda: self._remove(self._event_subscribers, callback)

    # ------------------------------------------------------------------ supervision

    def _handle(self) -> LaunchHandle:
        if self._current is None:
            raise RuntimeError("the launch has not started its first group yet")
        return self._current

    def _remove(self, targets: list, callback: Callable) -> None:
        with self._lock:
            if callback in targets:
                targets.remove(callback)

    def _request_stop(self, reason: str) -> LaunchHandle | None:
        with self._lock:
            if self.done:
                return None
            self._stop_reason = self._stop_reason or reason
            current = self._current
        self._wake.set()
        return current

    def start(self, threaded: bool = True) -> None:
        """Start the first try here (its errors raise in the caller), and the supervising thread if ``threaded``."""
        try:
            self._begin(1)
        except BaseException:
            self._complete()
            raise
        if threaded:
            self._thread = threading.Thread(
                target=self.supervise, name=f"notebook_accel-restarts-{self.run_id}", daemon=True
            )
            self._thread.start()

    def run_here(self) -> None:
        """Supervise every try in the calling thread (a blocking launch); ^C stops the run and re-raises."""
        self.supervise(interruptible=True)

    def _begin(self, number: int) -> None:
        started_at = time.time()
        handle = self._start_attempt(number, self._started)
        try:
            # Nothing is read from the workers before supervise: subscribing now misses no line or event.
            self._detach = (handle.subscribe(self._on_line), handle.subscribe_events(self._notify))
            with self._lock:
                self._current, self._current_started = handle, started_at
                stop = self._stop_reason is not None
        except BaseException:  # ^C right after the start: no group may be left unsupervised
            handle.kill()
            handle.supervise()
            raise
        if stop:  # stop() came while the group was starting
            handle.stop()

    def supervise(self, interruptible: bool = False) -> None:
        try:
            while True:
                handle = self._handle()
                handle.run_here() if interruptible else handle.supervise()
                for unsubscribe in self._detach:  # the try is over: it holds this run no more (no cycle)
                    unsubscribe()
                self._detach = ()  # each unsubscriber holds its callback too
                if not self._after_attempt(handle) or not self._wait_to_restart():
                    break
                try:
                    self._begin(handle.attempt + 1)
                except Exception as exc:  # e.g. no free port: the run ends with the last failure
                    self._error = self._final_error(f"restart {handle.attempt} could not start ({exc!r})")
                    self._error.__cause__ = exc
                    break
        except BaseException:
            # ^C (in a try, its workers are already stopped; or while waiting) or a supervisor crash.
            with self._lock:
                self._stop_reason = self._stop_reason or "interrupted"
            current = self._current
            if current is not None and not current.done:  # started, not supervised yet: reap it here
                current.kill()
                current.supervise()
            if current is not None and (not self._attempts or self._attempts[-1].number != current.attempt):
                self._attempts.append(_record(current, self._current_started))
            self._error = self._error or self._final_error(None)
            raise
        finally:
            self._complete()

    def _after_attempt(self, handle: LaunchHandle) -> bool:
        """Record the ended try; return True when a restart follows (the run's result is set otherwise)."""
        record = _record(handle, self._current_started)
        with self._lock:
            self._attempts.append(record)
        if record.state == State.SUCCEEDED:
            self._values = handle.result()
            return False
        if record.state != State.FAILED or self._stop_reason is not None or self._out_of_time():
            self._error = self._final_error(None)
            return False
        if record.number > self.max_restarts:
            self._error = self._final_error(
                f"all {record.number} attempts failed (max_restarts={self.max_restarts})"
            )
            return False
        logger.info("restarting the group after %s", record.failure)
        self._announce(
            f"restarting the group in {self.monitor_interval:g} s (restart {record.number} of "
            f"{self.max_restarts}) after {record.failure}"
        )
        self._notify("restart", -1, record)
        return True

    def _wait_to_restart(self) -> bool:
        """Return True once ``monitor_interval`` passed; False (the run's error set) after a stop or the timeout."""
        wait = self.monitor_interval
        if self._timeout is not None:
            wait = min(wait, max(0.0, self._started + self._timeout - time.monotonic()))
        self.restarting = True
        try:
            self._wake.wait(wait)
        finally:
            self.restarting = False
        restart = len(self._attempts)
        if self._stop_reason is not None:
            self._error = self._final_error(
                f"{self._stop_reason} before restart {restart} of {self.max_restarts}"
            )
            return False
        if self._out_of_time():
            self._error = self._final_error(f"timeout={self._timeout} s ran out before restart {restart}")
            return False
        return True

    def _out_of_time(self) -> bool:
        return self._timeout is not None and time.monotonic() - self._started >= self._timeout

    def _final_error(self, why: str | None) -> LaunchError:
        """Return the run's error: the last try's failures and traceback, with ``why`` (or which try it was) added."""
        last = self._attempts[-1]
        error = last.error
        if why is None:
            why = f"{self._stop_reason or last.state} on attempt {last.number} of {self.max_restarts + 1}"
        if error is None:  # the last try had succeeded: only a crash of this supervisor gets here
            return LaunchError([], f"launch {why}")
        summary = f"{error.summary}; {why}" if error.summary else why
        final = LaunchError(error.failures, summary=summary, stacks=error.stacks)
        final.__cause__ = error
        return final

    def _on_line(self, line: OutputLine) -> None:
        with self._lock:
            self._history.append(line)
            targets = list(self._subscribers)
        for target in targets:
            try:
                target(line)
            except Exception:
                logger.exception("subscriber %r failed on a line of rank %d", target, line.rank)

    def _notify(self, kind: str, rank: int, state: Any) -> None:
        with self._lock:
            targets = list(self._event_subscribers)
        for target in targets:
            try:
                target(kind, rank, state)
            except Exception:
                logger.exception("event subscriber %r failed on %r", target, kind)

    def _announce(self, text: str) -> None:
        for sink in self._sinks:
            announce = getattr(sink, "announce", None)
            if announce is not None:
                try:
                    announce(text)
                except Exception:
                    logger.exception("sink %r failed to show a restart", sink)

    def _finish(self) -> None:
        self._complete()
