"""The child side of a launch: wire the process up, run the function, send back what happened.

Runs first thing in every worker (forked or spawned). It puts the worker in its own process group
(so stopping it also stops what it started), points file descriptors 1 and 2 at the parent's pipes
(so C-level writes and subprocesses are captured too), sets the torchrun environment, forgets any
state singletons inherited from the parent, then calls the function. The result pipe carries framed messages
(``utils._worker_channel``): events while the function runs (progress bars, metrics, device
memory), then the result: ``("ok", value)`` or ``("err", type, message, traceback)``.
"""

from __future__ import annotations

import io
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..utils._accelerate_alias import reinstall_from_env
from ..utils._worker_channel import close_channel, open_channel, send_event
from .progress import install_bar_events
from .usage import final_usage, start_device_reporter

__all__ = ["WorkerSpec", "to_cpu", "worker_main"]


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


def to_cpu(value: Any) -> Any:
    """Return ``value`` with every tensor inside (lists, tuples, dicts) moved to the CPU."""
    if "torch" not in sys.modules:
        return value  # no tensor without torch (and the launcher's own import stays torch-free)
    from ..utils._ops_structure import recursively_apply

    return recursively_apply(lambda tensor: tensor.detach().cpu(), value)


def _redirect(out_fd: int, err_fd: int) -> None:
    sys.stdout.flush() if sys.stdout else None
    sys.stderr.flush() if sys.stderr else None
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    # Line-buffered text streams over the new fds: each print() reaches the parent at once.
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
    )


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent goes away (PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


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


def worker_main(spec: WorkerSpec, out_fd: int, err_fd: int, result_fd: int) -> None:
    """Run one rank and exit the process (never returns)."""
    code = 1
    try:
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
        # A kernel installs its own SIGINT handler; a worker wants the plain KeyboardInterrupt.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _redirect(out_fd, err_fd)
        os.environ.update(spec.env)
        open_channel(result_fd)
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
            value = to_cpu(function(*args))
            try:
                data = pickle.dumps(("ok", value), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                raise TypeError(
                    f"rank {spec.rank} returned a {type(value).__name__} that cannot be pickled back to the "
                    f"caller ({exc}); return plain data or tensors"
                ) from exc
            code = 0
        except KeyboardInterrupt:
            message = ("stopped", "KeyboardInterrupt", "stopped by SIGINT", traceback.format_exc())
            data = pickle.dumps(message)
            code = 130
        except BaseException as exc:  # SystemExit too: the parent reports it with its code
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
