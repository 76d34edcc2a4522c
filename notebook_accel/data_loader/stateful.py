"""Resuming a prepared dataloader mid-epoch: ``DataLoaderConfiguration(use_stateful_dataloader=True)``.

torchdata's ``StatefulDataLoader`` records how far an epoch went (``state_dict()``) and, given that
state before the next ``iter()``, skips what was already served. Two things make the resumed run
see exactly the samples of the uninterrupted one here:

- the prepared loader reads one batch ahead (to flag the last batch), so the position saved is the
  one *before* that look-ahead, taken as each batch is handed out;
- the shuffling generator is saved as it was when the epoch began and put back before the
  permutation is drawn again, so a plain shuffled loader (without ``use_seedable_sampler``)
  replays the interrupted epoch's order too. Accelerate 1.15 resumes such a loader on other samples.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["LoaderPosition", "make_stateful_loader"]

logger = logging.getLogger(__name__)


def make_stateful_loader(dataset: Any, **kwargs: Any) -> Any:
    """Return a torchdata ``StatefulDataLoader`` over ``dataset`` (ImportError naming torchdata when absent)."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        raise ImportError(
            "use_stateful_dataloader=True needs torchdata's StatefulDataLoader: pip install 'torchdata>=0.8.0' "
            "(or pip install 'notebook-accel[stateful]')"
        ) from None
    return StatefulDataLoader(dataset, **kwargs)


class LoaderPosition:
    """Where a prepared loader stands in its epoch, over an inner ``StatefulDataLoader``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._served: dict[str, Any] | None = None  # position after the last batch handed out
        self._epoch_generator: torch.Tensor | None = None
        self._pending: dict[str, Any] | None = None

    def start(self, generator: torch.Generator | None) -> Iterator[Any]:
        """Return the epoch's iterator, resumed from a loaded position if one is pending."""
        pending, self._pending = self._pending, None
        if pending is not None:
            if "generator" in pending and isinstance(generator, torch.Generator):
                generator.set_state(pending["generator"])
            self.inner.load_state_dict(pending["loader"])
        self._epoch_generator = generator.get_state() if isinstance(generator, torch.Generator) else None
        self._served = None
        # Creating an iterator draws a worker base seed from the global RNG: draw it from a fork so
        # the global stream is the same in a resumed run.
        with torch.random.fork_rng(devices=[]):
            return iter(self.inner)

    def served(self) -> None:
        """Return nothing; record the position right after the batch about to be handed out."""
        self._served = self.inner.state_dict()

    def finish(self) -> None:
        """Return nothing; the epoch ran to its end (the next one starts from scratch)."""
        self._served = None
        self._epoch_generator = None

    def state_dict(self, iteration: int) -> dict[str, Any]:
        """Return the position to save: the inner loader's state, the epoch and its starting generator."""
        state: dict[str, Any] = {"iteration": iteration}
        if self._served is not None:
            state["loader"] = self._served
            if self._epoch_generator is not None:
                state["generator"] = self._epoch_generator
        else:
            state["loader"] = self.inner.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Return nothing; the next ``start`` resumes from ``state`` (what ``state_dict`` gave)."""
        if not isinstance(state, dict) or "loader" not in state:
            raise ValueError(
                "load_state_dict expects what a stateful prepared dataloader's state_dict() returned "
                f"(a dict with 'loader'), got {type(state).__name__}"
            )
        self._pending = state
