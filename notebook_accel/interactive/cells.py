"""Code that travels from the kernel to the ranks, handled the same way on both sides.

A cell is compiled by the kernel first (``split_code``: a SyntaxError stops it before any rank sees
it) and again by each rank, which runs it; both register its source (``remember_source``) so
tracebacks and stacks show its lines. A function defined in a cell travels by value, without the
globals the ranks already have (``without_globals``, kernel side), and runs rebound to the rank's
namespace (``in_namespace``, rank side).
"""

from __future__ import annotations

import ast
import linecache
import types
from collections.abc import Callable
from typing import Any

__all__ = ["in_namespace", "is_cell_function", "remember_source", "split_code", "without_globals"]


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


def is_cell_function(value: Any) -> bool:
    """Return True for a plain function defined in ``__main__`` (a notebook cell, a script)."""
    return isinstance(value, types.FunctionType) and value.__module__ == "__main__"


def _with_globals(function: types.FunctionType, namespace: dict[str, Any]) -> types.FunctionType:
    """Return a copy of ``function`` whose global names are looked up in ``namespace``."""
    copy = types.FunctionType(
        function.__code__, namespace, function.__name__, function.__defaults__, function.__closure__
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    copy.__doc__ = function.__doc__
    return copy


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
    copy = _with_globals(function, kept)
    copy.__module__ = "__main__"
    return copy


def in_namespace(
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
        namespace[name] = in_namespace(value, namespace, installed)
        if installed is not None:
            installed(name, namespace[name])
    return _with_globals(function, namespace)
