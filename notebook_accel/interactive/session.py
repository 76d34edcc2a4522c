"""``start_ranks`` and ``Ranks``: a process group kept alive between cells, fed code and functions.

The ranks are the launcher's workers (same plan, environment, output, status and doctor as
``notebook_launcher``), forked from the kernel so they start with its imports, functions and
variables, each running ``rank_loop.rank_main``: it forms the process group, then serves commands
over a Unix socket until ``stop()``. One ``Ranks`` is the "current" one (``current()``), the one
the ``%ranks`` magics drive.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import pickle
import select
import shutil
import socket
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..launch.doctor import RankStack
from ..launch.handle import LaunchHandle
from ..launch.request import START_METHODS, LaunchRequest
from ..launchers import start_persistent_group
from ..utils.imports import cuda_device_count
from .cell_sink import CellSink
from .errors import NoRanksError, RankError
from .gpus import check_gpus, choose_start_method, cuda_initialised
from .group import Group, failure_of, mark_idle
from .jobs import Job, command_guard, start_job, stop_running
from .rank_loop import rank_main, recv_frame, remember_source, split_code, without_globals
from .rank_shell import prepare_cell
from .remote import relay_hook, resolve_nodes
from .stale import StaleGlobalWarning, fingerprint, global_tokens, stale_message
from .values import DEFAULT_VALUE_LIMIT, CellResult, cell_result, parse_size

__all__ = ["CellResult", "RankState", "Ranks", "current", "require_current", "start_ranks"]

logger = logging.getLogger(__name__)

# Options of notebook_launcher a persistent group takes too (through **more).
_MORE = ("mixed_precision", "use_port", "master_addr", "log_dir", "log_line_prefix_template", "progress_bars",
         "collapse_output")  # fmt: skip
_READY_SECONDS = 120.0  # forming the group: the first import of torch.distributed on a loaded machine is slow
_cells = itertools.count(1)
_current: Ranks | None = None
_current_lock = threading.RLock()
_LIVE: weakref.WeakSet[Ranks] = weakref.WeakSet()


@dataclass
class RankState:
    """Where one rank stands between (or during) commands."""

    rank: int
    pid: int | None
    state: str
    """``"idle"``, ``"running"`` (a command), ``"failed"`` (its last command raised; alive) or ``"dead"``."""
    cell: str = ""
    """Short text of the command running (or last run) on this rank."""
    cpu_percent: float | None = None
    rss: int | None = None
    last_line: str = ""
    node: str | None = None
    """The host the rank runs on, for ranks started with ``nodes=`` (None on this machine)."""


def current() -> Ranks | None:
    """Return the running ``Ranks`` started last (None when none runs)."""
    ranks = _current
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
    hang_timeout: float = 60,
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
        hang_timeout: seconds without progress after which a wait is judged (math.inf: never). A
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
    global _current
    unknown = sorted(set(more) - set(_MORE))
    if unknown:
        raise TypeError(
            f"start_ranks() got unknown option(s) {unknown}; it takes num_processes, start_method, panel, "
            f"hang_timeout, gpus, value_limit, nodes and {', '.join(_MORE)}"
        )
    with _current_lock:
        running = current()
        if running is not None and running.alive:
            raise RuntimeError(
                f"{running.num_processes} ranks are already running (started by an earlier start_ranks); call "
                "ranks.stop() (or %ranks stop) first, or ranks.restart() (%ranks restart) for fresh ones"
            )
        if running is not None:
            running.stop()  # broken: nothing left to lose
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
        ranks._start()
        _current = ranks
    return ranks


class Ranks:
    """A persistent process group: run code or functions on its ranks, push and pull values, stop it."""

    def __init__(
        self,
        num_processes: int | None = 2,
        *,
        start_method: str | None = None,
        panel: bool = False,
        hang_timeout: float = 60,
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
        if start_method is not None and start_method not in START_METHODS:
            raise ValueError(
                f"start_method={start_method!r} is not supported; choose one of {', '.join(START_METHODS)} "
                "(fork: the ranks start with the kernel's names), or None (fork, spawn once CUDA is initialised)"
            )
        self._gpus = check_gpus(gpus, num_processes, cuda_device_count() if gpus is not None else 0)
        if num_processes is None and self._gpus is not None:
            self._options["num_processes"] = num_processes = len(self._gpus)
        # Every option checked now, before anything starts (the function and its args are replaced later).
        LaunchRequest(function=_placeholder, args=("", None, None), **self._options)
        self._group: Group | None = None
        self._stopped = True
        self._claims: dict[str, object] = {}  # "command": the token of the command running
        self._books: dict[int, dict[str, Any]] = {}
        self._num_processes = num_processes
        self._known: frozenset[str] = frozenset()
        self._jobs: list[Job] = []

    # ------------------------------------------------------------------ starting and stopping

    def _start(self) -> None:
        uses_cuda = self._gpus is not None or cuda_device_count() > 0
        method, note = choose_start_method(self._start_method, uses_cuda, cuda_initialised())
        self._options["start_method"] = method
        if note is not None:
            logger.warning("%s", note)
        folder = tempfile.mkdtemp(prefix="notebook_accel-ranks-")
        address = os.path.join(folder, "ranks.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(address)
            listener.listen(64)
            sink = CellSink(
                not self._options["panel"],
                self._options.get("log_line_prefix_template"),
                self._num_processes or 1,
            )
            request = LaunchRequest(
                function=rank_main,
                # Ranks elsewhere inherit no listener to close (and reach this one through their agent).
                args=(address, None if "nodes" in self._options else listener.fileno(), self._gpus),
                block=False,
                sinks=[sink],
                **self._options,
            )
            # Across nodes the ranks start once the agents joined and relay this socket (remote.py).
            joined = {"on_join": relay_hook(request, address)} if "nodes" in self._options else {}
            handle = start_persistent_group(request, **joined)
            sink._n, sink.window = handle.num_processes, request.collapse_seconds
            if handle.plan.hosts:  # across nodes: the prefix names the node, as notebook_launcher's does
                sink.hosts, sink._n = handle.plan.hosts, handle.plan.num_processes
            try:
                conns = _accept(listener, handle, sink)
            except BaseException:
                handle.kill()
                handle.wait(5)
                raise
        finally:
            listener.close()
            shutil.rmtree(folder, ignore_errors=True)
        self._group = Group(handle, conns, sink)
        self._num_processes = handle.num_processes
        self._books = {r: {"busy": False, "failed": False, "cell": ""} for r in range(handle.num_processes)}
        self._stopped = False
        main = sys.modules.get("__main__")
        forked = self._options["start_method"] == "fork" and main is not None
        # Names every rank has for sure (a function using them need not bring them): the fork copied them.
        self._known = frozenset(vars(main)) if forked else frozenset()
        _LIVE.add(self)

    def stop(self) -> None:
        """End the ranks (idempotent); they also end with the kernel."""
        global _current
        stop_running(self._jobs)  # a job's thread must not read sockets closed under it
        if self._group is not None:
            self._group.stop()
        self._stopped = True
        _LIVE.discard(self)
        with _current_lock:
            if _current is self:
                _current = None

    def restart(self) -> list[int]:
        """Stop the ranks and fork new ones from the kernel; return the ranks whose namespaces were lost."""
        running = current()
        if running is not None and running is not self and running.alive:
            raise RuntimeError(
                "other ranks are running (the current ones, from a later start_ranks); stop them first "
                "(ranks.stop() or %ranks stop), then restart these"
            )
        lost = list(range(self.num_processes)) if self._group is not None else []
        stop_running(self._jobs)
        if self._group is not None:
            self._group.stop()
        self._stopped = True  # until the new ranks are up (a failed start leaves this stopped)
        self._start()
        global _current
        with _current_lock:
            _current = self
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
        state = "stopped" if self._stopped else "broken" if self.broken else "alive"
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
            if not alive or s.state not in ("starting", "running"):
                state = "dead"
            elif book.get("busy"):
                state = "running"
            else:
                state = "failed" if book.get("failed") else "idle"
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
        n = self.num_processes
        if on is None:
            return list(range(n))
        items = [on] if isinstance(on, int) else on
        try:
            ranks = sorted(set(items))
        except TypeError:
            raise TypeError(f"on={on!r} must be a rank, a list of ranks or None (every rank)") from None
        if not ranks:
            raise ValueError(f"on={on!r} names no rank; give ranks in 0..{n - 1}, or None for every rank")
        for r in ranks:
            if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < n:
                raise ValueError(f"on={on!r}: rank {r!r} does not exist; this group has ranks 0..{n - 1}")
        return ranks

    def _usable(self) -> Group:
        if self._stopped or self._group is None:
            raise NoRanksError(
                "these ranks were stopped; start new ones with notebook_accel.start_ranks(...) (or %ranks start)"
            )
        if not self.alive:
            handle = self._group.handle
            error = handle.error if handle.done else None
            why = (
                error.failures[0].headline()
                if error is not None and error.failures
                else "a rank died or hung"
            )
            raise RuntimeError(
                f"the ranks' group is broken ({why}): call ranks.restart() (or %ranks restart) to fork new "
                "ranks from the kernel"
            )
        return self._group

    def _command(self, on: Any, command: tuple, cell: str) -> tuple[list[int], dict[int, tuple]]:
        """Return (targets, replies) of ``command`` run on the ranks ``on`` names; raise if one failed."""
        targets = self._targets(on)
        group = self._usable()
        # Refused while a background job runs, unless this is the job's own thread.
        interrupt = command_guard(self._jobs)
        me = object()  # this command's claim token
        try:
            # One command at a time. The claim is taken inside the try (a Stop landing just after it is
            # released below), with one atomic dict call, so no lock can stay taken.
            if self._claims.setdefault("command", me) is not me:
                raise RuntimeError(
                    "another command is running on these ranks (from another thread); wait for it"
                )
            for r in targets:
                self._books[r].update(busy=True, cell=cell)

            def on_reply(rank: int, reply: tuple) -> None:
                self._books[rank].update(busy=False, failed=reply[0] == "err")

            try:
                replies = group.exchange(targets, command, on_reply, interrupt)
            finally:
                for r in targets:
                    self._books[r]["busy"] = False
        finally:
            if self._claims.get("command") is me:
                del self._claims["command"]
        self._raise_failures(targets, replies)
        return targets, replies

    def _raise_failures(self, targets: list[int], replies: dict[int, tuple]) -> None:
        failed = [r for r in targets if replies[r][0] != "ok"]
        if not failed:
            return
        now = time.monotonic()
        failures = [failure_of(r, self._group.pid(r), replies[r], now) for r in failed]
        results = [
            CellResult(r, ok=False, error=replies[r][4])
            if r in failed
            else cell_result(r, replies[r][2], self._value_limit)
            for r in targets
        ]
        raise RankError(
            failures,
            f"raised on rank(s) {failed}; the ranks are alive and their namespaces intact",
            results=results,
        )

    def execute(self, code: str, on: int | Iterable[int] | None = None) -> list[CellResult]:
        """Return one CellResult per targeted rank (rank order) after running ``code`` there.

        ``code`` is compiled here first (a SyntaxError is raised before any rank runs it); the
        value of its last expression comes back, as in IPython. Raises RankError when it raised
        on some rank (``.results`` holds every rank's CellResult). A value over ``value_limit``
        stays on its rank (its ``CellResult`` has its display forms; ``.value`` says how to pull it).
        """
        return self._execute(code, on, self._value_limit)

    def _execute(self, code: str, on: Any, limit: int | None) -> list[CellResult]:
        if not isinstance(code, str):
            raise TypeError(
                f"code must be a string of Python; got {type(code).__name__} (ranks.run() takes functions)"
            )
        filename = f"<rank cell {next(_cells)}>"
        python, transformed = prepare_cell(code)  # %time, !ls ...: IPython's input transformations
        split_code(python, filename)  # a SyntaxError stops here, before any rank sees the code
        remember_source(code, filename)  # stacks taken here show the cell's lines
        # Values are compared (digests, on the ranks) only where several ranks show theirs side by side.
        options = {"limit": limit, "compare": len(self._targets(on)) > 1, "ipython": transformed}
        if transformed:
            options["python"] = python
        targets, replies = self._command(on, ("exec", code, filename, options), _short(code))
        return [cell_result(r, replies[r][2], limit) for r in targets]

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
            function = without_globals(code_or_fn, self._known)
            blob = _dumps(
                (function, args, kwargs), "the function and its arguments", "pass picklable arguments"
            )
            forked = self._options["start_method"] == "fork"
            command = ("call", blob, global_tokens(code_or_fn), forked)
            targets, replies = self._command(on, command, _short(getattr(code_or_fn, "__qualname__", "call")))
            results = [cell_result(r, replies[r][2]) for r in targets]
            stale = stale_message(code_or_fn, {r: replies[r][2].get("stale", ()) for r in targets})
            if stale is not None:
                warnings.warn(stale, StaleGlobalWarning, stacklevel=2)
        else:
            raise TypeError(
                f"ranks.run() takes a string of code or a callable; got {type(code_or_fn).__name__}"
            )
        for result in results:
            if result.unpicklable is not None:
                raise TypeError(
                    f"the value rank {result.rank} computed ({result.unpicklable}) cannot be pickled back to the "
                    "kernel (the code did run); assign it to a name and return a picklable part of it (a tensor, "
                    "a state_dict(), plain numbers)"
                )
        return [result.value for result in results]

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
        if "command" in self._claims:
            raise RuntimeError("another command is running on these ranks (from another thread); wait for it")
        return start_job(self._jobs, _short(what), None if on is None else targets, call, show)

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
        if not values:
            raise ValueError("push_many() got no values; pass name=value pairs")
        for name in values:
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(
                    f"{name!r} is not a Python name; push values under names like 'model' or 'lr'"
                )
        for name, value in values.items():
            _dumps(value, f"{name} (a {type(value).__module__}.{type(value).__qualname__})", _PUSH_FIX)
        blob = _dumps(values, "the values", _PUSH_FIX)
        tokens = {name: fingerprint(value) for name, value in values.items()}
        self._command(on, ("push", blob, tokens), f"push {', '.join(values)}")
        if on is None:
            self._known |= frozenset(values)

    def pull(self, name: str, on: int | Iterable[int] | None = None) -> list:
        """Return the value of ``name`` on each targeted rank (rank order)."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{name!r} is not a Python name; pull a variable of the ranks by its name")
        targets, replies = self._command(on, ("pull", name), f"pull {name}")
        results = [cell_result(r, replies[r][2]) for r in targets]
        for result in results:
            if result.unpicklable is not None:
                raise TypeError(
                    f"{name} on rank {result.rank} is {result.unpicklable}, and cannot be pickled back to the "
                    "kernel; pull a picklable part of it instead (a tensor, a state_dict(), plain lists or "
                    "numbers): assign one to a name on the ranks first"
                )
        return [result.value for result in results]


