"""Notes on exceptions on every Python we support (``BaseException.add_note`` is 3.11+)."""

from __future__ import annotations

__all__ = ["add_note"]


def add_note(error: BaseException, note: str) -> BaseException:
    """Return ``error`` with ``note`` attached: ``add_note`` where Python has it (3.11+, shown under the
    traceback); on 3.10, appended to ``__notes__`` (kept for code that reads it; tracebacks don't show it)."""
    method = getattr(error, "add_note", None)
    if callable(method):
        method(note)
    else:
        notes = getattr(error, "__notes__", None)
        error.__notes__ = [*notes, note] if isinstance(notes, list) else [note]
    return error
