"""``GradientState``: the gradient-accumulation and dataloader bookkeeping shared by one process.

The ``Accelerator`` and its prepared dataloaders drive it through the ``_add_dataloader``,
``_remove_dataloader``, ``_set_sync_gradients``, ``_set_end_of_dataloader`` and ``_set_remainder``
helpers; user code reads the attributes.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from ..utils.environment import parse_flag_from_env
from .process import PartialState

__all__ = ["GradientState"]


class GradientState:
    """Singleton with what gradient synchronisation needs to know about accumulation and dataloaders.

    ``GradientState(gradient_accumulation_plugin=None)``: the plugin's fields (``num_steps``,
    ``adjust_scheduler``, ``sync_with_dataloader``, ``sync_each_batch``) become ``plugin_kwargs``; a
    later call with a plugin replaces them.
    """

    _shared_state: dict[str, Any] = {}

    def __init__(self, gradient_accumulation_plugin: Any = None) -> None:
        self.__dict__ = self._shared_state
        if not self.initialized:
            self.sync_gradients = True
            self._dataloader_references: list[Any] = [None]
            self.plugin_kwargs: dict[str, Any] = {}
            self._is_xla_gradients_synced = False
            self._end_of_dataloader = False
            self._remainder = -1
            self._initialized = True
        if gradient_accumulation_plugin is not None:
            self.plugin_kwargs = _plugin_kwargs(gradient_accumulation_plugin)

    @property
    def initialized(self) -> bool:
        """Return whether the shared state has been set up."""
        return bool(self._shared_state.get("_initialized", False))

    @property
    def active_dataloader(self) -> Any:
        """The dataloader being iterated (the innermost when loops nest), or None outside any loop."""
        return self._dataloader_references[-1]

    @property
    def dataloader_references(self) -> list[Any]:
        """The dataloaders being iterated, outermost first, after a leading None."""
        return self._dataloader_references

    @dataloader_references.setter
    def dataloader_references(self, references: list[Any]) -> None:
        self._dataloader_references = list(references) if references else [None]

    @property
    def num_steps(self) -> int:
        """Return the number of steps to accumulate gradients over (1 by default)."""
        return self.plugin_kwargs.get("num_steps") or 1

    @property
    def adjust_scheduler(self) -> bool:
        """Return whether the scheduler should account for gradient accumulation."""
        return bool(self.plugin_kwargs.get("adjust_scheduler", False))

    @property
    def sync_with_dataloader(self) -> bool:
        """Return whether gradients sync (and the step count resets) at the end of a dataloader."""
        return bool(self.plugin_kwargs.get("sync_with_dataloader", True))

    @property
    def sync_each_batch(self) -> bool:
        """Return whether gradients sync on every batch even while accumulating."""
        return bool(self.plugin_kwargs.get("sync_each_batch", False))

    @property
    def in_dataloader(self) -> bool:
        """Return whether a prepared dataloader is being iterated."""
        return self.active_dataloader is not None

    @property
    def end_of_dataloader(self) -> bool:
        """Return whether the active dataloader has yielded its last batch (False outside one)."""
        if self.active_dataloader is None:
            return False
        # A dataloader may keep the flag itself (Accelerate's DataLoaderStateMixin) or set it here.
        return bool(getattr(self.active_dataloader, "end_of_dataloader", self._end_of_dataloader))

    @property
    def remainder(self) -> int:
        """Return how many samples of the last batch are padding duplicates (-1 when unknown)."""
        if self.active_dataloader is None:
            return -1
        return int(getattr(self.active_dataloader, "remainder", self._remainder))

    @property
    def is_xla_gradients_synced(self) -> bool:
        """Return whether XLA gradients were reduced before the optimizer step (always True under FSDP)."""
        if parse_flag_from_env("ACCELERATE_USE_FSDP"):
            return True
        return self._is_xla_gradients_synced

    @is_xla_gradients_synced.setter
    def is_xla_gradients_synced(self, value: bool) -> None:
        self._is_xla_gradients_synced = bool(value)

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        """Record whether the next backward pass synchronises gradients."""
        self.sync_gradients = bool(sync_gradients)
        if self.sync_gradients:
            _xla_mark_step()

    def _set_end_of_dataloader(self, end_of_dataloader: bool) -> None:
        """Record that the active dataloader reached (or left) its last batch."""
        self._end_of_dataloader = bool(end_of_dataloader)
        if self.active_dataloader is not None and hasattr(self.active_dataloader, "end_of_dataloader"):
            self.active_dataloader.end_of_dataloader = self._end_of_dataloader

    def _set_remainder(self, remainder: int) -> None:
        """Record how many samples of the active dataloader's last batch are padding."""
        self._remainder = int(remainder)
        if self.active_dataloader is not None and hasattr(self.active_dataloader, "remainder"):
            self.active_dataloader.remainder = self._remainder

    def _add_dataloader(self, dataloader: Any) -> None:
        """Make ``dataloader`` the active one (a dataloader starting its iteration)."""
        self._dataloader_references.append(dataloader)
        self._end_of_dataloader = False
        self._remainder = -1

    def _remove_dataloader(self, dataloader: Any) -> None:
        """Forget ``dataloader`` (its iteration ended); the previous one, if any, becomes active again."""
        for i in range(len(self.dataloader_references) - 1, -1, -1):
            if self.dataloader_references[i] is dataloader:
                del self.dataloader_references[i]
                break
        if not self.dataloader_references:
            self._dataloader_references = [None]
        self._end_of_dataloader = False
        self._remainder = -1

    def __repr__(self) -> str:
        # One line, every documented attribute as name=value; the plugin's fields only when one was given.
        fields = {
            "sync_gradients": self.sync_gradients,
            "num_steps": self.num_steps,
            "in_dataloader": self.in_dataloader,
            "end_of_dataloader": self.end_of_dataloader,
            "remainder": self.remainder,
        }
        if self.plugin_kwargs:
            fields["plugin_kwargs"] = self.plugin_kwargs
        return (
            f"{type(self).__name__}(" + ", ".join(f"{key}={value!r}" for key, value in fields.items()) + ")"
        )

    @classmethod
    def _reset_state(cls) -> None:
        """Forget the shared state; the next ``GradientState()`` starts afresh."""
        cls._shared_state.clear()


def _plugin_kwargs(plugin: Any) -> dict[str, Any]:
    # Every field, not only to_kwargs()'s changed ones: a plugin's defaults (adjust_scheduler=True)
    # differ from GradientState's no-plugin defaults.
    if dataclasses.is_dataclass(plugin):
        return {f.name: getattr(plugin, f.name) for f in dataclasses.fields(plugin)}
    to_kwargs = getattr(plugin, "to_kwargs", None)
    if to_kwargs is None:
        raise TypeError(
            f"gradient_accumulation_plugin must be a GradientAccumulationPlugin, got {type(plugin).__name__}"
        )
    return dict(to_kwargs())


def _xla_mark_step() -> None:
    """Cut the XLA graph where gradients sync, when running on XLA (torch_xla imported)."""
    if "torch_xla" not in sys.modules:
        return
    if PartialState().distributed_type == "XLA":
        import torch_xla.core.xla_model as xm

        xm.mark_step()
