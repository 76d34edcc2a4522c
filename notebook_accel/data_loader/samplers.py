"""Index samplers behind the prepared dataloaders: per-process shards, seedable shuffling, skipping.

``BatchSamplerShard`` hands process ``i`` of ``n`` its batches of a batch sampler,
``IterableDatasetShard`` does the same for a stream, ``SeedableRandomSampler`` shuffles from
``initial_seed + epoch`` only (same order on every process, replayable after a restart) and
``SkipBatchSampler`` drops the first batches (mid-epoch resume). Re-exported by ``data_loader``,
which also builds a prepared loader's batch sampler with the helpers at the end of this module.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from ..utils.operations import broadcast_object_list

__all__ = ["BatchSamplerShard", "IterableDatasetShard", "SeedableRandomSampler", "SkipBatchSampler"]


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose permutation depends only on ``initial_seed + epoch``.

    Every process builds the same permutation without communicating, and a run restored from a
    checkpoint (which records ``epoch``) replays exactly the permutation of the interrupted epoch.
    """

    def __init__(self, *args: Any, initial_seed: int = 0, **kwargs: Any) -> None:
        data_seed = kwargs.pop("data_seed", None)
        super().__init__(*args, **kwargs)
        self.initial_seed = int(data_seed if data_seed is not None else initial_seed)
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch`` for the next pass."""
        self.epoch = int(epoch)

    def state_dict(self) -> dict[str, int]:
        """Return what is needed to replay the current epoch's permutation."""
        return {"epoch": self.epoch, "initial_seed": self.initial_seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.initial_seed = int(state["initial_seed"])


def _check_fixed_batch_size(batch_size: Any, source: str) -> None:
    """Raise ValueError unless ``batch_size`` is a natural number (split_batches cuts fixed-size batches)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"split_batches=True needs a fixed batch size to split, but the {source} has batch_size="
            f"{batch_size!r}: give the DataLoader (or its batch sampler) a batch_size, or use "
            "split_batches=False"
        )


class BatchSamplerShard(BatchSampler):
    """Yield process ``process_index``'s share of the batches of ``batch_sampler``.

    With ``split_batches=False`` the process takes every ``num_processes``-th batch (the global
    batch is ``num_processes`` times the loader's); with ``split_batches=True`` every batch is cut in
    ``num_processes`` equal parts. With ``even_batches`` the last round is completed with samples
    from the start of the data so every process gets the same number of full batches; the
    dataloader records how many samples of that round are real (``GradientState.remainder``).
    """

    def __init__(
        self,
        batch_sampler: Iterable[list[int]],
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        if num_processes < 1 or not 0 <= process_index < num_processes:
            raise ValueError(
                f"process_index={process_index} is out of range for num_processes={num_processes}: "
                "need 0 <= process_index < num_processes"
            )
        batch_size = getattr(batch_sampler, "batch_size", None)
        if split_batches:
            _check_fixed_batch_size(batch_size, type(batch_sampler).__name__)
        if split_batches and batch_size is not None and batch_size % num_processes != 0:
            raise ValueError(
                f"split_batches=True needs a batch size that is a round multiple of num_processes, got "
                f"batch_size={batch_size} for num_processes={num_processes}: change the batch size or "
                "use split_batches=False"
            )
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size = batch_size
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))
        self.sampler = getattr(batch_sampler, "sampler", None)

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        n, length = self.num_processes, len(self.batch_sampler)
        if self.split_batches:
            return length
        if self.drop_last:
            return length // n
        if self.even_batches:
            return math.ceil(length / n)
        return length // n + (1 if self.process_index < length % n else 0)

    def __iter__(self) -> Iterator[list[int]]:
        return self._iter_split() if self.split_batches else self._iter_rounds()

    def _iter_split(self) -> Iterator[list[int]]:
        n, i = self.num_processes, self.process_index
        first: list[int] | None = None
        for batch in self.batch_sampler:
            batch = list(batch)
            if first is None:
                first = batch
            size = self.batch_size or len(first)
            if len(batch) < size:
                if self.drop_last:
                    return
                if self.even_batches:
                    batch = batch + _cycle(first, size - len(batch))
            if self.batch_size is None and len(batch) % n != 0:
                raise ValueError(
                    f"split_batches=True needs batches whose length is a multiple of num_processes={n}, "
                    f"got a batch of {len(batch)}"
                )
            # Each process owns a fixed slice of a full batch: a short last batch (even_batches=False)
            # fills the first slices and leaves later processes short or empty, as in Accelerate 1.15.
            chunk = size // n if self.batch_size is not None else len(batch) // n
            mine = batch[i * chunk : (i + 1) * chunk]
            if mine:
                yield mine

    def _iter_rounds(self) -> Iterator[list[int]]:
        n, i = self.num_processes, self.process_index
        round_: list[list[int]] = []
        first_indices: list[int] = []
        first_batches: list[list[int]] = []
        for batch in self.batch_sampler:
            batch = list(batch)
            if len(first_batches) < n:
                first_batches.append(batch)
            if len(round_) == n:
                # The held round had a short batch that was not the last one (a sampler of varying
                # batch sizes): nothing to pad, serve it as it is.
                yield round_[i]
                round_ = []
            if len(first_indices) < (self.batch_size or len(batch)) * n:
                first_indices.extend(batch)
            round_.append(batch)
            if len(round_) == n and (
                self.batch_size is None or all(len(b) == self.batch_size for b in round_)
            ):
                yield round_[i]
                round_ = []
        if not round_ or self.drop_last:
            return
        if not self.even_batches:
            if i < len(round_):
                yield round_[i]
            return
        # Complete the last round: pad the short batch and add missing batches by cycling
        # through the first samples, so every process runs the same number of full steps.
        if self.batch_size is None:
            # Batches of no fixed size: the missing ones are the first batches again, whole.
            round_ += _Cycler(first_batches).take(n - len(round_))
            yield round_[i]
            return
        filler = _Cycler(first_indices)
        round_ = [b + filler.take(self.batch_size - len(b)) for b in round_]
        while len(round_) < n:
            round_.append(filler.take(self.batch_size))
        yield round_[i]


def _cycle(indices: list[int], count: int) -> list[int]:
    return _Cycler(indices).take(count)


class _Cycler:
    """Hand out ``count`` items at a time from ``items`` repeated endlessly."""

    def __init__(self, items: list[Any]) -> None:
        if not items:
            raise ValueError("cannot pad batches of an empty dataset")
        self.items, self.pos = items, 0

    def take(self, count: int) -> list[Any]:
        out = []
        for _ in range(max(count, 0)):
            out.append(self.items[self.pos % len(self.items)])
            self.pos += 1
        return out


class IterableDatasetShard(IterableDataset):
    """Process ``process_index``'s share of an iterable dataset, read in global batches.

    Items are read ``batch_size * num_processes`` at a time (``batch_size`` with ``split_batches``)
    and each process keeps its slice; an incomplete last buffer is padded with the first items
    unless ``drop_last``. ``last_real_count`` tells how many items of that last buffer were real.
    """

    def __init__(
        self,
        dataset: Iterable,
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
    ) -> None:
        self.dataset = dataset
        self.batch_size, self.drop_last, self.split_batches = batch_size, drop_last, split_batches
        self.num_processes, self.process_index = num_processes, process_index
        self.last_real_count = -1  # known once the last buffer has been read
        if split_batches and batch_size > 1 and batch_size % num_processes:
            raise ValueError(
                f"IterableDatasetShard: with split_batches=True each global batch is cut into num_processes "
                f"equal slices, so batch_size={batch_size} must be a multiple of num_processes={num_processes}"
            )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        global_size = self.batch_size if self.split_batches else self.batch_size * self.num_processes
        local_size = global_size // self.num_processes
        length = len(self.dataset)  # type: ignore[arg-type]
        if self.drop_last:
            return (length // global_size) * local_size
        return math.ceil(length / global_size) * local_size

    def __iter__(self) -> Iterator[Any]:
        global_size = self.batch_size if self.split_batches else self.batch_size * self.num_processes
        local_size = global_size // self.num_processes
        lo, hi = self.process_index * local_size, (self.process_index + 1) * local_size
        self.last_real_count = -1
        first: list[Any] | None = None
        buffer: list[Any] = []
        for item in self.dataset:
            buffer.append(item)
            if len(buffer) == global_size:
                if first is None:
                    first = buffer
                yield from buffer[lo:hi]
                buffer = []
        if buffer and not self.drop_last:
            self.last_real_count = len(buffer)
            buffer = buffer + _Cycler(first or list(buffer)).take(global_size - len(buffer))
            yield from buffer[lo:hi]


class SkipBatchSampler(BatchSampler):
    """A batch sampler that drops the first ``skip_batches`` batches of ``batch_sampler``."""

    def __init__(self, batch_sampler: Iterable[list[int]], skip_batches: int = 0) -> None:
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)
        self.sampler = getattr(batch_sampler, "sampler", None)

    def __iter__(self) -> Iterator[list[int]]:
        for index, batch in enumerate(self.batch_sampler):
            if index >= self.skip_batches:
                yield batch

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip_batches, 0)


# ------------------------------------------------------------------ building a prepared loader's sampler


def _shard_batch_sampler(
    dataloader: DataLoader,
    num_processes: int,
    process_index: int,
    split_batches: bool,
    even_batches: bool,
    use_seedable_sampler: bool,
    data_seed: int | None,
    rng_types: list[str],
) -> tuple[Any, torch.Generator | None]:
    """Return ``(batch_sampler, synchronized_generator)`` for this process's share of a map-style loader.

    A ``RandomSampler`` becomes a :class:`SeedableRandomSampler` (``use_seedable_sampler``) or gets a
    generator synchronised from process 0 (then ``"generator"`` is appended to ``rng_types``).
    """
    synchronized_generator = None
    sampler = dataloader.sampler
    batch_sampler = dataloader.batch_sampler
    if isinstance(sampler, RandomSampler) and not isinstance(sampler, SeedableRandomSampler):
        if use_seedable_sampler:
            seed = _shared_seed(data_seed, num_processes)
            sampler = SeedableRandomSampler(
                data_source=sampler.data_source,
                replacement=sampler.replacement,
                num_samples=sampler._num_samples,
                initial_seed=seed,
            )
        elif num_processes > 1:
            # Same permutation on every process: its generator is broadcast from process 0 each epoch.
            synchronized_generator = sampler.generator
            if synchronized_generator is None:
                # Seeded from the global RNG like a plain RandomSampler; process 0's state is then
                # broadcast at every epoch, so processes seeded differently still agree.
                synchronized_generator = torch.Generator()
                synchronized_generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
                sampler.generator = synchronized_generator
            if "generator" not in rng_types:
                rng_types.append("generator")
        if isinstance(batch_sampler, BatchSampler) and type(batch_sampler) is BatchSampler:
            batch_sampler = BatchSampler(
                sampler, batch_size=batch_sampler.batch_size, drop_last=batch_sampler.drop_last
            )
        elif batch_sampler is not None and hasattr(batch_sampler, "sampler"):
            batch_sampler.sampler = sampler
    if num_processes > 1:
        batch_sampler = BatchSamplerShard(
            batch_sampler,
            num_processes=num_processes,
            process_index=process_index,
            split_batches=split_batches,
            even_batches=even_batches,
        )
    return batch_sampler, synchronized_generator


def _usable_rng_types(rng_types: list[str], generator: torch.Generator | None) -> list[str] | None:
    # A "generator" entry is meaningful only with a generator to synchronise.
    kept = [str(getattr(r, "value", r)) for r in rng_types]
    if generator is None:
        kept = [r for r in kept if r != "generator"]
    return kept or None


def _shared_seed(data_seed: int | None, num_processes: int) -> int:
    """Return ``data_seed`` or process 0's torch seed, the same on every process."""
    seed = int(data_seed) if data_seed is not None else int(torch.initial_seed() % (2**63))
    if num_processes > 1 and data_seed is None:
        box = [seed]
        broadcast_object_list(box, from_process=0)
        seed = int(box[0])
    return seed


def _own_epoch_counter(batch_sampler: Any) -> Any:
    """Return ``batch_sampler`` with shallow copies down to a seedable sampler, if there is one.

    The loader ``skip_first_batches`` builds then counts its epoch on its own sampler: after it, the
    original loader replays the epoch it was at (Accelerate 1.15 behaves so; ``set_epoch`` selects
    another), instead of the skipped loader moving it on.
    """
    chain, obj = [], batch_sampler
    while obj is not None and not isinstance(obj, SeedableRandomSampler) and len(chain) < 8:
        chain.append(obj)
        obj = getattr(obj, "batch_sampler", None) or getattr(obj, "sampler", None)
    if not isinstance(obj, SeedableRandomSampler):
        return batch_sampler
    seedable = copy.copy(obj)
    inner: Any = seedable
    for level in reversed(chain):
        level = copy.copy(level)
        if getattr(level, "batch_sampler", None) is not None:
            level.batch_sampler = inner
        if isinstance(getattr(level, "sampler", None), SeedableRandomSampler):
            level.sampler = seedable
        inner = level
    return inner
