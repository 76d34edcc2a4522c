"""Sharded data loaders: each process sees its own slice of every global batch.

``prepare_data_loader`` rebuilds a ``torch.utils.data.DataLoader`` so that process ``i`` of ``n``
iterates over its part of the data (``BatchSamplerShard`` for map-style datasets,
``IterableDatasetShard`` for iterable ones), moves batches to the device, keeps the random
samplers of all processes in step (``SeedableRandomSampler`` or a synchronised generator) and tells
``GradientState`` when the last batch is being served and how many of its samples are real.
``skip_first_batches`` resumes a loader mid-epoch without loading the skipped samples.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler

from .logging import get_logger
from .samplers import (
    BatchSamplerShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    _own_epoch_counter,
    _shard_batch_sampler,
    _usable_rng_types,
)
from .state import GradientState, PartialState
from .stateful import LoaderPosition, make_stateful_loader
from .utils.enums import DistributedType, RNGType
from .utils.imports import is_torch_xla_available
from .utils.operations import (
    broadcast,
    broadcast_object_list,
    concatenate,
    find_batch_size,
    get_data_structure,
    initialize_tensors,
    recursively_apply,
    send_to_device,
    slice_tensors,
)
from .utils.package_checks import is_datasets_available, is_torchdata_stateful_dataloader_available
from .utils.random import synchronize_rng_states
from .utils.versions import compare_versions, is_torch_version

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


# DataLoader constructor arguments carried over when a loader is rebuilt around a new sampler.
_LOADER_KWARGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)
_LOADER_DEFAULTS: dict[str, Any] = {
    "num_workers": 0,
    "collate_fn": None,
    "pin_memory": False,
    "timeout": 0,
    "worker_init_fn": None,
    "multiprocessing_context": None,
    "generator": None,
    "prefetch_factor": None,
    "persistent_workers": False,
    "pin_memory_device": "",
    "in_order": True,
}


class _DataLoaderStateMixin:
    """Book-keeping shared by the prepared loaders: epoch, end-of-data flag, remainder, GradientState."""

    end_of_dataloader: bool = False
    remainder: int = -1

    def set_epoch(self, epoch: int) -> None:
        """Select ``epoch``'s shuffling in the sampler (or iterable dataset) behind this loader."""
        self.iteration = epoch
        sampler = find_sampler(self)
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def _begin(self) -> None:
        self.end_of_dataloader = False
        self.remainder = self._compute_remainder()
        self.gradient_state = GradientState()
        self.gradient_state._add_dataloader(self)
        self._publish()

    def _mark_last_batch(self) -> None:
        self.end_of_dataloader = True
        self._publish()

    def _finish(self) -> None:
        self.gradient_state._remove_dataloader(self)

    def _publish(self) -> None:
        # GradientState answers end_of_dataloader/remainder for the active loader; keep it current.
        gs = self.gradient_state
        if gs.active_dataloader is self:
            gs._set_end_of_dataloader(self.end_of_dataloader)
            gs._set_remainder(self.remainder)

    # Accelerate 1.15's public names for the same book-keeping (custom loaders call them).
    def reset(self) -> None:
        """Forget the end-of-data flag and the remainder (a new iteration starts)."""
        self.end_of_dataloader = False
        self.remainder = -1

    def begin(self) -> None:
        """Start an iteration: reset, and register this loader as GradientState's active one."""
        self._begin()

    def end(self) -> None:
        """Finish an iteration: this loader stops being GradientState's active one."""
        self._finish()

    def _compute_remainder(self) -> int:
        # Known up front from the length of what is iterated: for a sharded stream that is the
        # padded stream (so 0: its padding completes the last batch and gather_for_metrics keeps
        # it, as in Accelerate); a dispatcher learns it from its last batch instead.
        if self._drop_last or isinstance(self, DataLoaderDispatcher):
            return -1
        try:
            length = len(self.dataset)
        except TypeError:
            return -1
        if isinstance(self.dataset, IterableDatasetShard):
            length *= self.dataset.num_processes
        total = self.total_batch_size
        return length % total if total else -1


# Accelerate's name for the mixin (custom loaders subclass it).
DataLoaderStateMixin = _DataLoaderStateMixin


