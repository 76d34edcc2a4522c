"""Sharded data loaders: each process sees its own slice of every global batch.

``prepare_data_loader`` rebuilds a ``torch.utils.data.DataLoader`` so that process ``i`` of ``n``
iterates over its part of the data (``BatchSamplerShard`` for map-style datasets,
``IterableDatasetShard`` for iterable ones, its own shards of a 🤗 ``datasets.IterableDataset``), moves batches to the device, keeps the random
samplers of all processes in step (``SeedableRandomSampler`` or a synchronised generator) and tells
``GradientState`` when the last batch is being served and how many of its samples are real.
``skip_first_batches`` resumes a loader mid-epoch without loading the skipped samples. The
dispatching loader lives in ``batch_dispatch``, the adapter and book-keeping they share in
``loader_adapter``; all are served here, at Accelerate's path.
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from ..logging import get_logger
from ..state import GradientState, PartialState
from ..utils.enums import DistributedType, RNGType
from ..utils.imports import is_torch_xla_available
from ..utils.operations import (
    broadcast,
    broadcast_object_list,
    concatenate,
    find_batch_size,
    get_data_structure,
    initialize_tensors,
    send_to_device,
    slice_tensors,
)
from ..utils.package_checks import is_datasets_available, is_torchdata_stateful_dataloader_available
from ..utils.random import synchronize_rng_states
from ..utils.versions import compare_versions, is_torch_version
from .batch_dispatch import DataLoaderDispatcher
from .loader_adapter import (
    DataLoaderAdapter,
    DataLoaderStateMixin,
    _data_parallel_share,
    _loader_kwargs,
    _PositionedLoader,
    get_sampler,
)
from .samplers import (
    BatchSamplerShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    _check_fixed_batch_size,
    _own_epoch_counter,
    _shard_batch_sampler,
    _usable_rng_types,
)

__all__ = [
    "BatchSamplerShard",
    "DataLoaderAdapter",
    "DataLoaderStateMixin",
    "get_sampler",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "SkipDataLoader",
    "prepare_data_loader",
    "skip_first_batches",
]
# Accelerate 1.15 serves these names at this path too (defined elsewhere).
__all__ += [
    "DistributedType",
    "GradientState",
    "PartialState",
    "RNGType",
    "broadcast",
    "broadcast_object_list",
    "compare_versions",
    "concatenate",
    "find_batch_size",
    "get_data_structure",
    "get_logger",
    "initialize_tensors",
    "is_datasets_available",
    "is_torch_version",
    "is_torch_xla_available",
    "is_torchdata_stateful_dataloader_available",
    "send_to_device",
    "slice_tensors",
    "synchronize_rng_states",
]

logger = logging.getLogger(__name__)


_END = object()


class DataLoaderShard(_PositionedLoader, DataLoaderStateMixin):
    """A ``DataLoader`` serving one process's batches, on its device, one batch ahead.

    Reading one batch ahead lets it flag the last batch (``end_of_dataloader``) while that batch is
    being used, which gradient accumulation and ``gather_for_metrics`` rely on. At the start of each
    iteration it synchronises the random generators named in ``rng_types`` from process 0
    (``"generator"`` is ``synchronized_generator``), gives ``iteration`` (the epoch) to the sampler's
    or the iterable dataset's ``set_epoch``, and drops the first ``skip_batches`` batches (read, not
    served). Batches go to ``device`` when one is given (``_non_blocking``: a non-blocking copy).
    ``use_stateful_dataloader`` reads through torchdata's ``StatefulDataLoader`` so ``state_dict()``
    resumes mid-epoch. ``torch_device_mesh`` is kept for the caller: the sharding over its
    data-parallel ranks is the batch sampler's (``prepare_data_loader`` builds it), as in Accelerate.
    """

    _epoch_reaches_batch_sampler = True

    def __init__(
        self,
        dataset: Any,
        device: torch.device | None = None,
        rng_types: list[str] | None = None,
        synchronized_generator: torch.Generator | None = None,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        torch_device_mesh: Any = None,
        iteration: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, use_stateful_dataloader=use_stateful_dataloader, **kwargs)
        if skip_batches < 0:
            raise ValueError(f"skip_batches must be >= 0, got {skip_batches}")
        self.device = device
        self.rng_types = rng_types
        self.synchronized_generator = synchronized_generator
        self.skip_batches = skip_batches
        self._drop_last = _drop_last
        self._non_blocking = _non_blocking
        self.torch_device_mesh = torch_device_mesh
        self.iteration = iteration
        self._keep_position()

    @property
    def total_batch_size(self) -> int | None:
        """Return the number of samples one step consumes over all processes."""
        sampler = self.batch_sampler
        for _ in range(8):  # through skip wrappers down to the shard, if any
            if isinstance(sampler, BatchSamplerShard) or getattr(sampler, "batch_sampler", None) is None:
                break
            sampler = sampler.batch_sampler
        if isinstance(sampler, BatchSamplerShard) and sampler.batch_size is not None:
            return sampler.batch_size * (1 if sampler.split_batches else sampler.num_processes)
        if isinstance(self.dataset, IterableDatasetShard):
            shard = self.dataset
            return shard.batch_size * (1 if shard.split_batches else shard.num_processes)
        if self.batch_size is not None:
            return self.batch_size
        return getattr(sampler, "batch_size", None)

    @property
    def total_dataset_length(self) -> int:
        """Return the length of the underlying (unsharded) dataset."""
        return len(_unsharded(self.dataset))

    def _remainder_length(self) -> int | None:
        # A sharded stream counts as the whole padded stream (so the remainder is 0: its padding
        # completes the last batch and gather_for_metrics keeps it, as in Accelerate).
        length = super()._remainder_length()
        if length is not None and isinstance(self.dataset, IterableDatasetShard):
            length *= self.dataset.num_processes
        return length

    def __iter__(self) -> Iterator[Any]:
        if self.rng_types:
            synchronize_rng_states(self.rng_types, self.synchronized_generator)
        self.set_epoch(self.iteration)
        self.begin()
        try:
            if self._position is not None:
                iterator = self._position.start(self.synchronized_generator)
            else:
                # Creating the iterator draws the worker base seed from the loader's generator (or
                # the global RNG) exactly as a plain DataLoader does: the streams stay Accelerate's.
                iterator = super().__iter__()
            for _ in range(self.skip_batches):
                if next(iterator, _END) is _END:
                    break
            current = next(iterator, _END)
            while current is not _END:
                if self._position is not None:
                    self._position.served()  # before the look-ahead below moves the position on
                following = next(iterator, _END)
                if following is _END:
                    self._mark_last_batch()
                yield self._place(current)
                current = following
            self.iteration += 1
            if self._position is not None:
                self._position.finish()
        finally:
            self.end()

    def _place(self, batch: Any) -> Any:
        if self.device is None:
            return batch
        return send_to_device(batch, self.device, non_blocking=self._non_blocking)


def _unsharded(dataset: Any) -> Any:
    # Only our own shard wrapper is looked through (a user's Subset also has a .dataset attribute).
    return dataset.dataset if isinstance(dataset, IterableDatasetShard) else dataset


class SkipDataLoader(DataLoaderAdapter, DataLoaderStateMixin):
    """A ``DataLoader`` that skips its first ``skip_batches`` batches (read, then dropped) each iteration.

    While iterated it is GradientState's active loader; as in Accelerate 1.15 it does not flag its
    last batch (``end_of_dataloader`` stays False, ``remainder`` -1). ``use_stateful_dataloader``
    reads through torchdata's ``StatefulDataLoader`` (``state_dict()`` / ``load_state_dict()``).
    """

    def __init__(
        self, dataset: Any, skip_batches: int = 0, use_stateful_dataloader: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(dataset, use_stateful_dataloader=use_stateful_dataloader, **kwargs)
        if skip_batches < 0:
            raise ValueError(f"skip_batches must be >= 0, got {skip_batches}")
        self.skip_batches = skip_batches

    def _compute_remainder(self) -> int:
        return -1

    def __iter__(self) -> Iterator[Any]:
        self.begin()
        try:
            yield from itertools.islice(super().__iter__(), self.skip_batches, None)
        finally:
            self.end()

    def __len__(self) -> int:
        return max(super().__len__() - self.skip_batches, 0)


def prepare_data_loader(
    dataloader: DataLoader,
    device: torch.device | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: list[str] | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Any = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
) -> DataLoader:
    """Return a loader serving this process's share of ``dataloader``'s batches.

    ``split_batches`` cuts each batch between processes (otherwise each process takes whole
    batches in turn), ``even_batches`` pads the last round so every process steps equally,
    ``use_seedable_sampler`` replaces a ``RandomSampler`` by a :class:`SeedableRandomSampler`
    (otherwise its generator is synchronised from process 0 at every epoch), ``dispatch_batches``
    reads the data on process 0 only and sends each process its slice. ``use_stateful_dataloader``
    iterates through torchdata's ``StatefulDataLoader`` so ``state_dict()`` / ``load_state_dict()``
    resume mid-epoch. With a ``torch_device_mesh`` (and no explicit counts) the loader is sharded over
    its data-parallel ranks only: ranks of one tensor-parallel group read the same batches. Undispatched,
    unsplit, a 🤗 ``datasets.IterableDataset`` with ``n_shards >= num_processes`` is split by shards.
    """
    if not isinstance(dataloader, DataLoader):
        raise TypeError(
            f"prepare_data_loader expects a torch.utils.data.DataLoader, got {type(dataloader).__name__}"
        )
    state = PartialState()
    if torch_device_mesh is not None and num_processes is None and process_index is None:
        num_processes, process_index = _data_parallel_share(torch_device_mesh)
    num_processes = state.num_processes if num_processes is None else num_processes
    process_index = state.process_index if process_index is None else process_index
    # DataLoader batches are CPU tensors already: skip a per-batch no-op move on CPU runs.
    device = device if put_on_device and device is not None and torch.device(device).type != "cpu" else None
    is_iterable = isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches is None:
        # A stream is read once, on process 0, unless asked otherwise (Accelerate's default).
        dispatch_batches = bool(put_on_device and is_iterable)
    if split_batches and dataloader.batch_size is None:
        _check_fixed_batch_size(
            getattr(dataloader.batch_sampler, "batch_size", None), "DataLoader's batch sampler"
        )
    _check_options(dataloader.batch_size, num_processes, split_batches, dispatch_batches, put_on_device)
    if dispatch_batches:
        return _dispatching_loader(
            dataloader, split_batches, non_blocking, slice_fn_for_dispatch, device,
            use_stateful_dataloader=use_stateful_dataloader, torch_device_mesh=torch_device_mesh,
        )  # fmt: skip
    kwargs = _loader_kwargs(dataloader)
    rng_types = list(rng_types) if rng_types else []
    if is_iterable:
        kwargs.pop("generator", None)
        dataset, loader_args, synchronized_generator = _sharded_stream(
            dataloader, num_processes, process_index, split_batches
        )
    else:
        dataset = dataloader.dataset
        batch_sampler, synchronized_generator = _shard_batch_sampler(
            dataloader, num_processes, process_index, split_batches, even_batches,
            use_seedable_sampler, data_seed, rng_types,
        )  # fmt: skip
        loader_args = {"batch_sampler": batch_sampler}
    return DataLoaderShard(
        dataset,
        device=device,
        rng_types=_usable_rng_types(rng_types, synchronized_generator),
        synchronized_generator=synchronized_generator,
        _drop_last=dataloader.drop_last,
        _non_blocking=non_blocking,
        torch_device_mesh=torch_device_mesh,
        use_stateful_dataloader=use_stateful_dataloader,
        **loader_args,
        **kwargs,
    )


def _check_options(
    batch_size: int | None,
    num_processes: int,
    split_batches: bool,
    dispatch_batches: bool,
    put_on_device: bool,
) -> None:
    """Raise ValueError for option combinations ``prepare_data_loader`` cannot serve."""
    if split_batches and batch_size is not None and batch_size % num_processes != 0:
        raise ValueError(
            f"split_batches=True needs a batch size that is a round multiple of num_processes, got "
            f"batch_size={batch_size} for num_processes={num_processes}: change the batch size or use "
            "split_batches=False"
        )
    if dispatch_batches and not put_on_device:
        # The slices are sent to each process's device, as in Accelerate 1.15 (which raises the same).
        raise ValueError(
            "dispatch_batches=True requires put_on_device=True (each process's slice is sent to its "
            "device): pass put_on_device=True, or dispatch_batches=False to shard the loader in place"
        )


def _dispatching_loader(
    dataloader: DataLoader,
    split_batches: bool,
    non_blocking: bool,
    slice_fn: Any,
    device: torch.device | None,
    **dispatcher_args: Any,
) -> DataLoaderDispatcher:
    """Return a :class:`DataLoaderDispatcher` over ``dataloader``'s data, sampler and batch size."""
    kwargs = _loader_kwargs(dataloader)
    kwargs.pop("generator", None)
    batch_size, drop_last = dataloader.batch_size, dataloader.drop_last
    if isinstance(dataloader.dataset, IterableDataset):
        loader_args: dict[str, Any] = {"batch_size": batch_size, "drop_last": drop_last}
    elif batch_size is None:
        loader_args = {"batch_sampler": dataloader.batch_sampler}
    elif isinstance(dataloader.sampler, RandomSampler):
        # Process 0 keeps the user's sampler (and its generator): it alone draws the order.
        loader_args = {"batch_size": batch_size, "drop_last": drop_last, "sampler": dataloader.sampler}
    else:
        loader_args = {"batch_size": batch_size, "drop_last": drop_last, "shuffle": False,
                       "_prepared_in_order": True}  # fmt: skip
    return DataLoaderDispatcher(
        dataloader.dataset,
        split_batches=split_batches,
        _drop_last=drop_last,
        _non_blocking=non_blocking,
        slice_fn=slice_fn,
        device=device,
        **dispatcher_args,
        **loader_args,
        **kwargs,
    )


