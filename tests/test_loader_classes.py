"""DataLoaderShard, DataLoaderDispatcher and SkipDataLoader built directly, with Accelerate 1.15's parameters.

The expected batches are the ones Accelerate 1.15 yields for the same constructor calls (recorded
with its ``debug_launcher`` on 2 CPU processes and in one plain process; see the comments): what a
parameter does (``skip_batches``, ``iteration``, ``rng_types``, ``synchronized_generator``,
``slice_fn``, ``torch_device_mesh``, ``_non_blocking``, ``_drop_last``, ``use_stateful_dataloader``)
is checked by its effect on the batches, flags and devices.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from notebook_accel.data_loader import (
    BatchSamplerShard,
    DataLoaderDispatcher,
    DataLoaderShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipDataLoader,
)
from notebook_accel.state import AcceleratorState, GradientState, PartialState
from tests._dist import run_distributed


def _lists(loader) -> list:
    return [b.tolist() for b in loader]


class _Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(range(self.n))


class _Moved:
    """A batch whose ``.to`` records how it was called (send_to_device uses it)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def to(self, device, non_blocking=False):
        self.calls.append((str(device), non_blocking))
        return self


def test_shard_skips_batches_and_sizes_its_global_batch() -> None:
    data = list(range(10))
    # Accelerate 1.15: [[6, 7, 8], [9]] for both kinds of dataset; len still counts the skipped ones.
    skipping = DataLoaderShard(data, batch_size=3, skip_batches=2)
    assert _lists(skipping) == [[6, 7, 8], [9]] and len(skipping) == 4
    assert _lists(DataLoaderShard(_Stream(10), batch_size=3, skip_batches=2)) == [[6, 7, 8], [9]]
    assert skipping.total_batch_size == 3 and skipping.total_dataset_length == 10
    # total_batch_size comes from the shard behind the loader (Accelerate: 4, 4 and 3).
    shard = BatchSamplerShard(BatchSampler(SequentialSampler(data), 2, False), 2, 1)
    by_turns = DataLoaderShard(data, batch_sampler=shard)
    assert _lists(by_turns) == [[2, 3], [6, 7], [0, 1]] and by_turns.total_batch_size == 4
    split = BatchSamplerShard(BatchSampler(SequentialSampler(data), 4, False), 2, 1, split_batches=True)
    assert DataLoaderShard(data, batch_sampler=split).total_batch_size == 4
    plain = BatchSampler(SequentialSampler(data), 3, False)
    assert DataLoaderShard(data, batch_sampler=plain).total_batch_size == 3
    stream = IterableDatasetShard(_Stream(10), batch_size=2, num_processes=2, process_index=1)
    assert _lists(DataLoaderShard(stream, batch_size=2)) == [[2, 3], [6, 7], [0, 1]]
    with pytest.raises(ValueError, match="skip_batches must be >= 0, got -1"):
        DataLoaderShard(data, batch_size=3, skip_batches=-1)


def test_shard_gives_iteration_to_set_epoch_and_counts_passes() -> None:
    data = list(range(10))
    # Accelerate 1.15, SeedableRandomSampler(data_seed=5): epoch 0 and 1 orders, and iteration=3
    # gives epoch 3's order (the sampler's own epoch is overridden at the start of every pass).
    epoch0, epoch1 = [1, 4, 9, 6, 3, 5, 0, 2, 8, 7], [0, 7, 5, 1, 8, 3, 9, 2, 4, 6]
    epoch3 = [3, 5, 0, 1, 2, 6, 4, 7, 8, 9]
    loader = DataLoaderShard(data, batch_size=10, sampler=SeedableRandomSampler(data, data_seed=5))
    assert _lists(loader) == [epoch0] and _lists(loader) == [epoch1] and loader.iteration == 2
    resumed = DataLoaderShard(
        data, batch_size=10, sampler=SeedableRandomSampler(data, data_seed=5), iteration=3
    )
    assert _lists(resumed) == [epoch3] and resumed.iteration == 4
    sampler = SeedableRandomSampler(data, data_seed=5)
    sampler.set_epoch(2)  # set on the sampler only: the loader's iteration (0) wins
    assert _lists(DataLoaderShard(data, batch_size=10, sampler=sampler)) == [epoch0]
    stream = _Stream(2)
    DataLoaderShard(stream, batch_size=1, iteration=5).__iter__().__next__()
    assert stream.epoch == 5


