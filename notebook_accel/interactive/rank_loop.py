"""The rank side of an interactive group: a loop running the kernel's commands in the rank's namespace.

``rank_entry.rank_main`` (the function the launcher runs in each worker) connects to the kernel's
socket and hands it to ``RankLoop.serve``: it forms the process group (``PartialState()``, so the
first collective is fast and later ``Accelerator()`` / ``torch.distributed`` calls use it), sends
``Ready``, then runs commands (``Exec``, ``Call``, ``Push``, ``Pull``) until the kernel closes the
connection, replying ``Ok``, ``Err`` or ``Interrupted``; a ``display()`` while a command runs goes
to its cell as ``Display``. The messages and their framing are ``protocol.py``'s, the one module
this loop shares with the kernel side.

SIGINT raises KeyboardInterrupt only while a command's own code runs: one arriving while the rank
waits for work (or sends a reply) is ignored, so the Stop button never ends the loop itself.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import threading
import traceback
from typing import Any

from ..state import PartialState
from .cells import in_namespace, remember_source, split_code
from .protocol import (
    Call,
    Command,
    Display,
    Err,
    Exec,
    Interrupted,
    Ok,
    Pull,
    Push,
    Ready,
    Reply,
    encode,
    wait_for_command,
)
from .rank_shell import forward_display, rank_shell, refuse_input, run_maybe_async, show_figures
from .stale import fingerprint, stale_names
from .values import value_payload

__all__ = ["RankLoop", "type_name"]


def type_name(exc: BaseException) -> str:
    """Return the exception type's name, qualified unless it is a builtin or defined in ``__main__``."""
    cls = type(exc)
    if cls.__module__ in ("builtins", "__main__"):
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


class _Interrupted(Exception):
    pass


