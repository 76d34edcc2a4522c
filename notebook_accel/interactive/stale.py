"""Push what changed: notice a function from the kernel reading a global the ranks hold an older copy of.

A rank holds what the kernel gave it: every name at the fork, then what ``push`` sent and the globals
functions brought along. When the kernel rebinds such a name (``lr = 0.01`` in a later cell), the rank
keeps its copy until it is pushed, and ``ranks.run(fn)`` runs ``fn`` with the rank's copy. That is the
rule (code on the ranks sees the ranks' names), but doing it silently hides a stale value, so the
kernel sends, with each call, a fingerprint of the current kernel value of every global the function
reads (through the cell functions it calls too); the rank compares it with the fingerprint of what it
was given, for names it still holds as given (not rebound by rank code), and the kernel warns with
``StaleGlobalWarning``, naming ``%ranks push NAME``.

Fingerprints: small plain values (numbers, short strings, None) by value, anything else by identity.
So rebinding is noticed, and rebinding to an equal number is not; a change made in place (``cfg["lr"]
= 0.1``, a tensor's ``add_``) keeps the object and is not noticed.
"""

from __future__ import annotations

import dis
import types
from collections.abc import Iterable
from typing import Any

__all__ = ["StaleGlobalWarning", "fingerprint", "global_tokens", "stale_message", "stale_names"]

_BY_VALUE = (int, float, complex, bool, type(None), str, bytes)
_LONGEST = 1024
_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})


class StaleGlobalWarning(UserWarning):
    """A function run on the ranks read a global the kernel changed but never pushed to them."""


def fingerprint(value: object) -> tuple:
    """Return what identifies ``value`` for the stale check: small plain values by value, others by id."""
    kind = type(value)
    if kind in _BY_VALUE and not (kind in (str, bytes) and len(value) > _LONGEST):
        return ("v", kind.__name__, value)
    return ("id", id(value))


def _code_globals(code: types.CodeType, out: set[str]) -> None:
    for instruction in dis.get_instructions(code):
        if instruction.opname in _LOADS:
            out.add(instruction.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions, lambdas, comprehensions
            _code_globals(const, out)


def _is_cell_function(value: object) -> bool:
    return isinstance(value, types.FunctionType) and value.__module__ == "__main__"


def global_tokens(function: Any) -> dict[str, tuple]:
    """Return ``{name: fingerprint}`` of the kernel globals ``function`` reads, through the cell functions it calls."""
    tokens: dict[str, tuple] = {}
    seen: set[int] = set()
    todo = [function]
    while todo:
        fn = todo.pop()
        if not _is_cell_function(fn) or id(fn) in seen:
            continue
        seen.add(id(fn))
        names: set[str] = set()
        _code_globals(fn.__code__, names)
        for name in names:
            if name in fn.__globals__ and not name.startswith("__"):
                value = fn.__globals__[name]
                tokens[name] = fingerprint(value)
                todo.append(value)
    return tokens


def stale_names(
    namespace: dict[str, Any], given: dict[str, tuple[int, Any, str]], tokens: dict[str, Any], forked: bool
) -> list[str]:
    """Return the names of ``tokens`` this rank still holds as the kernel gave them, while the kernel's value changed.

    ``given`` maps a name to (id of the object the rank got, the kernel's fingerprint of it, how:
    "fork", "push" or "call"); fork entries count only when the rank was forked from the kernel.
    """
    stale = []
    for name, token in tokens.items():
        entry = given.get(name)
        if entry is None or name not in namespace:
            continue
        held, was, how = entry
        if how == "fork" and not forked:
            continue
        if id(namespace[name]) == held and was != token:
            stale.append(name)
    return sorted(stale)


def stale_message(function: Any, by_rank: dict[int, Iterable[str]]) -> str | None:
    """Return the warning for ``function`` given each rank's stale names, or None when there are none."""
    ranks_of: dict[str, list[int]] = {}
    for rank, names in sorted(by_rank.items()):
        for name in names:
            ranks_of.setdefault(name, []).append(rank)
    if not ranks_of:
        return None
    what = getattr(function, "__qualname__", "the function")
    names = sorted(ranks_of)
    held = "; ".join(f"{name} on rank(s) {ranks_of[name]}" for name in names)
    return (
        f"ranks.run({what}): {what} read {', '.join(names)}, which the kernel changed after giving it to the ranks; "
        f"the ranks used their older copy ({held}). Code on the ranks sees the ranks' names: push what changed, "
        f"%ranks push {' '.join(names)} (ranks.push_many({', '.join(f'{n}={n}' for n in names)}))"
    )