_PUSH_FIX = (
    "push plain data instead (tensors, lists, numbers, a state_dict()), or build the object on the ranks"
)


def _placeholder(address: str, listener_fd: int | None, gpus: tuple[int, ...] | None) -> None:
    """Stands for ``rank_main`` while the options are checked."""


def _short(code: str, limit: int = 60) -> str:
    lines = [line.strip() for line in code.strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1:
        text += " …"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _dumps(value: Any, what: str, fix: str) -> bytes:
    import cloudpickle

    try:
        return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"{what} cannot be pickled to send to the ranks ({type(exc).__name__}: {exc}); {fix}"
        ) from exc


def _accept(listener: socket.socket, handle: LaunchHandle, sink: CellSink) -> dict[int, socket.socket]:
    """Return each rank's connected socket, once every rank has formed the group and said ready."""
    n = handle.num_processes
    conns: dict[int, socket.socket] = {}
    waiting: list[socket.socket] = []
    printer = sink.printer()
    deadline = time.monotonic() + _READY_SECONDS
    sink.begin(printer)  # what the ranks print while they start: by this thread, into the calling cell
    try:
        while len(conns) < n:
            if handle.done:
                error = handle.error
                raise RuntimeError(f"the ranks ended before they were ready: {error or 'no error reported'}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the ranks were not ready within {_READY_SECONDS:g} s; see their output above"
                )
            ready = select.select([listener, *waiting], [], [], 0.05)[0]
            for sock in ready:
                if sock is listener:
                    waiting.append(listener.accept()[0])
                    continue
                waiting.remove(sock)
                message = recv_frame(sock)
                if message is None or message[0] != "ready":
                    sock.close()
                    continue
                _, rank, _pid, problem = message
                conns[rank] = sock
                if problem:
                    raise RuntimeError(f"rank {rank} could not join the process group: {problem}")
            sink.flush(printer)
    except BaseException:
        for sock in (*conns.values(), *waiting):
            sock.close()
        raise
    finally:
        sink.end(printer)
    return conns


@atexit.register
def _stop_live_ranks() -> None:
    # The kernel is shutting down: end the ranks (they would also end with it, a moment later).
    for ranks in list(_LIVE):
        try:
            ranks.stop()
        except Exception:
            logger.debug("stopping ranks at exit failed", exc_info=True)
