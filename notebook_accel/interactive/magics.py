"""The ``%ranks`` and ``%%ranks`` magics: a thin layer over ``start_ranks`` and ``Ranks``.

``%load_ext notebook_accel`` calls :func:`load_ipython_extension`, which registers one line-and-cell
magic named ``ranks``. Every subcommand maps to one call of the Python API, so what a notebook does
with magics a script or a test does with ``start_ranks``:

==================================  ==================================================
``%ranks start 2``                  ``start_ranks(2)`` (``--start-method``, ``--panel``, ``--hang-timeout``,
                                    ``--gpus``, ``--value-limit``, ``--collapse-output on|off|SECONDS``)
``%ranks start 2 --nodes slurm``    ``start_ranks(2, nodes="slurm")`` (or ``slurm:JOBID``, or a ``Nodes`` variable)
``%ranks start 2 --hosts a,b``      ``start_ranks(2, nodes=["a", "b"])``: SSH to each host
``%%ranks`` / ``%%ranks 0,2``       ``ranks.execute(cell, on=...)``, the values displayed per rank
``%%ranks --bg [0,2]``              the same as a background job: returns at once, output in its cell
``%ranks wait`` / ``wait N``        wait for the last job (job N), then show what its cell would have shown
``%ranks jobs``                     ``ranks.jobs`` as a table (number, state, time, ranks, command)
``%ranks stop``                     ``ranks.stop()``
``%ranks status`` / ``stacks``      ``ranks.status()`` / ``ranks.stacks()``
``%ranks restart``                  ``ranks.restart()``
``%ranks pull NAME``                ``NAME = ranks.pull("NAME")`` in the kernel
``%ranks push NAME``                ``ranks.push("NAME", NAME)``
``%ranks auto on|off``              every following cell runs as a ``%%ranks`` cell
``%ranks value-limit [SIZE]``       ``ranks.value_limit = SIZE`` (no SIZE: show it)
==================================  ==================================================

The magic logic (:class:`RanksMagic`) is plain Python; IPython is imported only when the extension is
loaded, so the core stays importable without it.
"""

from __future__ import annotations

import argparse
import io
import re
import shlex
import sys
import tokenize
from typing import Any

from ..launch.collapse import collapse_window
from ..nodes.spec import Nodes
from .display import CellDisplay, StacksView, StatusTable
from .gpus import parse_gpus
from .jobs import Job, JobsTable
from .session import current, start_ranks
from .values import format_size, parse_size

__all__ = ["SUBCOMMANDS", "RanksMagic", "RanksUsageError", "load_ipython_extension", "parse_ranks"]

SUBCOMMANDS = (
    "start",
    "stop",
    "status",
    "stacks",
    "restart",
    "pull",
    "push",
    "auto",
    "value-limit",
    "wait",
    "jobs",
)
"""The words ``%ranks`` understands, in the order its help lists them."""

_BACKGROUND = "--bg"  # %%ranks --bg: the cell runs as a background job
# A cell that starts with a magic (``%ranks auto off``, ``%time``, ``%%ranks 0``) stays in the kernel
# in auto mode: the ranks run plain Python, and ``%ranks auto off`` must reach the kernel to work.
_KERNEL_CELL = re.compile(r"^\s*[%!]")
_NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}


class RanksUsageError(ValueError):
    """Bad use of ``%ranks`` / ``%%ranks``: the message says what was wrong and how to write it.

    In a kernel it is shown as IPython's ``UsageError`` (a message, no traceback).
    """