class DataLoaderShard(_DataLoaderStateMixin, DataLoader):
    """A ``DataLoader`` serving one process's batches, on its device, one batch ahead.

    Reading one batch ahead lets it flag the last batch (``end_of_dataloader``) while that batch is
    being used, which gradient accumulation and ``gather_for_metrics`` rely on.
    """

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
        _total_batch_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, **kwargs)
        self.use_stateful_dataloader = use_stateful_dataloader
        # Iterated in our place when the position must survive a checkpoint (see stateful.py).
        self._position = (
            LoaderPosition(make_stateful_loader(dataset, **kwargs)) if use_stateful_dataloader else None
        )
        self.device = device
        self.rng_types = rng_types
        self.synchronized_generator = synchronized_generator
        self.skip_batches = skip_batches
        self._drop_last = _drop_last
        self._non_blocking = _non_blocking
        self._total_batch_size = _total_batch_size
        self.iteration = 0

    @property
    def total_batch_size(self) -> int | None:
        """Return the number of samples one step consumes over all processes."""
        if self._total_batch_size is not None:
            return self._total_batch_size
        return self.batch_size

    @property
    def total_dataset_length(self) -> int:
        """Return the length of the underlying (unsharded) dataset."""
        return len(_unsharded(self.dataset))

    def __iter__(self) -> Iterator[Any]:
        if self.rng_types:
            synchronize_rng_states(self.rng_types, self.synchronized_generator)
        self._begin()
        try:
            if self._position is not None:
                iterator = self._position.start(self.synchronized_generator)
            else:
                # Creating the iterator draws the worker base seed from the loader's generator (or
                # the global RNG) exactly as a plain DataLoader does: the streams stay Accelerate's.
                iterator = super().__iter__()
            if self.skip_batches and isinstance(self.dataset, IterableDataset):
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
            self._finish()

    def state_dict(self) -> dict[str, Any]:
        """Return this loader's position in its epoch (needs ``use_stateful_dataloader=True``)."""
        return self._require_position().state_dict(self.iteration)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Return nothing; the next iteration resumes at the position ``state_dict`` recorded."""
        self._require_position().load_state_dict(state_dict)
        self.iteration = int(state_dict.get("iteration", self.iteration))

    def _require_position(self) -> LoaderPosition:
        if self._position is None:
            raise ValueError(
                "this prepared dataloader keeps no position: create the Accelerator with "
                "dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)"
            )
        return self._position

    def _place(self, batch: Any) -> Any:
        if self.device is None:
            return batch

        return send_to_device(batch, self.device, non_blocking=self._non_blocking)


_END = object()


def _unsharded(dataset: Any) -> Any:
    # Only our own shard wrapper is looked through (a user's Subset also has a .dataset attribute).
    return dataset.dataset if isinstance(dataset, IterableDatasetShard) else dataset


class DataLoaderDispatcher(_DataLoaderStateMixin, DataLoader):
    """A ``DataLoader`` read only on the main process, whose batches are sliced out to all processes.

    For data that cannot be sharded up front (a stream read once): process 0 reads a global batch,
    broadcasts it, and every process keeps its slice. A short last batch is padded with its own
    first samples so every process gets an equal slice; ``remainder`` records the real ones.
    """

    def __init__(
        self,
        dataset: Any,
        split_batches: bool = False,
        skip_batches: int = 0,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        slice_fn: Any = None,
        device: torch.device | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, **kwargs)

        state = PartialState()
        self.num_processes, self.process_index = state.num_processes, state.process_index
        self.split_batches = split_batches
        self.skip_batches = skip_batches
        self._drop_last = _drop_last
        self._non_blocking = _non_blocking
        self.slice_fn = slice_fn
        self.device = device if device is not None else state.device
        self.iteration = 0

    @property
    def total_batch_size(self) -> int | None:
        if self.batch_size is None:
            return None
        return self.batch_size if self.split_batches else self.batch_size * self.num_processes

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

    def __iter__(self) -> Iterator[Any]:
        self._begin()
        try:
            iterator = None
            if self.process_index == 0:
                # Draws the worker base seed from the global RNG, as a DataLoader does.
                iterator = super().__iter__()
            else:
                # The other processes read nothing but make the same draw (Accelerate's processes
                # each build the iterator), so every rank's global stream stays Accelerate's.
                torch.empty((), dtype=torch.int64).random_(generator=self.generator)
            skipped = 0
            current = self._exchange(iterator, broadcast_object_list)
            while current is not _END:
                following = self._exchange(iterator, broadcast_object_list)
                if skipped < self.skip_batches:
                    skipped += 1
                    current = following
                    continue
                size = find_batch_size(current)
                local = math.ceil(size / self.num_processes)
                if following is _END:
                    self.end_of_dataloader = True
                    if local * self.num_processes != size and self._drop_last:
                        break
                    self.remainder = size  # the real samples of the last global batch
                    self._publish()
                padded = _pad_batch(current, local * self.num_processes, size)
                lo = self.process_index * local
                part = (self.slice_fn or slice_tensors)(padded, slice(lo, lo + local))
                yield send_to_device(part, self.device, non_blocking=self._non_blocking)
                current = following
            self.iteration += 1
        finally:
            self._finish()

    def _exchange(self, iterator: Iterator[Any] | None, broadcast_object_list: Any) -> Any:
        payload = [None]
        if iterator is not None:
            batch = self._read_global_batch(iterator)
            payload = [None if batch is _END else _to_cpu(batch)]
        if self.num_processes > 1:
            broadcast_object_list(payload, from_process=0)
        return _END if payload[0] is None else payload[0]

    def __len__(self) -> int:
        whole = super().__len__()
        if self.split_batches:
            steps = whole
        else:
            steps = whole // self.num_processes if self._drop_last else math.ceil(whole / self.num_processes)
        return steps  # skipped batches included, as Accelerate counts them


def _to_cpu(batch: Any) -> Any:
    return send_to_device(batch, torch.device("cpu"))


def _pad_batch(batch: Any, target: int, size: int) -> Any:
    """Return ``batch`` grown to ``target`` samples by repeating its first samples."""
    if target == size:
        return batch

    def grow(tensor: torch.Tensor) -> torch.Tensor:
        reps = math.ceil(target / size)
        return torch.cat([tensor] * reps, dim=0)[:target]

    return recursively_apply(grow, batch)


class SkipDataLoader(DataLoader):
    """A plain ``DataLoader`` that skips its first ``skip_batches`` batches (read, then dropped)."""

    def __init__(self, dataset: Any, skip_batches: int = 0, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.skip_batches = skip_batches

    def __iter__(self) -> Iterator[Any]:
        for index, batch in enumerate(super().__iter__()):
            if index >= self.skip_batches:
                yield batch

    def __len__(self) -> int:
        return max(super().__len__() - self.skip_batches, 0)


def find_sampler(dataloader: Any) -> Sampler | None:
    """Return the innermost index sampler behind ``dataloader`` (through shard/skip wrappers)."""
    obj = getattr(dataloader, "batch_sampler", None)
    seen = 0
    while obj is not None and seen < 8:
        inner = getattr(obj, "batch_sampler", None)
        if inner is None:
            return getattr(obj, "sampler", None)
        obj, seen = inner, seen + 1
    return getattr(dataloader, "sampler", None)


def get_sampler(dataloader: Any) -> Sampler | None:
    """Return the sampler that orders ``dataloader``'s samples (looking through batch samplers and shard wrappers)."""
    return find_sampler(dataloader)


