"""Small deterministic CPU training programs run on both Accelerate 1.15 and notebook_accel.

Every case is a function ``case(A, ctx) -> dict`` where ``A`` is the library's top-level module
(``accelerate`` or ``notebook_accel``, used only through the names both share) and ``ctx`` holds the
rank, the world size and a scratch directory shared by all ranks. A case returns plain JSON data: the
sample indices this rank received at each step, the losses, the final parameters (full-precision
floats) and whatever else the case checks. ``scripts/record_accelerate_goldens.py`` runs them under
the real Accelerate (torchrun) and commits the results to ``tests/data/goldens/``;
``tests/test_goldens.py`` runs them on notebook_accel through ``notebook_launcher`` and compares.

This file imports neither library: the caller passes the module in.
"""

from __future__ import annotations

import math
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, SequentialSampler

from tests.goldens_dropin_cases import DROPIN_CASES
from tests.goldens_loader_cases import LOADER_CASES
from tests.goldens_metrics_cases import METRICS_CASES
from tests.goldens_shared import gather_objects, registrar

__all__ = ["CASES", "run_cases"]

CASES: dict[str, Callable[[Any, dict], dict]] = {}


_case = registrar(CASES)


# ---------------------------------------------------------------------------------------------
# data, models, loop


class _Regression(Dataset):
    """``n`` samples of y = 2x + 3 (x in [0, 1)); each sample carries its own index."""

    def __init__(self, n: int = 96) -> None:
        self.x = torch.arange(n, dtype=torch.float32).reshape(-1, 1) / n
        self.y = 2 * self.x + 3

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i], "idx": torch.tensor(i)}


class _Stream(IterableDataset):
    """The same samples as ``_Regression``, as a stream (with or without a length)."""

    def __init__(self, n: int = 96, sized: bool = True) -> None:
        self.inner = _Regression(n)
        self.sized = sized

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(len(self.inner)):
            yield self.inner[i]

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("this stream has no length")
        return len(self.inner)


class _ReversedChunks(BatchSampler):
    """A user batch sampler: batches of ``batch_size`` taken from the end of the data first."""

    def __init__(self, n: int, batch_size: int) -> None:
        super().__init__(SequentialSampler(range(n)), batch_size, drop_last=False)
        self.n = n

    def __iter__(self) -> Iterator[list[int]]:
        order = list(range(self.n))[::-1]
        for lo in range(0, self.n, self.batch_size):
            yield order[lo : lo + self.batch_size]

    def __len__(self) -> int:
        return math.ceil(self.n / self.batch_size)


