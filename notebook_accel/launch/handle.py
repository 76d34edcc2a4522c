"""``LaunchHandle``: the running launch, supervised by one background thread.

The thread waits (``supervisor.RankSupervisor``) on every worker's stdout, stderr and result pipe and
on a descriptor that becomes readable when the worker exits (or, for ranks on other nodes, on the one
inbox they all push into). It cuts output into ``OutputLine``s for the sinks and subscribers, collects results, notices the first failure and stops the other ranks at
once (a rank blocked in a collective would otherwise wait for its timeout), and, at the end, closes
every descriptor it owns. States per rank (``states.State``): starting -> running -> succeeded | failed
| stopped. The hang rule of ``hangs.py`` watches the ranks meanwhile, its stack samples taken in a thread of
their own so that output keeps flowing.
"""

from __future__ import annotations

import atexit
import collections
import gc
import logging
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .completion import Completion
from .doctor import RankStack, describe_stacks
from .errors import LaunchError, RankFailure
from .events import EventHub
from .hangs import LaunchWatch
from .interfaces import RunView, WorkerBackend, WorkerStart
from .output import LineSplitter, OutputHistory, OutputLine, announce
from .plan import LaunchPlan
from .procs import LocalProcesses
from .ranks import RankStatus, _Rank, launch_error, settle_all
from .states import State
from .supervisor import RankInbox, RankSupervisor, Signals, start_workers
from .usage import apply_usage
from .views import LaunchViews

__all__ = ["LaunchHandle", "RankStatus"]

logger = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[LaunchHandle] = weakref.WeakSet()  # running launches, stopped at interpreter exit