def _sharded_stream(
    dataloader: DataLoader, num_processes: int, process_index: int, split_batches: bool
) -> tuple[Any, dict[str, Any], torch.Generator | None]:
    """Return ``(dataset, loader arguments, generator to synchronise)`` for this process's part of a stream."""
    dataset, batch_size, drop_last = dataloader.dataset, dataloader.batch_size, dataloader.drop_last
    generator = getattr(dataset, "generator", None)
    synchronized_generator = generator if isinstance(generator, torch.Generator) else None
    if num_processes > 1 and not split_batches and _splits_by_shards(dataset, num_processes):
        # Native sharding: each process reads only its own block of contiguous shards (files) instead
        # of reading the whole stream and keeping one batch in num_processes. A process may get one
        # shard more than another (n_shards=3 on 2 processes: 2 and 1) and so more batches, as with
        # Accelerate 1.15. (datasets' split_dataset_by_node would deal the shards out round-robin,
        # and fall back to one sample in num_processes when they do not divide: other batches.)
        dataset = dataset.shard(num_shards=num_processes, index=process_index)
    elif num_processes > 1:
        dataset = IterableDatasetShard(
            dataset,
            batch_size=batch_size or 1,
            drop_last=drop_last,
            num_processes=num_processes,
            process_index=process_index,
            split_batches=split_batches,
        )
        batch_size = (batch_size or 1) // num_processes if split_batches else batch_size
    return dataset, {"batch_size": batch_size, "drop_last": drop_last}, synchronized_generator


