"""The shared shape of every panel: a plain-Python model with a lazily built ipywidgets view.

Like tqdm's notebook front end, all logic lives in the model; the view only displays it. A panel
subclass implements ``_build_widget()`` (returns an ipywidgets container, built from stock widgets),
``_refresh_widget()`` (pushes the model's current state into the built widgets), ``_html()`` (a
static HTML snapshot) and ``_text()`` (a plain-text summary).
"""

from __future__ import annotations

import html
import threading
import time
from collections.abc import Callable
from typing import Any

__all__: list[str] = []

# Colours of the status styles, matching ipywidgets' bootstrap-like button/label styles.
_STYLE_COLOURS = {
    "success": "#5cb85c",
    "info": "#5bc0de",
    "warning": "#f0ad4e",
    "danger": "#d9534f",
    "": "#999999",
}


def _import_ipywidgets() -> Any:
    """Return the ipywidgets module, or raise ImportError naming the extra to install."""
    try:
        import ipywidgets
    except ImportError as exc:  # pragma: no cover - ipywidgets is in the test environment
        raise ImportError(
            "The notebook view of this panel requires `ipywidgets`: pip install 'notebook-accel[panels]' "
            "(or read the panel's attributes / repr() without a view)"
        ) from exc
    return ipywidgets


class _Panel:
    """Base of the panels: lazy ``.widget``, ``display()``, ``_repr_html_()`` and a text ``__repr__``."""

    _widget: Any = None

    # -- to implement -------------------------------------------------------------------------
    def _build_widget(self) -> Any:
        raise TypeError(f"{type(self).__name__} must implement _build_widget() to have a notebook view")

    def _refresh_widget(self) -> None:
        raise TypeError(f"{type(self).__name__} must implement _refresh_widget() to update its view")

    def _html(self) -> str:
        raise TypeError(f"{type(self).__name__} must implement _html() for its static snapshot")

    def _text(self) -> str:
        raise TypeError(f"{type(self).__name__} must implement _text() for its text summary")

    # -- shared -------------------------------------------------------------------------------
    @property
    def widget(self) -> Any:
        """Return the ipywidgets view of this panel (built on first access)."""
        if self._widget is None:
            self._widget = self._build_widget()
            self._refresh_widget()
        return self._widget

    def refresh(self) -> None:
        """Push the model's current state into the view, if the view was built."""
        if self._widget is not None:
            self._refresh_widget()

    def display(self) -> None:
        """Show the panel: its widget view in a Jupyter kernel, else its text (or HTML) snapshot."""
        from IPython import get_ipython
        from IPython.display import display as ipy_display

        shell = get_ipython()
        if shell is None or not hasattr(shell, "kernel"):
            # No widget frontend (plain Python, a terminal IPython): a widget would print as its
            # trait dump, so show the panel itself, which renders as text or static HTML.
            ipy_display(self)
            return
        try:
            view = self.widget
        except ImportError:
            ipy_display(self)
            return
        # The widget's own bundle plus the static snapshot: a frontend without a widget manager
        # (GitHub, nbviewer, a saved notebook without widget state) renders the HTML instead of
        # the widget's trait dump.
        self._display_handle = ipy_display(self._bundle(view), raw=True, display_id=True)

    def _bundle(self, view: Any) -> dict:
        bundle = dict(view._repr_mimebundle_() or {})
        bundle["text/plain"] = self._text()
        bundle["text/html"] = self._repr_html_()
        return bundle

    def _update_snapshot(self) -> None:
        """Re-send the displayed output's static snapshot (e.g. a launch's final state), if displayed."""
        handle = getattr(self, "_display_handle", None)
        if handle is not None and self._widget is not None:
            handle.update(self._bundle(self._widget), raw=True)

    def _repr_html_(self) -> str:
        return f'<div class="notebook-accel-panel">{self._html()}</div>'

    def __repr__(self) -> str:
        return self._text()


class _Throttle:
    """Call ``fn`` at most once per ``interval`` seconds; a call inside the window is delivered late.

    Live panels receive events far faster than a browser can draw; this keeps at most ~1/interval
    view updates a second and guarantees the last state is shown (a trailing call on a timer).
    """

    def __init__(self, fn: Callable[[], None], interval: float = 0.1, defer: bool = False) -> None:
        self._fn = fn
        self.interval = interval
        # defer=True never runs fn in the caller's thread (a producer thread that must not block).
        self.defer = defer
        self._last = 0.0
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.calls = 0

    def __call__(self) -> None:
        with self._lock:
            now = time.monotonic()
            wait = self._last + self.interval - now
            if wait > 0 or self.defer:
                if self._timer is None:
                    self._timer = threading.Timer(max(0.0, wait), self._fire)
                    self._timer.daemon = True
                    self._timer.start()
                return
            self._last = now
        self._run()

    def _fire(self) -> None:
        with self._lock:
            self._timer = None
            self._last = time.monotonic()
        self._run()

    def _run(self) -> None:
        self.calls += 1
        self._fn()

    def flush(self) -> None:
        """Cancel any pending trailing call and run ``fn`` now."""
        self.cancel()
        with self._lock:
            self._last = time.monotonic()
        self._run()

    def cancel(self) -> None:
        """Drop a pending trailing call."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None


def _badge(text: str, style: str = "") -> str:
    """Return an HTML badge showing ``text`` in the colour of ``style`` (success, danger...)."""
    colour = _STYLE_COLOURS.get(style, _STYLE_COLOURS[""])
    return (
        f'<span style="background:{colour};color:white;border-radius:3px;padding:0 4px;'
        f'font-size:85%;font-family:monospace">{html.escape(text)}</span>'
    )


def _table(headers: list[str], rows: list[list[str]], escape: bool = True, wrap_headers: bool = True) -> str:
    """Return an HTML table; cells are escaped unless ``escape`` is False (pre-rendered HTML)."""
    esc = html.escape if escape else (lambda s: s)
    nowrap = "" if wrap_headers else ";white-space:nowrap"
    head = "".join(
        f"<th style='text-align:left;padding:2px 8px{nowrap}'>{html.escape(h)}</th>" for h in headers
    )
    body = "".join(
        "<tr>" + "".join(f"<td style='padding:2px 8px'>{esc(str(c))}</td>" for c in row) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _text_table(headers: list[str], rows: list[list[str]]) -> str:
    """Return a fixed-width plain-text table."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _size_literal(n: int) -> str:
    """Return ``n`` bytes as a size string ``convert_file_size_to_int`` reads back ("10GiB", "512.50MiB")."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.2f}{unit}"
    return f"{n}"


def _fmt_bytes(n: float | None) -> str:
    """Return ``n`` bytes in a readable binary unit (``"1.50 GiB"``); ``"-"`` for None."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover - loop always returns
