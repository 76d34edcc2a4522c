"""Small checks shared by the configuration dataclasses (kwargs handlers, plugins, configs)."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["choice", "env", "positive_int"]


def choice(owner: str, name: str, value: Any, choices: tuple) -> Any:
    """Return ``value`` if it is one of ``choices``, else raise ValueError naming the field and the choices."""
    if value not in choices:
        raise ValueError(f"{owner}: {name}={value!r} is not valid; choose one of {list(choices)}")
    return value


def env(name: str, default: str) -> str:
    """Return environment variable ``name``, or ``default`` when it is unset or empty."""
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def positive_int(owner: str, name: str, value: Any) -> int:
    """Return ``value`` if it is an int >= 1, else raise ValueError naming the field."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")
    return value