def _splits_by_shards(dataset: Any, num_processes: int) -> bool:
    """Return whether ``dataset`` is a 🤗 ``datasets.IterableDataset`` with a shard for every process."""
    # Only an already-imported `datasets` can have built the dataset: importing it here (pyarrow,
    # pandas) would cost every stream that is not one.
    datasets = sys.modules.get("datasets")
    iterable = getattr(datasets, "IterableDataset", None)
    if not isinstance(iterable, type) or not isinstance(dataset, iterable):
        return False
    return getattr(dataset, "n_shards", 0) >= num_processes


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
    """Return a loader over the same data that starts after its first ``num_batches`` batches.

    For a prepared map-style loader the skipped batches are never loaded (their indices are
    dropped); the new loader shares the sampler, so the next epoch continues from the original.
    """
    if num_batches < 0:
        raise ValueError(f"num_batches must be >= 0, got {num_batches}")
    if isinstance(dataloader, DataLoaderDispatcher):
        new = DataLoaderDispatcher.__new__(DataLoaderDispatcher)
        new.__dict__.update(dataloader.__dict__)
        if dataloader.base_dataloader is dataloader:  # a plain loader reads itself, not the original
            new.base_dataloader = new
        new.skip_batches = num_batches
        return new
    if isinstance(dataloader, DataLoaderShard):
        kwargs = _loader_kwargs(dataloader)
        common = {
            "device": dataloader.device,
            "rng_types": dataloader.rng_types,
            "synchronized_generator": dataloader.synchronized_generator,
            "_drop_last": dataloader._drop_last,
            "_non_blocking": dataloader._non_blocking,
            "torch_device_mesh": dataloader.torch_device_mesh,
            "iteration": dataloader.iteration,
            # A resumed loader stays resumable (Accelerate 1.15 drops the stateful loader here).
            "use_stateful_dataloader": dataloader.use_stateful_dataloader,
        }
        if isinstance(dataloader.dataset, IterableDataset):
            new = DataLoaderShard(
                dataloader.dataset,
                skip_batches=num_batches,
                batch_size=dataloader.batch_size,
                drop_last=dataloader.drop_last,
                **common,
                **kwargs,
            )
        else:
            new = DataLoaderShard(
                dataloader.dataset,
                batch_sampler=SkipBatchSampler(_own_epoch_counter(dataloader.batch_sampler), num_batches),
                **common,
                **kwargs,
            )
        return new
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"skip_first_batches expects a DataLoader, got {type(dataloader).__name__}")
    kwargs = _loader_kwargs(dataloader)
    if isinstance(dataloader.dataset, IterableDataset):
        return SkipDataLoader(
            dataloader.dataset,
            skip_batches=num_batches,
            batch_size=dataloader.batch_size,
            drop_last=dataloader.drop_last,
            **kwargs,
        )
    return DataLoader(
        dataloader.dataset, batch_sampler=SkipBatchSampler(dataloader.batch_sampler, num_batches), **kwargs
    )