class _Parser(argparse.ArgumentParser):
    """An argument parser that raises :class:`RanksUsageError` instead of exiting the kernel."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise RanksUsageError(f"{self.prog}: {message}\n{self.format_usage().strip()}")


def _gpu_list(text: str) -> list[int]:
    try:
        return parse_gpus(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None  # argparse shows this message, not its own


def _collapse(text: str) -> bool | float:
    """Return ``collapse_output`` for ``--collapse-output on|off|SECONDS``."""
    value = {"on": True, "off": False}.get(text.lower())
    try:
        value = float(text) if value is None else value
        collapse_window(value)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"--collapse-output {text}: give on (identical lines of several ranks shown once), off, or the "
            "seconds a line waits for the other ranks (like 0.5)"
        ) from None
    return value


def _parsers() -> dict[str, _Parser]:
    parsers = {name: _Parser(prog=f"%ranks {name}", add_help=False) for name in SUBCOMMANDS}
    start = parsers["start"]
    start.add_argument("num_processes", nargs="?", type=int, default=2, metavar="N")
    start.add_argument("--start-method", default=None)
    start.add_argument("--gpus", type=_gpu_list, default=None, metavar="0,1")
    start.add_argument("--panel", action="store_true")
    start.add_argument("--hang-timeout", type=float, default=None, metavar="SECONDS")
    start.add_argument("--value-limit", default=None, metavar="SIZE")
    parsers["value-limit"].add_argument("size", nargs="?", default=None, metavar="SIZE")
    start.add_argument("--nodes", default=None, metavar="slurm|slurm:JOBID|VARIABLE")
    start.add_argument("--hosts", default=None, metavar="HOST,HOST")
    start.add_argument("--collapse-output", type=_collapse, default=True, metavar="on|off|SECONDS")
    parsers["pull"].add_argument("name", metavar="NAME")
    parsers["push"].add_argument("names", nargs="+", metavar="NAME")
    for name in ("pull", "push"):
        parsers[name].add_argument("--on", default=None, metavar="RANKS")
    parsers["auto"].add_argument("switch", choices=("on", "off"), metavar="on|off")
    parsers["wait"].add_argument("job", nargs="?", type=int, default=None, metavar="JOB")
    return parsers


def parse_ranks(spec: str | None) -> list[int] | None:
    """Return the ranks a ``%%ranks`` line names (``"0,2"`` -> ``[0, 2]``), None for every rank.

    An empty spec and ``all`` mean every rank. Whether the ranks exist is checked by ``Ranks`` itself,
    which knows how many there are.
    """
    spec = (spec or "").strip()
    if spec in ("", "all"):
        return None
    ranks = []
    for part in spec.replace(" ", ",").split(","):
        if not part:
            continue
        if not part.isdigit():
            raise RanksUsageError(
                f"%%ranks takes the ranks to run the cell on, like `%%ranks 0` or `%%ranks 0,2`; "
                f"got {spec!r}. For the other commands use the line magic: `%ranks {spec}`."
            )
        ranks.append(int(part))
    if len(set(ranks)) != len(ranks):
        raise RanksUsageError(f"%%ranks {spec}: a rank is named twice; name each rank once, like 0,2")
    return ranks


class RanksMagic:
    """The state and the logic behind ``%ranks`` / ``%%ranks`` for one IPython shell.

    ``line(text)`` runs ``%ranks text``, ``cell(line, body)`` runs a ``%%ranks line`` cell, and
    ``auto_transform`` is the input transformer that turns cells into ``%%ranks`` cells in auto mode.
    ``shell`` needs only ``user_ns``, so the logic is testable without a kernel.
    """

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.auto = False
        """Whether every cell (except those starting with a magic) runs on the ranks."""
        self._parsers = _parsers()

    # -- the ranks this shell works with -------------------------------------------------------------

    @staticmethod
    def _ranks(command: str) -> Any:
        ranks = current()
        if ranks is None:
            raise RanksUsageError(f"{command}: no ranks are running. Start them first with `%ranks start N`.")
        return ranks

    # -- %%ranks ----------------------------------------------------------------------------------

    def cell(self, line: str, body: str) -> CellDisplay | Job | None:
        """Run ``body`` on the ranks ``line`` names; return what to display (None: nothing; ``--bg``: the job)."""
        words = line.split()
        background = _BACKGROUND in words
        line = " ".join(word for word in words if word != _BACKGROUND)
        on = parse_ranks(line)
        ranks = self._ranks("%%ranks")
        missing = [r for r in on or () if r >= ranks.num_processes]
        if missing:
            raise RanksUsageError(
                f"%%ranks {line.strip()}: rank {missing[0]} does not exist; these ranks are "
                f"0..{ranks.num_processes - 1} (`%ranks status` lists them)"
            )
        if background:
            return self._background(ranks, body, on)
        results = ranks.execute(body, on=on)
        shown = CellDisplay(results, ranks.num_processes)
        return None if shown.empty or _ends_with_semicolon(body) else shown

    @staticmethod
    def _background(ranks: Any, body: str, on: list[int] | None) -> Job:
        """Return the started job of a ``%%ranks --bg`` cell (``%ranks wait`` shows what the cell would)."""
        hidden = _ends_with_semicolon(body)
        return ranks._start_job(
            body,
            on,
            lambda: CellDisplay(ranks.execute(body, on=on), ranks.num_processes),
            lambda shown: None if shown.empty or hidden else shown,
        )

    # -- %ranks -----------------------------------------------------------------------------------

    def line(self, text: str) -> Any:
        """Run ``%ranks text``; return what the magic displays (None: nothing)."""
        try:
            words = shlex.split(text)
        except ValueError as err:  # an unbalanced quote
            raise RanksUsageError(f"%ranks {text}: {err}; close the quote") from None
        if not words:
            raise RanksUsageError(f"%ranks needs a command, one of: {', '.join(SUBCOMMANDS)}")
        command, rest = words[0], words[1:]
        if command not in SUBCOMMANDS:
            hint = ""
            if command.replace(",", "").isdigit():
                hint = f" To run code on rank(s) {command}, start a cell with `%%ranks {command}`."
            raise RanksUsageError(
                f"%ranks: unknown command {command!r}; use one of: {', '.join(SUBCOMMANDS)}.{hint}"
            )
        args = self._parsers[command].parse_args(rest)
        return getattr(self, f"_{command.replace('-', '_')}")(args)

    def _start(self, args: argparse.Namespace) -> Any:
        running = current()
        if running is not None and running.alive:  # a broken group is replaced: nothing left to lose
            raise RanksUsageError(
                f"%ranks start: {running.num_processes} ranks are already running. "
                "Use them, or `%ranks stop` (or `%ranks restart`) first."
            )
        # Shown as Out[] (``<Ranks 2 rank(s), alive>``), and ``ranks = %ranks start 2`` keeps the object.
        limit = (
            {}
            if args.value_limit is None
            else {"value_limit": _size(args.value_limit, "start --value-limit")}
        )
        return start_ranks(
            args.num_processes,
            start_method=args.start_method,
            panel=args.panel,
            hang_timeout=args.hang_timeout,
            **limit,
            gpus=args.gpus,
            nodes=nodes_option(args.nodes, args.hosts, self.shell.user_ns),
            collapse_output=args.collapse_output,
        )

    def _stop(self, args: argparse.Namespace) -> None:
        # Safe to repeat: stopping nothing is not an error. Auto mode ends with the ranks it fed.
        self.auto = False
        ranks = current()
        if ranks is not None:
            ranks.stop()

    def _status(self, args: argparse.Namespace) -> StatusTable:
        return StatusTable(self._ranks("%ranks status").status())

    def _stacks(self, args: argparse.Namespace) -> StacksView:
        return StacksView(self._ranks("%ranks stacks").stacks())

    def _restart(self, args: argparse.Namespace) -> None:
        # Ranks.restart() warns which namespaces were lost; its list would only repeat that as Out[].
        self._ranks("%ranks restart").restart()

    def _pull(self, args: argparse.Namespace) -> list:
        name = _identifier(args.name, "pull")
        values = self._ranks("%ranks pull").pull(name, on=parse_ranks(args.on))
        self.shell.user_ns[name] = values
        return values

    def _push(self, args: argparse.Namespace) -> None:
        names = [_identifier(name, "push") for name in args.names]
        missing = [name for name in names if name not in self.shell.user_ns]
        if missing:
            raise RanksUsageError(
                f"%ranks push: the kernel has no variable {', '.join(map(repr, missing))}; "
                "define it in a cell first, then push it."
            )
        # All names in one command: a value that cannot be pickled refuses the push before any is sent.
        values = {name: self.shell.user_ns[name] for name in names}
        self._ranks("%ranks push").push_many(values, on=parse_ranks(args.on))

    def _wait(self, args: argparse.Namespace) -> Any:
        jobs = self._ranks("%ranks wait").jobs
        if not jobs:
            raise RanksUsageError(
                "%ranks wait: these ranks ran no background job; start one with `%%ranks --bg` "
                "(or ranks.submit(...))"
            )
        chosen = jobs[-1] if args.job is None else next((j for j in jobs if j.number == args.job), None)
        if chosen is None:
            raise RanksUsageError(
                f"%ranks wait {args.job}: no job {args.job} on these ranks; their jobs are "
                f"{', '.join(str(j.number) for j in jobs)} (`%ranks jobs` lists them)"
            )
        # Shown as the foreground cell would have shown it; a failed job raises its error here.
        return chosen.shown()

    def _jobs(self, args: argparse.Namespace) -> JobsTable:
        return JobsTable(self._ranks("%ranks jobs").jobs)

    def _value_limit(self, args: argparse.Namespace) -> str:
        ranks = self._ranks("%ranks value-limit")
        if args.size is not None:
            ranks.value_limit = _size(args.size, "value-limit")
        return f"cell values up to {format_size(ranks.value_limit)} (pickled) come to the kernel"

    def _auto(self, args: argparse.Namespace) -> None:
        if args.switch == "on":
            self._ranks("%ranks auto on")  # switching on with nothing to run on would break every cell
        self.auto = args.switch == "on"

    # -- auto mode --------------------------------------------------------------------------------

    def auto_transform(self, lines: list[str]) -> list[str]:
        """Return the cell's lines, made into a ``%%ranks`` cell when auto mode is on.

        An IPython input transformer (``input_transformers_cleanup``): it runs before IPython looks for
        cell magics. Blank cells and cells starting with a magic or a shell escape are left alone.
        """
        if not self.auto:
            return lines
        first = next((line for line in lines if line.strip()), None)
        if first is None or _KERNEL_CELL.match(first):
            return lines
        return ["%%ranks\n", *lines]


def _ends_with_semicolon(source: str) -> bool:
    """Return True when the cell's last token is ``;``: Jupyter then shows no value."""
    last = None
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type not in _NOT_CODE:
                last = token
    except (tokenize.TokenError, SyntaxError):
        return False  # the ranks refuse code that does not tokenize; nothing to show anyway
    return last is not None and last.string == ";"