class RankLoop:
    """One rank's end of the group: its namespace, and the commands it runs in it."""

    def __init__(self, sock: socket.socket, rank: int, world_size: int) -> None:
        self.sock = sock
        self.rank = rank
        self.busy = False
        main = sys.modules.get("__main__")
        # The rank's own __main__ (forked: a copy of the kernel's, with its imports, functions and
        # variables): functions defined before the fork see the names later commands define.
        self.namespace: dict[str, Any] = main.__dict__ if main is not None else {}
        self.namespace["rank"] = rank
        self.namespace["world_size"] = world_size
        self.seq: int | None = None
        """The command running now (a ``display()`` bundle goes with it)."""
        self._send_lock = threading.Lock()  # a display() from another thread must not split a reply
        # What the kernel gave this rank, by name: the object the rank got and the kernel's fingerprint
        # of it (the fork copied every name; push and functions' globals give more later).
        self.given: dict[str, tuple[int, Any, str]] = {
            name: (id(value), fingerprint(value), "fork")
            for name, value in self.namespace.items()
            if not name.startswith("__")
        }

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.busy:
            raise KeyboardInterrupt

    def serve(self) -> None:
        """Form the group, send Ready, then run commands until the kernel closes the connection.

        A message the protocol does not allow here raises ProtocolError: the rank ends, and the
        kernel reports it with the rank's output (a command is never dropped in silence).
        """
        signal.signal(signal.SIGINT, self._on_sigint)
        refuse_input()
        forward_display(self._send_display)
        problem = _init_group()
        if problem is None:
            self.namespace["device"] = _own_device()
        self._send(Ready(rank=self.rank, pid=os.getpid(), problem=problem))
        while True:
            command = wait_for_command(self.sock)
            if command is None:
                return
            self.seq = command.seq
            try:
                reply = self._handle(command)
            finally:
                self.seq = None
            _flush_streams()  # every line of this command reaches the kernel first
            self._send(reply)

    def _send(self, message: Ready | Reply) -> None:
        try:
            frame = encode(message)
        except Exception as exc:  # a payload made of plain parts always pickles: this is a bug of ours
            if isinstance(message, Ready):
                raise
            why = f"reply could not be pickled: {exc}"
            frame = encode(Err(seq=message.seq, exc_type="TypeError", message=why, traceback=""))
        with self._send_lock:
            self.sock.sendall(frame)

    def _send_display(self, data: dict, metadata: dict) -> bool:
        """Send a ``display()`` bundle to the running command's cell; return False when none runs."""
        seq = self.seq
        if seq is None:
            return False
        try:
            frame = encode(Display(seq=seq, data=data, metadata=metadata))
        except Exception:
            return False  # not plain data: shown as its text instead
        _flush_streams()  # the lines printed before the display() come before it in the cell
        with self._send_lock:
            self.sock.sendall(frame)
        return True

    def _handle(self, command: Command) -> Reply:
        run = {Exec: self._exec, Call: self._call, Push: self._push, Pull: self._pull}[type(command)]
        try:
            payload = run(command)
        except _Interrupted as exc:
            return Interrupted(seq=command.seq, traceback=str(exc))
        except BaseException as exc:  # SystemExit too: a command never ends the rank
            return Err(
                seq=command.seq, exc_type=type_name(exc), message=str(exc), traceback=_user_traceback(exc)
            )
        return Ok(seq=command.seq, payload=payload)

    def _guarded(self, run: Any) -> Any:
        """Return ``run()``, with SIGINT raising KeyboardInterrupt while it runs."""
        self.busy = True
        try:
            return run()
        except KeyboardInterrupt as exc:
            self.busy = False
            raise _Interrupted(_user_traceback(exc)) from None
        finally:
            self.busy = False

    def _exec(self, command: Exec) -> dict[str, Any]:
        """Run a cell; return its last value's payload."""
        python = command.python if command.python is not None else command.source
        body, last = split_code(python, command.filename)
        remember_source(command.source, command.filename)  # tracebacks show the cell as written
        if command.ipython:
            rank_shell(self.namespace)
        ns = self.namespace

        def run() -> Any:
            run_maybe_async(body, ns)
            return run_maybe_async(last, ns) if last is not None else None

        value = self._guarded(run)
        show_figures()  # plt.plot(...) in a cell shows its figure, as in Jupyter
        if value is not None:
            ns["_"] = value  # as IPython's Out: a value that stayed here is pulled by this name
        return value_payload(value, limit=command.limit, compare=command.compare)

    def _call(self, command: Call) -> dict[str, Any]:
        function, args, kwargs = pickle.loads(command.blob)
        check = command.check
        # Before the function brings new names.
        stale = stale_names(self.namespace, self.given, check, command.forked)

        def installed(name: str, value: Any) -> None:
            self.given[name] = (id(value), check.get(name), "call")

        function = in_namespace(function, self.namespace, installed)
        value = self._guarded(lambda: function(*args, **kwargs))
        payload = value_payload(value)
        payload["stale"] = stale
        return payload

    def _push(self, command: Push) -> dict[str, Any]:
        values = pickle.loads(command.blob)
        self.namespace.update(values)
        for name, value in values.items():
            self.given[name] = (id(value), command.tokens.get(name), "push")
        return {}

    def _pull(self, command: Pull) -> dict[str, Any]:
        if command.name not in self.namespace:
            raise NameError(f"name {command.name!r} is not defined on rank {self.rank}")
        return value_payload(self.namespace[command.name], with_repr=False)


def _user_traceback(exc: BaseException) -> str:
    """Return the traceback of ``exc`` from the user's first frame on (this module's frames left out)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _init_group() -> str | None:
    """Form the process group now (``PartialState()``); return what went wrong, or None."""
    try:
        PartialState()
    except Exception as exc:
        return f"{type_name(exc)}: {exc}\n{traceback.format_exc()}"
    return None


def _own_device() -> Any:
    """Return the rank's device (``PartialState().device``), made CUDA's current device on a GPU rank."""
    device = PartialState().device
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)  # bare .cuda() and new CUDA tensors land on the rank's own GPU
    return device
