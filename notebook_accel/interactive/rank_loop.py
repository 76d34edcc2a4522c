"""The rank side of an interactive group: a loop running the kernel's commands in the rank's namespace.

``rank_main`` is the function a ``LaunchHandle`` runs in each worker: it connects to the kernel's
socket, forms the process group (``PartialState()``, so the first collective is fast and later
``Accelerator()`` / ``torch.distributed`` calls use it), says it is ready, then serves commands
until the kernel closes the connection. Messages both ways are length-prefixed pickles.

Commands: ``("exec", seq, source, filename[, options])``, ``("call", seq, blob[, check, forked])``,
``("push", seq, blob[, tokens])``, ``("pull", seq, name)``. Replies: ``("ok", seq, payload)``, ``("err",
seq, type, message, traceback)`` or ``("interrupted", seq, traceback)``; while a command runs, a rank may
also send ``("display", seq, data, metadata)``: a ``display()`` bundle for the running cell.

SIGINT raises KeyboardInterrupt only while a command's own code runs: one arriving while the rank
waits for work (or sends a reply) is ignored, so the Stop button never ends the loop itself.
"""

from __future__ import annotations

import ast
import linecache
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
import types
from collections.abc import Callable
from typing import Any

from ..state import PartialState
from ..utils._worker_channel import FRAME_HEADER
from .gpus import use_gpus
from .rank_shell import forward_display, rank_shell, refuse_input, run_maybe_async, show_figures
from .remote import connect_rank
from .stale import fingerprint, stale_names
from .values import value_payload

__all__ = ["rank_main", "recv_frame", "send_frame", "split_code"]

_PROTOCOL = pickle.HIGHEST_PROTOCOL