class _GrowingBatches:
    """A plain batch sampler (no BatchSampler base) whose batches grow: 1, 2, 3, ... samples."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[list[int]]:
        lo, size = 0, 1
        while lo < self.n:
            yield list(range(lo, min(lo + size, self.n)))
            lo, size = lo + size, size + 1

    def __len__(self) -> int:
        count, lo, size = 0, 0, 1
        while lo < self.n:
            count, lo, size = count + 1, lo + size, size + 1
        return count


def _model(dropout: bool = False) -> torch.nn.Module:
    layer = torch.nn.Linear(1, 1)
    torch.nn.init.zeros_(layer.weight)
    torch.nn.init.zeros_(layer.bias)
    if dropout:
        return torch.nn.Sequential(torch.nn.Dropout(0.25), layer)
    return torch.nn.Sequential(layer)


def _params(accelerator: Any, model: torch.nn.Module) -> list[float]:
    return [float(v) for p in accelerator.unwrap_model(model).parameters() for v in p.detach().flatten()]


def _accelerator(A: Any, *, dl: dict | None = None, **kwargs: Any) -> Any:
    if dl:
        kwargs["dataloader_config"] = A.utils.DataLoaderConfiguration(**dl)
    return A.Accelerator(**kwargs)


def _fit(
    A: Any,
    loader: DataLoader,
    *,
    epochs: int = 2,
    dl: dict | None = None,
    set_epoch: bool = False,
    accumulate: bool = False,
    lr: float = 0.5,
    scheduler: bool = False,
    dropout: bool = False,
    **accel_kwargs: Any,
) -> dict:
    """Train the 1-feature regression on ``loader`` through an Accelerator; return what happened."""
    accelerator = _accelerator(A, dl=dl, **accel_kwargs)
    model = _model(dropout)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    objs = [model, optimizer, loader]
    if scheduler:
        objs.append(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s)))
    prepared = accelerator.prepare(*objs)
    model, optimizer, loader = prepared[:3]
    sched = prepared[3] if scheduler else None
    out: dict[str, list] = {"indices": [], "losses": [], "sync": [], "end": [], "lr": []}
    for epoch in range(epochs):
        if set_epoch:
            loader.set_epoch(epoch)
        for batch in loader:
            ctx = accelerator.accumulate(model) if accumulate else _nullcontext()
            with ctx:
                loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
                accelerator.backward(loss)
                optimizer.step()
                if sched is not None:
                    sched.step()
                optimizer.zero_grad()
            out["indices"].append(batch["idx"].tolist())
            out["losses"].append(loss.item())
            out["sync"].append(bool(accelerator.sync_gradients))
            out["end"].append(bool(accelerator.gradient_state.end_of_dataloader))
            out["lr"].append(float(optimizer.param_groups[0]["lr"]))
    out["params"] = _params(accelerator, model)
    out["len"] = _safe_len(loader)
    return out


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _safe_len(loader: Any) -> int:
    try:
        return len(loader)
    except TypeError:
        return -1


def _shuffled(n: int = 96, batch_size: int = 8, seed: int | None = 7, **kw: Any) -> DataLoader:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return DataLoader(_Regression(n), batch_size=batch_size, shuffle=True, generator=gen, **kw)


def _plain(n: int = 96, batch_size: int = 8, **kw: Any) -> DataLoader:
    return DataLoader(_Regression(n), batch_size=batch_size, **kw)


def _per_rank_bs(ctx: dict, global_bs: int = 16) -> int:
    return global_bs // ctx["world"]


# ---------------------------------------------------------------------------------------------
# sampling: shuffling, seeds, epochs


@_case
def case_noshuffle(A, ctx):
    return _fit(A, _plain(batch_size=_per_rank_bs(ctx)), epochs=3)


@_case
def case_shuffle_user_generator(A, ctx):
    # The regression: the same model as one process with batch 16.
    return _fit(A, _shuffled(batch_size=_per_rank_bs(ctx)), epochs=3)


@_case
def case_shuffle_user_generator_split_batches(A, ctx):
    return _fit(A, _shuffled(batch_size=16), epochs=3, dl={"split_batches": True})


@_case
def case_shuffle_user_generator_set_epoch(A, ctx):
    return _fit(A, _shuffled(batch_size=_per_rank_bs(ctx)), epochs=3, set_epoch=True)


@_case
def case_shuffle_global_seed(A, ctx):
    A.utils.set_seed(42)
    return _fit(A, _shuffled(batch_size=_per_rank_bs(ctx), seed=None), epochs=2)


@_case
def case_shuffle_rank_dependent_seed(A, ctx):
    # Each rank's global RNG differs: the prepared loader must still give every rank one permutation.
    torch.manual_seed(100 + ctx["rank"])
    return _fit(A, _shuffled(batch_size=_per_rank_bs(ctx), seed=None), epochs=2)


@_case
def case_shuffle_rank_dependent_generator(A, ctx):
    gen = torch.Generator().manual_seed(11 + ctx["rank"])
    loader = DataLoader(_Regression(), batch_size=_per_rank_bs(ctx), shuffle=True, generator=gen)
    return _fit(A, loader, epochs=2)


@_case
def case_seedable_sampler(A, ctx):
    A.utils.set_seed(3)
    return _fit(
        A, _shuffled(batch_size=_per_rank_bs(ctx), seed=None), epochs=2, dl={"use_seedable_sampler": True}
    )


@_case
def case_seedable_sampler_set_epoch(A, ctx):
    A.utils.set_seed(3)
    return _fit(
        A,
        _shuffled(batch_size=_per_rank_bs(ctx), seed=None),
        epochs=3,
        set_epoch=True,
        dl={"use_seedable_sampler": True},
    )


@_case
def case_seedable_sampler_data_seed(A, ctx):
    torch.manual_seed(5 + ctx["rank"])
    return _fit(
        A,
        _shuffled(batch_size=_per_rank_bs(ctx), seed=None),
        epochs=2,
        dl={"use_seedable_sampler": True, "data_seed": 1234},
    )


@_case
def case_seedable_sampler_user_generator(A, ctx):
    return _fit(A, _shuffled(batch_size=_per_rank_bs(ctx)), epochs=2, dl={"use_seedable_sampler": True})


# ---------------------------------------------------------------------------------------------
# batching: split, even, drop_last, custom samplers


@_case
def case_split_batches_noshuffle(A, ctx):
    return _fit(A, _plain(batch_size=16), epochs=2, dl={"split_batches": True})


@_case
def case_even_batches_uneven_length(A, ctx):
    return _fit(A, _plain(n=90, batch_size=8), epochs=2)


@_case
def case_even_batches_false_uneven_length(A, ctx):
    return _fit(A, _plain(n=90, batch_size=8), epochs=2, dl={"even_batches": False})


@_case
def case_even_batches_shuffled_uneven(A, ctx):
    return _fit(A, _shuffled(n=75, batch_size=8), epochs=2)


@_case
def case_split_batches_uneven_length(A, ctx):
    return _fit(A, _plain(n=90, batch_size=16), epochs=2, dl={"split_batches": True})


@_case
def case_drop_last(A, ctx):
    return _fit(A, _plain(n=90, batch_size=8, drop_last=True), epochs=2)


@_case
def case_drop_last_shuffled_split(A, ctx):
    return _fit(A, _shuffled(n=90, batch_size=16, drop_last=True), epochs=2, dl={"split_batches": True})


@_case
def case_custom_batch_sampler(A, ctx):
    loader = DataLoader(_Regression(90), batch_sampler=_ReversedChunks(90, 8))
    return _fit(A, loader, epochs=2)


@_case
def case_custom_batch_sampler_growing(A, ctx):
    loader = DataLoader(_Regression(40), batch_sampler=_GrowingBatches(40))
    return _fit(A, loader, epochs=1)


def _collect(A: Any, loader: DataLoader, dl: dict | None = None) -> dict:
    """Iterate a prepared loader without training (ranks may see different step counts)."""
    accelerator = _accelerator(A, dl=dl)
    loader = accelerator.prepare(loader)
    out: dict[str, list] = {"indices": [], "end": []}
    for batch in loader:
        out["indices"].append(batch["idx"].tolist())
        out["end"].append(bool(accelerator.gradient_state.end_of_dataloader))
    out["len"] = _safe_len(loader)
    return out


@_case
def case_even_batches_false_odd_batch_count(A, ctx):
    return _collect(A, _plain(n=36, batch_size=8), dl={"even_batches": False})


@_case
def case_custom_batch_sampler_growing_uneven(A, ctx):
    return _collect(
        A, DataLoader(_Regression(40), batch_sampler=_GrowingBatches(40)), dl={"even_batches": False}
    )


# ---------------------------------------------------------------------------------------------
# iterable datasets and dispatching


@_case
def case_iterable_sized(A, ctx):
    return _fit(A, DataLoader(_Stream(96), batch_size=_per_rank_bs(ctx)), epochs=2)


@_case
def case_iterable_uneven(A, ctx):
    return _fit(A, DataLoader(_Stream(90), batch_size=8), epochs=2)


@_case
def case_iterable_unknown_length(A, ctx):
    return _fit(A, DataLoader(_Stream(90, sized=False), batch_size=8), epochs=2)


@_case
def case_iterable_split_batches(A, ctx):
    return _fit(A, DataLoader(_Stream(90), batch_size=16), epochs=2, dl={"split_batches": True})


@_case
def case_iterable_drop_last(A, ctx):
    return _fit(A, DataLoader(_Stream(90), batch_size=8, drop_last=True), epochs=2)


@_case
def case_dispatch_batches_map(A, ctx):
    return _fit(A, _plain(n=90, batch_size=8), epochs=2, dl={"dispatch_batches": True})


@_case
def case_dispatch_batches_shuffled(A, ctx):
    return _fit(A, _shuffled(n=96, batch_size=8), epochs=2, dl={"dispatch_batches": True})


@_case
def case_dispatch_batches_iterable(A, ctx):
    return _fit(A, DataLoader(_Stream(90), batch_size=8), epochs=2, dl={"dispatch_batches": True})


@_case
def case_dispatch_batches_split(A, ctx):
    return _fit(
        A,
        DataLoader(_Stream(90), batch_size=16),
        epochs=2,
        dl={"dispatch_batches": True, "split_batches": True},
    )


@_case
def case_global_rng_dropout_map(A, ctx):
    # Iterating draws the worker base seed from the global RNG (no loader generator): dropout sees it.
    A.utils.set_seed(8)
    return _fit(A, _plain(n=64, batch_size=8), epochs=2, dropout=True)


@_case
def case_global_rng_dropout_dispatch(A, ctx):
    A.utils.set_seed(8)
    return _fit(
        A, DataLoader(_Stream(64), batch_size=8), epochs=2, dropout=True, dl={"dispatch_batches": True}
    )


@_case
def case_global_rng_dropout_shuffled_dispatch(A, ctx):
    A.utils.set_seed(8)
    loader = _shuffled(n=64, batch_size=8, seed=None)
    return _fit(A, loader, epochs=2, dropout=True, dl={"dispatch_batches": True})


# ---------------------------------------------------------------------------------------------
# gradient accumulation and syncing


@_case
def case_grad_accum_1(A, ctx):
    return _fit(A, _shuffled(n=80, batch_size=8), epochs=2, accumulate=True, gradient_accumulation_steps=1)


@_case
def case_grad_accum_3(A, ctx):
    # 80 samples, 8 per rank and step: 5 steps per epoch, so the last window is cut by the loader's end.
    return _fit(A, _shuffled(n=80, batch_size=8), epochs=2, accumulate=True, gradient_accumulation_steps=3)


@_case
def case_grad_accum_3_no_sync_at_end(A, ctx):
    plugin = A.utils.GradientAccumulationPlugin(num_steps=3, sync_with_dataloader=False)
    return _fit(
        A, _shuffled(n=80, batch_size=8), epochs=2, accumulate=True, gradient_accumulation_plugin=plugin
    )


@_case
def case_grad_accum_3_scheduler(A, ctx):
    return _fit(
        A,
        _shuffled(n=80, batch_size=8),
        epochs=2,
        accumulate=True,
        gradient_accumulation_steps=3,
        scheduler=True,
    )


@_case
def case_manual_no_sync(A, ctx):
    accelerator = A.Accelerator()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _plain(n=96, batch_size=8))
    grads = []
    for step, batch in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        if step % 2 == 0:
            with accelerator.no_sync(model):
                accelerator.backward(loss)
            grads.append([float(p.grad.sum()) for p in model.parameters()])
        else:
            accelerator.backward(loss)
            grads.append([float(p.grad.sum()) for p in model.parameters()])
            optimizer.step()
            optimizer.zero_grad()
    return {"grads": grads, "params": _params(accelerator, model)}


@_case
def case_scheduler_with_optimizer(A, ctx):
    return _fit(A, _shuffled(n=96, batch_size=8), epochs=2, scheduler=True, lr=0.3)


@_case
def case_scheduler_not_with_optimizer(A, ctx):
    return _fit(
        A,
        _shuffled(n=96, batch_size=8),
        epochs=2,
        scheduler=True,
        lr=0.3,
        step_scheduler_with_optimizer=False,
    )


@_case
def case_scheduler_split_batches(A, ctx):
    return _fit(
        A, _shuffled(n=96, batch_size=16), epochs=2, scheduler=True, lr=0.3, dl={"split_batches": True}
    )


# ---------------------------------------------------------------------------------------------
# metrics, skipping, resuming


def _gather_all(A: Any, loader: DataLoader, **accel_kwargs: Any) -> dict:
    accelerator = _accelerator(A, **accel_kwargs)
    loader = accelerator.prepare(loader)
    seen, sizes, remainders = [], [], []
    for batch in loader:
        got = accelerator.gather_for_metrics(batch["idx"])
        seen.extend(got.tolist())
        sizes.append(len(got))
        remainders.append(int(accelerator.gradient_state.remainder))
    return {"seen": seen, "sizes": sizes, "remainders": remainders}


@_case
def case_gather_for_metrics_uneven(A, ctx):
    return _gather_all(A, _plain(n=90, batch_size=8))


@_case
def case_gather_for_metrics_uneven_split(A, ctx):
    return _gather_all(A, _plain(n=90, batch_size=16), dl={"split_batches": True})


@_case
def case_gather_for_metrics_iterable(A, ctx):
    return _gather_all(A, DataLoader(_Stream(90), batch_size=8))


@_case
def case_gather_for_metrics_iterable_even(A, ctx):
    return _gather_all(A, DataLoader(_Stream(96), batch_size=8))


@_case
def case_gather_for_metrics_iterable_unknown_length(A, ctx):
    return _gather_all(A, DataLoader(_Stream(90, sized=False), batch_size=8))


@_case
def case_gather_for_metrics_iterable_no_dispatch(A, ctx):
    return _gather_all(A, DataLoader(_Stream(90), batch_size=8), dl={"dispatch_batches": False})


@_case
def case_gather_for_metrics_dispatch(A, ctx):
    return _gather_all(A, DataLoader(_Stream(90), batch_size=8), dl={"dispatch_batches": True})


@_case
def case_gather_for_metrics_objects(A, ctx):
    return gather_objects(A, _plain(n=90, batch_size=8), lambda i: f"s{i}", use_gather_object=True)


def _skip_run(A: Any, loader: DataLoader, skip: int) -> dict:
    accelerator = A.Accelerator()
    loader = accelerator.prepare(loader)
    out: dict[str, list] = {"first_epoch": [], "second_epoch": []}
    skipped = accelerator.skip_first_batches(loader, skip)
    out["skipped_len"] = [_safe_len(skipped)]
    for batch in skipped:
        out["first_epoch"].append(batch["idx"].tolist())
    for batch in loader:
        out["second_epoch"].append(batch["idx"].tolist())
    return out


@_case
def case_skip_first_batches(A, ctx):
    return _skip_run(A, _plain(n=90, batch_size=8), 2)


@_case
def case_skip_first_batches_shuffled(A, ctx):
    return _skip_run(A, _shuffled(n=96, batch_size=8), 3)


@_case
def case_skip_first_batches_iterable(A, ctx):
    return _skip_run(A, DataLoader(_Stream(90), batch_size=8), 2)


def _resumable_setup(A: Any, seedable: bool) -> tuple:
    """Build the run of the resume cases: dropout from each rank's own RNG, LambdaLR, and a user
    generator (or, ``seedable``, a seedable sampler and no generator)."""
    dl = {"use_seedable_sampler": True, "data_seed": 4} if seedable else None
    accelerator = _accelerator(A, dl=dl)
    A.utils.set_seed(21, device_specific=True)
    model = _model(dropout=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.5 * s))
    generator = None if seedable else torch.Generator().manual_seed(13)
    loader = DataLoader(_Regression(96), batch_size=8, shuffle=True, generator=generator)
    return (accelerator, *accelerator.prepare(model, optimizer, loader, scheduler))


def _resumable(A: Any, interrupt_at: int | None, directory: str, seedable: bool = False) -> dict:
    """Train 2 epochs; with ``interrupt_at``, save after that many steps and resume in a fresh run."""
    accelerator, model, optimizer, loader, scheduler = _resumable_setup(A, seedable)
    out: dict[str, list] = {"indices": [], "losses": [], "lr": []}

    def run(batches: Any, stop: int | None = None) -> None:
        for step, batch in enumerate(batches):
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            out["indices"].append(batch["idx"].tolist())
            out["losses"].append(loss.item())
            out["lr"].append(float(optimizer.param_groups[0]["lr"]))
            if stop is not None and step + 1 == stop:
                return

    if interrupt_at is None:
        run(loader)
    else:
        run(loader, interrupt_at)
        accelerator.save_state(directory)
        accelerator.wait_for_everyone()
        # A fresh run (new objects, other RNG streams) restored from the checkpoint.
        _reset(A)
        accelerator, model, optimizer, loader, scheduler = _resumable_setup(A, seedable)
        torch.manual_seed(999)
        accelerator.load_state(directory)
        run(accelerator.skip_first_batches(loader, interrupt_at))
    run(loader)
    out["params"] = _params(accelerator, model)
    out["rng_after"] = torch.rand(3).tolist()
    return out


@_case
def case_resume_uninterrupted(A, ctx):
    return _resumable(A, None, os.path.join(ctx["workdir"], "unused"))


@_case
def case_resume_mid_epoch(A, ctx):
    # Resumed after 5 of 6 steps (odd, with LambdaLR): must equal the uninterrupted run.
    return _resumable(A, 5, os.path.join(ctx["workdir"], "ckpt_mid_epoch"))


@_case
def case_resume_seedable_uninterrupted(A, ctx):
    return _resumable(A, None, os.path.join(ctx["workdir"], "unused"), seedable=True)


@_case
def case_resume_seedable_mid_epoch(A, ctx):
    return _resumable(A, 3, os.path.join(ctx["workdir"], "ckpt_seedable"), seedable=True)


# ---------------------------------------------------------------------------------------------
# collectives on nested structures, precision, seeds


def _nested(rank: int, length: int = 2) -> dict:
    base = torch.arange(length, dtype=torch.float32) + 10 * rank
    return {
        "a": base.clone(),
        "b": [base.reshape(-1, 1) * 2, (base.long() + 1,)],
        "c": torch.tensor(float(rank)),
    }


def _to_json(data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return {"dtype": str(data.dtype), "shape": list(data.shape), "values": data.flatten().tolist()}
    if isinstance(data, dict):
        return {k: _to_json(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return {"type": type(data).__name__, "items": [_to_json(v) for v in data]}
    return data


@_case
def case_ops_reduce_nested(A, ctx):
    acc = A.Accelerator()
    return {
        "sum": _to_json(acc.reduce(_nested(acc.process_index), reduction="sum")),
        "mean": _to_json(acc.reduce({"m": torch.arange(3.0) + acc.process_index}, reduction="mean")),
    }


@_case
def case_ops_gather_nested(A, ctx):
    acc = A.Accelerator()
    return {"gather": _to_json(acc.gather(_nested(acc.process_index)))}


@_case
def case_ops_pad_across_processes(A, ctx):
    acc = A.Accelerator()
    data = _nested(acc.process_index, length=2 + acc.process_index)
    return {
        "pad": _to_json(acc.pad_across_processes(data, dim=0, pad_index=-1)),
        "pad_first": _to_json(acc.pad_across_processes(data, dim=0, pad_index=7, pad_first=True)),
    }


@_case
def case_ops_broadcast_nested(A, ctx):
    acc = A.Accelerator()
    data = _nested(acc.process_index)
    return {"broadcast": _to_json(A.utils.broadcast(data, from_process=0))}


@_case
def case_mixed_precision_bf16(A, ctx):
    A.utils.set_seed(0)
    out = _fit(A, _shuffled(n=96, batch_size=8), epochs=2, mixed_precision="bf16")
    out["mixed_precision"] = A.state.AcceleratorState().mixed_precision
    return out


@_case
def case_set_seed_device_specific(A, ctx):
    A.Accelerator()
    A.utils.set_seed(17, device_specific=True)
    first = torch.rand(4).tolist()
    A.utils.set_seed(17)
    second = torch.rand(4).tolist()
    return {"device_specific": first, "shared": second}


# ---------------------------------------------------------------------------------------------
# running


def _reset(A: Any) -> None:
    """Forget the Accelerator/gradient singletons (the process group stays) between cases."""
    A.state.AcceleratorState._reset_state(reset_partial_state=False)
    A.state.GradientState._reset_state()


# The programs that build the prepared dataloader classes directly live in their own file.
CASES.update(LOADER_CASES)
CASES.update(DROPIN_CASES)
CASES.update(METRICS_CASES)


def run_cases(
    A: Any, workdir: str, names: list[str] | None = None, log: Callable | None = None, catch: bool = False
) -> dict[str, dict]:
    """Run the named cases (all by default) in this process; return ``{case: result}``.

    With ``catch`` a case that raises is recorded as ``{"error": traceback}`` and the next one runs.
    """
    state = A.state.PartialState()
    ctx = {"rank": state.process_index, "world": state.num_processes, "workdir": workdir}
    results = {}
    for name in names or list(CASES):
        _reset(A)
        torch.manual_seed(0)
        if log is not None:
            log(name)
        try:
            results[name] = CASES[name](A, ctx)
        except Exception:
            if not catch:
                raise
            results[name] = {"error": traceback.format_exc()}
        A.state.PartialState().wait_for_everyone()
    _reset(A)
    return results
