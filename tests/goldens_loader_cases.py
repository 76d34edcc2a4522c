"""Golden programs that build the prepared dataloader classes directly, with Accelerate 1.15's parameters.

``DataLoaderShard``, ``DataLoaderDispatcher`` and ``SkipDataLoader`` are public classes that code
written for Accelerate constructs itself (and that ``skip_first_batches`` returns). These cases record
what each constructor parameter does to the batches on Accelerate 1.15: which sample indices every
rank gets, the last-batch flag and remainder, lengths and epoch counters. ``tests/goldens_programs.py``
adds them to its ``CASES``; the same rules hold (``A`` is the library's top-level module, the result
is plain JSON). This file imports neither library.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from tests.goldens_shared import Samples, registrar

__all__ = ["LOADER_CASES"]

LOADER_CASES: dict[str, Callable[[Any, dict], dict]] = {}


_case = registrar(LOADER_CASES)


class _Indexed(Samples):
    """``n`` samples, each a dict carrying its own index."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"idx": torch.tensor(i), "x": torch.tensor([float(i)])}


class _IndexedStream(IterableDataset):
    """The same samples as a stream that records the epoch its loader gave it."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, -1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return (_Indexed(self.n)[i] for i in range(self.n))


def _dl(A: Any) -> Any:
    return importlib.import_module(f"{A.__name__}.data_loader")


def _loaders(A: Any) -> Any:
    """Return the library's data_loader module, once an Accelerator made the process state its loaders read."""
    A.Accelerator()
    return _dl(A)


def _rows(loader: Any) -> list[list]:
    """Return ``[indices, end_of_dataloader, remainder]`` for every batch of one pass."""
    return [[b["idx"].tolist(), bool(loader.end_of_dataloader), int(loader.remainder)] for b in loader]


@_case
def case_loader_shard_direct(A, ctx):
    dl = _loaders(A)
    skipping = dl.DataLoaderShard(_Indexed(10), batch_size=3, skip_batches=1)
    out = {"skip": _rows(skipping), "skip_len": len(skipping), "total_batch_size": skipping.total_batch_size}
    stream = _IndexedStream(10)
    out["stream_skip"] = _rows(dl.DataLoaderShard(stream, batch_size=3, skip_batches=2, iteration=4))
    out["stream_epoch"] = stream.epoch
    sampler = dl.SeedableRandomSampler(_Indexed(10), data_seed=5)
    seeded = dl.DataLoaderShard(_Indexed(10), batch_size=5, sampler=sampler, iteration=3)
    out["seeded"] = [_rows(seeded), _rows(seeded)]
    out["iteration"] = seeded.iteration
    dropping = dl.DataLoaderShard(_Indexed(10), batch_size=4, _drop_last=True)
    out["drop_flags"] = _rows(dropping)
    return out


@_case
def case_loader_shard_rng_types(A, ctx):
    dl = _loaders(A)
    torch.manual_seed(10 + ctx["rank"])
    generator = torch.Generator().manual_seed(100 + ctx["rank"])
    loader = dl.DataLoaderShard(
        _Indexed(12), batch_size=4, shuffle=True, generator=generator,
        rng_types=["generator", "torch"], synchronized_generator=generator,
    )  # fmt: skip
    out = {"epochs": [_rows(loader), _rows(loader)], "torch_after": torch.rand(2).tolist()}
    generator = torch.Generator().manual_seed(100 + ctx["rank"])
    plain = dl.DataLoaderShard(_Indexed(12), batch_size=4, shuffle=True, generator=generator)
    out["unsynced"] = _rows(plain)
    return out


@_case
def case_loader_dispatcher_direct(A, ctx):
    dl = _loaders(A)
    out = {}
    for name, n, kwargs in (
        ("pad11", 11, {"batch_size": 3}),
        ("pad13", 13, {"batch_size": 3}),
        ("split9", 9, {"batch_size": 4, "split_batches": True}),
        ("skip11", 11, {"batch_size": 3, "skip_batches": 1}),
        ("drop10", 10, {"batch_size": 3, "drop_last": True, "_drop_last": True}),
    ):
        loader = dl.DataLoaderDispatcher(_Indexed(n), **kwargs)
        out[name] = {"rows": _rows(loader), "len": len(loader)}
    counted = dl.DataLoaderDispatcher(_Indexed(6), batch_size=2, iteration=2)
    _rows(counted)
    out["iteration"] = counted.iteration
    return out


@_case
def case_loader_dispatcher_stream(A, ctx):
    stream = _IndexedStream(11)
    loader = _loaders(A).DataLoaderDispatcher(stream, batch_size=2, iteration=1)
    return {"rows": _rows(loader), "epoch": stream.epoch, "iteration": loader.iteration}


@_case
def case_loader_dispatcher_slice_fn(A, ctx):
    seen = []

    def slice_fn(data, tensor_slice, process_index=None, num_processes=None):
        seen.append([process_index, num_processes, tensor_slice.start, tensor_slice.stop])
        return {key: value[tensor_slice] for key, value in data.items()}

    loader = _loaders(A).DataLoaderDispatcher(_Indexed(10), batch_size=4, slice_fn=slice_fn)
    return {"rows": _rows(loader), "calls": seen}


@_case
def case_loader_skip_dataloader(A, ctx):
    dl = _loaders(A)
    loader = dl.SkipDataLoader(_Indexed(10), skip_batches=2, batch_size=3)
    active = []
    for _ in loader:
        active.append(A.state.GradientState().active_dataloader is loader)
    return {
        "rows": _rows(loader),
        "len": len(loader),
        "active": active,
        "after": A.state.GradientState().active_dataloader is None,
        "stream": _rows(dl.SkipDataLoader(_IndexedStream(10), skip_batches=1, batch_size=4)),
    }


@_case
def case_loader_native_shards(A, ctx):
    # A 🤗 datasets stream of 13 samples in 1 to 4 shards (fewer shards than processes, as many, more
    # but not a multiple, a multiple), prepared with and without dispatching, and split_batches.
    import datasets
    from torch.utils.data import DataLoader

    def stream(shards: int) -> Any:
        table = datasets.Dataset.from_dict({"idx": list(range(13))})
        return table.to_iterable_dataset(num_shards=shards).with_format("torch")

    dl, out = _dl(A), {}
    for shards in (1, 2, 3, 4):
        for dispatch, split in ((False, False), (True, False), (False, True)):
            config = A.utils.DataLoaderConfiguration(dispatch_batches=dispatch, split_batches=split)
            loader = A.Accelerator(dataloader_config=config).prepare(DataLoader(stream(shards), batch_size=2))
            out[f"{shards}_dispatch{dispatch:d}_split{split:d}"] = {
                "rows": _rows(loader),
                "by_batches": isinstance(loader.dataset, dl.IterableDatasetShard),
                "n_shards": getattr(loader.dataset, "n_shards", None),
            }
    # Shuffled shards: the epoch reaches the dataset each pass; skip_first_batches keeps the split.
    acc = A.Accelerator(dataloader_config=A.utils.DataLoaderConfiguration(dispatch_batches=False))
    loader = acc.prepare(DataLoader(stream(4).shuffle(seed=3, buffer_size=3), batch_size=2))
    out["shuffled"] = [_rows(loader), _rows(loader)]
    out["skipped"] = _rows(acc.skip_first_batches(loader, 1))
    return out
