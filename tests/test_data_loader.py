"""Sharded samplers and loaders: which indices each process gets, padding, skipping, seeding."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler, TensorDataset

from notebook_accel.data_loader import (
    BatchSamplerShard,
    DataLoaderShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    prepare_data_loader,
    skip_first_batches,
)
from tests._dist import run_distributed


def _shards(n: int, batch_size: int, drop_last: bool = False, **kwargs) -> list[list[list[int]]]:
    sampler = BatchSampler(SequentialSampler(range(n)), batch_size=batch_size, drop_last=drop_last)
    return [list(BatchSamplerShard(sampler, 2, i, **kwargs)) for i in range(2)]


def test_batch_sampler_shard_takes_batches_in_turn_and_pads_last_round() -> None:
    # 24 samples, batch 3: 8 batches, 4 rounds, nothing to pad
    s0, s1 = _shards(24, 3)
    assert s0 == [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]]
    assert s1 == [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21, 22, 23]]
    # 22 samples: the last round [18,19,20] + [21] is completed from the start
    s0, s1 = _shards(22, 3)
    assert s0[-1] == [18, 19, 20] and s1[-1] == [21, 0, 1]
    # 21 samples: 7 batches, process 1 gets a whole batch of padding
    s0, s1 = _shards(21, 3)
    assert s0[-1] == [18, 19, 20] and s1[-1] == [0, 1, 2]
    assert (
        len(s0)
        == len(s1)
        == len(BatchSamplerShard(BatchSampler(SequentialSampler(range(21)), 3, False), 2, 0))
    )
    # 2 samples: fewer than a round, padding cycles the few there are
    s0, s1 = _shards(2, 3)
    assert s0 == [[0, 1, 0]] and s1 == [[1, 0, 1]]


def test_batch_sampler_shard_with_varying_batch_sizes() -> None:
    batches = [[0], [1, 2, 3], [4, 5], [6], [7, 8, 9]]  # a bucketing sampler without batch_size
    s0, s1 = (list(BatchSamplerShard(batches, 2, i)) for i in range(2))
    # the missing batch is the first batch again, whole (Accelerate 1.15 gives the same)
    assert s0 == [[0], [4, 5], [7, 8, 9]] and s1 == [[1, 2, 3], [6], [0]]
    s0, s1 = (list(BatchSamplerShard(batches, 2, i, even_batches=False)) for i in range(2))
    assert s0 == [[0], [4, 5], [7, 8, 9]] and s1 == [[1, 2, 3], [6]]
    batches = [[0, 1], [2, 3, 4], [5], [6, 7, 8], [9]]
    s0, s1 = (list(BatchSamplerShard(batches, 2, i)) for i in range(2))
    assert s0 == [[0, 1], [5], [9]] and s1 == [[2, 3, 4], [6, 7, 8], [0, 1]]


def test_batch_sampler_shard_uneven_drop_last_and_split() -> None:
    s0, s1 = _shards(22, 3, even_batches=False)
    assert s0[-1] == [18, 19, 20] and s1[-1] == [21]
    s0, s1 = _shards(21, 3, even_batches=False)
    assert len(s0) == 4 and len(s1) == 3
    assert [
        len(BatchSamplerShard(BatchSampler(SequentialSampler(range(21)), 3, False), 2, i, even_batches=False))
        for i in range(2)
    ] == [4, 3]
    s0, s1 = _shards(22, 3, drop_last=True)
    assert s0[-1] == [12, 13, 14] and s1[-1] == [15, 16, 17] and len(s0) == 3
    s0, s1 = _shards(10, 4, split_batches=True)
    assert s0 == [[0, 1], [4, 5], [8, 9]] and s1 == [[2, 3], [6, 7], [0, 1]]
    s0, s1 = _shards(10, 4, split_batches=True, even_batches=False)
    # As Accelerate 1.15: each process owns a fixed slice of a full batch, so the short last batch
    # [8, 9] is all process 0's and process 1 has one batch less.
    assert s0 == [[0, 1], [4, 5], [8, 9]] and s1 == [[2, 3], [6, 7]]
    with pytest.raises(ValueError, match="batch_size=3 for num_processes=2"):
        BatchSamplerShard(BatchSampler(SequentialSampler(range(9)), 3, False), 2, 0, split_batches=True)
    with pytest.raises(ValueError, match="process_index=2 is out of range"):
        BatchSamplerShard(BatchSampler(SequentialSampler(range(9)), 3, False), 2, 2)


class _Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


def test_iterable_dataset_shard() -> None:
    shards = [
        list(IterableDatasetShard(_Stream(11), batch_size=2, num_processes=2, process_index=i))
        for i in range(2)
    ]
    assert shards[0] == [0, 1, 4, 5, 8, 9]
    assert shards[1] == [2, 3, 6, 7, 10, 0]
    shard = IterableDatasetShard(_Stream(11), batch_size=2, num_processes=2, process_index=1)
    list(shard)
    assert shard.last_real_count == 3 and len(shard) == 6
    dropped = [list(IterableDatasetShard(_Stream(11), 2, True, 2, i)) for i in range(2)]
    assert dropped == [[0, 1, 4, 5], [2, 3, 6, 7]]
    split = [
        list(IterableDatasetShard(_Stream(8), 4, num_processes=2, process_index=i, split_batches=True))
        for i in range(2)
    ]
    assert split == [[0, 1, 4, 5], [2, 3, 6, 7]]
    with pytest.raises(ValueError, match="batch_size=3 must be a multiple of num_processes=2"):
        IterableDatasetShard(_Stream(8), 3, num_processes=2, split_batches=True)


def test_seedable_sampler_replays_epochs() -> None:
    data = list(range(10))
    a, b = SeedableRandomSampler(data, initial_seed=3), SeedableRandomSampler(data, initial_seed=3)
    first, second = list(a), list(a)
    assert first != second and sorted(first) == data  # a new permutation each epoch
    b.load_state_dict({"epoch": 1, "initial_seed": 3})
    assert list(b) == second and b.state_dict() == {"epoch": 2, "initial_seed": 3}
    b.set_epoch(0)
    assert list(b) == first


def test_single_process_loader_flags_last_batch_and_skips() -> None:
    from notebook_accel.state import GradientState

    loader = prepare_data_loader(
        DataLoader(TensorDataset(torch.arange(10)), batch_size=4), torch.device("cpu"), put_on_device=True
    )
    assert isinstance(loader, DataLoaderShard) and len(loader) == 3
    flags = []
    for (x,) in loader:
        flags.append((x.tolist(), GradientState().end_of_dataloader, GradientState().remainder))
    assert flags[-1] == ([8, 9], True, 2) and not flags[0][1]
    assert GradientState().active_dataloader is None
    skipped = skip_first_batches(loader, 2)
    assert [x.tolist() for (x,) in skipped] == [[8, 9]] and len(skipped) == 1
    subset = prepare_data_loader(
        DataLoader(torch.utils.data.Subset(list(range(100)), range(5)), batch_size=2)
    )
    assert [(b.tolist(), subset.remainder) for b in subset][-1] == (
        [4],
        1,
    ) and subset.total_dataset_length == 5
    workers = prepare_data_loader(DataLoader(list(range(10)), batch_size=4, num_workers=2))
    assert [b.tolist() for b in workers] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] and workers.num_workers == 2
    plain = skip_first_batches(DataLoader(list(range(6)), batch_size=2), 1)
    assert [b.tolist() for b in plain] == [[2, 3], [4, 5]]
    stream = skip_first_batches(DataLoader(_Stream(6), batch_size=2), 2)
    assert [b.tolist() for b in stream] == [[4, 5]] and len(stream) == 1
    assert list(SkipBatchSampler([[0], [1], [2]], 1)) == [[1], [2]]
    with pytest.raises(TypeError, match="expects a DataLoader"):
        skip_first_batches([1, 2], 1)
    with pytest.raises(
        ValueError, match=r"needs a fixed batch size to split, but the list has batch_size=None"
    ):
        BatchSamplerShard([[0, 1, 2]], 2, 0, split_batches=True)
    with pytest.raises(ValueError, match="num_batches must be >= 0"):
        skip_first_batches(loader, -1)
    with pytest.raises(TypeError, match="expects a torch.utils.data.DataLoader"):
        prepare_data_loader([1, 2, 3])
    with pytest.raises(ValueError, match="batch_size=3 for num_processes=2"):
        prepare_data_loader(
            DataLoader(list(range(6)), batch_size=3), num_processes=2, process_index=0, split_batches=True
        )


def _loader_worker() -> dict:
    from notebook_accel import Accelerator
    from notebook_accel.utils import DataLoaderConfiguration

    out = {}
    # shuffled, synchronised generator (default sampler): ranks see disjoint halves each epoch
    acc = Accelerator()
    torch.manual_seed(acc.process_index)  # different global seeds: the loader must still agree
    loader = acc.prepare(DataLoader(list(range(16)), batch_size=2, shuffle=True))
    out["epochs"] = [torch.cat(list(loader)).tolist() for _ in range(2)]
    # rng_types=["torch"]: the global torch RNG is broadcast from rank 0 when an epoch starts
    acc.rng_types = ["torch"]
    synced = acc.prepare(DataLoader(list(range(4)), batch_size=2))
    out["before_sync"] = torch.rand(2)
    next(iter(synced))
    out["after_sync"] = torch.rand(2)
    # iterable dataset: dispatched from rank 0 by default
    stream = acc.prepare(DataLoader(_Stream(11), batch_size=2))
    out["stream"] = [b.tolist() for b in stream]
    out["stream_type"] = type(stream).__name__
    out["stream_skipped"] = [b.tolist() for b in skip_first_batches(stream, 1)]
    # iterable dataset sharded in place (dispatch_batches=False)
    acc.dataloader_config = DataLoaderConfiguration(dispatch_batches=False)
    sharded = acc.prepare(DataLoader(_Stream(11), batch_size=2))
    metrics = []
    for b in sharded:
        metrics.append(acc.gather_for_metrics(b))
    out["sharded_metrics"] = torch.cat(metrics).tolist()
    # split_batches: each process gets half of every batch
    acc.dataloader_config = DataLoaderConfiguration(split_batches=True)
    split = acc.prepare(DataLoader(list(range(8)), batch_size=4))
    out["split"] = [b.tolist() for b in split]
    return out


def test_loaders_on_two_processes() -> None:
    r0, r1 = run_distributed(_loader_worker, nprocs=2)
    for e in range(2):
        assert sorted(r0["epochs"][e] + r1["epochs"][e]) == list(range(16))
    assert r0["epochs"][0] != r0["epochs"][1]
    assert not torch.equal(r0["before_sync"], r1["before_sync"]) and torch.equal(
        r0["after_sync"], r1["after_sync"]
    )
    assert r0["stream_type"] == "DataLoaderDispatcher"
    # The last global batch [8, 9, 10] is completed with the epoch's first sample (Accelerate 1.15
    # gives [10, 0] too, skipped batches included: the first batch read, not the first served).
    assert r0["stream"] == [[0, 1], [4, 5], [8, 9]] and r1["stream"] == [[2, 3], [6, 7], [10, 0]]
    assert r0["stream_skipped"] == [[4, 5], [8, 9]] and r1["stream_skipped"] == [[6, 7], [10, 0]]
    # sharded in place, the shard pads its last global batch and reports remainder 0 up front, so
    # gather_for_metrics keeps the padding sample (Accelerate 1.15 does the same; dispatching is exact)
    assert r0["sharded_metrics"] == list(range(11)) + [0]
    assert r0["split"] == [[0, 1], [4, 5]] and r1["split"] == [[2, 3], [6, 7]]
