"""Background jobs: a command on the interactive ranks that runs while the notebook stays free.

``ranks.submit(code_or_fn, ...)`` and ``%%ranks --bg`` start a :class:`Job`: a thread that runs the
command exactly as a foreground call does (``Ranks.run`` / ``Ranks.execute`` over ``Group.exchange``,
so the same death, collective-failure and hang rule supervise it) and returns at once. The thread
runs in a copy of the submitting cell's context: ipykernel sends what a thread writes or displays
under the parent header of the context that writes it, so the ranks' lines and bars land in the
output area of the cell that started the job, whatever cell runs meanwhile. Where the kernel offers it
(ipykernel's ``set_thread_parent``), the thread also names that cell as its parent explicitly, which
holds even where a kernel stops reading the parent from a context a thread inherited.

One command at a time runs on the ranks: while a job runs, any other command (a ``%%ranks`` cell,
``run``, ``push``, ``pull``, another job) is refused with :class:`JobRunningError`, naming the job
(never queued: a queued cell would block the notebook until the job ends, which the job was started
to avoid). Kernel cells run freely. ``job.stop()`` interrupts the job's ranks as the Stop button does
a foreground cell (namespaces kept); ^C while waiting on ``job.result()`` or ``%ranks wait`` does the
same.
"""

from __future__ import annotations

import contextvars
import html as _html
import itertools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["Job", "JobRunningError", "JobsTable", "command_guard", "running_job", "start_job", "stop_running"]

logger = logging.getLogger(__name__)

_numbers = itertools.count(1)
_start_lock = threading.Lock()  # two threads submitting at once: one job starts, the other is refused
_POLL_SECONDS = 0.1  # waits poll, so ^C reaches a waiting kernel at once
_STOP_SECONDS = 30.0  # stop(): the interrupt takes up to a few seconds (then the group is given up)


class JobRunningError(RuntimeError):
    """A command was refused because a background job runs on the ranks; the message names the job."""

    def _render_traceback_(self) -> list[str]:
        # The message says all; the kernel-side frames (the magic, the command plumbing) would not.
        return [f"{type(self).__name__}: {self}"]


def _where(on: Sequence[int] | None) -> str:
    return "every rank" if on is None else f"rank(s) {list(on)}"


class Job:
    """One background command on the ranks: ``done()``, ``result()``, ``stop()``, its state and time.

    Made by ``Ranks.submit`` or ``%%ranks --bg``, never directly.
    """

    def __init__(
        self, what: str, on: Sequence[int] | None, call: Callable[[], Any], show: Callable[[Any], Any]
    ) -> None:
        self.number = next(_numbers)
        """The job's number (``job 3``), unique in this kernel."""
        self.what = what
        """Short text of the command (the cell's first line, or the function's name)."""
        self.on = None if on is None else list(on)
        """The ranks it runs on (None: every rank)."""
        self.started_at = time.monotonic()
        self.ended_at: float | None = None
        self._call, self._show = call, show
        self._value: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._interrupt = threading.Event()
        self._cell = _cell_parent()
        self._thread = threading.Thread(
            target=contextvars.copy_context().run,
            args=(self._body,),
            name=f"notebook_accel-job-{self.number}",
            daemon=True,
        )

    # ------------------------------------------------------------------ the thread

    def _body(self) -> None:
        if self._cell is not None:
            shell, parent = self._cell
            try:
                shell.set_thread_parent(parent)
            except Exception:  # the copied context still routes the output on kernels that read it
                logger.debug(
                    "could not name job %d's cell as its thread's parent", self.number, exc_info=True
                )
        try:
            if self._interrupt.is_set():
                raise KeyboardInterrupt(f"job {self.number} was stopped before it started")
            self._value = self._call()
        except BaseException as exc:  # kept for result(): a KeyboardInterrupt (stop) is an outcome too
            self._error = exc
        finally:
            self.ended_at = time.monotonic()
            self._announce()  # before done(): whoever waits for the job sees its end line first
            self._done.set()

    def _announce(self) -> None:
        # One line in the job's own cell (this thread runs in its context) saying how it ended.
        if self._error is None:
            line = f"[job {self.number}] done in {self.elapsed:.1f} s; %ranks wait (or job.result()) shows its result"
        else:
            first = (str(self._error).strip().splitlines() or [""])[0][:160]
            line = (
                f"[job {self.number}] {self.state} after {self.elapsed:.1f} s "
                f"({type(self._error).__name__}: {first}); %ranks wait (or job.result()) raises it"
            )
        try:
            print(line, file=sys.stdout, flush=True)
        except Exception:
            logger.debug("could not print the end of job %d", self.number, exc_info=True)

    def owns_thread(self) -> bool:
        """Return True when called from this job's own thread."""
        return threading.current_thread() is self._thread

    # ------------------------------------------------------------------ facts

    @property
    def state(self) -> str:
        """Return ``"running"``, ``"done"``, ``"failed"`` (raised) or ``"stopped"`` (``stop()``, ^C)."""
        if self.ended_at is None:
            return "running"
        if self._error is None:
            return "done"
        return "stopped" if isinstance(self._error, KeyboardInterrupt) else "failed"

    @property
    def elapsed(self) -> float:
        """Return the seconds the job ran (so far, while it runs)."""
        return (self.ended_at or time.monotonic()) - self.started_at

    def done(self) -> bool:
        """Return True once the job ended (done, failed or stopped)."""
        return self._done.is_set()

    def line(self) -> str:
        """Return one line about the job: ``job 2 running 3.1 s: train (every rank)``."""
        return f"job {self._summary()}"

    def _summary(self) -> str:
        state = self.state
        when = f"{self.elapsed:.1f} s" if state == "running" else f"after {self.elapsed:.1f} s"
        return f"{self.number} {state} {when}: {self.what} ({_where(self.on)})"

    def __repr__(self) -> str:
        return f"<Job {self._summary()}>"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def busy_message(self) -> str:
        """Return why a command is refused while this job runs, and what to do instead."""
        return (
            f"job {self.number} ({self.what!r} on {_where(self.on)}, started {self.elapsed:.0f} s ago) is running "
            "on the ranks in the background, and the ranks run one command at a time: this one is refused, not "
            "queued. Wait for the job (%ranks wait, or job.result()) or stop it (job.stop(); the namespaces "
            "stay), then run it again; kernel cells run meanwhile"
        )

    # ------------------------------------------------------------------ waiting and stopping

    def wait(self, timeout: float | None = None) -> bool:
        """Return True once the job ended, False when ``timeout`` seconds passed first.

        ^C (the Stop button) while waiting stops the job, as it stops a foreground cell.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._done.is_set():
                left = _POLL_SECONDS if deadline is None else min(_POLL_SECONDS, deadline - time.monotonic())
                if left <= 0:
                    return False
                self._done.wait(left)
        except KeyboardInterrupt:
            self.stop()
        return True

    def result(self, timeout: float | None = None) -> Any:
        """Return what the foreground call returns (``ranks.run``'s list; a ``%%ranks --bg`` cell's display).

        Waits for the job. Raises what the foreground call would raise (``RankError`` when it
        raised on a rank, with ``broken`` set if the group could not go on; KeyboardInterrupt after
        ``stop()``), and TimeoutError when ``timeout`` seconds pass first (the job goes on).
        """
        if not self.wait(timeout):
            raise TimeoutError(
                f"job {self.number} ({self.what!r}) is still running after {timeout:g} s; wait longer "
                "(job.result() with no timeout), or stop it with job.stop()"
            )
        if self._error is not None:
            raise self._error
        return self._value

    def shown(self) -> Any:
        """Return what the job's cell would have displayed in the foreground (raises as ``result()``)."""
        return self._show(self.result())

    def stop(self, timeout: float = _STOP_SECONDS) -> None:
        """Interrupt the job's ranks and wait for the job to end (no-op once it ended).

        As the Stop button does for a foreground cell: SIGINT to the busy ranks, whose namespaces
        stay; ranks that do not stop within a few seconds (inside a C call such as a gloo collective)
        break the group, and ``result()`` then says so. Raises TimeoutError when the job has not ended
        after ``timeout`` seconds.
        """
        if self._done.is_set():
            return
        self._interrupt.set()
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"job {self.number} did not end within {timeout:g} s of being stopped; ranks.stop() ends the ranks"
            )


