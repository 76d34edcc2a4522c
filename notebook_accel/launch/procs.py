"""Starting one worker process per rank with fork, spawn or forkserver, behind one small interface.

``fork`` is a bare ``os.fork()`` (no pickling: notebook functions and closures just work); ``spawn``
runs a fresh interpreter with ``subprocess`` and sends the function by value (cloudpickle) on its
stdin; ``forkserver`` goes through multiprocessing's fork server, which keeps running afterwards as
multiprocessing's shared helper. Every worker leads its own process group.
"""

from __future__ import annotations

import errno
import os
import pickle
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace

from ..utils._wire import dumps_by_value
from .doctor import StackCollector
from .interfaces import WorkerBackend, WorkerProcess, WorkerStart, start_each
from .usage import UsageSampler
from .worker import WorkerSpec, worker_main

__all__ = ["LocalProcess", "LocalProcesses", "WorkerProcess", "by_value", "start_worker"]


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # old kernel: the supervisor polls instead
        return None


class LocalProcess(WorkerProcess):
    """A worker started on this machine: its sentinel is its pidfd (or multiprocessing's sentinel)."""

    def __init__(self, pid: int, *, popen: subprocess.Popen | None = None, mp_process=None) -> None:
        self.pid = pid
        self._popen = popen
        self._mp = mp_process
        self.exitcode: int | None = None
        self.sentinel: int | None = mp_process.sentinel if mp_process is not None else _pidfd(pid)

    @property
    def pidfd(self) -> int | None:
        """Return the worker's pidfd (None under forkserver, whose sentinel is multiprocessing's pipe)."""
        return self.sentinel if self._mp is None else None

    def poll(self) -> int | None:
        """Return the exit code (negative: killed by that signal) once the process has ended."""
        if self.exitcode is not None:
            return self.exitcode
        if self._popen is not None:
            self.exitcode = self._popen.poll()
        elif self._mp is not None:
            self.exitcode = self._mp.exitcode
        else:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: the code is lost
                self.exitcode = -signal.SIGKILL
                return self.exitcode
            if pid:
                self.exitcode = os.waitstatus_to_exitcode(status)
        return self.exitcode

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the worker's process group (its children too), or to it alone."""
        if self.exitcode is not None:
            return  # reaped: the pid (and its group id) may belong to someone else now
        try:
            os.killpg(self.pid, signum)
            return
        except (ProcessLookupError, PermissionError):
            pass  # not (yet) a group leader
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def kill_and_reap(self) -> None:
        """SIGKILL the worker's group and return once the worker itself has ended."""
        self.signal_group(signal.SIGKILL)
        while self.poll() is None:
            time.sleep(0.01)

    def kill_leftovers(self) -> None:
        """SIGKILL whatever the worker started that still lives in its group (before reaping it)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except OSError as exc:
            if exc.errno not in (errno.ESRCH, errno.EPERM):
                raise

    def close(self) -> None:
        """Release the sentinel fd and the multiprocessing/subprocess objects."""
        if (
            self._mp is None and self.sentinel is not None
        ):  # the pidfd is ours; multiprocessing closes its own
            os.close(self.sentinel)
        self.sentinel = None
        if self._mp is not None:
            self._mp.join(timeout=1)
            self._mp.close()
            self._mp = None
        if self._popen is not None:
            self._popen.wait(timeout=1)
            self._popen = None


class _ForkThread:
    """One long-lived thread per process that does every ``os.fork()`` of the launcher.

    GNU OpenMP (torch's intra-op pool) keeps its pool in the state of the thread that first ran a
    parallel region; a child forked from that thread inherits a pool whose threads do not exist, and
    its first parallel op on more than one thread waits forever (a kernel that had trained before
    launching hung every rank given two threads or more). The child's only thread is a copy of the
    forking one, so forking from a thread that never runs OpenMP gives each child a pool of its own;
    CPython makes that thread the child's main thread (signals, KeyboardInterrupt). The thread lives
    as long as the process: a worker relying on ``PR_SET_PDEATHSIG`` (kernels without pidfd) would be
    killed when the thread that forked it exits.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._owner: int | None = None

    def fork(self, child: Callable[[], None]) -> int:
        """Fork; the child runs ``child()`` (which must not return), the parent gets the pid."""
        with self._lock:
            self._ensure_started()
            answer: queue.SimpleQueue = queue.SimpleQueue()
            self._requests.put((child, answer))
            try:
                got = answer.get()
            except BaseException:  # ^C while forking: the child exists; take it down before raising
                got = answer.get()
                if isinstance(got, int):
                    orphan = LocalProcess(got)
                    orphan.kill_and_reap()
                    orphan.close()
                raise
        if isinstance(got, BaseException):
            raise got
        return got

    def _ensure_started(self) -> None:
        if self._owner != os.getpid():  # first use, or in a forked child: a thread of its own
            self._requests = queue.SimpleQueue()
            threading.Thread(target=self._serve, name="notebook_accel-fork", daemon=True).start()
            self._owner = os.getpid()

    def start(self) -> None:
        """Start the thread now (it lives as long as the process)."""
        with self._lock:
            self._ensure_started()

    def _serve(self) -> None:
        requests = self._requests
        while True:
            child, answer = requests.get()
            try:
                pid = _fork_without_thread_warning()
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                answer.put(exc)
                continue
            if pid == 0:
                threading.current_thread().name = "MainThread"
                # The caller held the lock while waiting for this fork: the child's copy stays held
                # for good, and a launch from the child (a worker forking in turn) would wait forever.
                self._lock = threading.Lock()
                try:
                    child()
                finally:
                    os._exit(1)
            answer.put(pid)


_FORKER = _ForkThread()

# Python 3.12+ warns on os.fork() in a process with more than one thread. Forking from a thread is what
# _ForkThread is for (see its docstring), so that one warning, at that one call, says nothing the user
# can act on. It is silenced by a filter that matches only it (category, message, and this module,
# which the warning is attributed to) and that exists only around the fork: a filter installed once
# at import would be shadowed by the filters pytest or a user inserts in front of it later, and
# warnings.catch_warnings() swaps the process-wide filter list, so on exit it would drop a filter
# another thread added meanwhile. Inserting then removing this one entry changes nothing else, and
# while it is there it can match no other warning (no other code forks from this module).
_FORK_WARNING = r"This process \(pid=\d+\) is multi-threaded, use of fork\(\) may lead to deadlocks"
_FORK_MODULE = re.escape(__name__) + r"\Z"
_FORK_FILTER = ("ignore", re.compile(_FORK_WARNING, re.I), DeprecationWarning, re.compile(_FORK_MODULE), 0)


def _fork_without_thread_warning() -> int:
    """Return ``os.fork()``'s result, without Python's multi-threaded-fork ``DeprecationWarning``."""
    added = _FORK_FILTER not in warnings.filters  # the same entry already there: leave it alone
    if added:
        warnings.filterwarnings("ignore", _FORK_WARNING, DeprecationWarning, _FORK_MODULE)
    try:
        return os.fork()
    finally:  # in the parent and in the child, which inherits the entry
        if added:
            try:
                warnings.filters.remove(_FORK_FILTER)
            except ValueError:  # another thread's catch_warnings() exited meanwhile: already gone
                pass


def _fork(spec: WorkerSpec, out_w: int, err_w: int, res_w: int) -> LocalProcess:
    pid = _FORKER.fork(lambda: worker_main(spec, out_w, err_w, res_w))
    try:
        os.setpgid(pid, pid)  # also done by the child: whichever runs first wins, no race on kill
    except OSError:
        pass
    return LocalProcess(pid)


def by_value(spec: WorkerSpec) -> WorkerSpec:
    """Return ``spec`` with the function and its arguments cloudpickled (a fresh interpreter runs them).

    A spec that already travelled by value (a node's agent starting a rank the kernel pickled) is kept.
    """
    if spec.payload is not None:
        return replace(spec, close_fds=())
    payload = dumps_by_value(
        (spec.function, spec.args),
        what=f"the function {getattr(spec.function, '__qualname__', spec.function)!r} and its arguments",
        to=f"rank {spec.rank}, a fresh interpreter",
        fix="pass arguments that pickle (tensors, numbers, lists, dicts), or build the objects in the function",
    )
    return replace(spec, function=None, args=(), payload=payload, close_fds=())


def _spawn(spec: WorkerSpec, out_w: int, err_w: int, res_w: int) -> WorkerProcess:
    spec = by_value(spec)
    header = pickle.dumps((list(sys.path), os.getcwd(), res_w, spec))
    popen = subprocess.Popen(
        [sys.executable, "-c", "from notebook_accel.launch.procs import _spawned_main; _spawned_main()"],
        stdin=subprocess.PIPE,
        stdout=out_w,
        stderr=err_w,
        pass_fds=(res_w,),
        start_new_session=True,  # own process group (pgid == pid) for killpg; process_group= is 3.11+
    )
    try:
        popen.stdin.write(header)
        popen.stdin.close()
    except BrokenPipeError:
        pass  # the interpreter died at start; its stderr and exit code tell why
    return LocalProcess(popen.pid, popen=popen)


def _spawned_main() -> None:
    """Entry point of a spawned worker: read the spec from stdin, then run like a forked one."""
    path, cwd, res_w, spec = pickle.loads(sys.stdin.buffer.read())
    sys.path[:] = path
    os.chdir(cwd)
    worker_main(spec, os.dup(1), os.dup(2), res_w)


def _forkserver_entry(spec: WorkerSpec, out_c, err_c, res_c) -> None:
    fds = []
    for conn in (out_c, err_c, res_c):
        fds.append(os.dup(conn.fileno()))
        conn.close()
    worker_main(spec, *fds)


def _forkserver(spec: WorkerSpec, out_w: int, err_w: int, res_w: int) -> WorkerProcess:
    import multiprocessing as mp
    from multiprocessing.connection import Connection

    ctx = mp.get_context("forkserver")
    spec = by_value(spec)
    conns = [Connection(os.dup(fd), readable=False) for fd in (out_w, err_w, res_w)]
    proc = ctx.Process(target=_forkserver_entry, args=(spec, *conns), daemon=False)
    try:
        proc.start()
    finally:
        for conn in conns:
            conn.close()
    return LocalProcess(proc.pid, mp_process=proc)


def start_worker(method: str, spec: WorkerSpec, out_w: int, err_w: int, res_w: int) -> LocalProcess:
    """Return the started worker for ``spec`` (``method``: fork, spawn or forkserver)."""
    starter = {"fork": _fork, "spawn": _spawn, "forkserver": _forkserver}[method]
    try:
        return starter(spec, out_w, err_w, res_w)
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.ENOMEM):
            raise
        world = spec.env.get("WORLD_SIZE", "?")
        # The same exception type and errno, so code that handles BlockingIOError or ENOMEM still does.
        raise type(exc)(
            exc.errno,
            f"could not start rank {spec.rank} of {world} ({method}: {exc.strerror}): this machine's limit on "
            "processes (ulimit -u, or a container's pids limit) or its free memory is used up. Launch fewer "
            "processes, free memory, or raise the limit (ulimit -u)",
        ) from exc


class LocalProcesses(WorkerBackend):
    """The backend of ranks on this machine: ``start_worker`` for each, stacks files, /proc usage."""

    def start(self, method: str, starts: Sequence[WorkerStart]) -> list[WorkerProcess]:
        """Return the started local workers of ``starts`` (all or none)."""
        return start_each(_start_local, method, starts)

    def stack_source(self) -> StackCollector:
        """Return a stacks-files collector (a temporary directory of its own)."""
        return StackCollector()

    def usage_source(self) -> UsageSampler:
        """Return a /proc sampler of the workers' CPU and memory."""
        return UsageSampler()

    def close(self) -> None:
        """Nothing to release: each worker is closed by its supervisor."""


def _start_local(method: str, start: WorkerStart) -> WorkerProcess:
    return start_worker(method, start.spec, start.stdout, start.stderr, start.result)
