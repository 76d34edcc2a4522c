"""``KwargsHandler``: the base of the kwargs handlers (``utils.kwargs``) and of the plugins.

In a module of its own so that the plugins, which the process state reads, do not load the handlers.
"""

from __future__ import annotations

import copy
from dataclasses import fields
from typing import Any

__all__ = ["KwargsHandler"]


class KwargsHandler:
    """Base of the kwargs handlers: ``to_kwargs()`` gives the fields changed from their defaults."""

    # Fields that configure the handler itself, not the torch object it builds.
    _not_kwargs: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Return every field as a ``{name: value}`` dict (a deep copy)."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]

    def to_kwargs(self) -> dict[str, Any]:
        """Return ``{name: value}`` for the fields whose value differs from the class default."""
        defaults = self.__class__().to_dict()
        return {
            name: value
            for name, value in self.to_dict().items()
            if name not in self._not_kwargs and defaults[name] != value
        }
