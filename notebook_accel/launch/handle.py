"""``LaunchHandle``: the running launch, supervised by one background thread.

The thread waits (``selectors``) on every worker's stdout, stderr and result pipe and on a
descriptor that becomes readable when the worker exits. It cuts output into ``OutputLine``s for the
sinks and subscribers, collects results, notices the first failure and stops the other ranks at
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
import os
import selectors
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .completion import Completion
from .doctor import RankStack, describe_stacks, named_ranks
from .errors import LaunchError, RankFailure, death_notes, order_failures, signal_name
from .events import EventHub
from .hangs import SampledWatch, Verdict, launch_outcome, returned_note
from .interfaces import WorkerBackend, WorkerStart
from .output import LineSplitter, OutputHistory, OutputLine, announce
from .plan import LaunchPlan, threads_per_worker
from .procs import LocalProcesses
from .ranks import RankStatus, _Rank
from .states import State
from .usage import apply_usage
from .views import LaunchViews
from .worker import WorkerSpec

__all__ = ["LaunchHandle", "RankStatus"]

logger = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[LaunchHandle] = weakref.WeakSet()  # running launches, stopped at interpreter exit
_DRAIN_SECONDS = 2.0  # after the last exit, how long pipes held by stray descendants may stay open


class LaunchHandle(Completion, LaunchViews):
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
        self._stop_signals: list[tuple[float, int]] = []
        self._stop_reason = ""
        self._user_stopped = False
        self._sent_signals: set[int] = set()
        # ``timeout`` counts from here: a restarted group passes the launch's first start.
        self._started = time.monotonic() if started is None else started
        self._timed_out = False
        n = plan.num_processes
        self._ranks = [
            _Rank(rank, rank % n, attempt, rank // n, plan.hosts[rank // n] if plan.hosts else None)
            for rank in plan.supervised_ranks
        ]
        self._thread: threading.Thread | None = None
        self._bar_events = bar_events
        self._events = EventHub(live_bar_ranks)
        self._usage = self._backend.usage_source()
        self._collector = self._backend.stack_source()
        # Stacks are sampled beside the supervising thread, which keeps reading output meanwhile.
        self._hang = SampledWatch(hang_timeout, time.monotonic(), self.stacks, plan.backend == "nccl")
        self._first_end: float | None = None  # when a rank first ended: the others will never meet it again
        self._hang_active = True
        self._on_hang = on_hang
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
        return self._hang.rule.timeout

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

        The ranks are not stopped: faulthandler writes the stacks from a signal handler and the rank
        goes on. A rank that has ended is absent; one still starting (its handler not installed
        yet) comes back with ``answered`` False.
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

    def _start(self, threaded: bool = True) -> None:
        """Start the workers, and the supervising thread unless ``threaded`` is False."""
        freeze = self.plan.start_method == "fork"
        if freeze:
            # Objects that exist now move to the permanent generation for the forks: a worker's
            # garbage collections then never touch (and copy-on-write) the kernel's heap.
            gc.freeze()
        writes: list[int] = []
        try:
            starts = self._worker_starts(writes)
            try:
                procs = self._backend.start(self.plan.start_method, starts)
            finally:
                for fd in writes:
                    os.close(fd)
                writes.clear()
        except BaseException:
            # A failed start (or ^C while forking): the backend took down what it started; release every fd.
            for fd in writes:
                os.close(fd)
            self._collector.close()
            for r in self._ranks:
                for fd in r.fds:
                    os.close(fd)
                r.fds.clear()
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
                target=self._supervise, name=f"notebook_accel-launch-{self.run_id}", daemon=True
            )
            self._thread.start()

    def _worker_starts(self, writes: list[int]) -> list[WorkerStart]:
        """Return each rank's start, over pipes opened now (write ends appended to ``writes``, read ends kept)."""
        plan = self.plan
        ends = []
        for r in self._ranks:
            pipes = {name: os.pipe() for name in ("stdout", "stderr", "result")}
            for name, (read_end, write_end) in pipes.items():
                r.fds[read_end] = name
                writes.append(write_end)
            ends.append(tuple(pipes[name][1] for name in ("stdout", "stderr", "result")))
        # A forked worker closes every other descriptor of the launch: the read ends, the others' write ends.
        parent_fds = [fd for r in self._ranks for fd in r.fds]
        threads = threads_per_worker(plan.num_processes)
        store_ports = tuple(p for p in (plan.master_port, plan.dry_run_port) if p)
        starts = []
        for r, own in zip(self._ranks, ends):
            spec = WorkerSpec(
                rank=r.rank,
                local_rank=r.local_rank,
                env=plan.worker_env(r.local_rank, r.node),
                num_threads=threads,
                backend=plan.backend,
                dry_run_port=plan.dry_run_port,
                function=self._function,
                args=self._args,
                close_fds=tuple(parent_fds + [fd for fd in writes if fd not in own]),
                parent_pid=os.getpid(),
                bar_events=self._bar_events,
                stacks_path=self._collector.path(r.rank),
                store_ports=store_ports,
            )
            starts.append(WorkerStart(spec, *own))
        return starts

    def _run_here(self) -> None:
        """Supervise the launch in the calling thread until it is done (a blocking launch).

        No extra thread to start or hand over to, and a blocking launch's output is printed by
        the caller's own thread (in a kernel: the cell's). ^C stops the workers (a second ^C kills
        them); KeyboardInterrupt is re-raised once they are all gone.
        """
        self._supervise(interruptible=True)

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
            now = time.monotonic()
            self._stop_started = now
            self._stop_reason = self._stop_reason or reason
            first, *later = signals
            self._stop_signals = [(now + grace * (i + 1), s) for i, s in enumerate(later)]
            self._signal_running(first)

    def _signal_running(self, signum: int) -> None:
        self._sent_signals.add(signum)
        for r in self._ranks:
            if r.proc is not None and not r.exited:
                r.proc.signal_group(signum)

    def _supervise(self, interruptible: bool = False) -> None:
        sel = selectors.DefaultSelector()
        interrupts = 0
        try:
            for r in self._ranks:
                for fd in r.fds:
                    os.set_blocking(fd, False)
                    sel.register(fd, selectors.EVENT_READ, (r, r.fds[fd]))
                if r.proc.sentinel is not None:
                    sel.register(r.proc.sentinel, selectors.EVENT_READ, (r, "exit"))
            polling = any(r.proc.sentinel is None for r in self._ranks)
            self._drain_deadline: float | None = None
            while True:
                try:
                    if self._step(sel, polling):
                        break
                except KeyboardInterrupt:
                    if not interruptible:
                        raise
                    interrupts += 1
                    self.stop() if interrupts == 1 else self.kill()
        except BaseException:
            logger.exception("launch supervisor crashed; killing the workers")
            self._signal_running(signal.SIGKILL)
            raise
        finally:
            self._finish(sel)
        if interrupts:
            raise KeyboardInterrupt(describe_stacks(self._stop_stacks) if self._stop_stacks else "")

    def _step(self, sel: selectors.BaseSelector, polling: bool) -> bool:
        """Handle what is ready; return True when the launch is over."""
        now = time.monotonic()
        if all(r.exited for r in self._ranks):
            if all(not r.fds for r in self._ranks):
                return True
            self._drain_deadline = self._drain_deadline or now + _DRAIN_SECONDS
            if now >= self._drain_deadline:
                return True
        for event, _ in sel.select(self._next_wakeup(now, polling, self._drain_deadline)):
            rank, kind = event.data
            if kind == "exit":
                sel.unregister(event.fd)
                self._on_exit(rank)
            elif event.fd in rank.fds:
                self._read(sel, rank, event.fd, kind)
        if polling or self._stop_started is not None:
            for r in self._ranks:
                if not r.exited and r.proc.poll() is not None:
                    if r.proc.sentinel is not None and r.proc.sentinel in sel.get_map():
                        sel.unregister(r.proc.sentinel)
                    self._on_exit(r)
        self._tick()
        self._watch_for_hang(time.monotonic())  # after the wait: a sample due now is started now
        if self._usage.due(now):
            with self._lock:
                for r in self._ranks:
                    if not r.exited:
                        self._usage.sample(r.status)
        return False

    def _next_wakeup(self, now: float, polling: bool, drain_deadline: float | None) -> float | None:
        deadlines = [t for t, _ in self._stop_signals]
        if self._timeout is not None and self._stop_started is None:
            deadlines.append(self._started + self._timeout)
        if drain_deadline is not None:
            deadlines.append(drain_deadline)
        check = self._hang.next_check(now) if self._hang_active and self._stop_started is None else None
        if check is not None:  # the hang rule's next sample, or one being taken
            deadlines.append(check)
        wait = min(deadlines) - now if deadlines else None
        if polling or self._stop_started is not None:
            wait = 0.05 if wait is None else min(wait, 0.05)
        # Wake up now and then anyway: a subscriber may have asked to stop between two events.
        return 0.5 if wait is None else max(0.0, min(wait, 0.5))

    def _tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            while self._stop_signals and self._stop_signals[0][0] <= now:
                _, signum = self._stop_signals.pop(0)
                self._signal_running(signum)
        if self._timeout is not None and self._stop_started is None and now - self._started >= self._timeout:
            self._timed_out = True
            for r in self._ranks:
                if not r.exited:
                    self._failures.append(
                        RankFailure(
                            r.rank,
                            r.status.pid,
                            "TimeoutError",
                            f"still running after timeout={self._timeout} s (last line: {r.status.last_line!r})",
                            "",
                            time=now,
                        )
                    )
            self._begin_stop(
                f"timed out after {self._timeout} s",
                [signal.SIGINT, signal.SIGTERM, signal.SIGKILL],
                1.0,
                stacks=True,
            )

    def _stack_targets(self) -> dict[int, tuple[int, int | None]]:
        return {
            r.rank: (r.proc.pid, r.proc.pidfd) for r in self._ranks if r.proc is not None and not r.exited
        }

    def _take_stacks(self) -> dict[int, RankStack]:
        targets = self._stack_targets()
        return self._collector.collect(targets) if targets else {}

    def watch_for_hangs(self, active: bool) -> None:
        """Turn the hang rule on or off (on by default); turned back on, it starts afresh.

        The interactive ranks turn it off: each command applies the same rule to the ranks it asked.
        """
        with self._lock:
            if active and not self._hang_active:
                rule = self._hang.rule
                self._hang = SampledWatch(rule.timeout, time.monotonic(), self.stacks, rule.device_sync)
                self._hang.rule.reported = rule.reported
            self._hang_active = active

    def _watch_for_hang(self, now: float) -> None:
        """Apply the hang rule (``hangs.py``) to the live ranks: judge the last stack sample, start the next."""
        if self._stop_started is not None or not self._hang_active:
            return
        live = [r for r in self._ranks if r.proc is not None and not r.exited]
        if self._first_end is None and len(live) < len(self._ranks):
            self._first_end = now  # a rank ended: whoever waits for it from now on waits in vain
        if not live or (len(live) < 2 and self._first_end is None):
            return  # a lone rank has no one to wait for
        last_sign = max(r.last_activity for r in live)
        verdict = self._hang.check(now, [r.rank for r in live], last_sign, self._first_end)
        if verdict is not None:
            self._judged(verdict)

    def _judged(self, verdict: Verdict) -> None:
        """Show the hang rule's verdict once; stop on a deadlock, a wait in vain, or honest work with on_hang="stop"."""
        ended = [r.rank for r in self._ranks if r.exited]
        nodes = {r.rank: r.status.node for r in self._ranks}
        text, reason = launch_outcome(verdict, self.hang_timeout, self._on_hang, ended, nodes)
        self.hang_report = text
        logger.warning("%s", text.partition("\n")[0])
        announce(self._sinks, text, guard=True)
        self._events.notify("hang", -1, text)
        if reason is not None:
            self._stop_stacks = verdict.stacks
            # What the ranks raise once signalled is the stop's doing, not a failure.
            self._user_stopped = True
            self._begin_stop(f"stopped: {reason}", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], 1.0)

    def _read(self, sel: selectors.BaseSelector, rank: _Rank, fd: int, kind: str) -> None:
        with self._lock:  # output_drained() sees each read either not begun or handed to the sinks
            self._read_locked(sel, rank, fd, kind)

    def _read_locked(self, sel: selectors.BaseSelector, rank: _Rank, fd: int, kind: str) -> None:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if kind == "result":
            self._on_frames(rank, data)
        elif data:
            rank.splitters[kind].feed(data)
        if data:
            return
        sel.unregister(fd)
        os.close(fd)
        del rank.fds[fd]
        if kind == "result":
            self._on_result(rank)
        else:
            rank.splitters[kind].close()
        self._maybe_settle(rank)

    def _on_frames(self, rank: _Rank, data: bytes) -> None:
        try:
            messages = rank.decoder.feed(data)
        except Exception as exc:  # a class missing here, or bytes that are not ours
            messages = [
                ("err", type(exc).__name__, f"a message of rank {rank.rank} could not be read: {exc}", "")
            ]
        for message in messages:
            if message[0] == "event":
                self._on_event(rank, message[1], message[2])
            else:
                rank.message = message

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
        message = rank.message
        if message is None:
            return
        if message[0] == "ok":
            rank.value = message[1]
        elif message[0] == "err" and not self._user_stopped:
            _, exc_type, text, tb = message
            self._fail(RankFailure(rank.rank, rank.status.pid, exc_type, text, tb, time=time.monotonic()))

    def _on_exit(self, rank: _Rank) -> None:
        rank.proc.kill_leftovers()  # before reaping, while the group id is still certainly ours
        while rank.proc.poll() is None:
            time.sleep(0.001)
        rank.exited = True
        self._usage.forget(rank.status.pid)
        rank.status.exitcode = rank.proc.exitcode
        rank.status.ended_at = time.time()
        self._maybe_settle(rank)

    def _maybe_settle(self, rank: _Rank) -> None:
        """Decide a rank's final state once it has exited and its result pipe is drained."""
        if not (rank.exited and rank.result_done) or not rank.status.state.live:
            return
        code = rank.proc.exitcode
        kind = rank.message[0] if rank.message else None
        if kind == "ok":
            state = State.SUCCEEDED
        elif kind == "stopped" or (kind == "err" and self._user_stopped):
            state = State.STOPPED
        elif kind == "err":
            state = State.FAILED
        elif code is not None and code < 0 and -code in self._sent_signals:
            state = State.STOPPED  # one of ours
        else:
            state = State.FAILED
            if code is not None and code < 0:
                name = signal_name(-code)
                hint = " (the out-of-memory killer sends SIGKILL)" if -code == signal.SIGKILL else ""
                tail = death_notes(list(rank.stderr_tail))
                shown = f"Last stderr lines of rank {rank.rank}:\n{tail}" if tail else ""
                failure = RankFailure(
                    rank.rank,
                    rank.status.pid,
                    "Signal",
                    f"killed by {name}{hint}",
                    shown,
                    exitcode=code,
                    signal=name,
                )
            else:
                failure = RankFailure(
                    rank.rank,
                    rank.status.pid,
                    "ExitCode",
                    f"exited with code {code} before returning a result",
                    "",
                    exitcode=code,
                )
            failure.time = time.monotonic()
            self._fail(failure)
        with self._lock:
            rank.status.state = state

    def _fail(self, failure: RankFailure) -> None:
        self._failures.append(failure)
        self._begin_stop(f"rank {failure.rank} failed", [signal.SIGTERM, signal.SIGKILL], 1.5)

    def _finish(self, sel: selectors.BaseSelector) -> None:
        for r in self._ranks:
            for fd in list(r.fds):
                try:
                    sel.unregister(fd)
                except (KeyError, ValueError):
                    pass
                os.close(fd)
            r.fds.clear()
            if r.proc is not None:
                if not r.exited:  # only after a supervisor crash
                    r.proc.kill_and_reap()
                    r.exited = True
                r.proc.close()
            for splitter in r.splitters.values():
                splitter.close()
        sel.close()
        for r in self._ranks:
            if r.status.state.live:
                r.status.state = State.STOPPED
            for f in self._failures:
                if f.rank == r.rank and r.status.state != State.FAILED:
                    r.status.state = State.FAILED if not self._timed_out else State.STOPPED
                    if f.exitcode is None:
                        f.exitcode = r.status.exitcode
        self._error = self._build_error()
        self._hang.sampler.join(2.0)  # a sample under way ends at once (no rank is left to answer)
        self._collector.close()
        _LIVE.discard(self)
        self._complete()

    def _kill_at_exit(self) -> None:
        """SIGKILL the workers' process groups (interpreter exit with a launch still running)."""
        for r in self._ranks:
            if r.proc is not None and not r.exited:
                r.proc.signal_group(signal.SIGKILL)

    def _build_error(self) -> LaunchError | None:
        where = describe_stacks(self._stop_stacks) if self._stop_stacks else None
        nodes = {r.rank: r.status.node for r in self._ranks}
        if self._failures:
            failures = order_failures(self._failures)
            for failure in failures:
                failure.node = failure.node or nodes.get(failure.rank)
            returned = [r.rank for r in self._ranks if r.status.state == State.SUCCEEDED]
            summary = self._stop_reason if self._timed_out else returned_note(failures[0], returned, nodes)
            return LaunchError(failures, summary, stacks=where)
        unfinished = [r.rank for r in self._ranks if r.status.state != State.SUCCEEDED]
        if unfinished:
            return LaunchError(
                [],
                f"launch {self._stop_reason or 'ended'}: {named_ranks(unfinished, nodes)} did not finish",
                stacks=where,
            )
        return None


@atexit.register
def _stop_live_launches() -> None:
    # The kernel is shutting down with non-blocking launches still running: take them along.
    for handle in list(_LIVE):
        handle._kill_at_exit()