def test_shard_flags_the_last_batch_and_places_batches_non_blocking() -> None:
    loader = DataLoaderShard(list(range(10)), batch_size=4)
    seen = [(b.tolist(), loader.end_of_dataloader, GradientState().remainder) for b in loader]
    assert seen == [([0, 1, 2, 3], False, 2), ([4, 5, 6, 7], False, 2), ([8, 9], True, 2)]
    dropping = DataLoaderShard(list(range(10)), batch_size=4, _drop_last=True)
    assert [dropping.remainder for _ in dropping] == [-1, -1, -1]
    for flag in (True, False):
        batch = _Moved()
        moved = DataLoaderShard(
            [batch], batch_size=1, collate_fn=lambda items: items[0], device="cpu", _non_blocking=flag
        )
        assert list(moved) == [batch] and batch.calls == [("cpu", flag)]
    unplaced = _Moved()
    list(DataLoaderShard([unplaced], batch_size=1, collate_fn=lambda items: items[0]))
    assert unplaced.calls == []  # no device: batches stay where the collate put them


def test_skip_data_loader() -> None:
    # Accelerate 1.15: [[6, 7, 8], [9]] (len 2), [] past the end, [[4, 5, 6, 7], [8, 9]] for a stream.
    loader = SkipDataLoader(list(range(10)), skip_batches=2, batch_size=3)
    assert _lists(loader) == [[6, 7, 8], [9]] and len(loader) == 2
    assert _lists(SkipDataLoader(list(range(10)), skip_batches=9, batch_size=3)) == []
    assert len(SkipDataLoader(list(range(10)), skip_batches=9, batch_size=3)) == 0
    assert _lists(SkipDataLoader(_Stream(10), skip_batches=1, batch_size=4)) == [[4, 5, 6, 7], [8, 9]]
    # It is GradientState's active loader while iterated, but (as in Accelerate) flags no last batch.
    flags = [
        (GradientState().active_dataloader is loader, loader.end_of_dataloader, loader.remainder)
        for _ in loader
    ]
    assert flags == [(True, False, -1), (True, False, -1)]
    assert GradientState().active_dataloader is None
    with pytest.raises(ValueError, match="use_stateful_dataloader=True"):
        loader.state_dict()
    with pytest.raises(ValueError, match="skip_batches must be >= 0, got -2"):
        SkipDataLoader(list(range(4)), skip_batches=-2)


def test_stateful_skip_data_loader_resumes() -> None:
    pytest.importorskip("torchdata")
    loader = SkipDataLoader(list(range(10)), skip_batches=1, batch_size=2, use_stateful_dataloader=True)
    iterator = iter(loader)
    assert next(iterator).tolist() == [2, 3]
    state = loader.state_dict()
    resumed = SkipDataLoader(list(range(10)), skip_batches=0, batch_size=2, use_stateful_dataloader=True)
    resumed.load_state_dict(state)
    assert _lists(resumed) == [[4, 5], [6, 7], [8, 9]]


def test_prepared_loaders_pickle() -> None:
    # Accelerate 1.15 documents a __reduce__ for the three: a pickled loader serves the same batches.
    shard = pickle.loads(
        pickle.dumps(DataLoaderShard(list(range(10)), batch_size=3, skip_batches=1, device="cpu"))
    )
    assert type(shard) is DataLoaderShard and _lists(shard) == [[3, 4, 5], [6, 7, 8], [9]]
    assert shard.skip_batches == 1 and shard.device == "cpu"
    skip = pickle.loads(pickle.dumps(SkipDataLoader(list(range(10)), batch_size=3, skip_batches=1)))
    assert _lists(skip) == [[3, 4, 5], [6, 7, 8], [9]]
    dispatcher = pickle.loads(
        pickle.dumps(DataLoaderDispatcher(list(range(10)), batch_size=3, skip_batches=1))
    )
    assert _lists(dispatcher) == [[3, 4, 5], [6, 7, 8], [9]]