def send_frame(sock: socket.socket, body: bytes) -> None:
    """Send one framed message (``body`` already pickled)."""
    sock.sendall(FRAME_HEADER.pack(len(body)) + body)


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, missing = [], size
    while missing:
        chunk = sock.recv(min(missing, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> Any:
    """Return the next message, or None once the peer closed the connection."""
    header = _recv_exactly(sock, FRAME_HEADER.size)
    if header is None:
        return None
    (length,) = FRAME_HEADER.unpack(header)
    body = _recv_exactly(sock, length)
    return None if body is None else pickle.loads(body)


def split_code(source: str, filename: str) -> tuple[types.CodeType, types.CodeType | None]:
    """Return ``(statements, last expression or None)`` compiled from ``source`` (SyntaxError if it has one).

    As in IPython, a cell whose last statement is an expression gives that expression's value; top-level
    ``await`` is allowed (such code evaluates to a coroutine: ``rank_shell.run_maybe_async`` runs it).
    """
    tree = ast.parse(source, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    body = compile(tree, filename, "exec", flags=flags)
    return body, (compile(last, filename, "eval", flags=flags) if last is not None else None)


def remember_source(source: str, filename: str) -> None:
    """Register ``source`` in linecache, so tracebacks and stacks show its lines."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)


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
        """Form the group, say ready, then run commands until the kernel closes the connection."""
        signal.signal(signal.SIGINT, self._on_sigint)
        refuse_input()
        forward_display(self._send_display)
        problem = _init_group()
        if problem is None:
            self.namespace["device"] = _own_device()
        self._send(("ready", self.rank, os.getpid(), problem))
        while True:
            message = recv_frame(self.sock)
            if message is None or message[0] == "stop":
                return
            self.seq = message[1]
            try:
                reply = self._handle(message)
            finally:
                self.seq = None
            _flush_streams()  # every line of this command reaches the kernel first
            self._send(reply)

    def _send(self, reply: tuple) -> None:
        try:
            body = pickle.dumps(reply, protocol=_PROTOCOL)
        except Exception as exc:  # a payload made of plain parts always pickles: this is a bug of ours
            body = pickle.dumps(("err", reply[1], "TypeError", f"reply could not be pickled: {exc}", ""))
        with self._send_lock:
            send_frame(self.sock, body)

    def _send_display(self, data: dict, metadata: dict) -> bool:
        """Send a ``display()`` bundle to the running command's cell; return False when none runs."""
        seq = self.seq
        if seq is None:
            return False
        try:
            body = pickle.dumps(("display", seq, data, metadata), protocol=_PROTOCOL)
        except Exception:
            return False  # not plain data: shown as its text instead
        _flush_streams()  # the lines printed before the display() come before it in the cell
        with self._send_lock:
            send_frame(self.sock, body)
        return True

    def _handle(self, message: tuple) -> tuple:
        kind, seq = message[0], message[1]
        try:
            if kind == "exec":
                payload = self._exec(message[2], message[3], *message[4:])
            elif kind == "call":
                payload = self._call(message[2], *message[3:])
            elif kind == "push":
                payload = self._push(message[2], *message[3:])
            elif kind == "pull":
                payload = self._pull(message[2])
            else:
                raise ValueError(f"unknown command {kind!r}")
        except _Interrupted as exc:
            return ("interrupted", seq, str(exc))
        except BaseException as exc:  # SystemExit too: a command never ends the rank
            return ("err", seq, type_name(exc), str(exc), _user_traceback(exc))
        return ("ok", seq, payload)

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

    def _exec(self, source: str, filename: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run a cell; return its last value's payload (``options``: ``limit``, ``compare``, ``ipython``)."""
        options = options or {}
        python = options.get("python", source)  # the cell as IPython transformed it, if it did
        body, last = split_code(python, filename)
        remember_source(source, filename)  # tracebacks show the cell as written
        if options.get("ipython"):
            rank_shell(self.namespace)
        ns = self.namespace

        def run() -> Any:
            run_maybe_async(body, ns)
            return run_maybe_async(last, ns) if last is not None else None

        value = self._guarded(run)
        show_figures()  # plt.plot(...) in a cell shows its figure, as in Jupyter
        if value is not None:
            ns["_"] = value  # as IPython's Out: a value that stayed here is pulled by this name
        return value_payload(value, limit=options.get("limit"), compare=options.get("compare", False))

    def _call(self, blob: bytes, check: dict[str, Any] | None = None, forked: bool = False) -> dict[str, Any]:
        function, args, kwargs = pickle.loads(blob)
        check = check or {}
        stale = stale_names(self.namespace, self.given, check, forked)  # before the function brings new names

        def installed(name: str, value: Any) -> None:
            self.given[name] = (id(value), check.get(name), "call")

        function = _in_namespace(function, self.namespace, installed)
        value = self._guarded(lambda: function(*args, **kwargs))
        payload = value_payload(value)
        payload["stale"] = stale
        return payload

    def _push(self, blob: bytes, tokens: dict[str, Any] | None = None) -> dict[str, Any]:
        values = pickle.loads(blob)
        self.namespace.update(values)
        for name, value in values.items():
            self.given[name] = (id(value), (tokens or {}).get(name), "push")
        return {}

    def _pull(self, name: str) -> dict[str, Any]:
        if name not in self.namespace:
            raise NameError(f"name {name!r} is not defined on rank {self.rank}")
        return value_payload(self.namespace[name], with_repr=False)


def _user_traceback(exc: BaseException) -> str:
    """Return the traceback of ``exc`` from the user's first frame on (this module's frames left out)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def is_cell_function(value: Any) -> bool:
    """Return True for a plain function defined in ``__main__`` (a notebook cell, a script)."""
    return isinstance(value, types.FunctionType) and value.__module__ == "__main__"


def without_globals(function: Any, known: frozenset[str]) -> Any:
    """Return a copy of a cell function whose globals leave out the names in ``known`` (the ranks have them).

    Pickled by value, a function brings the globals it uses; those the ranks got at the fork need
    not travel (they may be big, or not picklable at all): the ranks look them up at home.
    """
    if not is_cell_function(function) or not known:
        return function
    kept = {
        name: value
        for name, value in function.__globals__.items()
        if name not in known or name.startswith("__")
    }
    copy = types.FunctionType(
        function.__code__, kept, function.__name__, function.__defaults__, function.__closure__
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    copy.__doc__ = function.__doc__
    copy.__module__ = "__main__"
    return copy


def _in_namespace(
    function: Any, namespace: dict[str, Any], installed: Callable[[str, Any], None] | None = None
) -> Any:
    """Return ``function`` looking its global names up in the rank's namespace (as code run there does).

    A function from the kernel's ``__main__`` arrives with the kernel's values of the globals it
    uses (those the ranks did not get at the fork); names the rank lacks are taken from those,
    names the rank has keep the rank's values. Functions among them are rebound the same way;
    ``installed(name, value)`` hears of each name taken from the function.
    """
    if not is_cell_function(function):
        return function
    for name, value in list(function.__globals__.items()):
        if name.startswith("__") or name in namespace:
            continue
        namespace[name] = value  # first: a function referring back to this one finds it
        namespace[name] = _in_namespace(value, namespace, installed)
        if installed is not None:
            installed(name, namespace[name])
    rebound = types.FunctionType(
        function.__code__, namespace, function.__name__, function.__defaults__, function.__closure__
    )
    rebound.__kwdefaults__ = function.__kwdefaults__
    rebound.__qualname__ = function.__qualname__
    rebound.__doc__ = function.__doc__
    return rebound


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


def _close_inherited(listener_fd: int | None, address: str) -> None:
    """Close the kernel's listening socket, inherited through fork (a spawned rank has none)."""
    if listener_fd is None:
        return
    try:
        probe = socket.socket(fileno=os.dup(listener_fd))
    except OSError:
        return
    try:
        mine = probe.family == socket.AF_UNIX and probe.getsockname() == address
    except OSError:
        mine = False
    finally:
        probe.close()
    if mine:
        os.close(listener_fd)


def rank_main(
    address: str,
    listener_fd: int | None = None,
    gpus: tuple[int, ...] | None = None,
    relay: str | None = None,
) -> None:
    """Serve the kernel's commands in this rank until it closes the connection (run by the launcher).

    ``relay``: the token of the relay through which a rank on another node reaches ``address``.
    """
    use_gpus(gpus)  # before anything starts CUDA here: rank r then uses cuda:r, which is gpus[r]
    _close_inherited(listener_fd, address)
    sock = connect_rank(address, relay)
    try:
        RankLoop(sock, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])).serve()
    finally:
        sock.close()
