"""Golden programs for issue 22: behaviours code written for Accelerate 1.15 still saw differ on us.

Recorded from the real Accelerate 1.15 like the others (``scripts/record_accelerate_goldens.py
--cases NAME,...``); ``tests/goldens_programs.py`` adds them to its ``CASES``. ``A`` is the library's
top-level module; each case returns plain JSON. This file imports neither library.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler, TensorDataset

from tests.goldens_shared import registrar

__all__ = ["DROPIN_CASES"]

DROPIN_CASES: dict[str, Callable[[Any, dict], dict]] = {}


_case = registrar(DROPIN_CASES)


def _utils(A: Any) -> Any:
    return importlib.import_module(A.__name__ + ".utils")


def _accelerator(A: Any, **config: Any) -> Any:
    if config:
        return A.Accelerator(dataloader_config=_utils(A).DataLoaderConfiguration(**config))
    return A.Accelerator()


def _rows(loader: Any) -> list[list[int]]:
    return [batch[0].tolist() for batch in loader]


@_case
def case_dropin_split_batches_uneven_no_even(A, ctx):
    acc = _accelerator(A, split_batches=True, even_batches=False)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(22)), batch_size=8))
    ends = []
    rows = []
    for batch in loader:
        rows.append(batch[0].tolist())
        ends.append(bool(acc.gradient_state.end_of_dataloader))
    return {"rows": rows, "end": ends, "len": len(loader)}


@_case
def case_dropin_reduce_max_mean_sum(A, ctx):
    ops = importlib.import_module(A.__name__ + ".utils.operations")
    _accelerator(A)
    rank = ctx["rank"]
    out = {}
    for name in ("max", "mean", "sum"):
        t = torch.tensor([1.0 + rank, 5.0 - 3 * rank, 2.0])
        reduced = ops.reduce({"a": t, "b": [t.clone()]}, reduction=name)
        out[name] = [reduced["a"].tolist(), reduced["b"][0].tolist(), t.tolist()]
    out["max_int"] = ops.reduce(torch.tensor([1 + rank, 7 - 5 * rank]), reduction="max").tolist()
    return out


@_case
def case_dropin_prepare_twice(A, ctx):
    acc = _accelerator(A)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2)
    first = acc.prepare(model, optimizer, scheduler, loader)
    again = acc.prepare(*first)
    other = _accelerator(A)
    other.prepare(*first)
    return {
        "same": [a is b for a, b in zip(first, again)],
        "flags": [bool(getattr(obj, "_is_accelerate_prepared", False)) for obj in first],
        # One process: nothing is registered twice. Under DDP 1.15 registers the wrapped model a
        # second time (a deliberate difference, see migrating.md), so the counts are left out there.
        "counts": [len(acc._models), len(acc._optimizers), len(acc._schedulers), len(acc._dataloaders)]
        if ctx["world"] == 1
        else None,
        "other": [
            len(other._models),
            len(other._optimizers),
            len(other._schedulers),
            len(other._dataloaders),
        ],
    }


@_case
def case_dropin_dynamo_to_kwargs(A, ctx):
    plugin = _utils(A).TorchDynamoPlugin
    cases = [
        {},
        {"backend": "inductor"},
        {"mode": "max-autotune"},
        {"backend": "eager", "fullgraph": True},
        {"options": {"a": 1}},
        {"dynamic": False},
        {"disable": True},
        {"use_regional_compilation": True},
    ]
    return {"kwargs": [plugin(**kwargs).to_kwargs() for kwargs in cases]}


@_case
def case_dropin_find_executable_batch_size(A, ctx):
    utils = _utils(A)
    out = {}
    for message in ("CPU out of memory.", "CUDA out of memory.", "MUSA out of memory."):
        tried = []

        def train(batch_size, tried=tried, message=message):
            tried.append(batch_size)
            if batch_size > 8:
                raise RuntimeError(message)
            return batch_size

        out[message] = [utils.find_executable_batch_size(train, starting_batch_size=64)(), tried]
    return out


class _EpochSampler(Sampler):
    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist())


@_case
def case_dropin_set_epoch_batch_sampler(A, ctx):
    acc = _accelerator(A)
    loader = acc.prepare(
        DataLoader(TensorDataset(torch.arange(16)), batch_sampler=BatchSampler(_EpochSampler(16), 4, False))
    )
    epochs = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        epochs.append(_rows(loader))
    return {"epochs": epochs}


@_case
def case_dropin_stateful_state_dict_resume(A, ctx):
    from torchdata.stateful_dataloader import StatefulDataLoader

    out = {}
    for dispatch in (False, True):
        acc = _accelerator(A, use_stateful_dataloader=True, dispatch_batches=dispatch)

        def make(acc=acc):
            return acc.prepare(DataLoader(TensorDataset(torch.arange(40)), batch_size=4))

        loader = make()
        iterator = iter(loader)
        first = [next(iterator)[0].tolist() for _ in range(3)]
        state = loader.state_dict()
        del iterator
        resumed = make()
        resumed.load_state_dict(state)
        out[str(dispatch)] = {
            "first": first,
            "rest": _rows(resumed),
            "stateful": [isinstance(x, StatefulDataLoader) for x in (loader, resumed)],
        }
    return out
