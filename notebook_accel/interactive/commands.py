"""The plumbing under ``Ranks``' verbs: the command each sends, which ranks it goes to, one at a time, its failures.

``Ranks.run``, ``execute``, ``push`` and ``pull`` each build one command of ``protocol.py`` here
(``exec_command``, ``call_command``, ``push_command``, ``pull_command``: what can be checked in the
kernel is, before any rank sees the command) and hand it to :meth:`Commands.run`: it refuses a
second command while one runs (from another thread, or a background job's), keeps each rank's books (busy, which cell, whether its last command raised: what
``Ranks.status()`` shows), runs the exchange (``Group.exchange``), and raises ``RankError`` when
some rank replied with an error, every targeted rank's ``CellResult`` attached.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from ..utils._wire import dumps_by_value
from .cells import remember_source, split_code, without_globals
from .errors import NoRanksError, RankError
from .group import Group, failure_of
from .jobs import Job, command_guard
from .protocol import Call, Command, Err, Exec, Ok, Pull, Push, Reply
from .rank_shell import prepare_cell
from .stale import fingerprint, global_tokens
from .values import CellResult, cell_result

__all__ = [
    "Commands",
    "call_command",
    "exec_command",
    "pull_command",
    "push_command",
    "short_text",
    "targets_of",
    "usable",
    "values_of",
]

_CLAIM = "command"
_BUSY = "another command is running on these ranks (from another thread); wait for it"
_RANKS = "the ranks"
_PUSH_FIX = (
    "push plain data instead (tensors, lists, numbers, a state_dict()), or build the object on the ranks"
)
_cells = itertools.count(1)


def exec_command(code: str, limit: int | None) -> Exec:
    """Return the command running ``code`` (compiled here first: a SyntaxError is raised before any rank sees it)."""
    if not isinstance(code, str):
        raise TypeError(
            f"code must be a string of Python; got {type(code).__name__} (ranks.run() takes functions)"
        )
    filename = f"<rank cell {next(_cells)}>"
    python, transformed = prepare_cell(code)  # %time, !ls ...: IPython's input transformations
    split_code(python, filename)  # a SyntaxError stops here, before any rank sees the code
    remember_source(code, filename)  # stacks taken here show the cell's lines
    return Exec(
        source=code,
        filename=filename,
        python=python if transformed else None,
        ipython=transformed,
        limit=limit,
    )


def call_command(
    function: Callable, args: tuple, kwargs: dict[str, Any], known: frozenset[str], forked: bool
) -> Call:
    """Return the command calling ``function(*args, **kwargs)``; TypeError when they cannot be pickled.

    ``known``: the names every rank has (the function's globals among them do not travel).
    """
    blob = dumps_by_value(
        (without_globals(function, known), args, kwargs),
        what="the function and its arguments",
        to=_RANKS,
        fix="pass picklable arguments",
    )
    return Call(blob=blob, check=global_tokens(function), forked=forked)


def push_command(values: dict[str, Any]) -> Push:
    """Return the command setting ``values`` by name; ValueError for a bad name, TypeError naming a value that cannot be pickled."""
    if not values:
        raise ValueError("push_many() got no values; pass name=value pairs")
    for name in values:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{name!r} is not a Python name; push values under names like 'model' or 'lr'")
    for name, value in values.items():  # each alone first: the error names the value that fails
        what = f"{name} (a {type(value).__module__}.{type(value).__qualname__})"
        dumps_by_value(value, what=what, to=_RANKS, fix=_PUSH_FIX)
    blob = dumps_by_value(values, what="the values", to=_RANKS, fix=_PUSH_FIX)
    return Push(blob=blob, tokens={name: fingerprint(value) for name, value in values.items()})


def pull_command(name: str) -> Pull:
    """Return the command fetching ``name``'s value; ValueError when it is not a Python name."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{name!r} is not a Python name; pull a variable of the ranks by its name")
    return Pull(name=name)


def values_of(results: list[CellResult], pulled: str | None = None) -> list:
    """Return each result's value; TypeError for the first that could not come back (``pulled``: the name pulled)."""
    for result in results:
        if result.unpicklable is None:
            continue
        if pulled is not None:
            raise TypeError(
                f"{pulled} on rank {result.rank} is {result.unpicklable}, and cannot be pickled back to the "
                "kernel; pull a picklable part of it instead (a tensor, a state_dict(), plain lists or "
                "numbers): assign one to a name on the ranks first"
            )
        raise TypeError(
            f"the value rank {result.rank} computed ({result.unpicklable}) cannot be pickled back to the "
            "kernel (the code did run); assign it to a name and return a picklable part of it (a tensor, "
            "a state_dict(), plain numbers)"
        )
    return [result.value for result in results]


def short_text(code: str, limit: int = 60) -> str:
    """Return a command's first line, cut to ``limit`` characters (``…`` where more was left out)."""
    lines = [line.strip() for line in code.strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1:
        text += " …"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def usable(group: Group | None, stopped: bool) -> Group:
    """Return ``group`` when it takes commands; NoRanksError when there is none (or it was stopped), RuntimeError when it broke."""
    if stopped or group is None:
        raise NoRanksError(
            "these ranks were stopped; start new ones with notebook_accel.start_ranks(...) (or %ranks start)"
        )
    if not group.alive:
        handle = group.handle
        error = handle.error if handle.done else None
        why = error.failures[0].headline() if error is not None and error.failures else "a rank died or hung"
        raise RuntimeError(
            f"the ranks' group is broken ({why}): call ranks.restart() (or %ranks restart) to fork new "
            "ranks from the kernel"
        )
    return group


def targets_of(on: Any, n: int) -> list[int]:
    """Return the ranks ``on`` names (a rank, ranks, or None: every rank of ``n``), sorted; ValueError if one is not."""
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


class Commands:
    """One command at a time on a group's ranks, and each rank's books."""

    def __init__(self, jobs: list[Job]) -> None:
        self._jobs = jobs
        self._claims: dict[str, object] = {}  # _CLAIM: the token of the command running
        self.books: dict[int, dict[str, Any]] = {}
        """Per rank: ``busy`` (a command runs there), ``cell`` (its short text), ``failed`` (it raised)."""

    def reset(self, num_processes: int) -> None:
        """Start fresh books for a group of ``num_processes`` new ranks (the same dict, emptied)."""
        self.books.clear()
        self.books.update({r: {"busy": False, "failed": False, "cell": ""} for r in range(num_processes)})

    @property
    def busy(self) -> bool:
        """Return True while a command runs on the ranks."""
        return _CLAIM in self._claims

    def refuse_if_busy(self) -> None:
        """Raise RuntimeError while a command (from another thread) runs on the ranks."""
        if self.busy:
            raise RuntimeError(_BUSY)

    def run(
        self, group: Group, targets: list[int], command: Command, cell: str, limit: int | None
    ) -> dict[int, Ok]:
        """Return each target's ``Ok`` reply to ``command``; RankError when some rank replied otherwise.

        ``cell`` is the command's short text for the books; ``limit`` the value limit the failed
        command's other results are read with.
        """
        # Refused while a background job runs, unless this is the job's own thread.
        interrupt = command_guard(self._jobs)
        me = object()  # this command's claim token
        try:
            # One command at a time. The claim is taken inside the try (a Stop landing just after it is
            # released below), with one atomic dict call, so no lock can stay taken.
            if self._claims.setdefault(_CLAIM, me) is not me:
                raise RuntimeError(_BUSY)
            for r in targets:
                self.books[r].update(busy=True, cell=cell)

            def on_reply(rank: int, reply: Reply) -> None:
                self.books[rank].update(busy=False, failed=isinstance(reply, Err))

            try:
                replies = group.exchange(targets, command, on_reply, interrupt)
            finally:
                for r in targets:
                    self.books[r]["busy"] = False
        finally:
            if self._claims.get(_CLAIM) is me:
                del self._claims[_CLAIM]
        return _succeeded(group, targets, replies, limit)


def _succeeded(
    group: Group, targets: list[int], replies: dict[int, Reply], limit: int | None
) -> dict[int, Ok]:
    """Return ``replies`` when every one is ``Ok``; else raise RankError naming the ranks that raised."""
    oks = {r: reply for r, reply in replies.items() if isinstance(reply, Ok)}
    failed = [r for r in targets if r not in oks]
    if not failed:
        return oks
    now = time.monotonic()
    failures = [failure_of(r, group.pid(r), replies[r], now) for r in failed]  # type: ignore[arg-type]
    results = [
        cell_result(r, oks[r].payload, limit)
        if r in oks
        else CellResult(r, ok=False, error=replies[r].traceback)
        for r in targets
    ]
    raise RankError(
        failures,
        f"raised on rank(s) {failed}; the ranks are alive and their namespaces intact",
        results=results,
    )
