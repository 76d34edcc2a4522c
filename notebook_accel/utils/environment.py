"""Environment variables: the names Accelerate reads, parsing helpers and temporary patching."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

__all__ = [
    "ACCELERATE_DEBUG_MODE",
    "clear_environment",
    "get_int_from_env",
    "parse_flag_from_env",
    "patch_environment",
    "str_to_bool",
]

# The variable that turns on debug mode (shape checks before collectives); its value is a flag.
ACCELERATE_DEBUG_MODE = "ACCELERATE_DEBUG_MODE"

_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """Return 1 (or True) for a truthy string, 0 (or False) for a falsy one.

    Truthy: y, yes, t, true, on, 1. Falsy: n, no, f, false, off, 0 (case-insensitive).
    """
    lowered = str(value).strip().lower()
    if lowered in _TRUE:
        return True if to_bool else 1
    if lowered in _FALSE:
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}: use one of {_TRUE + _FALSE}")


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """Return the boolean value of environment variable ``key`` (``default`` when unset)."""
    value = os.environ.get(key)
    if value is None or value == "":
        return default
    try:
        return bool(str_to_bool(value))
    except ValueError:
        raise ValueError(
            f"environment variable {key}={value!r} is not a flag: use one of {_TRUE + _FALSE}"
        ) from None


def get_int_from_env(env_keys: Iterable[str], default: int) -> int:
    """Return the first non-negative integer among the variables ``env_keys``, else ``default``."""
    for key in env_keys:
        raw = os.environ.get(key)
        if raw is None or raw == "":
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None
        if value >= 0:
            return value
    return default


def _process_index() -> int:
    """Return this process's global rank: from PartialState once it exists, else from ``RANK`` (0 if unset).

    Never builds the state (logging and seeding must work before it exists), and never imports it.
    """
    state_cls = getattr(sys.modules.get("notebook_accel.state"), "PartialState", None)
    if state_cls is not None and state_cls._shared_state:
        return state_cls().process_index
    raw = os.environ.get("RANK", "0")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable RANK={raw!r} is not an integer") from None


@contextmanager
def patch_environment(**kwargs) -> Iterator[None]:
    """Set each keyword as an environment variable (key upper-cased, value ``str()``) inside the block.

    On exit every patched variable gets its previous value back (or is removed when it did not
    exist), also when the block raises.
    """
    previous: dict[str, str | None] = {}
    for key, value in kwargs.items():
        name = key.upper()
        if name not in previous:
            previous[name] = os.environ.get(name)
        os.environ[name] = str(value)
    try:
        yield
    finally:
        for name, old in previous.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


@contextmanager
def clear_environment() -> Iterator[None]:
    """Empty ``os.environ`` inside the block and restore it exactly on exit (also on error)."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