class LaunchHandle(Completion, LaunchViews, RunView):
    """A launch in progress: per-rank status, live output, results, stop."""

    def __init__(
        self,
        plan: LaunchPlan,
        function: Callable,
        args: tuple = (),
        *,
        sinks: list[Callable[[OutputLine], None]] | None = None,
        timeout: float | None = None,
        run_id: str = "",
        log_files: dict[int, dict[str, str]] | None = None,
        on_finish: Callable[[], None] | None = None,
        bar_events: bool = False,
        live_bar_ranks: set[int] | None = None,
        hang_timeout: float = float("inf"),
        on_hang: str = "report",
        attempt: int = 1,
        started: float | None = None,
        backend: WorkerBackend | None = None,
    ) -> None:
        self.plan = plan
        # Where the ranks run: processes on this machine (the default), or the agents of a launch across
        # nodes (nodes.remote.NodeGroup): the same interfaces (interfaces.py) either way.
        self._backend = LocalProcesses() if backend is None else backend
        # Where a pushing backend's ranks report (supervisor.start_workers); None over pipes.
        self._inbox: RankInbox | None = None
        self.attempt = attempt
        """Which try of a launch with restarts this group is (1 without ``max_restarts``)."""
        self.run_id = run_id
        self.log_files = log_files or {}
        """``{rank: {"stdout": path, "stderr": path}}`` when ``log_dir`` was given."""
        self._function, self._args = function, tuple(args)
        self._sinks = list(sinks or [])
        self._timeout = timeout
        self._on_finish = on_finish
        self._lock = threading.RLock()
        self._history = OutputHistory()  # bounded in lines and bytes (output.HISTORY_*)
        self._subscribers: list[Callable[[OutputLine], None]] = []
        self._done_callbacks: list[Callable[[LaunchHandle], None]] = []
        self._done = threading.Event()
        self._failures: list[RankFailure] = []
        self._error: LaunchError | None = None
        self._stop_started: float | None = None
        self._stop_reason = ""
        self._user_stopped = False
        # ``timeout`` counts from here: a restarted group passes the launch's first start.
        self._started = time.monotonic() if started is None else started
        self._timed_out = False
        n = plan.num_processes
        self._ranks = [
            _Rank(rank, rank % n, attempt, rank // n, plan.hosts[rank // n] if plan.hosts else None)
            for rank in plan.supervised_ranks
        ]
        self._signals = Signals(self._ranks)  # those of a stop: SIGINT, then SIGTERM, then SIGKILL...
        self._thread: threading.Thread | None = None
        self._bar_events = bar_events
        self._events = EventHub(live_bar_ranks)
        self._usage = self._backend.usage_source()
        self._collector = self._backend.stack_source()
        # Stacks are sampled beside the supervising thread, which keeps reading output meanwhile. The
        # watch holds the handle weakly: a launch dropped once over is freed at once, not at a full collection.
        stacks = weakref.WeakMethod(self.stacks)
        self._hangs = LaunchWatch(
            hang_timeout, time.monotonic(), lambda: stacks()(), plan.backend == "nccl", on_hang
        )
        self._stop_stacks: dict[int, RankStack] | None = None
        self.hang_report: str | None = None
        """The hang rule's report (every rank's position, the stacks), once it made one (``hangs.py``)."""

    # ------------------------------------------------------------------ public API

    @property
    def num_processes(self) -> int:
        """Return the number of worker processes of this launch."""
        return len(self._ranks)

    @property
    def hang_timeout(self) -> float:
        """Return the seconds without progress after which the hang rule reports or ends a wait (math.inf: never)."""
        return self._hangs.watch.rule.timeout

    @property
    def pids(self) -> list[int | None]:
        """Return each rank's pid (None before it started)."""
        return [r.status.pid for r in self._ranks]

    def status(self) -> list[RankStatus]:
        """Return a snapshot of every rank's status."""
        with self._lock:
            return [RankStatus(**vars(r.status)) for r in self._ranks]

    def _results(self) -> list:
        return [r.value for r in self._ranks]

    def stacks(self) -> dict[int, RankStack]:
        """Return every live rank's current Python stacks (all threads), taken within about a second.

        The ranks are not stopped: a thread of each rank writes them (``stackdump``) and the rank
        goes on. A rank that has ended is absent; one still starting (its answering thread not
        started yet) comes back with ``answered`` False.
        """
        if self.done:
            return {}
        with self._lock:  # only to read who is alive: output keeps flowing while the stacks are taken
            targets = self._stack_targets()
        try:
            return self._collector.collect(targets) if targets else {}
        except FileNotFoundError:
            if not self._collector.closed():
                raise
            return {}  # the launch ended meanwhile and removed its stacks files: no rank is live

    def stop(self, grace: float = 1.0) -> None:
        """Stop every worker: SIGINT now, SIGTERM after ``grace`` s, then SIGKILL. Idempotent."""
        self._user_stopped = self._user_stopped or not self.done
        self._begin_stop(
            "stopped by the user", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], grace, stacks=True
        )

    def kill(self) -> None:
        """Stop every worker with SIGKILL at once."""
        self._user_stopped = self._user_stopped or not self.done
        self._begin_stop("killed by the user", [signal.SIGKILL], 0.0, force=True)

    def __repr__(self) -> str:
        states = collections.Counter(s.state for s in self.status())
        summary = ", ".join(f"{n} {state}" for state, n in states.items())
        return f"<LaunchHandle {self.run_id or ''} {self.num_processes} process(es): {summary}>"

    # ------------------------------------------------------------------ starting

    def start(self, threaded: bool = True) -> None:
        """Start the workers, and the supervising thread unless ``threaded`` is False."""
        freeze = self.plan.start_method == "fork"
        if freeze:
            # Objects that exist now move to the permanent generation for the forks: a worker's
            # garbage collections then never touch (and copy-on-write) the kernel's heap.
            gc.freeze()
        try:
            procs, self._inbox = start_workers(
                self._backend, self.plan.start_method, self._ranks, self._worker_starts
            )
        except BaseException:
            self._collector.close()  # the pipes were closed, and what started was taken down
            raise
        finally:
            if freeze:
                gc.unfreeze()
        for r, proc in zip(self._ranks, procs):
            r.proc = proc
            r.status.pid = proc.pid
            r.status.state = State.RUNNING
            self._usage.sample(r.status)
            for stream in ("stdout", "stderr"):
                r.splitters[stream] = LineSplitter(r.rank, stream, self._emit)
        _LIVE.add(self)
        if threaded:
            self._thread = threading.Thread(
                target=self.supervise, name=f"notebook_accel-launch-{self.run_id}", daemon=True
            )
            self._thread.start()

    def _worker_starts(self, ends: list[tuple[int, ...]], writes: list[int]) -> list[WorkerStart]:
        return self.plan.worker_starts(
            self._ranks,
            ends,
            writes,
            self._collector.path,
            function=self._function,
            args=self._args,
            bar_events=self._bar_events,
        )

    def run_here(self) -> None:
        """Supervise the launch in the calling thread until it is done (a blocking launch).

        No extra thread to start or hand over to, and a blocking launch's output is printed by
        the caller's own thread (in a kernel: the cell's). ^C stops the workers (a second ^C kills
        them); KeyboardInterrupt is re-raised once they are all gone.
        """
        self.supervise(interruptible=True)

    # ------------------------------------------------------------------ supervising thread

    def _emit(self, line: OutputLine) -> None:
        if line.attempt != self.attempt:
            line = replace(line, attempt=self.attempt)
        with self._lock:
            self._history.append(line)
            rank = self._ranks[line.rank - self._ranks[0].rank]
            rank.status.last_line = line.text
            rank.last_activity = time.monotonic()
            if line.stream == "stderr":
                rank.stderr_tail.append(line.text)
            for target in (*self._sinks, *self._subscribers):
                try:
                    target(line)
                except Exception:
                    logger.exception("output sink %r failed on a line of rank %d", target, line.rank)

    def _begin_stop(
        self, reason: str, signals: list[int], grace: float, force: bool = False, stacks: bool = False
    ) -> None:
        with self._lock:
            if self.done or (self._stop_started is not None and not force):
                return
            if stacks and self._stop_stacks is None:
                self._stop_stacks = self._take_stacks()  # where each rank was, for the error
            self._stop_started = time.monotonic()
            self._stop_reason = self._stop_reason or reason
            self._signals.escalate(signals, grace, self._stop_started)

    def supervise(self, interruptible: bool = False) -> None:
        """Supervise the launch until it is done: output, results, exits, stops, timeout, hang rule."""
        ranks = RankSupervisor(self._on_data, self._on_eof, self._on_exit, lock=self._lock, inbox=self._inbox)
        interrupts = 0
        try:
            ranks.add(self._ranks)
            while True:
                try:
                    if self._step(ranks):
                        break
                except KeyboardInterrupt:
                    if not interruptible:
                        raise
                    interrupts += 1
                    self.stop() if interrupts == 1 else self.kill()
        except BaseException:
            logger.exception("launch supervisor crashed; killing the workers")
            self._signals.send(signal.SIGKILL)
            raise
        finally:
            self._finish(ranks)
        if interrupts:
            raise KeyboardInterrupt(describe_stacks(self._stop_stacks) if self._stop_stacks else "")

    def _step(self, ranks: RankSupervisor) -> bool:
        """Handle what is ready; return True when the launch is over."""
        now = time.monotonic()
        if ranks.over(now):
            return True
        ranks.wait(self._next_wakeup(now, ranks))
        if ranks.polling or self._stop_started is not None:
            ranks.poll_exits()
        self._tick()
        self._watch_for_hang(time.monotonic())  # after the wait: a sample due now is started now
        if self._usage.due(now):
            with self._lock:
                for r in self._ranks:
                    if not r.exited:
                        self._usage.sample(r.status)
        return False

    def _next_wakeup(self, now: float, ranks: RankSupervisor) -> float | None:
        deadlines = [t for t, _ in self._signals.planned]
        if self._timeout is not None and self._stop_started is None:
            deadlines.append(self._started + self._timeout)
        if ranks.drain_deadline is not None:
            deadlines.append(ranks.drain_deadline)
        check = self._hangs.next_check(now) if self._stop_started is None else None
        if check is not None:  # the hang rule's next sample, or one being taken
            deadlines.append(check)
        wait = min(deadlines) - now if deadlines else None
        if ranks.polling or self._stop_started is not None:
            wait = 0.05 if wait is None else min(wait, 0.05)
        # Wake up now and then anyway: a subscriber may have asked to stop between two events.
        return 0.5 if wait is None else max(0.0, min(wait, 0.5))

    def _tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._signals.send_due(now)
        if self._timeout is not None and self._stop_started is None and now - self._started >= self._timeout:
            self._timed_out = True
            self._failures += [r.timeout_failure(self._timeout, now) for r in self._ranks if not r.exited]
            self._begin_stop(
                f"timed out after {self._timeout} s",
                [signal.SIGINT, signal.SIGTERM, signal.SIGKILL],
                1.0,
                stacks=True,
            )

    def _stack_targets(self) -> dict[int, int]:
        return {r.rank: r.proc.pid for r in self._ranks if r.proc is not None and not r.exited}

    def _take_stacks(self) -> dict[int, RankStack]:
        targets = self._stack_targets()
        return self._collector.collect(targets) if targets else {}

    def watch_for_hangs(self, active: bool) -> None:
        """Turn the hang rule on or off (on by default); turned back on, it starts afresh.

        The interactive ranks turn it off: each command applies the same rule to the ranks it asked.
        """
        with self._lock:
            self._hangs.set_active(active, time.monotonic())

    def _watch_for_hang(self, now: float) -> None:
        """Apply the hang rule (``hangs.py``) to the live ranks: judge the last stack sample, start the next."""
        judged = self._hangs.check(now, self._ranks) if self._stop_started is None else None
        if judged is None:
            return
        verdict, text, reason = judged
        self.hang_report = text
        logger.warning("%s", text.partition("\n")[0])
        announce(self._sinks, text, guard=True)
        self._events.notify("hang", -1, text)
        if reason is not None:  # a deadlock, a wait in vain, or honest work with on_hang="stop"
            self._stop_stacks = verdict.stacks
            # What the ranks raise once signalled is the stop's doing, not a failure.
            self._user_stopped = True
            self._begin_stop(f"stopped: {reason}", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], 1.0)

    def _on_data(self, rank: _Rank, kind: str, data: bytes) -> None:
        # Called with the lock held: output_drained() sees each read either not begun or handed to the sinks.
        if kind == "result":
            self._on_frames(rank, data)
        else:
            rank.splitters[kind].feed(data)

    def _on_eof(self, rank: _Rank, kind: str) -> None:
        if kind == "result":
            self._on_frames(rank, b"")  # frames left behind one that could not be read
            self._on_result(rank)
        else:
            rank.splitters[kind].close()
        self._maybe_settle(rank)

    def _on_frames(self, rank: _Rank, data: bytes) -> None:
        for message in rank.frames(data):
            self._on_event(rank, message[1], message[2])

    def _on_event(self, rank: _Rank, kind: str, payload: dict[str, Any]) -> None:
        rank.last_activity = time.monotonic()
        for line in self._events.dispatch(rank.rank, kind, payload):
            self._emit(line)
        if kind == "usage":
            with self._lock:
                apply_usage(rank.status, payload)

    def _on_result(self, rank: _Rank) -> None:
        rank.result_done = True
        for line in self._events.end_rank(rank.rank):
            self._emit(line)
        if rank.decoder.pending:
            # Killed while writing a message: the exit code or signal says what happened.
            logger.debug("rank %d: %d bytes of a truncated message dropped", rank.rank, rank.decoder.pending)
        failure = rank.result_failure(self._user_stopped)
        if failure is not None:
            self._fail(failure)

    def _on_exit(self, rank: _Rank) -> None:
        """A rank's process was reaped (``RankSupervisor``)."""
        self._usage.forget(rank.status.pid)
        rank.status.exitcode = rank.proc.exitcode
        rank.status.ended_at = time.time()
        self._maybe_settle(rank)

    def _maybe_settle(self, rank: _Rank) -> None:
        """Decide a rank's final state once it has exited and its result pipe is drained."""
        if not (rank.exited and rank.result_done) or not rank.status.state.live:
            return
        state, failure = rank.outcome(self._user_stopped, self._signals.sent)
        if failure is not None:
            self._fail(failure)
        with self._lock:
            rank.status.state = state

    def _fail(self, failure: RankFailure) -> None:
        self._failures.append(failure)
        self._begin_stop(f"rank {failure.rank} failed", [signal.SIGTERM, signal.SIGKILL], 1.5)

    def _finish(self, ranks: RankSupervisor) -> None:
        ranks.close()
        for r in self._ranks:
            for splitter in r.splitters.values():
                splitter.close()
            r.splitters.clear()  # each held the handle (its ``_emit``): no cycle outlives the launch
        settle_all(self._ranks, self._failures, self._timed_out)
        self._error = launch_error(
            self._ranks, self._failures, self._stop_reason, self._timed_out, self._stop_stacks
        )
        self._hangs.watch.sampler.join(2.0)  # a sample under way ends at once (no rank is left to answer)
        self._collector.close()
        _LIVE.discard(self)
        self._complete()

    def _kill_at_exit(self) -> None:
        """SIGKILL the workers' process groups (interpreter exit with a launch still running)."""
        for r in self._ranks:
            if r.proc is not None and not r.exited:
                r.proc.signal_group(signal.SIGKILL)


@atexit.register
def _stop_live_launches() -> None:
    # The kernel is shutting down with non-blocking launches still running: take them along.
    for handle in list(_LIVE):
        handle._kill_at_exit()
