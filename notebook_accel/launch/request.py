"""``LaunchRequest``: every option of one launch, built by keyword, checked once, frozen.

``notebook_launcher`` and ``debug_launcher`` build one request and hand it down; nothing below them
takes a long positional list (a swapped pair of same-typed options would fail silently). Every check
of an option's type and value lives here, so a bad option is refused before anything is forked, on
every path (in the caller, forked workers, torch elastic, torch_xla). What depends on the machine
(how many GPUs, which backend) is decided later, in ``plan.resolve_plan``.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..utils.enums import MIXED_PRECISION_CHOICES, PrecisionType
from .collapse import collapse_window
from .output import OutputLine, format_prefix
from .ports import DEFAULT_PORT, check_master_addr, parse_port

__all__ = [
    "DEFAULT_HANG_TIMEOUT",
    "HANG_ACTIONS",
    "MAX_PROCESSES_PER_CORE",
    "PERSISTENT_OPTIONS",
    "PROGRESS_BARS",
    "RDZV_BACKENDS",
    "START_METHODS",
    "LaunchRequest",
]

logger = logging.getLogger(__name__)

START_METHODS = ("fork", "spawn", "forkserver")
RDZV_BACKENDS = ("static", "c10d")
PROGRESS_BARS = ("auto", "main", "all", "text")
HANG_ACTIONS = ("report", "stop")
MAX_PROCESSES_PER_CORE = 64
"""Above this many processes per CPU core a launch needs ``allow_oversubscribe=True`` (likely a typo)."""
DEFAULT_HANG_TIMEOUT = 60.0
"""Seconds without progress after which the hang rule (``launch/hangs.py``) reports a wait or ends a deadlock.