def _cell_parent() -> tuple[Any, Any] | None:
    """Return (the kernel's shell, the running cell's parent message) where a thread's output can be routed, else None.

    Nothing is imported: a kernel has imported IPython already, and outside one the core must not load it.
    """
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or not hasattr(shell, "set_thread_parent") or not hasattr(shell, "get_parent"):
        return None
    return shell, shell.get_parent()


def start_job(
    jobs: list[Job],
    what: str,
    on: Sequence[int] | None,
    call: Callable[[], Any],
    show: Callable[[Any], Any] = lambda value: value,
) -> Job:
    """Return a started Job running ``call`` (appended to ``jobs``); raise JobRunningError while another runs."""
    with _start_lock:
        job = running_job(jobs)
        if job is not None:
            raise JobRunningError(job.busy_message())
        job = Job(what, on, call, show)
        jobs.append(job)
        job._thread.start()
    return job


def running_job(jobs: list[Job]) -> Job | None:
    """Return the job of ``jobs`` still running (one at a time), else None."""
    job = jobs[-1] if jobs else None
    return job if job is not None and not job.done() else None


def command_guard(jobs: list[Job]) -> threading.Event | None:
    """Return the interrupt event of the job whose thread asks (None outside a job).

    Raises JobRunningError when a job runs and another thread asks: the ranks serve one command at a time.
    """
    job = running_job(jobs)
    if job is None:
        return None
    if job.owns_thread():
        return job._interrupt
    raise JobRunningError(job.busy_message())


def stop_running(jobs: list[Job]) -> None:
    """Stop the running job, if any (before the ranks are stopped or restarted under it)."""
    job = running_job(jobs)
    if job is not None and not job.owns_thread():
        try:
            job.stop()
        except TimeoutError:
            logger.warning("job %d did not stop; stopping the ranks under it", job.number)


class JobsTable:
    """``%ranks jobs``: one row per background job of the ranks (number, state, time, ranks, command)."""

    columns = ("job", "state", "time", "ranks", "command")

    def __init__(self, jobs: Iterable[Job]) -> None:
        self.jobs = list(jobs)

    def cells(self) -> list[tuple[str, ...]]:
        """Return the table's rows as text, one tuple per job."""
        return [
            (
                str(job.number),
                job.state,
                f"{job.elapsed:.1f} s",
                "all" if job.on is None else ",".join(map(str, job.on)),
                job.what,
            )
            for job in self.jobs
        ]

    def __repr__(self) -> str:
        if not self.jobs:
            return "no background jobs yet: %%ranks --bg (or ranks.submit(...)) starts one"
        rows = [self.columns, *self.cells()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self.columns))]
        return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def _repr_html_(self) -> str | None:
        if not self.jobs:
            return None
        head = "".join(f"<th>{c}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{_html.escape(v)}</td>" for v in row) + "</tr>" for row in self.cells()
        )
        return f"<table><tr>{head}</tr>{body}</table>"