def test_dispatcher_on_one_process() -> None:
    PartialState(cpu=True)
    # Accelerate 1.15: the skip drops a global batch, len counts it; remainder is learnt at the end.
    loader = DataLoaderDispatcher(list(range(10)), batch_size=3, skip_batches=1, iteration=2)
    seen = [(b.tolist(), loader.end_of_dataloader, loader.remainder) for b in loader]
    assert seen == [([3, 4, 5], False, -1), ([6, 7, 8], False, -1), ([9], True, 1)]
    assert len(loader) == 4 and loader.iteration == 3 and loader.total_dataset_length == 10
    dropping = DataLoaderDispatcher(list(range(10)), batch_size=3, drop_last=True, _drop_last=True)
    assert _lists(dropping) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] and len(dropping) == 3
    moved = _Moved()
    placed = DataLoaderDispatcher(
        list(range(4)), batch_size=4, _non_blocking=True, slice_fn=lambda *a, **k: moved, device="cpu"
    )
    assert list(placed) == [moved] and moved.calls == [("cpu", True)]
    with pytest.raises(ValueError, match="skip_batches must be >= 0, got -1"):
        DataLoaderDispatcher(list(range(4)), skip_batches=-1)


def _recording_slice(data, tensor_slice, process_index=None, num_processes=None):
    return data[tensor_slice] * 100 + process_index * 1000 + num_processes * 10000


def _dispatch_worker() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    def flags(loader) -> list:
        return [(b.tolist(), loader.end_of_dataloader, loader.remainder) for b in loader]

    rank = PartialState(cpu=True).process_index
    out = {
        "b3": flags(DataLoaderDispatcher(list(range(10)), batch_size=3)),
        "b3_len": len(DataLoaderDispatcher(list(range(10)), batch_size=3)),
        "pad11": flags(DataLoaderDispatcher(list(range(11)), batch_size=3)),
        "pad13": flags(DataLoaderDispatcher(list(range(13)), batch_size=3)),
        "split9": _lists(DataLoaderDispatcher(list(range(9)), batch_size=4, split_batches=True)),
        "split_len": len(DataLoaderDispatcher(list(range(10)), batch_size=4, split_batches=True)),
        "drop": _lists(DataLoaderDispatcher(list(range(10)), batch_size=3, drop_last=True, _drop_last=True)),
        "drop_len": len(DataLoaderDispatcher(list(range(10)), batch_size=3, drop_last=True, _drop_last=True)),
        "skip": _lists(DataLoaderDispatcher(list(range(11)), batch_size=3, skip_batches=1)),
        "slice_fn": _lists(DataLoaderDispatcher(list(range(10)), batch_size=4, slice_fn=_recording_slice)),
        "dicts": [
            {k: v.tolist() for k, v in b.items()}
            for b in DataLoaderDispatcher([{"x": i, "y": 10 * i} for i in range(5)], batch_size=2)
        ],
    }
    for dims in (("dp",), ("tp",)):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=dims)
        out[f"mesh_{dims[0]}"] = _lists(
            DataLoaderDispatcher(list(range(10)), batch_size=2, torch_device_mesh=mesh)
        )
        out[f"shard_mesh_{dims[0]}"] = _lists(
            DataLoaderShard(list(range(10)), batch_size=4, torch_device_mesh=mesh)
        )
    # rng_types: each rank seeded differently; the listed generators are taken from rank 0.
    generator = torch.Generator().manual_seed(100 + rank)
    out["synced"] = _lists(
        DataLoaderShard(list(range(10)), batch_size=10, shuffle=True, generator=generator,
                        rng_types=["generator"], synchronized_generator=generator)
    )  # fmt: skip
    generator = torch.Generator().manual_seed(100 + rank)
    out["unsynced"] = _lists(
        DataLoaderShard(list(range(10)), batch_size=10, shuffle=True, generator=generator)
    )
    torch.manual_seed(7 + rank)
    list(DataLoaderShard(list(range(4)), batch_size=4, rng_types=["torch"]))
    out["torch_after"] = torch.rand(2).tolist()
    return out


