"""The rank side of an interactive group: a loop running the kernel's commands in the rank's namespace.

``rank_main`` is the function a ``LaunchHandle`` runs in each worker: it connects to the kernel's
socket, forms the process group (``PartialState()``, so the first collective is fast and later
``Accelerator()`` / ``torch.distributed`` calls use it), says it is ready, then serves commands
until the kernel closes the connection. Messages both ways are length-prefixed pickles.

Commands: ``("exec", seq, source, filename)``, ``("call", seq, blob)``, ``("push", seq, blob)``,
``("pull", seq, name)``. Replies: ``("ok", seq, payload)``, ``("err", seq, type, message,
traceback)`` or ``("interrupted", seq, traceback)``.

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
import traceback
import types
from typing import Any

from ..launch.worker import to_cpu
from ..state import PartialState
from ..utils._worker_channel import FRAME_HEADER
from .remote import connect_rank

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

    As in IPython, a cell whose last statement is an expression gives that expression's value.
    """
    tree = ast.parse(source, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    body = compile(tree, filename, "exec")
    return body, (compile(last, filename, "eval") if last is not None else None)


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

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.busy:
            raise KeyboardInterrupt

    def serve(self) -> None:
        """Form the group, say ready, then run commands until the kernel closes the connection."""
        signal.signal(signal.SIGINT, self._on_sigint)
        _plain_display()
        problem = _init_group()
        self._send(("ready", self.rank, os.getpid(), problem))
        while True:
            message = recv_frame(self.sock)
            if message is None or message[0] == "stop":
                return
            reply = self._handle(message)
            for stream in (sys.stdout, sys.stderr):  # every line of this command reaches the kernel first
                try:
                    stream.flush()
                except Exception:
                    pass
            self._send(reply)

    def _send(self, reply: tuple) -> None:
        try:
            body = pickle.dumps(reply, protocol=_PROTOCOL)
        except Exception as exc:  # a payload made of plain parts always pickles: this is a bug of ours
            body = pickle.dumps(("err", reply[1], "TypeError", f"reply could not be pickled: {exc}", ""))
        send_frame(self.sock, body)

    def _handle(self, message: tuple) -> tuple:
        kind, seq = message[0], message[1]
        try:
            if kind == "exec":
                payload = self._exec(message[2], message[3])
            elif kind == "call":
                payload = self._call(message[2])
            elif kind == "push":
                self.namespace.update(pickle.loads(message[2]))
                payload = {}
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

    def _exec(self, source: str, filename: str) -> dict[str, Any]:
        body, last = split_code(source, filename)
        remember_source(source, filename)
        ns = self.namespace

        def run() -> Any:
            exec(body, ns)
            return eval(last, ns) if last is not None else None

        value = self._guarded(run)
        return _value_payload(value)

    def _call(self, blob: bytes) -> dict[str, Any]:
        function, args, kwargs = pickle.loads(blob)
        function = _in_namespace(function, self.namespace)
        value = self._guarded(lambda: function(*args, **kwargs))
        return _value_payload(value)

    def _pull(self, name: str) -> dict[str, Any]:
        if name not in self.namespace:
            raise NameError(f"name {name!r} is not defined on rank {self.rank}")
        return _value_payload(self.namespace[name], with_repr=False)


def _user_traceback(exc: BaseException) -> str:
    """Return the traceback of ``exc`` from the user's first frame on (this module's frames left out)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _value_payload(value: Any, with_repr: bool = True) -> dict[str, Any]:
    """Return what the kernel gets of a value: the value pickled (if it can be), its repr and HTML."""
    import cloudpickle  # by value for classes defined in a rank's __main__ (the kernel does not have them)

    payload: dict[str, Any] = {"text": None, "html": None}
    if with_repr and value is not None:
        try:
            payload["text"] = repr(value)
        except Exception as exc:
            payload["text"] = f"<repr of {type(value).__name__} failed: {exc!r}>"
        html = getattr(value, "_repr_html_", None)
        if callable(html) and not isinstance(value, type):
            try:
                payload["html"] = html()
            except Exception:
                payload["html"] = None
    try:
        payload["value"] = cloudpickle.dumps(to_cpu(value), protocol=_PROTOCOL)
    except Exception as exc:
        payload["value"] = None
        payload["type"] = f"{type(value).__module__}.{type(value).__qualname__}"
        payload["unpicklable"] = f"{type(exc).__name__}: {exc}"
    return payload


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


def _in_namespace(function: Any, namespace: dict[str, Any]) -> Any:
    """Return ``function`` looking its global names up in the rank's namespace (as code run there does).

    A function from the kernel's ``__main__`` arrives with the kernel's values of the globals it
    uses (those the ranks did not get at the fork); names the rank lacks are taken from those,
    names the rank has keep the rank's values. Functions among them are rebound the same way.
    """
    if not is_cell_function(function):
        return function
    for name, value in list(function.__globals__.items()):
        if name.startswith("__") or name in namespace:
            continue
        namespace[name] = value  # first: a function referring back to this one finds it
        namespace[name] = _in_namespace(value, namespace)
    rebound = types.FunctionType(
        function.__code__, namespace, function.__name__, function.__defaults__, function.__closure__
    )
    rebound.__kwdefaults__ = function.__kwdefaults__
    rebound.__qualname__ = function.__qualname__
    rebound.__doc__ = function.__doc__
    return rebound


def _plain_display() -> None:
    """Make IPython's ``display()`` in this rank print the value's text as an output line.

    A rank forked from a kernel has the kernel's shell, whose display publisher would write to
    the kernel's sockets (the forked copy of which nobody reads): the value would be lost.
    """
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    publisher = getattr(shell, "display_pub", None)
    if publisher is None:
        return

    def publish(data: Any = None, metadata: Any = None, *args: Any, **kwargs: Any) -> None:
        text = data.get("text/plain") if isinstance(data, dict) else None
        if text is not None:
            print(text, flush=True)

    publisher.publish = publish
    publisher.clear_output = lambda *args, **kwargs: None


def _init_group() -> str | None:
    """Form the process group now (``PartialState()``); return what went wrong, or None."""
    try:
        PartialState()
    except Exception as exc:
        return f"{type_name(exc)}: {exc}\n{traceback.format_exc()}"
    return None


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


def rank_main(address: str, listener_fd: int | None = None, relay: str | None = None) -> None:
    """Serve the kernel's commands in this rank until it closes the connection (run by the launcher).

    ``relay``: the token of the relay through which a rank on another node reaches ``address``.
    """
    _close_inherited(listener_fd, address)
    sock = connect_rank(address, relay)
    try:
        RankLoop(sock, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])).serve()
    finally:
        sock.close()
