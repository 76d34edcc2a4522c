"""Dispatching batches: process 0 reads the data, every process gets its slice of each global batch.

For data that cannot be sharded up front (a stream read once, a loader that must run in one place):
``DataLoaderDispatcher`` iterates its loader on process 0 only, broadcasts each global batch and
every process keeps its slice. A last batch that does not split evenly is completed with the first
samples of the epoch (as Accelerate 1.15 does) and ``remainder`` records how many were real.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..state import PartialState
from ..utils.operations import (
    broadcast_object_list,
    concatenate,
    find_batch_size,
    send_to_device,
    slice_tensors,
)
from .loader_adapter import DataLoaderStateMixin, _data_parallel_share, _PositionedLoader

__all__ = ["DataLoaderDispatcher"]

logger = logging.getLogger(__name__)

_END = object()


class DataLoaderDispatcher(_PositionedLoader, DataLoaderStateMixin):
    """A ``DataLoader`` read only on the main process, whose batches are sliced out to all processes.

    ``split_batches`` cuts each loader batch between the processes (otherwise a global batch is
    ``num_processes`` loader batches); ``skip_batches`` drops the first global batches of every
    iteration; ``slice_fn(batch, slice, process_index=, num_processes=)`` replaces
    :func:`~notebook_accel.utils.slice_tensors`; ``_non_blocking`` makes the move to the device
    non-blocking; with a ``torch_device_mesh`` the batches are split over its data-parallel ranks only
    (ranks of one tensor/context-parallel group get the same slice); ``iteration`` is the epoch the
    next pass starts at (given to the sampler's ``set_epoch``); ``use_stateful_dataloader`` reads
    through torchdata's ``StatefulDataLoader`` so that ``state_dict()`` resumes mid-epoch.
    """

    def __init__(
        self,
        dataset: Any,
        split_batches: bool = False,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        slice_fn: Callable[..., Any] | None = None,
        torch_device_mesh: Any = None,
        iteration: int = 0,
        *,
        device: torch.device | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, use_stateful_dataloader=use_stateful_dataloader, **kwargs)
        state = PartialState()
        # Global rank 0 reads and broadcasts to the whole world; the slice is chosen by the rank's
        # data-parallel index (the whole world without a mesh).
        self._reader, self._world = state.process_index == 0, state.num_processes
        self.torch_device_mesh = torch_device_mesh
        if torch_device_mesh is not None:
            self.num_processes, self.process_index = _data_parallel_share(torch_device_mesh)
        else:
            self.num_processes, self.process_index = state.num_processes, state.process_index
        self.split_batches = split_batches
        if skip_batches < 0:
            raise ValueError(f"skip_batches must be >= 0, got {skip_batches}")
        self.skip_batches = skip_batches
        self._drop_last = _drop_last
        self._non_blocking = _non_blocking
        self.slice_fn = slice_tensors if slice_fn is None else slice_fn
        self.device = device if device is not None else state.device
        self.iteration = iteration
        self._keep_position()

    @property
    def total_batch_size(self) -> int | None:
        """Return the number of samples one step consumes over all processes."""
        if self.batch_size is None:
            return None
        return self.batch_size if self.split_batches else self.batch_size * self.num_processes

    @property
    def total_dataset_length(self) -> int:
        """Return the length of the dataset read on the main process."""
        return len(self.dataset)

    def _compute_remainder(self) -> int:
        return -1  # learnt from the last global batch

    def __iter__(self) -> Iterator[Any]:
        self.set_epoch(self.iteration)
        self.begin()
        try:
            yield from self._dispatch(self._open())
            self.iteration += 1
            if self._position is not None:
                self._position.finish()
        finally:
            self.end()

    def _open(self) -> Iterator[Any] | None:
        """Return the loader's iterator on the reading process, None elsewhere."""
        if self._reader:
            # Draws the worker base seed from the loader's generator (or the global RNG), as a
            # DataLoader does; the stateful position draws it from a fork of the RNG instead.
            return self._position.start(None) if self._position is not None else super().__iter__()
        if self._position is None:
            # The other processes read nothing but make the same draw (Accelerate's processes each
            # build the iterator), so every rank's global stream stays Accelerate's.
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        return None

    def _dispatch(self, iterator: Iterator[Any] | None) -> Iterator[Any]:
        first, skipped = None, 0
        current = self._exchange(iterator)
        while current is not _END:
            if first is None:
                # Kept to complete an uneven last batch; Accelerate 1.15 keeps it through slice_fn too
                # (a user's slice_fn sees this call).
                first = self._slice(current, slice(0, self.num_processes))
            if self._position is not None and iterator is not None:
                self._position.served()  # before the look-ahead below moves the position on
            following = self._exchange(iterator)
            if skipped < self.skip_batches:
                skipped, current = skipped + 1, following
                continue
            size = find_batch_size(current)
            local = math.ceil(size / self.num_processes)
            if following is _END:
                if local * self.num_processes != size and self._drop_last:
                    break
                self.remainder = size  # the real samples of the last global batch
                self._mark_last_batch()
            padded = _pad_batch(current, first, local * self.num_processes, size)
            lo = self.process_index * local
            part = self._slice(padded, slice(lo, lo + local))
            yield send_to_device(part, self.device, non_blocking=self._non_blocking)
            current = following

    def _slice(self, batch: Any, part: slice) -> Any:
        return self.slice_fn(batch, part, process_index=self.process_index, num_processes=self.num_processes)

    def _read_global_batch(self, iterator: Iterator[Any]) -> Any:
        """On the main process, concatenate the next ``num_processes`` loader batches (or one)."""
        if self.split_batches:
            return next(iterator, _END)
        parts = []
        for _ in range(self.num_processes):
            part = next(iterator, _END)
            if part is _END:
                break
            parts.append(part)
        if not parts or (self._drop_last and len(parts) < self.num_processes):
            return _END  # with drop_last an incomplete global batch is dropped as a whole
        return parts[0] if len(parts) == 1 else concatenate(parts)

    def _exchange(self, iterator: Iterator[Any] | None) -> Any:
        payload = [None]
        if iterator is not None:
            batch = self._read_global_batch(iterator)
            payload = [None if batch is _END else send_to_device(batch, torch.device("cpu"))]
        if self._world > 1:
            broadcast_object_list(payload, from_process=0)
        return _END if payload[0] is None else payload[0]

    def __len__(self) -> int:
        whole = super().__len__()
        if self.split_batches:
            return whole
        if self._drop_last:
            return whole // self.num_processes
        return math.ceil(whole / self.num_processes)  # skipped batches included, as Accelerate counts them


def _pad_batch(batch: Any, first: Any, target: int, size: int) -> Any:
    """Return ``batch`` grown to ``target`` samples with the first samples of ``first`` (cycled)."""
    if target == size:
        return batch
    missing = target - size
    reps = math.ceil(missing / find_batch_size(first))
    filler = concatenate([first] * reps) if reps > 1 else first
    return concatenate([batch, slice_tensors(filler, slice(0, missing))])
