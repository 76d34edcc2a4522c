"""The kernel's end of one persistent group: the launch handle, its links to the ranks, one exchange at a time.

``Group.exchange`` sends a command to some ranks and waits for their replies in the calling thread,
printing the ranks' lines meanwhile (in a kernel: into the running cell). While it waits it watches
for what would otherwise hang the cell: a rank that died (the launcher stops the others), ranks
waiting in a collective for a rank that already failed or for each other (the one hang rule of
``launch/hangs.py`` says when: a busy rank is honest work, reported once, never a hang), and the Stop
button (SIGINT to the busy ranks; ranks that do not stop within a few seconds break the group).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, fields

from ..launch.doctor import RankStack, describe_stacks, named_ranks
from ..launch.errors import RankFailure, order_failures
from ..launch.handle import LaunchHandle
from ..launch.hangs import SampledWatch, Verdict, give_up_reason, report_text
from ..launch.output import PrintSink
from .cell_output import CellSink, CommandBars, command_bars
from .errors import RankError
from .links import RankLinks
from .protocol import (
    IDLE_WAIT,
    Command,
    Display,
    Err,
    Interrupted,
    MessageReader,
    ProtocolError,
    Reply,
    encode,
)
from .rank_shell import show_rank_display

__all__ = ["Group", "IdleRankStack", "failure_of", "mark_idle"]

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.05
_INTERRUPT_SECONDS = 3.0  # after SIGINT, how long busy ranks get to stop before the group is given up
_DRAIN_SECONDS = 1.0
_DEATH_SECONDS = 5.0
_LAST_LINES = 15
_SHARED_FRAME = 1 << 16  # a frame up to this size is decoded once for every rank that sent the same bytes
_HONEST_WORK = (
    "a busy rank is not a hang, so the command goes on (Stop ends it). It is given up only when no rank has "
    "made progress for hang_timeout={timeout:g} s"
)
_GLOO_NOTE = (
    "gloo cannot abort a collective without losing the ranks, so the group was stopped and every rank's "
    "namespace is lost; ranks.restart() (%ranks restart) forks new ranks from the kernel"
)


@dataclass(frozen=True)
class IdleRankStack(RankStack):
    """The stacks of a rank that waits for its next command (says so, instead of where in the loop)."""

    def summary(self) -> str:
        return "idle, waiting for a command"


def mark_idle(stacks: dict[int, RankStack]) -> dict[int, RankStack]:
    """Return ``stacks`` with the ranks waiting for a command (in ``protocol.IDLE_WAIT``) marked idle."""
    out: dict[int, RankStack] = {}
    for rank, stack in stacks.items():
        main = stack.main
        waiting = main is not None and IDLE_WAIT.in_frames(main.frames)
        out[rank] = (
            IdleRankStack(**{f.name: getattr(stack, f.name) for f in fields(stack)}) if waiting else stack
        )
    return out


def _idle_ranks(wait: _Wait, world: int, nodes: dict[int, str | None]) -> str:
    """Return who the busy ranks wait for, and why those will not join: ``rank(s) [1], which raised``."""
    groups = {
        "which raised": sorted(r for r, reply in wait.replies.items() if isinstance(reply, Err)),
        "which finished the command": sorted(
            r for r, reply in wait.replies.items() if not isinstance(reply, Err)
        ),
        "which do not run this command": sorted(set(range(world)) - set(wait.replies) - wait.pending),
    }
    return "; ".join(f"{named_ranks(ranks, nodes)}, {why}" for why, ranks in groups.items() if ranks)


class _Conn:
    """One rank's connection: its key in the group's ``RankLinks``, and the reader of what it sent."""

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.reader = MessageReader()


def failure_of(rank: int, pid: int | None, reply: Err | Interrupted, when: float) -> RankFailure:
    """Return the RankFailure an ``Err`` (or ``Interrupted``: its code raised KeyboardInterrupt) reply describes."""
    if isinstance(reply, Interrupted):
        return RankFailure(rank, pid, "KeyboardInterrupt", "interrupted", reply.traceback, None, None, when)
    return RankFailure(rank, pid, reply.exc_type, reply.message, reply.traceback, None, None, when)


class _Wait:
    """One exchange's bookkeeping: who still owes a reply, what came back, when the first error did."""

    def __init__(self, seq: int, targets: list[int]) -> None:
        self.seq = seq
        self.pending = set(targets)
        self.replies: dict[int, Reply] = {}
        self.times: dict[int, float] = {}
        self.raised = False
        """Some rank's reply is an ``Err``."""
        self.next_watch = 0.0
        """When the hang rule looks next (``_step``)."""
        self.first_idle: float | None = None
        """When some rank of the group first had nothing to do (replied, or not asked): now or never."""
        self.watch: SampledWatch | None = None
        self.bars: CommandBars | None = None
        self.printer: PrintSink | None = None
        self.decoded: dict[bytes, list] = {}
        """Frames read during this exchange (small, whole ones) and their messages (``Group._read``)."""


