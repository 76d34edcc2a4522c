"""Worker side of live progress bars: tqdm bars send their state to the launcher instead of redrawing.

While a launched function runs, every tqdm bar the worker shows (``tqdm.tqdm``, ``tqdm.auto.tqdm``,
``tqdm.notebook.tqdm`` inherited from the kernel, ``notebook_accel.utils.tqdm``) sends a ``"bar"``
event with its state (n, total, desc, rate, elapsed and tqdm's own one-line text) each time tqdm
would redraw it, at tqdm's own pace (``mininterval``), and a last one when it closes. Nothing of
the bar reaches the worker's stdout/stderr, so the rank's output keeps only what the function
printed. The patch is on the classes, so bars of classes imported before the launch (a notebook
cell's ``from tqdm.auto import tqdm``) are covered too; it lives only in the worker process.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

from ..utils._worker_channel import send_event

__all__ = ["install_bar_events"]

_ids = itertools.count()
_installed = False


class _NullWriter:
    """Swallows tqdm's closing ``\\n`` / ``\\r``: the bar's last state travels as an event instead."""

    def write(self, _text: str) -> int:
        return 0

    def flush(self) -> None:
        return None


_NULL = _NullWriter()


def _stream_of(bar: Any) -> str:
    fp = getattr(bar, "fp", None)
    inner = getattr(fp, "_wrapped", fp)  # tqdm wraps the file in DisableOnWriteError
    return "stdout" if inner is sys.stdout or inner is sys.__stdout__ else "stderr"


def _state(bar: Any, closed: bool = False, leave: bool = False) -> dict[str, Any]:
    """Return the payload of a bar event: tqdm's format_dict essentials plus its rendered line."""
    d = bar.format_dict
    elapsed = d.get("elapsed") or 0.0
    rate = d.get("rate")
    if rate is None and elapsed > 0:
        rate = (bar.n - (d.get("initial") or 0)) / elapsed
    return {
        "id": bar._na_bar_id,
        "desc": bar.desc or "",
        "n": bar.n,
        "total": bar.total,
        "elapsed": elapsed,
        "rate": rate,
        "unit": d.get("unit") or "it",
        "text": bar.format_meter(**d),
        "stream": bar._na_stream,
        "closed": closed,
        "leave": leave,
    }


def _display(self: Any, msg: str | None = None, pos: int | None = None, **_signals: Any) -> bool:
    # msg == "" is tqdm clearing the bar (leave=False); the closing event says so instead.
    if msg == "" or getattr(self, "_na_closing", False):
        return True
    if not hasattr(self, "_na_bar_id"):
        self._na_bar_id = next(_ids)
        self._na_stream = _stream_of(self)
    self._na_shown = True
    send_event("bar", _state(self))
    return True


def _clear(self: Any, *_args: Any, **_kwargs: Any) -> None:
    """Nothing was drawn on the terminal, so there is nothing to clear."""
    return None


def _moveto(self: Any, n: int) -> None:
    return None


def _make_close(std_close: Any) -> Any:
    def close(self: Any) -> None:
        if getattr(self, "disable", True):
            return
        pos = abs(getattr(self, "pos", 0))
        leave = pos == 0 if self.leave is None else bool(self.leave)
        self._na_closing = True
        fp = getattr(self, "fp", None)
        self.fp = _NULL
        try:
            std_close(self)  # tqdm's own bookkeeping (instances, positions, final average rate)
        finally:
            self.fp = fp
        if getattr(self, "_na_shown", False):
            send_event("bar", _state(self, closed=True, leave=leave))

    return close


def _make_notebook_init(std_init: Any) -> Any:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        # tqdm.notebook builds an ipywidgets bar and displays it through the kernel this worker was
        # forked from; the worker has no frontend of its own, so it runs as a text bar whose
        # redraws become events like any other.
        kwargs.pop("display", None)
        std_init(self, *args, **kwargs)
        self.disp = self.display  # tqdm.notebook's __iter__/update call disp(bar_style=...) on errors

    return __init__


def install_bar_events() -> None:
    """Make every tqdm bar of this process send ``"bar"`` events instead of drawing (idempotent)."""
    global _installed
    if _installed:
        return
    import tqdm.std as std

    cls = std.tqdm
    std_close, std_init, std_reset = cls.close, cls.__init__, cls.reset
    cls.display, cls.clear, cls.moveto = _display, _clear, _moveto
    cls.close = _make_close(std_close)
    notebook = sys.modules.get("tqdm.notebook")
    if notebook is None and "ipykernel" in sys.modules:
        # Forked from a kernel: tqdm.auto (notebook_accel.utils.tqdm too) will pick tqdm.notebook
        # when first imported here, after this patch; import it now so that its class is patched.
        try:
            import tqdm.notebook as notebook
        except ImportError:  # IPython without its display module: tqdm.auto then picks the text bar
            notebook = None
    if notebook is not None:
        nb = notebook.tqdm_notebook
        nb.__init__ = _make_notebook_init(std_init)
        nb.display, nb.clear, nb.close, nb.reset = _display, _clear, cls.close, std_reset
        # Its status_printer builds an ipywidgets bar, whose comm would talk to the parent's kernel.
        nb.status_printer = cls.__dict__["status_printer"]
    _installed = True
