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

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["OWN_KEYS", "LoaderPosition", "make_stateful_loader"]

# The keys our checkpoints of an earlier version put inside state_dict() (still read when loading one);
# the same facts now go in resume_state(), beside torchdata's dictionary.
OWN_KEYS = {
    "iteration": "_notebook_accel_iteration",
    "generator": "_notebook_accel_generator",
    "global_rng": "_notebook_accel_global_rng",
}

logger = logging.getLogger(__name__)

_END = object()


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
        self._epoch_global_rng: torch.Tensor | None = None

    def start(self, generator: torch.Generator | None) -> Iterator[Any]:
        """Return the epoch's iterator, resumed from a loaded position if one is pending."""
        pending, self._pending = self._pending, None
        global_rng = None
        if pending is not None:
            if "generator" in pending and isinstance(generator, torch.Generator):
                generator.set_state(pending["generator"])
            global_rng = pending.get("global_rng")
            self.inner.load_state_dict(pending["loader"])
        self._epoch_generator = generator.get_state() if isinstance(generator, torch.Generator) else None
        # Without a generator of its own a shuffling sampler draws the epoch's order from the global
        # RNG when its first batch is read: keep that state so a resumed run draws the same order.
        self._epoch_global_rng = None
        if self._epoch_generator is None:
            self._epoch_global_rng = global_rng if global_rng is not None else torch.get_rng_state()
        self._served = None
        # Creating an iterator draws a worker base seed from the global RNG: draw it from a fork so
        # the global stream is the same in a resumed run.
        # Resumed: the order (and the skip to the saved position) comes from the global RNG as it
        # was when the interrupted epoch began; the global stream itself stays as load_state set it.
        # The sampler draws while worker processes are primed (in iter()), else at the first batch.
        workers = getattr(self.inner, "num_workers", 0)
        with torch.random.fork_rng(devices=[]):
            if global_rng is not None and workers > 0:
                torch.set_rng_state(global_rng)
            iterator = iter(self.inner)
            if global_rng is None:
                return iterator
            if workers == 0:
                torch.set_rng_state(global_rng)
            first = next(iterator, _END)
        return iter(()) if first is _END else itertools.chain([first], iterator)

    def served(self) -> None:
        """Return nothing; record the position right after the batch about to be handed out."""
        self._served = self.inner.state_dict()

    def finish(self) -> None:
        """Return nothing; the epoch ran to its end (the next one starts from scratch)."""
        self._served = None
        self._epoch_generator = None
        self._epoch_global_rng = None

    def state_dict(self) -> dict[str, Any]:
        """Return the position to save: torchdata's ``StatefulDataLoader.state_dict()`` as 1.15 returns it
        (the position of the last batch handed out), and nothing else."""
        return dict(self._served if self._served is not None else self.inner.state_dict())

    def resume_state(self, iteration: int) -> dict[str, Any]:
        """Return what an exact resumption needs beside ``state_dict()``: the epoch and, mid-epoch, the
        generators the epoch began with (``save_state`` writes it in a file of its own)."""
        state: dict[str, Any] = {"iteration": iteration}
        if self._served is not None:
            if self._epoch_generator is not None:
                state["generator"] = self._epoch_generator
            if self._epoch_global_rng is not None:
                state["global_rng"] = self._epoch_global_rng
        return state

    def load_state_dict(self, state: dict[str, Any], resume: dict[str, Any] | None = None) -> None:
        """Return nothing; the next ``start`` resumes from ``state``: what ``state_dict`` gave (a
        ``StatefulDataLoader.state_dict()``, torchdata's or one Accelerate 1.15 saved), with ``resume``
        (what ``resume_state`` gave) when there is one, or a state of an earlier version of ours (the nested
        ``{"loader": ...}`` form, or torchdata's keys with our ``OWN_KEYS``)."""
        if isinstance(state, dict) and "loader" not in state and _is_torchdata_state(state):
            ours = {name: state[key] for name, key in OWN_KEYS.items() if key in state}
            # without ours: the shuffling generator (or the global RNG) as it is now
            state = {"loader": {k: v for k, v in state.items() if k not in OWN_KEYS.values()}, **ours}
        if not isinstance(state, dict) or "loader" not in state:
            raise ValueError(
                "load_state_dict expects what a stateful prepared dataloader's state_dict() returned, "
                f"a StatefulDataLoader's state_dict(), got {type(state).__name__}"
                + (f" with keys {sorted(state)[:6]}" if isinstance(state, dict) else "")
            )
        if resume:
            state = {**state, **{k: v for k, v in resume.items() if k in ("generator", "global_rng")}}
        self._pending = state


def _is_torchdata_state(state: dict) -> bool:
    """Return whether ``state`` looks like a ``StatefulDataLoader.state_dict()`` (single- or multi-worker)."""
    return "_iterator_finished" in state or "_snapshot" in state or "_num_yielded" in state
