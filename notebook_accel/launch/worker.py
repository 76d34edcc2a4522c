"""The child side of a launch: wire the process up, run the function, send back what happened.

Runs first thing in every worker (forked or spawned). It puts the worker in its own process group
(so stopping it also stops what it started), points file descriptors 1 and 2 at the parent's pipes
(so C-level writes and subprocesses are captured too), sets the torchrun environment, forgets any
state singletons inherited from the parent, then calls the function. The result pipe carries framed messages
(``utils._worker_channel``): events while the function runs (progress bars, metrics, device
memory), then the result: ``("ok", value)`` or ``("err", type, message, traceback)``.
"""

from __future__ import annotations

import faulthandler
import io
import logging
import os
import pickle
import select
import signal
import socket
import stat
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._alias import reinstall_from_env
from ..utils._worker_channel import close_channel, open_channel, send_event
from .progress import install_bar_events
from .stackdump import start_answering
from .usage import final_usage, start_device_reporter

__all__ = ["WorkerSpec", "threads_per_worker", "to_cpu", "worker_main"]

logger = logging.getLogger(__name__)


def threads_per_worker(num_processes: int, omp_num_threads: str | None = None) -> int:
    """Return the torch threads each of ``num_processes`` workers gets.

    ``OMP_NUM_THREADS`` wins when set; it may be a list of nesting levels (``"4,2"``, valid OpenMP),
    of which the outer level counts. A value that is not a positive integer (list) is ignored with a
    warning, and the cores are shared out as when it is unset.
    """
    if omp_num_threads is None:
        omp_num_threads = os.environ.get("OMP_NUM_THREADS")
    if omp_num_threads:
        outer = omp_num_threads.split(",")[0].strip()
        if outer.isdigit() and int(outer) > 0:
            return int(outer)
        logger.warning(
            "OMP_NUM_THREADS=%r is not a positive integer (or list of them, e.g. '4,2'); ignored, each worker "
            "gets its share of the CPU cores",
            omp_num_threads,
        )
    return max(1, (os.cpu_count() or 1) // num_processes)


@dataclass
class WorkerSpec:
    """What one worker needs; pickled (by value for the function) under spawn/forkserver."""

    rank: int
    local_rank: int
    env: dict[str, str]
    num_threads: int
    backend: str
    dry_run_port: int | None
    function: Callable | None = None
    args: tuple = ()
    payload: bytes | None = None
    """``cloudpickle.dumps((function, args))`` when the worker does not share memory with the parent."""
    close_fds: tuple[int, ...] = ()
    """Parent-side descriptors a forked child inherited and must close (other ranks' pipes)."""
    parent_pid: int | None = None
    """The launching process: the worker dies with it (Linux), so a killed kernel leaves no orphans."""
    bar_events: bool = False
    """tqdm bars send their state as events (shown live by the launcher) instead of drawing text."""
    stacks_path: str | None = None
    """File (appended to) where the worker writes every thread's stack when asked (``stackdump``)."""
    store_ports: tuple[int, ...] = ()
    """Ports of the launcher's rendezvous stores: a forked worker closes the sockets it inherited on them."""


def to_cpu(value: Any) -> Any:
    """Return ``value`` with every tensor inside (lists, tuples, dicts, namedtuples) moved to the CPU."""
    torch = sys.modules.get("torch")
    if torch is None:
        return value  # no tensor without torch (and the launcher's own import stays torch-free)
    return _moved(value, torch.Tensor)


def _moved(value: Any, tensor_type: type) -> Any:
    if isinstance(value, tensor_type):
        return value.detach().cpu()
    if isinstance(value, dict):
        return type(value)((k, _moved(v, tensor_type)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_moved(v, tensor_type) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_moved(v, tensor_type) for v in value)
    return value


# The streams a forked worker inherited, kept referenced until it exits (see _redirect).
_INHERITED_STREAMS: list = []


def _redirect(out_fd: int, err_fd: int) -> None:
    # The inherited streams are neither flushed nor finalized here: text the launching process had
    # buffered (a script's stdout redirected to a file is block-buffered) is its own to write, and a
    # worker writing it printed it once more per rank. A flush could also block for good on a
    # stream lock that another thread of the launcher held at the fork.
    _INHERITED_STREAMS.extend((sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__))
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    sys.stdout = sys.__stdout__ = _text_stream(1)
    sys.stderr = sys.__stderr__ = _text_stream(2)


def _text_stream(fd: int) -> io.TextIOWrapper:
    """Return a line-buffered text stream over ``fd``: each print() reaches the parent at once, whole.

    The BufferedWriter between the text layer and the raw file is what keeps every byte: a write
    to a full pipe that a signal interrupts (a stop's SIGINT, a signal the function handles) returns
    having written only part, and a TextIOWrapper straight over the raw file drops the rest without
    a word; BufferedWriter writes again until all of it is out.
    """
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(
        io.BufferedWriter(raw), encoding="utf-8", errors="backslashreplace", line_buffering=True
    )


def _die_with_parent(parent_pid: int) -> None:
    """Make this process (and its group) end when the launching process ends, not when its thread does.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked us exits (a launch started from an
    executor thread would be killed with it), so a daemon thread waits on a pidfd of the launching
    process instead: it becomes readable only when the whole process is gone. Kernels without
    pidfd_open (< 5.3) fall back to PR_SET_PDEATHSIG.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        pidfd = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is None:
        _pdeathsig()
    if os.getppid() != parent_pid and (pidfd is None or select.select([pidfd], [], [], 0)[0]):
        os._exit(1)  # the launcher died before we could watch it
    if pidfd is None:
        return

    def watch() -> None:
        select.select([pidfd], [], [])
        os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, name="notebook_accel-parent-watch", daemon=True).start()


def _pdeathsig() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return


def _close_store_sockets(ports: tuple[int, ...]) -> None:
    """Close the inherited sockets of the launcher's rendezvous stores (listening and accepted ones)."""
    if not ports:
        return
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        fd = int(name)
        try:
            if fd < 3 or not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            local = probe.getsockname()
            mine = isinstance(local, tuple) and local[1] in ports
        except OSError:
            mine = False
        finally:
            probe.close()
        if mine:
            os.close(fd)


def _install_fault_reports(stacks_path: str | None) -> None:
    """Print the Python stacks on a fatal signal (segfault, abort); answer stack requests into the stacks file.

    The answers come from a thread of their own (``stackdump``), so a rank blocked inside a C call
    that released the interpreter lock (a gloo collective) still answers, and nothing stops.
    """
    faulthandler.enable(file=sys.stderr, all_threads=True)
    if stacks_path is not None:
        start_answering(stacks_path)


def _reset_state() -> None:
    """Forget notebook_accel singletons inherited from the parent (contract: state.py's _reset_state)."""
    state = sys.modules.get("notebook_accel.state")
    if state is None:
        return  # never imported, nothing inherited
    state.AcceleratorState._reset_state(reset_partial_state=True)
    state.GradientState._reset_state()


def _dry_run(spec: WorkerSpec) -> None:
    """Check that every rank can join a process group (ACCELERATE_DEBUG_MODE), then leave it."""
    import torch.distributed as dist

    env = spec.env
    addr = env["MASTER_ADDR"]
    try:
        dist.init_process_group(
            spec.backend,
            init_method=f"tcp://{addr}:{spec.dry_run_port}",
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
        )
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:
        raise RuntimeError(
            f"debug dry run: rank {env['RANK']} could not join a {spec.backend} process group of "
            f"{env['WORLD_SIZE']} on {addr}:{spec.dry_run_port}: {exc}"
        ) from exc


def _exc_type_name(exc: BaseException) -> str:
    cls = type(exc)
    return (
        cls.__qualname__
        if cls.__module__ in ("builtins", "__main__")
        else f"{cls.__module__}.{cls.__qualname__}"
    )


def _format_tb(exc: BaseException) -> str:
    """Return the traceback of ``exc`` without this module's own frame on top."""
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is worker_main.__code__ and tb.tb_next is not None:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _call(function: Callable, args: tuple) -> Any:
    """Return ``function(*args)`` on the CPU; a clean ``sys.exit(0)`` (or ``sys.exit()``) returns None."""
    try:
        return to_cpu(function(*args))
    except SystemExit as exc:
        if exc.code in (0, None):
            return None
        raise


def _prepare_process(spec: WorkerSpec, out_fd: int, err_fd: int, result_fd: int) -> None:
    """Make this process a rank's: its own process group, tied to its parent, the launcher's other
    descriptors closed, plain signal handlers, output to the rank's pipes, fault reports, the rank's
    environment and its result channel."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass  # already a group leader (the parent may have done it first)
    if spec.parent_pid is not None:
        _die_with_parent(spec.parent_pid)
    for fd in spec.close_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    _close_store_sockets(spec.store_ports)
    # A kernel installs its own SIGINT handler; a worker wants the plain KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _redirect(out_fd, err_fd)
    _install_fault_reports(spec.stacks_path)
    os.environ.update(spec.env)
    open_channel(result_fd)


def _hold_interrupts() -> None:
    """Ignore SIGINT from now on: the function has ended, and its result (or error) must reach the launcher.

    A stop sends SIGINT to every rank at once; a rank inside a C call (a gloo collective) sees it only
    when the call returns, often with the error of a peer that already stopped. Raised then, inside
    the code that sends the result, it would end the rank with code 1 and no word of why (a pending
    signal meets the handler installed when Python looks, so ignoring it here drops it).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def worker_main(spec: WorkerSpec, out_fd: int, err_fd: int, result_fd: int) -> None:
    """Run one rank and exit the process (never returns)."""
    code = 1
    try:
        _prepare_process(spec, out_fd, err_fd, result_fd)
        started, cpu_started = time.monotonic(), sum(os.times()[:2])
        stop_reporter = start_device_reporter()
        if spec.bar_events:
            install_bar_events()
        message: tuple
        try:
            # Before unpickling: a spawned worker's function may refer to `accelerate` modules.
            reinstall_from_env()
            function, args = (
                (spec.function, spec.args) if spec.payload is None else pickle.loads(spec.payload)
            )
            import torch

            torch.set_num_threads(spec.num_threads)
            _reset_state()
            if spec.dry_run_port is not None:
                _dry_run(spec)
            value = _call(function, args)
            try:
                data = pickle.dumps(("ok", value), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                raise TypeError(
                    f"rank {spec.rank} returned a {type(value).__name__} that cannot be pickled back to the "
                    f"caller ({exc}); return plain data or tensors"
                ) from exc
            code = 0
            _hold_interrupts()
        except KeyboardInterrupt:
            _hold_interrupts()
            message = ("stopped", "KeyboardInterrupt", "stopped by SIGINT", traceback.format_exc())
            data = pickle.dumps(message)
            code = 130
        except BaseException as exc:  # SystemExit too: the parent reports it with its code
            _hold_interrupts()
            message = ("err", _exc_type_name(exc), str(exc), _format_tb(exc))
            data = pickle.dumps(message)
            code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) and exc.code else 1
        stop_reporter.set()
        try:
            send_event("usage", final_usage(started, cpu_started))
        except Exception:  # figures are a nicety; the result must get through
            pass
        close_channel(data)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        # Skip atexit handlers and non-daemon threads inherited from the kernel: they belong to it.
        os._exit(code)
