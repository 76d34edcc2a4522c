"""``start_ranks`` and ``Ranks``: a process group kept alive between cells, fed code and functions.

The ranks are the launcher's workers (same plan, environment, output, status and doctor as
``notebook_launcher``), forked from the kernel so they start with its imports, functions and
variables, each running ``rank_entry.rank_main``: it forms the process group, then serves commands
over a Unix socket (``protocol.py``: the messages both sides share) until ``stop()``. ``startup.py``
starts them, ``commands.py`` builds and sends each verb's command. One ``Ranks`` is the "current"
one (``current()``), the one the ``%ranks`` magics drive.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..launch.doctor import RankStack
from ..launch.handle import LaunchHandle
from ..launch.states import State
from ..utils.imports import cuda_device_count
from . import registry
from .commands import (
    Commands,
    call_command,
    exec_command,
    pull_command,
    push_command,
    short_text,
    targets_of,
    usable,
    values_of,
)
from .errors import NoRanksError
from .gpus import check_gpus, choose_start_method, cuda_initialised
from .group import Group, mark_idle
from .jobs import Job, command_guard, start_job, stop_running
from .protocol import Command, Ok
from .remote import resolve_nodes
from .stale import StaleGlobalWarning, stale_message
from .startup import group_request, start_group
from .values import DEFAULT_VALUE_LIMIT, CellResult, cell_result, parse_size

__all__ = ["CellResult", "RankState", "Ranks", "current", "require_current", "start_ranks"]

logger = logging.getLogger(__name__)


@dataclass
class RankState:
    """Where one rank stands between (or during) commands."""

    rank: int
    pid: int | None
    state: State
    """``IDLE``, ``RUNNING`` (a command), ``FAILED`` (its last command raised; alive) or ``DEAD`` (equal to ``"idle"``...)."""
    cell: str = ""
    """Short text of the command running (or last run) on this rank."""
    cpu_percent: float | None = None
    rss: int | None = None
    last_line: str = ""
    node: str | None = None
    """The host the rank runs on, for ranks started with ``nodes=`` (None on this machine)."""

    def __post_init__(self) -> None:
        self.state = State(self.state)


def current() -> Ranks | None:
    """Return the running ``Ranks`` started last (None when none runs)."""
    ranks: Ranks | None = registry.get_current()
    return ranks if ranks is not None and not ranks._stopped else None


def require_current() -> Ranks:
    """Return ``current()``; raise NoRanksError saying how to start ranks when there are none."""
    ranks = current()
    if ranks is None:
        raise NoRanksError(
            "no ranks are running: start them with ranks = notebook_accel.start_ranks(2) (or %ranks start 2)"
        )
    return ranks


def start_ranks(
    num_processes: int | None = 2,
    *,
    start_method: str | None = None,
    panel: bool = False,
    hang_timeout: float | None = None,
    value_limit: int | str | None = DEFAULT_VALUE_LIMIT,
    gpus: list[int] | None = None,
    nodes: Any = None,
    **more: Any,
) -> Ranks:
    """Return ``num_processes`` ranks forked from this process into one process group, waiting for commands.

    Args:
        num_processes: ranks on this machine (None: one per CUDA device, or 1 on a CPU).
        start_method: "fork" (the ranks start with this process's imports, functions and
            variables), "spawn" or "forkserver" (fresh interpreters: push what they need). None
            (the default): fork, or spawn with a warning once CUDA is initialised in this process
            (a forked rank cannot use CUDA then), for the first start and each ``restart()``.
        gpus: one CUDA device index per rank (``[0, 1]``): rank ``r`` sees only those devices and
            uses ``gpus[r]`` (``cuda:r`` there), held in its namespace as ``device``.
        panel: show the launch panel (status, CPU, memory, stacks, output per rank).
        hang_timeout: seconds without progress after which a wait is judged (None: 60 s, the launcher's
            ``DEFAULT_HANG_TIMEOUT``; math.inf: never). A
            rank computing while the others wait (``main_process_first()``, a checkpoint written by
            one rank) is honest work: after ``hang_timeout`` the cell shows one report (which ranks
            wait, where the busy one is, its stack) and goes on waiting; only Stop ends it. When
            every rank waits (a collective, ``send``/``recv``) and none has moved for
            ``hang_timeout``, the command is given up with every rank's stack (a deadlock); ranks
            waiting for an idle one (it raised, finished or was not asked) are given up at once, in
            about two seconds (on nccl, a rank in ``.item()``/``synchronize()`` too once a rank
            raised). Given up, the group is stopped (``restart()`` forks new ranks).
        value_limit: bytes (or a size like ``"50MB"``; None: no limit) up to which a cell's last value
            comes to the kernel (``execute``, ``%%ranks``); a bigger one stays on its rank, shown by its
            display forms, fetched with ``pull``. ``Ranks.value_limit`` changes it later.
        nodes: run ``num_processes`` ranks on each of several machines: ``"slurm"`` (every node of
            this Slurm allocation), ``"slurm:<jobid>"``, a list of SSH host names, or a ``Nodes``.
            Those ranks start as fresh interpreters (spawn): push what they need.
        **more: ``mixed_precision``, ``use_port``, ``master_addr``, ``log_dir``, ``log_line_prefix_template``,
            ``progress_bars`` and ``collapse_output`` (all out by each command's end), as for ``notebook_launcher``.

    Raises:
        RuntimeError: ranks started earlier are still running (stop them first).
        ValueError / TypeError: a bad option.
    """
    # Every option checked first: a bad one changes nothing (the ranks running stay as they are).
    ranks = Ranks(
        num_processes,
        start_method=start_method,
        panel=panel,
        hang_timeout=hang_timeout,
        value_limit=value_limit,
        gpus=gpus,
        nodes=nodes,
        **more,
    )
    with registry.lock:
        running = current()
        if running is not None and running.alive:
            raise RuntimeError(
                f"{running.num_processes} ranks are already running (started by an earlier start_ranks); call "
                "ranks.stop() (or %ranks stop) first, or ranks.restart() (%ranks restart) for fresh ones"
            )
        if running is not None:
            running.stop()  # broken: nothing left to lose
        ranks._start()
        registry.set_current(ranks)
    return ranks


class Ranks:
    """A persistent process group: run code or functions on its ranks, push and pull values, stop it."""

    def __init__(
        self,
        num_processes: int | None = 2,
        *,
        start_method: str | None = None,
        panel: bool = False,
        hang_timeout: float | None = None,
        value_limit: int | str | None = DEFAULT_VALUE_LIMIT,
        gpus: list[int] | None = None,
        nodes: Any = None,
        **more: Any,
    ) -> None:
        self.value_limit = value_limit
        nodes, start_method = resolve_nodes(nodes, start_method)
        if nodes is not None:  # only then: a LaunchRequest without the nodes option stays as it was
            more["nodes"] = nodes
        self._options = dict(
            more, num_processes=num_processes, start_method=start_method or "fork", panel=panel
        )
        self._options["hang_timeout"] = hang_timeout
        self._start_method = start_method  # None: chosen at each start (gpus.choose_start_method)
        self._gpus = check_gpus(gpus, num_processes, cuda_device_count() if gpus is not None else 0)
        if num_processes is None and self._gpus is not None:
            self._options["num_processes"] = num_processes = len(self._gpus)
        # Every option checked now, before anything starts; each start fills in the socket's address.
        self._request = group_request(self._options, self._gpus)
        self._group: Group | None = None
        self._stopped = True
        self._jobs: list[Job] = []
        self._commands = Commands(self._jobs)
        self._books = self._commands.books  # busy, cell, failed: per rank, for status()
        self._num_processes = num_processes
        self._known: frozenset[str] = frozenset()

    # ------------------------------------------------------------------ starting and stopping

    def _start(self) -> None:
        uses_cuda = self._gpus is not None or cuda_device_count() > 0
        method, note = choose_start_method(self._start_method, uses_cuda, cuda_initialised())
        self._options["start_method"] = method
        self._request = dataclasses.replace(self._request, start_method=method)
        if note is not None:
            logger.warning("%s", note)
        self._group = start_group(self._request, self._num_processes)
        handle = self._group.handle
        self._num_processes = handle.num_processes
        self._commands.reset(handle.num_processes)
        self._stopped = False
        main = sys.modules.get("__main__")
        forked = self._options["start_method"] == "fork" and main is not None
        # Names every rank has for sure (a function using them need not bring them): the fork copied them.
        self._known = frozenset(vars(main)) if forked else frozenset()
        registry.started(self)

    def stop(self) -> None:
        """End the ranks (idempotent); they also end with the kernel."""
        self._end()
        registry.forget(self)

    def _end(self) -> None:
        stop_running(self._jobs)  # a job's thread must not read sockets closed under it
        if self._group is not None:
            self._group.stop()
        self._stopped = True

    def restart(self) -> list[int]:
        """Stop the ranks and fork new ones from the kernel; return the ranks whose namespaces were lost."""
        running = current()
        if running is not None and running is not self and running.alive:
            raise RuntimeError(
                "other ranks are running (the current ones, from a later start_ranks); stop them first "
                "(ranks.stop() or %ranks stop), then restart these"
            )
        lost = list(range(self.num_processes)) if self._group is not None else []
        self._end()  # stopped until the new ranks are up (a failed start leaves it so)
        self._start()
        registry.set_current(self)
        if lost:
            logger.warning(
                "restarted %d ranks; the namespaces of ranks %s were lost (define their variables again)",
                self.num_processes,
                lost,
            )
        return lost

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = State.STOPPED if self._stopped else State.BROKEN if self.broken else "alive"
        return f"<Ranks {self.num_processes} rank(s), {state}>"

    # ------------------------------------------------------------------ facts

    @property
    def value_limit(self) -> int | None:
        """Return the bytes (pickled) up to which a cell's last value comes to the kernel (None: no limit)."""
        return self._value_limit

    @value_limit.setter
    def value_limit(self, size: int | str | None) -> None:
        self._value_limit = parse_size(size)

    @property
    def num_processes(self) -> int:
        """Return the number of ranks."""
        return self._num_processes or 1

    @property
    def handle(self) -> LaunchHandle | None:
        """Return the launch handle of the ranks (status, lines, stacks, events; for the panel)."""
        return self._group.handle if self._group is not None else None

    @property
    def broken(self) -> bool:
        """Return True when the group could not go on (a rank died or hung): ``restart()`` recovers."""
        group = self._group
        return group is not None and not self._stopped and (group.broken or not group.alive)

    @property
    def alive(self) -> bool:
        """Return True while the ranks run and take commands."""
        return self._group is not None and not self._stopped and self._group.alive

    def status(self) -> list[RankState]:
        """Return each rank's state: idle, running (which cell), failed (last command raised) or dead."""
        if self._group is None:
            return []
        out = []
        alive = self.alive
        for s in self._group.handle.status():
            book = self._books.get(s.rank, {})
            if not alive or not s.state.live:
                state = State.DEAD
            elif book.get("busy"):
                state = State.RUNNING
            else:
                state = State.FAILED if book.get("failed") else State.IDLE
            out.append(
                RankState(
                    s.rank,
                    s.pid,
                    state,
                    book.get("cell", ""),
                    s.cpu_percent,
                    s.rss,
                    s.last_line,
                    getattr(s, "node", None),
                )
            )
        return out

    def stacks(self) -> dict[int, RankStack]:
        """Return every live rank's current Python stacks (as ``LaunchHandle.stacks()``)."""
        if self._group is None or self._stopped:
            return {}
        return mark_idle(self._group.handle.stacks())

    # ------------------------------------------------------------------ commands

    def _targets(self, on: int | Iterable[int] | None) -> list[int]:
        return targets_of(on, self.num_processes)

    def _usable(self) -> Group:
        return usable(self._group, self._stopped)

    def _command(self, on: Any, command: Command, cell: str) -> tuple[list[int], dict[int, Ok]]:
        """Return (targets, replies) of ``command`` run on the ranks ``on`` names; raise if one failed."""
        targets = self._targets(on)
        group = self._usable()
        return targets, self._commands.run(group, targets, command, cell, self._value_limit)

    def execute(self, code: str, on: int | Iterable[int] | None = None) -> list[CellResult]:
        """Return one CellResult per targeted rank (rank order) after running ``code`` there.

        ``code`` is compiled here first (a SyntaxError is raised before any rank runs it); the
        value of its last expression comes back, as in IPython. Raises RankError when it raised
        on some rank (``.results`` holds every rank's CellResult). A value over ``value_limit``
        stays on its rank (its ``CellResult`` has its display forms; ``.value`` says how to pull it).
        """
        return self._execute(code, on, self._value_limit)

    def _execute(self, code: str, on: Any, limit: int | None) -> list[CellResult]:
        command = exec_command(code, limit)
        # Values are compared (digests, on the ranks) only where several ranks show theirs side by side.
        command = dataclasses.replace(command, compare=len(self._targets(on)) > 1)
        targets, replies = self._command(on, command, short_text(code))
        return [cell_result(r, replies[r].payload, limit) for r in targets]

    def run(
        self, code_or_fn: str | Callable, *args: Any, on: int | Iterable[int] | None = None, **kwargs: Any
    ) -> list:
        """Return one value per targeted rank (rank order): of the code's last expression, or of ``fn(*args, **kwargs)``.

        A function from the kernel runs in each rank's namespace (its global names are the
        rank's; names a rank lacks come from the kernel): where it reads a global the kernel
        changed since the ranks got theirs, a StaleGlobalWarning says to push it. The values
        come whatever their size (CUDA tensors as CPU tensors). Raises RankError when it raised
        on some rank; the ranks stay alive unless the error says the group is broken.
        """
        if isinstance(code_or_fn, str):
            if args or kwargs:
                raise TypeError(
                    "ranks.run(code) takes no arguments; pass a function to call it with arguments"
                )
            results = self._execute(code_or_fn, on, None)  # asked for the values: they all come
        elif callable(code_or_fn):
            forked = self._options["start_method"] == "fork"
            command = call_command(code_or_fn, args, kwargs, self._known, forked)
            targets, replies = self._command(
                on, command, short_text(getattr(code_or_fn, "__qualname__", "call"))
            )
            results = [cell_result(r, replies[r].payload) for r in targets]
            stale = stale_message(code_or_fn, {r: replies[r].payload.get("stale", ()) for r in targets})
            if stale is not None:
                warnings.warn(stale, StaleGlobalWarning, stacklevel=2)
        else:
            raise TypeError(
                f"ranks.run() takes a string of code or a callable; got {type(code_or_fn).__name__}"
            )
        return values_of(results)

    def submit(
        self, code_or_fn: str | Callable, *args: Any, on: int | Iterable[int] | None = None, **kwargs: Any
    ) -> Job:
        """Return a started background Job running ``run(code_or_fn, *args, on=on, **kwargs)``; returns at once.

        The ranks' output lands in the calling cell as it comes; ``job.result()`` waits and returns
        what ``run`` returns (or raises what it raises), ``job.stop()`` interrupts it. While it runs,
        other commands on these ranks raise JobRunningError; kernel cells run freely.
        """
        if not (isinstance(code_or_fn, str) or callable(code_or_fn)):
            raise TypeError(
                f"ranks.submit() takes a string of code or a callable; got {type(code_or_fn).__name__}"
            )
        if isinstance(code_or_fn, str) and (args or kwargs):
            raise TypeError(
                "ranks.submit(code) takes no arguments; pass a function to call it with arguments"
            )
        what = code_or_fn if isinstance(code_or_fn, str) else getattr(code_or_fn, "__qualname__", "call")
        return self._start_job(what, on, lambda: self.run(code_or_fn, *args, on=on, **kwargs))

    def _start_job(self, what: str, on: Any, call: Callable[[], Any], show: Callable = lambda v: v) -> Job:
        """Return a started Job running ``call``; what a foreground command would refuse is raised here."""
        targets = self._targets(on)  # bad ranks, stopped or broken ranks: raised now, not in job.result()
        self._usable()
        command_guard(self._jobs)  # one job at a time: the running one is named
        self._commands.refuse_if_busy()
        return start_job(self._jobs, short_text(what), None if on is None else targets, call, show)

    @property
    def jobs(self) -> list[Job]:
        """Return the background jobs started on these ranks (``submit``, ``%%ranks --bg``), oldest first."""
        return list(self._jobs)

    def push(self, name: str, value: Any, on: int | Iterable[int] | None = None) -> None:
        """Set ``name`` to ``value`` (sent from the kernel) in the namespace of every targeted rank."""
        self.push_many({name: value}, on=on)

    def push_many(self, mapping: dict[str, Any] | None = None, /, *, on: Any = None, **values: Any) -> None:
        """Set every name of ``mapping`` / ``values`` in the namespaces of the targeted ranks."""
        values = {**(mapping or {}), **values}
        self._command(on, push_command(values), f"push {', '.join(values)}")
        if on is None:
            self._known |= frozenset(values)

    def pull(self, name: str, on: int | Iterable[int] | None = None) -> list:
        """Return the value of ``name`` on each targeted rank (rank order)."""
        targets, replies = self._command(on, pull_command(name), f"pull {name}")
        return values_of([cell_result(r, replies[r].payload) for r in targets], pulled=name)