A minute: long past any collective of a healthy notebook-sized step (milliseconds to seconds), short
enough that someone watching a silent cell hears about it long before gloo's 30-minute timeout. A
legitimate wait (rank 0 saving while the others wait in a barrier) only earns a note by default."""

PERSISTENT_OPTIONS = ("num_processes", "start_method", "panel", "hang_timeout", "nodes", "mixed_precision",
                      "use_port", "master_addr", "log_dir", "log_line_prefix_template", "progress_bars",
                      "collapse_output")  # fmt: skip
"""The options of ``notebook_launcher`` a persistent group (``start_ranks``) takes too; the others have no
meaning for ranks that wait for commands (restarts, timeouts, elastic rendezvous, sinks: each command has its own)."""

# Options that only torch elastic (num_nodes > 1) reads, with their defaults.
_ELASTIC_ONLY = {
    "rdzv_backend": "static",
    "rdzv_endpoint": "",
    "rdzv_conf": None,
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_runs_when_called(function: Callable) -> None:
    """Raise TypeError for an ``async def`` or generator function: calling one runs none of its body."""
    name = getattr(function, "__qualname__", None) or repr(function)
    if inspect.isasyncgenfunction(function):
        raise TypeError(
            f"{name} is an async generator function: calling it runs none of its body. Launch a plain function "
            "that consumes it, e.g. one that returns asyncio.run(...) of a coroutine collecting it with async for"
        )
    if inspect.iscoroutinefunction(function):
        raise TypeError(
            f"{name} is an async def function: each worker would only get a coroutine back, never run it. "
            f"Launch a plain function that runs it, e.g. def main(*args): return asyncio.run({name}(*args))"
        )
    if inspect.isgeneratorfunction(function):
        raise TypeError(
            f"{name} is a generator function: calling it runs none of its body, and the generator cannot be "
            f"sent back from a worker. Launch a plain function that consumes it, e.g. "
            f"def main(*args): return list({name}(*args))"
        )


@dataclass(frozen=True, kw_only=True)
class LaunchRequest:
    """What the caller asked for, checked (``__post_init__`` raises on a bad option) and frozen."""

    function: Callable
    args: tuple = ()
    num_processes: int | None = None
    mixed_precision: str | PrecisionType = PrecisionType.NO
    """Given as a string or a PrecisionType; a PrecisionType once checked."""
    use_port: str | int = DEFAULT_PORT
    master_addr: str = "127.0.0.1"
    node_rank: int = 0
    num_nodes: int = 1
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_conf: Mapping[str, Any] | None = None
    rdzv_id: str = "none"
    max_restarts: int = 0
    monitor_interval: float = 0.1
    log_line_prefix_template: str | None = None
    block: bool = True
    panel: bool = False
    start_method: str = "fork"
    log_dir: str | os.PathLike | None = None
    sinks: tuple[Callable[[OutputLine], None], ...] | None = None
    timeout: float | None = None
    progress_bars: str = "auto"
    hang_timeout: float | None = None
    """None: ``DEFAULT_HANG_TIMEOUT``; ``math.inf``: no hang detection."""
    on_hang: str = "report"
    force_cpu: bool = False
    """debug_launcher: gloo on the CPU even where CUDA devices exist."""
    allow_oversubscribe: bool = False
    """Accept more than ``MAX_PROCESSES_PER_CORE`` processes per CPU core."""
    nodes: Any = None
    """The machines to run on, each with ``num_processes`` ranks (``"slurm"``, host names, a ``Nodes``); None: this one."""
    collapse_output: bool | float = True
    """Lines several ranks print alike show once in the cell, labelled with their ranks (``launch.collapse``):
    True holds a line up to ``collapse.DEFAULT_WINDOW`` s for the other ranks, a number that many seconds;
    False prints every rank's line as it comes."""
    master_port: int = field(init=False, default=0)
    """``use_port`` as a number (set by the checks)."""

    def __post_init__(self) -> None:
        self._check_nodes()  # first: with nodes=, node_rank is refused as such, not as out of range
        self._check_counts()
        self._check_call()
        self._check_times()
        self._check_choices()
        self._check_elastic()
        if self.sinks is not None:
            if isinstance(self.sinks, (str, bytes)) or not isinstance(self.sinks, Sequence):
                raise TypeError(f"sinks must be a list of callables taking an OutputLine; got {self.sinks!r}")
            object.__setattr__(self, "sinks", tuple(self.sinks))
            for sink in self.sinks:
                if not callable(sink):
                    raise TypeError(f"sinks must be callables taking an OutputLine; got {sink!r}")
        format_prefix(self.log_line_prefix_template, 0, 0)  # a bad template fails here, not in a thread
        collapse_window(self.collapse_output)

    def _check_call(self) -> None:
        if not callable(self.function):
            raise TypeError(f"function must be callable; got {self.function!r}")
        if not isinstance(self.args, (tuple, list)):
            raise TypeError(f"args must be a tuple of positional arguments; got {type(self.args).__name__}")
        object.__setattr__(self, "args", tuple(self.args))
        _check_runs_when_called(self.function)
        try:
            signature = inspect.signature(self.function)
        except (TypeError, ValueError):
            return  # a builtin without a signature: the worker finds out
        try:
            signature.bind(*self.args)
        except TypeError as exc:
            name = getattr(self.function, "__qualname__", repr(self.function))
            raise TypeError(
                f"{name}{signature} cannot be called with args of {len(self.args)} value(s) ({exc}); "
                "pass args=(...) with one value per positional parameter"
            ) from None

    def _check_counts(self) -> None:
        n = self.num_processes
        if n is not None and (not _is_int(n) or n < 1):
            raise ValueError(f"num_processes={n!r} must be a positive integer or None")
        if not _is_int(self.num_nodes) or self.num_nodes < 1:
            raise ValueError(f"num_nodes={self.num_nodes!r} must be a positive integer")
        if not _is_int(self.node_rank) or not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(
                f"node_rank={self.node_rank!r} must be an integer in [0, num_nodes={self.num_nodes})"
            )
        if not _is_int(self.max_restarts) or self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts!r} must be an integer >= 0")
        object.__setattr__(self, "master_port", parse_port(self.use_port))
        cores = os.cpu_count() or 1
        if n is not None and n > MAX_PROCESSES_PER_CORE * cores and self.allow_oversubscribe is not True:
            raise ValueError(
                f"num_processes={n} is more than {MAX_PROCESSES_PER_CORE} processes per CPU core on this machine "
                f"({cores} core(s)): each one holds its own interpreter and copy of torch, and a fork this many "
                f"times over likely hits a process or memory limit. Use at most {MAX_PROCESSES_PER_CORE * cores}, "
                "or pass allow_oversubscribe=True to notebook_launcher if you mean it"
            )
        if n is not None and n > 4 * cores:
            logger.warning(
                "num_processes=%d on a machine with %d CPU core(s): every process gets a fraction of a core, "
                "and each holds its own copy of torch (about 300 MB); fewer processes will likely run faster",
                n,
                cores,
            )

    def _check_times(self) -> None:
        if self.timeout is not None and not (_is_number(self.timeout) and self.timeout > 0):
            raise ValueError(f"timeout={self.timeout!r} must be a positive number of seconds or None")
        # inf would make the wait before a restart endless (and threading refuses it as a timeout)
        if not (_is_number(self.monitor_interval) and 0 < self.monitor_interval < math.inf):
            raise ValueError(
                f"monitor_interval={self.monitor_interval!r} must be a positive number of seconds"
            )
        hang = self.hang_timeout
        if hang is not None and not (_is_number(hang) and hang > 0 and not math.isnan(hang)):
            raise ValueError(
                f"hang_timeout={hang!r} must be a positive number of seconds, None (the default, "
                f"{DEFAULT_HANG_TIMEOUT:g} s) or math.inf (no hang detection)"
            )

    def _check_choices(self) -> None:
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"start_method={self.start_method!r} is not supported; choose one of {', '.join(START_METHODS)}"
            )
        precision = str(getattr(self.mixed_precision, "value", self.mixed_precision)).lower()
        if precision not in MIXED_PRECISION_CHOICES:
            raise ValueError(
                f"mixed_precision={self.mixed_precision!r} is not supported; choose one of "
                f"{', '.join(MIXED_PRECISION_CHOICES)}"
            )
        object.__setattr__(self, "mixed_precision", PrecisionType(precision))
        if self.progress_bars not in PROGRESS_BARS:
            raise ValueError(
                f"progress_bars={self.progress_bars!r} is not one of {list(PROGRESS_BARS)}: 'main' shows the main "
                "process's bars live, 'all' every rank's, 'text' lets tqdm write its usual text"
            )
        if self.on_hang not in HANG_ACTIONS:
            raise ValueError(
                f"on_hang={self.on_hang!r} is not one of {list(HANG_ACTIONS)}: 'report' reports a rank waiting "
                "for a busy one once and keeps running, 'stop' stops the launch there and raises with every "
                "rank's stack"
            )
        for name in ("block", "panel", "force_cpu", "allow_oversubscribe"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be True or False")

    def _check_elastic(self) -> None:
        if not isinstance(self.master_addr, str):
            raise TypeError(f"master_addr={self.master_addr!r} must be a host name or IP address string")
        check_master_addr(self.master_addr)
        if self.rdzv_conf is not None and not isinstance(self.rdzv_conf, Mapping):
            raise TypeError(f"rdzv_conf={self.rdzv_conf!r} must be a dict of rendezvous settings or None")
        if not isinstance(self.rdzv_endpoint, str):
            raise TypeError(f"rdzv_endpoint={self.rdzv_endpoint!r} must be a 'host:port' string")
        if self.rdzv_endpoint:
            host, sep, port = self.rdzv_endpoint.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"rdzv_endpoint={self.rdzv_endpoint!r} is not 'host:port' (e.g. '10.0.0.1:29400')"
                )
        if self.rdzv_backend not in RDZV_BACKENDS:
            raise ValueError(
                f"rdzv_backend={self.rdzv_backend!r} is not supported; choose one of {', '.join(RDZV_BACKENDS)}"
            )
        if self.num_nodes > 1:
            if self.rdzv_backend != "static" and not self.rdzv_endpoint:
                raise ValueError(
                    f"rdzv_backend={self.rdzv_backend!r} needs rdzv_endpoint='host:port' (the same on every node)"
                )
            return
        if self.rdzv_backend != "static":
            # one node through torch elastic's rendezvous (as 1.15 does); endpoint and settings apply
            return
        for name, default in _ELASTIC_ONLY.items():
            if getattr(self, name) != default:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} only applies to multi-node launches (num_nodes > 1, "
                    f"through torch elastic); leave it at {default!r} for a launch on this machine"
                )

    def _check_nodes(self) -> None:
        if self.nodes is None:
            return
        for name, default in (("num_nodes", 1), ("node_rank", 0), ("master_addr", "127.0.0.1")):
            if getattr(self, name) != default:
                where = (
                    "the rendezvous is at this kernel's address on the route to the nodes (Nodes(address=...) "
                    "names another)"
                    if name == "master_addr"
                    else "num_nodes/node_rank are the torchrun way, one kernel per machine"
                )
                raise ValueError(
                    f"{name}={getattr(self, name)!r} cannot be combined with nodes={self.nodes!r}: nodes= runs every "
                    f"node's ranks from this kernel and {where}; leave {name} at {default!r}"
                )

    @classmethod
    def persistent(cls, function: Callable, args: tuple = (), **options: Any) -> LaunchRequest:
        """Return the checked request of a persistent group (``start_ranks``): ``options`` among ``PERSISTENT_OPTIONS``.

        The group's launch never blocks the caller; ``hang_timeout`` None is ``DEFAULT_HANG_TIMEOUT``, as everywhere.
        """
        unknown = sorted(set(options) - set(PERSISTENT_OPTIONS))
        if unknown:
            raise TypeError(
                f"start_ranks() got unknown option(s) {unknown}; it takes gpus, value_limit and "
                f"{', '.join(PERSISTENT_OPTIONS)}"
            )
        return cls(function=function, args=args, block=False, **options)

    @property
    def collapse_seconds(self) -> float | None:
        """Return how long a line is held for the other ranks in the cell (None: lines are not collapsed)."""
        return collapse_window(self.collapse_output)

    @property
    def effective_hang_timeout(self) -> float:
        """Return the hang timeout in seconds (``math.inf``: detection off)."""
        return DEFAULT_HANG_TIMEOUT if self.hang_timeout is None else float(self.hang_timeout)

    def refuse_on(self, path: str, names: Sequence[str]) -> None:
        """Raise ValueError for the first of ``names`` set away from its default (not available on ``path``)."""
        defaults = {"block": True, "sinks": None, "timeout": None, "panel": False, "hang_timeout": None,
                    "on_hang": "report", "log_dir": None, "progress_bars": "auto", "collapse_output": True}  # fmt: skip
        for name in names:
            if getattr(self, name) != defaults[name]:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not available with {path}; leave it at {defaults[name]!r}"
                )
