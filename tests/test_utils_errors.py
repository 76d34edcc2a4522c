"""utils._errors: notes on exceptions on every Python we support."""

from __future__ import annotations

from notebook_accel.utils._errors import add_note


def test_add_note_attaches_a_note_where_python_has_no_add_note() -> None:
    error = add_note(ValueError("exact message"), "the way out")
    assert str(error) == "exact message" and error.__notes__ == ["the way out"]

    class Py310Error(ValueError):  # what BaseException is on 3.10: no add_note
        add_note = None

    old = add_note(add_note(Py310Error("exact message"), "first"), "second")
    assert str(old) == "exact message" and old.__notes__ == ["first", "second"]