class DataLoaderAdapter(DataLoader):
    """A ``DataLoader`` (or, with ``use_stateful_dataloader``, torchdata's ``StatefulDataLoader``) to prepare.

    With the stateful loader, iteration, ``state_dict`` and ``load_state_dict`` go to a
    ``StatefulDataLoader`` built with the same arguments (resuming mid-epoch); without it this is a
    plain DataLoader whose ``state_dict`` raises, naming the flag to set.
    """

    def __init__(
        self, dataset: Any, use_stateful_dataloader: bool = False, batch_sampler: Any = None, **kwargs: Any
    ):
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self.use_stateful_dataloader = use_stateful_dataloader
        self.base_dataloader: Any = self
        if use_stateful_dataloader:
            if not is_torchdata_stateful_dataloader_available():
                raise ImportError(
                    "use_stateful_dataloader=True needs torchdata's StatefulDataLoader: pip install 'torchdata>=0.8.0'"
                )
            from torchdata.stateful_dataloader import StatefulDataLoader

            self.base_dataloader = StatefulDataLoader(dataset, batch_sampler=batch_sampler, **kwargs)

    def __iter__(self):
        if self.base_dataloader is self:
            return super().__iter__()
        return iter(self.base_dataloader)

    def __len__(self) -> int:
        return super().__len__() if self.base_dataloader is self else len(self.base_dataloader)

    def state_dict(self) -> dict[str, Any]:
        """Return the stateful loader's position (needs ``use_stateful_dataloader=True``)."""
        if self.base_dataloader is self:
            raise ValueError(
                "state_dict() needs a stateful loader: build it with use_stateful_dataloader=True "
                "(DataLoaderConfiguration(use_stateful_dataloader=True) in an Accelerator)"
            )
        return self.adjust_state_dict_for_prefetch(self.base_dataloader.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the stateful loader at the position ``state_dict`` describes."""
        if self.base_dataloader is self:
            raise ValueError(
                "load_state_dict() needs a stateful loader: build it with use_stateful_dataloader=True"
            )
        self.base_dataloader.load_state_dict(state_dict)

    def adjust_state_dict_for_prefetch(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Return ``state_dict`` as is: this loader yields batches as it fetches them (no batch held ahead)."""
        return state_dict


def _loader_kwargs(dataloader: DataLoader) -> dict[str, Any]:
    """Return the constructor arguments of ``dataloader`` that differ from DataLoader's defaults."""
    out = {}
    for name in _LOADER_KWARGS:
        if hasattr(dataloader, name):
            value = getattr(dataloader, name)
            if value != _LOADER_DEFAULTS[name]:
                out[name] = value
    if out.get("num_workers", 0) == 0:
        out.pop("prefetch_factor", None)
        out.pop("persistent_workers", None)
    return out


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
    its data-parallel ranks only: ranks of one tensor-parallel group read the same batches.
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
    _check_options(
        dataloader.batch_size, num_processes, split_batches, dispatch_batches, use_stateful_dataloader
    )
    if dispatch_batches:
        return _dispatching_loader(dataloader, split_batches, non_blocking, slice_fn_for_dispatch, device)
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
    batch_size = dataloader.batch_size
    return DataLoaderShard(
        dataset,
        device=device,
        rng_types=_usable_rng_types(rng_types, synchronized_generator),
        synchronized_generator=synchronized_generator,
        _drop_last=dataloader.drop_last,
        _non_blocking=non_blocking,
        _total_batch_size=None
        if batch_size is None
        else batch_size * (1 if split_batches else num_processes),
        use_stateful_dataloader=use_stateful_dataloader,
        **loader_args,
        **kwargs,
    )


def _check_options(
    batch_size: int | None,
    num_processes: int,
    split_batches: bool,
    dispatch_batches: bool,
    use_stateful_dataloader: bool,
) -> None:
    """Raise ValueError for option combinations ``prepare_data_loader`` cannot serve."""
    if split_batches and batch_size is not None and batch_size % num_processes != 0:
        raise ValueError(
            f"split_batches=True needs a batch size that is a round multiple of num_processes, got "
            f"batch_size={batch_size} for num_processes={num_processes}: change the batch size or use "
            "split_batches=False"
        )
    if dispatch_batches and use_stateful_dataloader:
        raise ValueError(
            "use_stateful_dataloader=True is not available with dispatch_batches=True (process 0 reads for "
            "everyone): set DataLoaderConfiguration(dispatch_batches=False)"
        )


def _dispatching_loader(
    dataloader: DataLoader,
    split_batches: bool,
    non_blocking: bool,
    slice_fn: Any,
    device: torch.device | None,
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
        loader_args = {"batch_size": batch_size, "drop_last": drop_last, "shuffle": False}
    return DataLoaderDispatcher(
        dataloader.dataset,
        split_batches=split_batches,
        _drop_last=drop_last,
        _non_blocking=non_blocking,
        slice_fn=slice_fn,
        device=device,
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
    if num_processes > 1:
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


def _data_parallel_share(mesh: Any) -> tuple[int, int]:
    """Return ``(data-parallel ranks, this rank's index)`` of a device mesh (its "dp" dims, else all of it)."""
    names = tuple(mesh.mesh_dim_names or ())
    dp = [name for name in ("dp_replicate", "dp_shard") if name in names]
    if not dp:
        return (1, 0) if "tp" in names else (mesh.size(), mesh.get_rank())
    coordinate, total, index = mesh.get_coordinate(), 1, 0
    for name in dp:  # replicate-major, as the mesh lays the ranks out
        dim = names.index(name)
        index = index * mesh.shape[dim] + coordinate[dim]
        total *= mesh.shape[dim]
    return total, index


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
            "_total_batch_size": dataloader._total_batch_size,
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
        new.iteration = dataloader.iteration
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
