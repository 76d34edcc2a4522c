"""Native sharding of 🤗 datasets streams: each process reads its own block of shards.

The 2-process comparison with Accelerate 1.15 is the golden ``loader_native_shards``
(tests/test_goldens.py); these tests pin the rule in one process, for every rank in turn.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from torch.utils.data import DataLoader, IterableDataset

from notebook_accel.data_loader import IterableDatasetShard, prepare_data_loader

datasets = pytest.importorskip("datasets")


def _stream(n: int, shards: int):
    table = datasets.Dataset.from_dict({"idx": list(range(n))})
    return table.to_iterable_dataset(num_shards=shards).with_format("torch")


def _prepared(dataset, rank: int, world: int, **kwargs):
    return prepare_data_loader(
        DataLoader(dataset, batch_size=2), num_processes=world, process_index=rank, **kwargs
    )


def _samples(loader) -> list[int]:
    return [i for batch in loader for i in batch["idx"].tolist()]


@pytest.mark.parametrize(
    ("world", "shards", "per_rank"),
    [(2, 2, [1, 1]), (2, 4, [2, 2]), (2, 3, [2, 1]), (3, 5, [2, 2, 1]), (3, 3, [1, 1, 1])],
)
def test_each_rank_reads_a_contiguous_block_of_shards(world: int, shards: int, per_rank: list[int]) -> None:
    loaders = [_prepared(_stream(13, shards), rank, world) for rank in range(world)]
    assert [loader.dataset.n_shards for loader in loaders] == per_rank
    assert not any(isinstance(loader.dataset, IterableDatasetShard) for loader in loaders)
    # Together the ranks read the stream once, in order, with no padding (a rank may read more).
    assert sum((_samples(loader) for loader in loaders), []) == list(range(13))


def test_fewer_shards_than_processes_split_batches_or_other_streams_shard_by_batches() -> None:
    assert isinstance(_prepared(_stream(12, 1), 0, 2).dataset, IterableDatasetShard)
    assert isinstance(_prepared(_stream(12, 2), 0, 3).dataset, IterableDatasetShard)
    assert isinstance(_prepared(_stream(12, 4), 0, 2, split_batches=True).dataset, IterableDatasetShard)

    class Files(IterableDataset):  # a torch stream that merely has an n_shards attribute
        n_shards = 4

        def __iter__(self):
            return iter(range(8))

    assert isinstance(_prepared(Files(), 1, 2).dataset, IterableDatasetShard)


def test_a_dispatched_stream_is_read_whole_on_process_zero() -> None:
    loader = _prepared(_stream(12, 4), 0, 2, dispatch_batches=True, put_on_device=True)
    assert loader.dataset.n_shards == 4


def test_the_epoch_reaches_a_shuffled_split_stream() -> None:
    loader = _prepared(_stream(24, 4).shuffle(seed=3, buffer_size=4), 1, 2)
    first, second = _samples(loader), _samples(loader)
    assert sorted(first) == sorted(second) and first != second and len(first) == 12


def test_preparing_a_torch_stream_does_not_import_datasets() -> None:
    code = textwrap.dedent(
        """
        import sys
        from torch.utils.data import DataLoader, IterableDataset
        from notebook_accel.data_loader import prepare_data_loader

        class Stream(IterableDataset):
            def __iter__(self):
                return iter(range(6))

        loader = prepare_data_loader(DataLoader(Stream(), batch_size=2), num_processes=2, process_index=1)
        assert [b.tolist() for b in loader] == [[2, 3], [0, 1]], list(loader)
        assert "datasets" not in sys.modules, "prepare_data_loader imported datasets"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
