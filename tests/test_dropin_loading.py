"""Data loading answers that code written for Accelerate 1.15 relies on (issue 22).

Expected values were read off the real Accelerate 1.15 on the same inputs (run, not read).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler, SequentialSampler, TensorDataset

from notebook_accel import Accelerator, skip_first_batches
from notebook_accel.data_loader import BatchSamplerShard
from notebook_accel.utils import DataLoaderConfiguration


def _shards(n: int, batch_size: int, processes: int, **kwargs) -> list[list[list[int]]]:
    return [
        list(
            BatchSamplerShard(
                BatchSampler(SequentialSampler(range(n)), batch_size, False), processes, i, **kwargs
            )
        )
        for i in range(processes)
    ]


# (items, batch size, processes) -> each process's batches under split_batches=True, even_batches=False
_SPLIT_UNEVEN = {
    (10, 4, 2): [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7]]],
    (10, 6, 2): [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9]]],
    (3, 6, 2): [[[0, 1, 2]], []],
    (3, 6, 3): [[[0, 1]], [[2]], []],
    (16, 6, 2): [[[0, 1, 2], [6, 7, 8], [12, 13, 14]], [[3, 4, 5], [9, 10, 11], [15]]],
    (11, 4, 2): [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10]]],
}


@pytest.mark.parametrize(("items", "batch_size", "processes"), sorted(_SPLIT_UNEVEN))
def test_split_batches_without_even_batches_slices_like_accelerate(items, batch_size, processes) -> None:
    got = _shards(items, batch_size, processes, split_batches=True, even_batches=False)
    assert got == _SPLIT_UNEVEN[(items, batch_size, processes)]
    lengths = [
        len(BatchSamplerShard(BatchSampler(SequentialSampler(range(items)), batch_size, False), processes, i,
                              split_batches=True, even_batches=False))
        for i in range(processes)
    ]  # fmt: skip
    assert lengths == [len(_SPLIT_UNEVEN[(items, batch_size, processes)][0])] * processes  # 1.15's len


class _EpochSampler(Sampler):
    """A sampler whose order depends on the epoch it was given."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch, self.calls = n, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.calls.append(epoch)

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist())


def test_set_epoch_reaches_the_sampler_of_a_batch_sampler() -> None:
    sampler = _EpochSampler(8)
    loader = Accelerator().prepare(
        DataLoader(TensorDataset(torch.arange(8)), batch_sampler=BatchSampler(sampler, 4, False))
    )
    epochs = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        epochs.append([b[0].tolist() for b in loader])
    assert epochs == [
        [[4, 0, 7, 3], [2, 5, 1, 6]],
        [[5, 4, 2, 6], [7, 3, 1, 0]],
        [[0, 4, 7, 2], [6, 5, 1, 3]],
    ]
    assert sampler.calls == [0, 0, 1, 1, 2, 2]  # set_epoch, then the loader's own at iteration


class _Growing:
    """A batch sampler with no batch size: batches of 1, 2 and 3 samples."""

    def __iter__(self):
        return iter([[0], [1, 2], [3, 4, 5]])

    def __len__(self) -> int:
        return 3


@pytest.mark.parametrize("dispatch", [False, True])
def test_split_batches_refuses_a_loader_without_a_fixed_batch_size(dispatch: bool) -> None:
    acc = Accelerator(
        dataloader_config=DataLoaderConfiguration(split_batches=True, dispatch_batches=dispatch)
    )
    with pytest.raises(ValueError, match=r"split_batches=True needs a fixed batch size .* batch_size=None"):
        acc.prepare(DataLoader(TensorDataset(torch.arange(8)), batch_sampler=_Growing()))
    # A batch sampler that says its batch size is fine.
    fixed = acc.prepare(
        DataLoader(TensorDataset(torch.arange(8)), batch_sampler=BatchSampler(_EpochSampler(8), 4, False))
    )
    assert [len(b[0]) for b in fixed] == [4, 4]


@pytest.mark.parametrize("stateful", [False, True])
@pytest.mark.parametrize("dispatch", [False, True])
def test_a_dropped_prepared_loader_is_released(dispatch: bool, stateful: bool) -> None:
    if stateful:
        pytest.importorskip("torchdata")
    config = DataLoaderConfiguration(dispatch_batches=dispatch, use_stateful_dataloader=stateful)
    acc = Accelerator(dataloader_config=config)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=2))
    skipped = skip_first_batches(loader, 1)
    for _batch in loader:  # interrupted mid-epoch: the generator is dropped with its frame
        break
    next(iter(skipped))
    refs = [weakref.ref(loader), weakref.ref(skipped)]
    acc._dataloaders.clear()  # what the accelerator holds strongly, as 1.15's list does
    del loader, skipped, _batch
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert acc.gradient_state.active_dataloader is None