def _size(text: str, command: str) -> int | None:
    try:
        return parse_size(text, "size")
    except (TypeError, ValueError) as err:
        raise RanksUsageError(
            f"%ranks {command} {text}: {err}; e.g. `%ranks {command} 50MB` (or `none`: no limit)"
        ) from None


def nodes_option(nodes: str | None, hosts: str | None, user_ns: dict[str, Any]) -> Any:
    """Return what ``%ranks start --nodes X`` / ``--hosts a,b`` passes as ``start_ranks(nodes=...)`` (None: this machine).

    ``--nodes`` takes ``slurm``, ``slurm:JOBID`` or the name of a kernel variable holding a ``Nodes``;
    ``--hosts`` a comma-separated list of SSH host names.
    """
    if nodes is not None and hosts is not None:
        raise RanksUsageError(
            f"%ranks start: --nodes {nodes} and --hosts {hosts} both say where the ranks run; give one "
            "(--hosts a,b is --nodes for SSH hosts)"
        )
    if hosts is not None:
        names = [h.strip() for h in hosts.split(",")]
        if not all(names):
            raise RanksUsageError(
                f"%ranks start --hosts {hosts!r}: an empty host name; list hosts separated by commas, "
                "like --hosts gpu-a,gpu-b"
            )
        return _checked_nodes(names, f"--hosts {hosts}")
    if nodes is None:
        return None
    if nodes.isidentifier() and nodes != "slurm":
        value = user_ns.get(nodes)
        if not isinstance(value, Nodes):
            what = "no such variable" if nodes not in user_ns else f"a {type(value).__name__}, not a Nodes"
            raise RanksUsageError(
                f"%ranks start --nodes {nodes}: {what}; give slurm, slurm:JOBID, or the name of a variable "
                "holding notebook_accel.Nodes(...)"
            )
        return value
    return _checked_nodes(nodes, f"--nodes {nodes}")