class Group:
    """A started launch whose ranks serve commands over ``links`` (one stream each, ``links.py``)."""

    def __init__(
        self, handle: LaunchHandle, links: RankLinks, conns: dict[int, Hashable], sink: CellSink
    ) -> None:
        self.handle = handle
        self.sink = sink
        self.links = links
        self._conns = {rank: _Conn(key) for rank, key in conns.items()}
        self._by_key = {key: rank for rank, key in conns.items()}
        self._closed: set[int] = set()  # the ranks whose connection closed
        self.broken = False
        # The launcher's watch reports any rank in a collective while another is elsewhere; a command's
        # own ProgressWatch tells honest work from a hang instead (and its reports end with the command).
        handle.watch_for_hangs(False)
        self.hang_timeout = handle.hang_timeout
        self.device_sync = handle.plan.backend == "nccl"
        self._seq = 0

    @property
    def alive(self) -> bool:
        """Return True while every rank is up and the group can take commands."""
        return not self.broken and not self.handle.done and not self._closed

    def pid(self, rank: int) -> int | None:
        """Return rank ``rank``'s pid."""
        return self.handle.pids[rank]

    # ------------------------------------------------------------------ one exchange

    def exchange(
        self,
        targets: list[int],
        command: Command,
        on_reply: Callable[[int, Reply], None] | None = None,
        interrupt: threading.Event | None = None,
    ) -> dict[int, Reply]:
        """Return each target's reply to ``command`` (sent stamped with this exchange's sequence number).

        Raises RankError when the group broke meanwhile, KeyboardInterrupt after ^C (every busy
        rank interrupted, or the group stopped if one would not stop). ``interrupt`` set (from
        another thread: a background job's ``stop()``) acts as ^C does.
        """
        if interrupt is not None and interrupt.is_set():
            raise KeyboardInterrupt("stopped before the command was sent; no rank ran it")
        self._seq += 1
        frame = encode(dataclasses.replace(command, seq=self._seq))  # pickled once for every rank
        wait = _Wait(self._seq, targets)
        started = time.monotonic()
        if len(targets) < len(self._conns):
            wait.first_idle = started  # the ranks not asked wait for their next command
        wait.watch = SampledWatch(self.hang_timeout, started, self._take_stacks, self.device_sync)
        printer = wait.printer = self.sink.printer()
        bars = wait.bars = command_bars(self.handle, self.sink.printing)
        self.sink.begin(printer, targets)
        try:
            try:
                for key in self.links.send([self._conns[r].key for r in targets], frame):
                    self._closed.add(self._by_key[key])
                while wait.pending:
                    if interrupt is not None and interrupt.is_set():
                        raise KeyboardInterrupt
                    self._step(wait, printer, on_reply)
            except KeyboardInterrupt:
                self._interrupt(wait, printer, on_reply)
            self._drain(targets, printer)
        finally:
            if bars is not None:
                bars.close()
            self.sink.end(printer)
        return wait.replies

    def _poll(self, wait: _Wait, timeout: float, on_reply: Callable | None) -> None:
        """Read what the ranks sent within ``timeout`` s: replies to this exchange, its displays, closed links."""
        for key, data in self.links.wait(timeout):
            rank = self._by_key.get(key)
            if rank is None:
                continue
            conn = self._conns[rank]
            if not data:
                self._closed.add(rank)
                continue
            try:
                messages = self._read(wait, conn.reader, data)
            except ProtocolError as exc:
                raise self._refused(rank, exc) from exc
            for message in messages:
                if message.seq != wait.seq:
                    continue  # a late message of an exchange given up on
                if isinstance(message, Display):
                    if wait.printer is not None:  # after the lines the rank printed before it
                        self._drain([rank], wait.printer)
                    show_rank_display(rank, message.data, message.metadata, self.sink.printing)
                elif rank in wait.pending:
                    self._replied(wait, rank, message, on_reply)

    @staticmethod
    def _read(wait: _Wait, reader: MessageReader, data: bytes) -> list:
        """Return the messages ``data`` completes: frames that other ranks sent alike are decoded once.

        A thousand ranks' replies to one command are mostly the same bytes (``Ok`` of an empty value);
        the messages are frozen, and nothing of the kernel changes a message's payload, so ranks whose
        bytes are equal share the decoded messages.
        """
        if reader.pending or len(data) > _SHARED_FRAME:
            return reader.feed(data)
        messages = wait.decoded.get(data)
        if messages is None:
            messages = reader.feed(data)
            if not reader.pending:  # whole frames only: the same bytes read the same by any rank's reader
                wait.decoded[data] = messages
        return messages

    @staticmethod
    def _replied(wait: _Wait, rank: int, reply: Reply, on_reply: Callable | None) -> None:
        now = time.monotonic()
        wait.replies[rank], wait.times[rank] = reply, now
        wait.raised = wait.raised or isinstance(reply, Err)
        wait.pending.discard(rank)
        if wait.first_idle is None:
            wait.first_idle = now
        if on_reply is not None:
            on_reply(rank, reply)

    def _step(self, wait: _Wait, printer: PrintSink, on_reply: Callable | None) -> None:
        self._poll(wait, _POLL_SECONDS, on_reply)
        self.sink.flush(printer)
        if wait.bars is not None:
            wait.bars.pump()
        if not wait.pending:
            return
        if self.handle.done or not self._closed.isdisjoint(wait.pending):
            raise self._death(wait, printer)
        now = time.monotonic()
        if now >= wait.next_watch:  # a thousand replies wake this loop often: the rule needs no more than this
            wait.next_watch = now + _POLL_SECONDS
            self._watch(wait, printer)

    def _watch(self, wait: _Wait, printer: PrintSink) -> None:
        """Judge the last stack sample by the hang rule (give up, report once, or go on); start the next when due."""
        last_sign = max((self.sink.last_line.get(r, 0.0) for r in wait.pending), default=0.0)
        verdict = wait.watch.check(time.monotonic(), wait.pending, last_sign, wait.first_idle, wait.raised)
        if verdict is not None:
            self._judged(wait, verdict, printer)

    def _judged(self, wait: _Wait, verdict: Verdict, printer: PrintSink) -> None:
        if verdict.kind == "report":
            printer.announce(report_text(verdict, _HONEST_WORK.format(timeout=self.hang_timeout)))
            return
        idle = _idle_ranks(wait, len(self._conns), self._nodes())
        why = give_up_reason(verdict, self.hang_timeout, idle)
        raise self._give_up(wait, f"the group is broken: {why}; {_GLOO_NOTE}", verdict.stacks)

    def _nodes(self) -> dict[int, str | None]:
        """Return each rank's host (None on this machine), to name it in messages."""
        return {s.rank: s.node for s in self.handle.status()}

    def _take_stacks(self) -> dict[int, RankStack]:
        try:
            return mark_idle(self.handle.stacks())
        except Exception:  # the stacks are a help for the error, never a reason to hang
            logger.exception("could not take the ranks' stacks")
            return {}

    def _give_up(self, wait: _Wait, reason: str, stacks: dict[int, RankStack]) -> RankError:
        """Stop the whole group (it cannot go on) and return the error saying why."""
        self.broken = True
        self.stop(graceful=False)
        failures = [
            failure_of(r, self.pid(r), rep, wait.times[r])
            for r, rep in wait.replies.items()
            if isinstance(rep, Err)
        ]
        return RankError(
            order_failures(failures), reason, describe_stacks(stacks) if stacks else None, broken=True
        )

    def _death(self, wait: _Wait, printer: PrintSink) -> RankError:
        """Return the error of a group one of whose ranks died (the launcher stops the others)."""
        self.broken = True
        if not self.handle.wait(_DEATH_SECONDS):
            self.stop(graceful=False)
        self.sink.flush(printer)
        launch_error = self.handle.error
        failures = list(launch_error.failures) if launch_error is not None else []
        for failure in failures:
            # Its last lines on stdout (what it was doing), then what the launcher kept (a fatal-error dump).
            streams = ("stdout", "stderr") if not failure.traceback else ("stdout",)
            lines = [line.text for line in self.handle.lines(failure.rank) if line.stream in streams]
            shown = "\n".join(lines[-_LAST_LINES:]) if lines else "(no output)"
            failure.traceback = (
                f"Last output lines of rank {failure.rank}:\n{shown}\n\n{failure.traceback}".rstrip()
            )
        dead = sorted(f.rank for f in failures) or sorted(self._closed)
        failures += [
            failure_of(r, self.pid(r), rep, wait.times[r])
            for r, rep in wait.replies.items()
            if isinstance(rep, Err)
        ]
        reason = (
            f"{named_ranks(dead, self._nodes())} died, and the launcher stopped the others with them: the group is broken and every "
            "rank's namespace is lost; ranks.restart() (%ranks restart) forks new ranks from the kernel"
        )
        return RankError(order_failures(failures), reason, broken=True)

    def _refused(self, rank: int, error: ProtocolError) -> RankError:
        """Stop the group whose rank ``rank`` broke the protocol, and return the error saying so."""
        self.broken = True
        self.stop(graceful=False)
        return RankError(
            [],
            f"rank {rank} sent what the kernel<->rank protocol does not allow ({error}), so the group was "
            "stopped; ranks.restart() (%ranks restart) forks new ranks from the kernel",
            broken=True,
        )

    def _interrupt(self, wait: _Wait, printer: PrintSink, on_reply: Callable | None) -> None:
        """Interrupt the busy ranks (SIGINT), wait a little for them, then raise KeyboardInterrupt."""
        busy = sorted(wait.pending)
        for rank in busy:
            pid = self.pid(rank)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + _INTERRUPT_SECONDS
        try:
            while wait.pending and time.monotonic() < deadline and self.alive:
                self._poll(wait, _POLL_SECONDS, on_reply)
                self.sink.flush(printer)
        except KeyboardInterrupt:
            pass  # a second ^C: give the group up at once
        if not wait.pending and self.alive:
            self._drain(busy, printer)
            raise KeyboardInterrupt(
                f"interrupted {named_ranks(busy, self._nodes())}; the ranks are alive and their namespaces intact"
            )
        stuck = sorted(wait.pending)
        stacks = self._take_stacks() if self.alive else {}
        self.broken = True
        self.stop(graceful=False)
        where = describe_stacks(stacks) if stacks else ""
        raise KeyboardInterrupt(
            f"{named_ranks(stuck, self._nodes())} did not stop within {_INTERRUPT_SECONDS:g} s of the interrupt, so the group was "
            "stopped and every rank's namespace is lost (a rank inside a C call, such as a gloo collective, "
            "cannot be interrupted); ranks.restart() (%ranks restart) forks new ranks from the kernel"
            + (f"\n\n{where}" if where else "")
        )

    def _drain(self, ranks: list[int], printer: PrintSink) -> None:
        """Print every line the ranks wrote before replying (they flushed their streams first)."""
        deadline = time.monotonic() + _DRAIN_SECONDS
        while (ranks := self.handle.output_pending(ranks)) and time.monotonic() < deadline:
            time.sleep(0.001)
        self.sink.flush(printer, everything=True)

    # ------------------------------------------------------------------ the end

    def stop(self, graceful: bool = True, timeout: float = 3.0) -> None:
        """End the ranks (closing their links ends their loops; signals after ``timeout``); idempotent."""
        self.links.close()
        self._closed.update(self._conns)
        if not graceful:
            self.handle.kill()
        if not self.handle.wait(timeout if graceful else 1.0):
            self.handle.stop(grace=0.5)
            if not self.handle.wait(timeout):
                self.handle.kill()
                self.handle.wait(timeout)
