"""IPython in rank cells: magics, ``!`` commands, top-level ``await``, rich ``display()``, and no ``input()``.

Kernel side, ``prepare_cell`` turns a cell that is not plain Python (``%time x = 1``, ``!ls``,
``x = !echo hi``, ``%%time``) into Python with IPython's input transformations, as a Jupyter cell is;
plain Python is left as it is, untouched and without importing IPython. The transformed code calls
``get_ipython().run_line_magic(...)`` and ``.system(...)``; on the rank, ``rank_shell`` gives it a shell:
the kernel's own, forked with the rank (its magics work on the rank's namespace, which is its
``user_ns``), or a new ``InteractiveShell`` where the rank was not forked from a kernel.

``forward_display`` makes IPython's ``display()`` on the rank send its whole mime bundle (``image/png``,
``text/html``...) to the kernel, which shows it in the running cell under the rank's label.
``show_rank_display`` is the kernel's end of it. ``refuse_input`` makes ``input()`` and ``getpass()``
raise at once: a rank has no keyboard.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import getpass
import html
import importlib
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

from ..launch.cell_bars import kernel_display
from ..utils._errors import add_note

logger = logging.getLogger(__name__)

__all__ = [
    "NoInputOnRanksError",
    "forward_display",
    "labelled_bundle",
    "prepare_cell",
    "rank_shell",
    "refuse_input",
    "run_maybe_async",
    "show_figures",
    "show_rank_display",
]

_IPYTHON_HINT = (
    "this cell is not plain Python: magics (%time), shell commands (!ls) and other IPython syntax need "
    "IPython (pip install ipython); without it, write the cell in plain Python"
)


class NoInputOnRanksError(RuntimeError):
    """``input()`` or ``getpass()`` was called on a rank, which has no keyboard."""


def _ipython(name: str) -> Any:
    """Return IPython's module ``name``: the one a kernel loaded already, else imported now (ImportError without IPython).

    Only a cell that is not plain Python gets here, so the core itself never loads IPython (the rule
    launch/cell_bars.kernel_display follows); a rank outside a kernel imports it at this point of use.
    """
    module = sys.modules.get(name)
    return module if module is not None else importlib.import_module(name)


def prepare_cell(source: str) -> tuple[str, bool]:
    """Return ``(python source, whether IPython transformed it)`` for a rank cell.

    Plain Python comes back unchanged. Other cells go through IPython's input transformations (as
    a Jupyter cell does); a SyntaxError the transformation does not cure is raised as it was.
    """
    try:
        ast.parse(source)
    except SyntaxError as exc:
        try:
            transformers = _ipython("IPython.core.inputtransformer2")
        except ImportError:
            add_note(exc, _IPYTHON_HINT)
            raise exc from None
        python = transformers.TransformerManager().transform_cell(source)
        if python.strip() == source.strip():
            raise
        return python, True
    return source, False


def rank_shell(namespace: dict[str, Any]) -> Any:
    """Return the IPython shell of this rank (made now if it has none); ImportError when IPython is missing.

    A rank forked from a kernel has the kernel's shell, whose ``user_ns`` is the rank's namespace.
    Elsewhere a plain ``InteractiveShell`` is made on the rank's ``__main__``, history off.
    """
    try:
        InteractiveShell = _ipython("IPython.core.interactiveshell").InteractiveShell  # noqa: N806
    except ImportError as exc:
        raise ImportError(f"{_IPYTHON_HINT} (on the ranks too): {exc}") from None
    if InteractiveShell.initialized():
        shell = InteractiveShell.instance()
    else:
        from traitlets.config import Config

        config = Config()
        config.HistoryManager.enabled = False
        main = sys.modules.get("__main__")
        shell = InteractiveShell.instance(config=config, user_module=main)
        forward_display.reapply()  # the new shell's publisher sends to the kernel too
    if shell.user_ns is not namespace:
        namespace["get_ipython"] = shell.get_ipython  # this rank's code reaches the shell the same way
    return shell


def run_maybe_async(code: Any, namespace: dict[str, Any]) -> Any:
    """Return ``eval(code, namespace)``, awaited on the rank's event loop when the code has top-level ``await``."""
    result = eval(code, namespace)
    if code.co_flags & inspect.CO_COROUTINE:
        return _loop().run_until_complete(result)
    return result