def _checked_nodes(value: Any, option: str) -> Nodes:
    try:
        return Nodes.of(value)
    except (TypeError, ValueError) as err:
        raise RanksUsageError(f"%ranks start {option}: {err}") from None


def _identifier(name: str, command: str) -> str:
    if not name.isidentifier():
        raise RanksUsageError(
            f"%ranks {command}: {name!r} is not a variable name; give a name like `%ranks {command} weights`"
        )
    return name


def load_ipython_extension(ipython: Any) -> None:
    """Register the ``%ranks`` / ``%%ranks`` magics in ``ipython`` (what ``%load_ext notebook_accel`` does).

    Loading twice replaces the earlier registration (one auto-mode transformer per shell).
    """
    # The shell given here is IPython's, so IPython is imported already: take its UsageError from there
    # (the core never imports IPython itself, as launch/cell_bars.kernel_display does for display).
    UsageError = sys.modules["IPython.core.error"].UsageError  # noqa: N806

    magic = RanksMagic(ipython)

    def ranks(line: str, cell: str | None = None) -> Any:
        try:
            return magic.line(line) if cell is None else magic.cell(line, cell)
        except RanksUsageError as err:
            raise UsageError(str(err)) from None

    ranks.__doc__ = __doc__
    ipython.register_magic_function(ranks, magic_kind="line_cell", magic_name="ranks")
    transforms = ipython.input_transformers_cleanup
    transforms[:] = [t for t in transforms if not isinstance(getattr(t, "__self__", None), RanksMagic)]
    transforms.append(magic.auto_transform)
