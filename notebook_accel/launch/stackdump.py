"""The rank's side of taking stacks: one thread answers ``STACKS_SIGNAL`` with every thread's Python stack.

Why not ``faulthandler.register(STACKS_SIGNAL, all_threads=True)`` (what ranks used before): its
handler walks the other threads' frames from inside a signal handler, while those threads run. A
thread that returns from a deep call frees the frame memory the handler is reading, and the rank dies
of SIGSEGV; faulthandler's fatal handler then prints only ``Fatal Python error: Segmentation fault``
(its dump of the threads is refused: the interrupted dump still counts as in progress). Three such
deaths in CI runs of the suite, on the hang rule's samples; ``tests/test_stackdump.py`` has a rank with
busy threads that died within a few signals that way, and lives through hundreds now.

How it works now: the worker blocks ``STACKS_SIGNAL`` in its main thread before it starts any other
(``block_stack_requests``), so every later thread, torch's and gloo's included, inherits the block; one
daemon thread waits for the signal in ``sigwait`` and writes the stacks of ``sys._current_frames()``
while holding the interpreter lock (``start_answering``), in faulthandler's format, which
``doctor.parse_dump`` reads. A rank blocked in a C call that released the lock (a gloo collective, a
sleep, a read on a pipe) answers at once; a Python loop answers within the interpreter's switch
interval; one whose C call holds the lock answers only when it lets go (the launcher's collection
reports it as not answered meanwhile).

A process the rank forks (a DataLoader worker) gets the signal back at its default in the child; a
program it executes inherits the block (the signal mask survives ``exec``), so SIGUSR1 stays pending there.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import TextIO

__all__ = ["MAX_FRAMES", "STACKS_SIGNAL", "block_stack_requests", "format_stacks", "start_answering"]

STACKS_SIGNAL = signal.SIGUSR1
"""Sent by the launcher to one worker: its answering thread appends every thread's stack to its stacks file."""

MAX_FRAMES = 100
"""Frames written per thread, innermost first (faulthandler's own limit); a deeper stack ends with ``  ...``."""


def block_stack_requests() -> None:
    """Keep ``STACKS_SIGNAL`` for the answering thread: blocked in this (main) thread and every thread it starts.

    Call it before the process starts any thread. A thread that escaped the block (started earlier,
    by code not ours) would take the signal's default action, which ends the process: a handler that
    does nothing is installed for it instead.
    """
    signal.signal(STACKS_SIGNAL, _do_nothing)
    signal.pthread_sigmask(signal.SIG_BLOCK, {STACKS_SIGNAL})
    os.register_at_fork(after_in_child=_release_in_child)


def _do_nothing(signum: int, frame: object) -> None:
    """The handler of a request that reached a thread outside the block: that request goes unanswered."""
    return None


def _release_in_child() -> None:
    """In a process the rank forked: no answering thread there, so the signal is a plain one again."""
    signal.signal(STACKS_SIGNAL, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {STACKS_SIGNAL})


def start_answering(stacks_path: str) -> None:
    """Start the thread that appends every thread's stack to ``stacks_path`` on each ``STACKS_SIGNAL``.

    The file appears at ``stacks_path`` only once the thread waits (it is opened under a temporary name,
    then renamed): the launcher signals a rank only once its file exists.
    """
    pending = f"{stacks_path}.starting"
    out = open(pending, "a", encoding="utf-8")  # noqa: SIM115 - the answering thread owns it
    waiting = threading.Event()
    threading.Thread(target=_answer, args=(out, waiting), name="notebook_accel-stacks", daemon=True).start()
    waiting.wait()
    os.rename(pending, stacks_path)


def _answer(out: TextIO, waiting: threading.Event) -> None:
    me = threading.get_ident()
    waiting.set()  # a request sent from now on stays pending until sigwait takes it
    while True:
        signal.sigwait({STACKS_SIGNAL})
        try:
            out.write(format_stacks(skip=me))
            out.flush()
        except Exception:  # noqa: BLE001 - a full disk loses this answer; the rank goes on
            continue


def format_stacks(skip: int | None = None) -> str:
    """Return every Python thread's stack but ``skip``'s, as faulthandler writes them (the main thread last).

    Each thread: ``Thread 0x<ident> [<name>] (most recent call first):``, then one
    ``  File "<file>", line <n> in <function>`` per frame, innermost first, and a blank line.
    """
    frames = sys._current_frames()
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main = threading.main_thread().ident
    blocks = []
    for ident in sorted((i for i in frames if i != skip), key=lambda i: i == main):
        name = names.get(ident)
        lines = [f"Thread 0x{ident:016x}{f' [{name}]' if name else ''} (most recent call first):"]
        frame = frames[ident]
        while frame is not None:
            if len(lines) > MAX_FRAMES:
                lines.append("  ...")
                break
            code = frame.f_code
            lines.append(f'  File "{code.co_filename}", line {frame.f_lineno or 0} in {code.co_name}')
            frame = frame.f_back
        blocks.append("\n".join(lines) + "\n\n")
    return "".join(blocks)
