"""A rank's stacks on request: a thread of the rank writes every thread's Python stack when asked.

The two sides meet in two files per rank, in the launch's stacks folder: the rank's stacks file
(``rank_3.txt``, appended to) and a named pipe beside it (``rank_3.txt.request``). The launcher asks
by writing a byte to the pipe (``ask``); the rank's answering thread, blocked reading it, writes
the stacks of ``sys._current_frames()`` while holding the interpreter lock (``format_stacks``, in
faulthandler's format, which ``doctor.parse_dump`` reads) and goes back to waiting. A rank blocked in
a C call that released the lock (a gloo collective, a sleep, a read) answers at once; a Python loop
answers within the interpreter's switch interval; one whose C call holds the lock answers only when
it lets go (the launcher's collection reports it as not answered meanwhile). Nothing interrupts the
rank's own threads.

What ranks did before: ``faulthandler.register(SIGUSR1, all_threads=True)``. Its handler walks the
other threads' frames from inside a signal handler while they run; a thread that returns from a deep
call frees the frame memory the handler is reading, and the rank died of SIGSEGV with only ``Fatal
Python error: Segmentation fault`` on stderr (faulthandler refuses a second dump while the first is in
progress): twice in one CI run (the 3.13 subset and the main suite), once in a full run before it. A
signal answered by a ``sigwait`` thread does not work either: the signal must be blocked in every
other thread, and a thread that C code starts in a forked child before any Python runs (torch starts
one) takes it instead.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from typing import TextIO

__all__ = [
    "ANSWERER_LINE",
    "MAX_FRAMES",
    "REQUEST",
    "REQUEST_SUFFIX",
    "answerer",
    "ask",
    "format_stacks",
    "start_answering",
]

MAX_FRAMES = 100
"""Frames written per thread, innermost first (faulthandler's own limit); a deeper stack ends with ``  ...``."""

REQUEST_SUFFIX = ".request"
"""The named pipe beside a rank's stacks file: ``REQUEST`` written there asks for its stacks."""

REQUEST = b"?"
"""One ask (the answering thread reads it)."""

ANSWERER_LINE = "stacks answered by thread "
"""The first line of a stacks file, before the native id of the thread that answers: its reads of the
requests and writes of the answers are the rank's own bookkeeping, left out of the rank's I/O
(``doctor.io_bytes``), which the hang rule reads as progress."""


def start_answering(stacks_path: str) -> None:
    """Start the thread that appends every thread's stack to ``stacks_path`` whenever it is asked (``ask``).

    The stacks file appears at ``stacks_path`` only once the thread can be asked (it is opened under a
    temporary name, then renamed): the launcher asks a rank only once its file exists.
    """
    request = stacks_path + REQUEST_SUFFIX
    try:
        os.unlink(request)  # a previous attempt's
    except FileNotFoundError:
        pass
    os.mkfifo(request, 0o600)
    # Read and write: the pipe then always has a writer, and a read waits for the next byte, never EOF.
    requests = os.open(request, os.O_RDWR)
    pending = f"{stacks_path}.starting"
    out = open(pending, "a", encoding="utf-8")  # noqa: SIM115 - the answering thread owns it
    thread = threading.Thread(target=_answer, args=(requests, out), name="notebook_accel-stacks", daemon=True)
    thread.start()
    out.write(f"{ANSWERER_LINE}{thread.native_id}\n")
    out.flush()
    os.rename(pending, stacks_path)


def answerer(stacks_path: str) -> int | None:
    """Return the native thread id that answers for the rank of ``stacks_path`` (None: not known)."""
    try:
        with open(stacks_path, encoding="utf-8") as f:
            first = f.readline()
    except OSError:
        return None
    tid = first.removeprefix(ANSWERER_LINE).strip()
    return int(tid) if first.startswith(ANSWERER_LINE) and tid.isdigit() else None


def _answer(requests: int, out: TextIO) -> None:
    me = threading.get_ident()
    while True:
        os.read(requests, 4096)  # requests sent meanwhile are answered together
        try:
            out.write(format_stacks(skip=me))
            out.flush()
        except Exception:  # noqa: BLE001 - a full disk loses this answer; the rank goes on
            continue


def ask(stacks_path: str) -> bool:
    """Ask the rank whose stacks file is ``stacks_path`` for its stacks; False if no rank listens there.

    Never blocks: a rank that ended left its pipe without a reader (``ENXIO``), and a full pipe already
    holds requests the rank has yet to answer (this one is answered with them).
    """
    try:
        fd = os.open(stacks_path + REQUEST_SUFFIX, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: no reader (the rank ended); ENOENT: the launch's folder is gone
        return False
    try:
        os.write(fd, REQUEST)
    except OSError as exc:
        if exc.errno != errno.EAGAIN:
            return False
    finally:
        os.close(fd)
    return True


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