def test_dispatcher_and_shard_on_two_processes() -> None:
    r0, r1 = run_distributed(_dispatch_worker, nprocs=2, timeout=180)
    # Every expectation below is what Accelerate 1.15 yields on 2 processes for the same calls.
    assert r0["b3"] == [([0, 1, 2], False, -1), ([6, 7], True, 4)]
    assert r1["b3"] == [([3, 4, 5], False, -1), ([8, 9], True, 4)]
    assert r0["b3_len"] == 2 and r0["split_len"] == 3 and r0["drop_len"] == 1
    # A last global batch that does not split evenly is completed with the epoch's first samples.
    assert r0["pad11"] == [([0, 1, 2], False, -1), ([6, 7, 8], True, 5)]
    assert r1["pad11"] == [([3, 4, 5], False, -1), ([9, 10, 0], True, 5)]
    assert r1["pad13"] == [([3, 4, 5], False, -1), ([9, 10, 11], False, -1), ([0], True, 1)]
    assert r0["pad13"][-1] == ([12], True, 1)
    assert r0["split9"] == [[0, 1], [4, 5], [8]] and r1["split9"] == [[2, 3], [6, 7], [0]]
    assert r0["drop"] == [[0, 1, 2]] and r1["drop"] == [[3, 4, 5]]
    assert r0["skip"] == [[6, 7, 8]] and r1["skip"] == [[9, 10, 0]]
    # slice_fn gets process_index and num_processes as keywords.
    assert r0["slice_fn"] == [[20000, 20100, 20200, 20300], [20800]]
    assert r1["slice_fn"] == [[21400, 21500, 21600, 21700], [21900]]
    assert r0["dicts"] == [{"x": [0, 1], "y": [0, 10]}, {"x": [4], "y": [40]}]
    assert r1["dicts"] == [{"x": [2, 3], "y": [20, 30]}, {"x": [0], "y": [0]}]
    # A data-parallel mesh splits as the world does; a tensor-parallel one gives every rank each batch.
    assert r0["mesh_dp"] == [[0, 1], [4, 5], [8]] and r1["mesh_dp"] == [[2, 3], [6, 7], [9]]
    whole = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert r0["mesh_tp"] == whole and r1["mesh_tp"] == whole
    # The shard's mesh does not re-shard it (its batch sampler does, in prepare_data_loader).
    for name in ("shard_mesh_dp", "shard_mesh_tp"):
        assert r0[name] == r1[name] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert r0["synced"] == r1["synced"] and r0["unsynced"] != r1["unsynced"]
    assert r0["torch_after"] == r1["torch_after"]


def _stateful_dispatch_worker() -> dict:
    PartialState(cpu=True)
    make = lambda: DataLoaderDispatcher(list(range(12)), batch_size=2, use_stateful_dataloader=True)  # noqa: E731
    full = _lists(make())
    loader = make()
    iterator = iter(loader)
    first = next(iterator).tolist()
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    return {"full": full, "resumed": [first] + _lists(resumed)}


def test_stateful_dispatcher_resumes_mid_epoch() -> None:
    pytest.importorskip("torchdata")
    r0, r1 = run_distributed(_stateful_dispatch_worker, nprocs=2, timeout=180)
    assert r0["full"] == [[0, 1], [4, 5], [8, 9]] and r1["full"] == [[2, 3], [6, 7], [10, 11]]
    assert r0["resumed"] == r0["full"] and r1["resumed"] == r1["full"]


def _tensor_parallel_dispatch_worker() -> dict:
    from notebook_accel import Accelerator
    from notebook_accel.parallelism_config import ParallelismConfig
    from notebook_accel.utils import DataLoaderConfiguration

    out = {}
    for dispatch in (True, False):
        GradientState._reset_state()
        AcceleratorState._reset_state()
        acc = Accelerator(
            parallelism_config=ParallelismConfig(tp_size=2),
            dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch),
        )
        loader = acc.prepare(DataLoader(list(range(8)), batch_size=2))
        out[dispatch] = (type(loader).__name__, _lists(loader))
    return out


def test_accelerator_dispatches_whole_batches_to_a_tensor_parallel_group() -> None:
    # Both ranks form one tensor-parallel group (one data-parallel rank): dispatched or sharded in
    # place, each sees every batch, as the model's shards need the same input.
    r0, r1 = run_distributed(_tensor_parallel_dispatch_worker, nprocs=2, timeout=180)
    whole = [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert r0[True] == r1[True] == ("DataLoaderDispatcher", whole)
    assert r0[False] == r1[False] == ("DataLoaderShard", whole)
