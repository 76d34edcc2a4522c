"""``DataLoaderConfiguration(use_stateful_dataloader=True)``: prepared loaders are torchdata's loaders.

As in Accelerate 1.15, ``isinstance(loader, StatefulDataLoader)`` holds for ``DataLoaderShard`` and
``DataLoaderDispatcher`` (and here for ``skip_first_batches``' result too), and a position taken with
``state_dict()`` resumes on exactly the batches torchdata's own loader resumes on, with 0 and 2
workers, with and without dispatching. ``save_state`` / ``load_state`` mid-epoch resume at the same
sample and the same weights, tied or not, in safetensors or pickle.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from notebook_accel import notebook_launcher

pytest.importorskip("torchdata")
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

BREAK = 3


class _Stream(IterableDataset):
    """0..n-1, split between the loader's workers (worker w yields w, w + workers, ...)."""

    def __init__(self, n: int = 20) -> None:
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for i in range(worker, self.n, workers):
            yield torch.tensor(i)


def _loader_args(kind: str, workers: int) -> dict:
    data = TensorDataset(torch.arange(20)) if kind == "map" else _Stream()
    return {"dataset": data, "batch_size": 3, "num_workers": workers}


def _rows(batch) -> list[int]:
    return (batch[0] if isinstance(batch, (list, tuple)) else batch).tolist()


def _accelerator(dispatch: bool, **config):
    from notebook_accel import Accelerator
    from notebook_accel.state import AcceleratorState, GradientState
    from notebook_accel.utils import DataLoaderConfiguration

    AcceleratorState._reset_state()
    GradientState._reset_state()
    cfg = DataLoaderConfiguration(use_stateful_dataloader=True, dispatch_batches=dispatch, **config)
    return Accelerator(cpu=True, dataloader_config=cfg)


def _interrupted(loader_factory, state_of=lambda loader: loader.state_dict()):
    """Return (first BREAK batches, the batches of a fresh loader resumed from the position then)."""
    loader = loader_factory()
    iterator = iter(loader)
    first = [_rows(next(iterator)) for _ in range(BREAK)]
    state = state_of(loader)
    del iterator
    resumed = loader_factory()
    resumed.load_state_dict(state)
    return first, [_rows(b) for b in resumed]


def test_prepared_loaders_are_stateful_dataloaders() -> None:
    from notebook_accel.data_loader import DataLoaderDispatcher, DataLoaderShard, skip_first_batches

    for dispatch, cls in ((False, DataLoaderShard), (True, DataLoaderDispatcher)):
        loader = _accelerator(dispatch).prepare(DataLoader(**_loader_args("map", 0)))
        assert type(loader) is cls and isinstance(loader, cls)
        assert isinstance(loader, StatefulDataLoader) and isinstance(loader, DataLoader)
        assert isinstance(skip_first_batches(loader, 2), StatefulDataLoader)


def test_without_the_flag_a_prepared_loader_is_not_stateful() -> None:
    from notebook_accel import Accelerator

    loader = Accelerator(cpu=True).prepare(DataLoader(**_loader_args("map", 0)))
    assert not isinstance(loader, StatefulDataLoader)
    with pytest.raises(ValueError, match="use_stateful_dataloader=True"):
        loader.state_dict()


@pytest.mark.parametrize("dispatch", [False, True], ids=["shard", "dispatch"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_state_dict_resumes_on_torchdatas_batches(kind: str, workers: int, dispatch: bool) -> None:
    expected = _interrupted(lambda: StatefulDataLoader(**_loader_args(kind, workers)))
    acc = _accelerator(dispatch)
    ours = _interrupted(lambda: acc.prepare(DataLoader(**_loader_args(kind, workers))))
    assert ours == expected
    # torchdata's own position (or one a 1.15 checkpoint holds) is accepted as it is, too.
    reference = StatefulDataLoader(**_loader_args(kind, workers))
    iterator = iter(reference)
    for _ in range(BREAK):
        next(iterator)
    state = reference.state_dict()
    del iterator
    resumed = acc.prepare(DataLoader(**_loader_args(kind, workers)))
    resumed.load_state_dict(state)
    assert [_rows(b) for b in resumed] == expected[1]


def test_a_foreign_state_is_refused_with_what_was_expected() -> None:
    loader = _accelerator(False).prepare(DataLoader(**_loader_args("map", 0)))
    with pytest.raises(
        ValueError, match=r"StatefulDataLoader's state_dict\(\), got dict with keys \['epoch'\]"
    ):
        loader.load_state_dict({"epoch": 3})


def _two_process_worker(kind: str, workers: int, dispatch: bool) -> dict:
    acc = _accelerator(dispatch)

    def make():
        return acc.prepare(DataLoader(**_loader_args(kind, workers)))

    whole = [_rows(b) for b in make()]
    first, rest = _interrupted(make)
    return {"whole": whole, "resumed": first + rest, "stateful": isinstance(make(), StatefulDataLoader)}


@pytest.mark.parametrize("dispatch", [False, True], ids=["shard", "dispatch"])
@pytest.mark.parametrize("workers", [0, 2])
def test_two_processes_resume_where_they_stopped(workers: int, dispatch: bool) -> None:
    for kind in ("map", "iterable"):
        # The launcher's workers may start loader workers of their own (run_distributed's are daemons).
        ranks = notebook_launcher(
            _two_process_worker, args=(kind, workers, dispatch), num_processes=2, sinks=[], timeout=240
        )
        for rank, got in enumerate(ranks):
            assert got["stateful"]
            assert got["resumed"] == got["whole"], (kind, rank)
        assert ranks[0]["whole"] != ranks[1]["whole"]  # each rank has its own share


class _Tied(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 4)
        self.head = torch.nn.Linear(4, 20, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(idx)).logsumexp(-1).mean()


def _train(folder: str, tied: bool, safe: bool, interrupt: bool) -> dict:
    acc = _accelerator(False)
    torch.manual_seed(0)
    model = _Tied(tied)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.arange(20)), batch_size=2, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    seen = []

    def steps(n=None):
        for step, (idx,) in enumerate(loader):
            seen.append(idx.tolist())
            optimizer.zero_grad()
            acc.backward(model(idx))
            optimizer.step()
            if n is not None and step + 1 == n:
                return

    steps(BREAK if interrupt else None)
    if interrupt:
        acc.save_state(folder, safe_serialization=safe)
        for p in model.parameters():  # what a fresh process would hold: other weights
            torch.nn.init.normal_(p)
        acc.load_state(folder)
        steps()
    steps()  # a second epoch
    weights = {k: v.tolist() for k, v in acc.unwrap_model(model).state_dict().items()}
    return {"seen": seen, "weights": weights, "tied": model.head.weight is model.embed.weight}


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pickle"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_save_state_mid_epoch_resumes_at_the_same_sample(tied: bool, safe: bool, tmp_path) -> None:
    whole = _train(str(tmp_path / "unused"), tied, safe, interrupt=False)
    resumed = _train(str(tmp_path / "ckpt"), tied, safe, interrupt=True)
    assert resumed["seen"] == whole["seen"]
    assert resumed["tied"] is tied
    for key, value in whole["weights"].items():
        assert torch.allclose(torch.tensor(resumed["weights"][key]), torch.tensor(value), atol=1e-6), key