def show_figures() -> None:
    """Show the figures a cell drew with matplotlib's inline backend, as a Jupyter cell does at its end."""
    backend = sys.modules.get("matplotlib_inline.backend_inline")
    if backend is None:
        return
    try:
        backend.flush_figures()
    except Exception:
        logger.debug("showing the cell's figures failed", exc_info=True)


_LOOPS: list[asyncio.AbstractEventLoop] = []


def _loop() -> asyncio.AbstractEventLoop:
    """Return this rank's event loop, one for all its cells (tasks started in one cell go on in the next)."""
    if not _LOOPS:
        # A rank forked from a running kernel still believes the kernel's loop runs in this thread.
        asyncio._set_running_loop(None)
        _LOOPS.append(asyncio.new_event_loop())
    return _LOOPS[0]


class _Forwarder:
    """IPython's display publisher of the rank, sending every bundle through ``send`` (or printing its text)."""

    def __init__(self) -> None:
        self.send: Callable[[dict, dict], bool] | None = None

    def __call__(self, send: Callable[[dict, dict], bool]) -> None:
        """Send ``display()`` bundles through ``send(data, metadata)`` (False from it: print the text)."""
        self.send = send
        self.reapply()

    def reapply(self) -> None:
        """Install the forwarding in the shell this process has now, if any."""
        ipython = sys.modules.get("IPython")
        shell = ipython.get_ipython() if ipython is not None else None
        publisher = getattr(shell, "display_pub", None)
        if publisher is None:
            return
        publisher.publish = self._publish
        publisher.clear_output = lambda *args, **kwargs: None

    def _publish(self, data: Any = None, metadata: Any = None, *args: Any, **kwargs: Any) -> None:
        if not isinstance(data, dict):
            return
        if self.send is not None and self.send(dict(data), dict(metadata or {})):
            return
        text = data.get("text/plain")
        if text is not None:
            print(text, flush=True)


forward_display = _Forwarder()


def _no_input(what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NoInputOnRanksError(
            f"{what}() cannot read on a rank: the ranks have no keyboard (it would wait until Stop). Ask in a "
            f"kernel cell instead, then give the ranks the answer: answer = {what}(...), then %ranks push "
            "answer (or ranks.push('answer', answer))"
        )

    refuse.__name__ = what
    return refuse


def refuse_input() -> None:
    """Make ``input()`` and ``getpass.getpass()`` raise NoInputOnRanksError at once in this process."""
    builtins.input = _no_input("input")
    getpass.getpass = _no_input("getpass")


def labelled_bundle(rank: int, data: dict[str, Any], metadata: dict[str, Any]) -> tuple[dict, dict]:
    """Return a rank's ``display()`` bundle with its label: on the text, above the HTML and markdown.

    An image without an HTML form gets one (the label, then the image), so a front end that picks the
    richest form still shows whose it is; the image itself stays in the bundle.
    """
    label = f"[rank {rank}]"
    out = dict(data)
    text = out.get("text/plain")
    if text is not None:
        out["text/plain"] = f"{label}{chr(10) if chr(10) in text else ' '}{text}"
    head = f"<div><b>{html.escape(label)}</b></div>"
    if "text/html" in out:
        out["text/html"] = head + str(out["text/html"])
    else:
        for mime in ("image/png", "image/jpeg"):
            if isinstance(out.get(mime), str):
                out["text/html"] = f'{head}<img src="data:{mime};base64,{out[mime]}"/>'
                break
    if isinstance(out.get("text/markdown"), str):
        out["text/markdown"] = f"**{label}**\n\n{out['text/markdown']}"
    return out, {**metadata, "notebook-accel": {"rank": rank}}


def show_rank_display(
    rank: int, data: dict[str, Any], metadata: dict[str, Any], printing: bool = True
) -> None:
    """Show rank ``rank``'s ``display()`` bundle in the running cell (its text outside a kernel)."""
    bundle, meta = labelled_bundle(rank, data, metadata)
    display = kernel_display() if printing else None
    if display is not None:
        display(bundle, raw=True, metadata=meta)
    elif printing and "text/plain" in bundle:
        print(bundle["text/plain"], flush=True)
