"""Golden programs for ``gather_for_metrics`` on uneven last batches, as evaluation loops write it.

The dataset lengths do not divide by batch size times processes, so the prepared loader pads the last
batch with duplicates of the first samples; ``gather_for_metrics`` must drop exactly those, whatever
the structure gathered (prediction and label pairs, dicts, 2-d logits, 0-d values, objects), however
often it is called in one step, and for an evaluation loader run inside a training loop.
``tests/goldens_programs.py`` adds these to its ``CASES``; ``A`` is the library's top-level module,
the result is plain JSON. This file imports neither library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from tests.goldens_shared import Samples, gather_objects, registrar

__all__ = ["METRICS_CASES"]

METRICS_CASES: dict[str, Callable[[Any, dict], dict]] = {}


_case = registrar(METRICS_CASES)


class _Labelled(Samples):
    """``n`` samples: an index, 3 "logits" that encode it and a label (index mod 5)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        logits = torch.tensor([i, 10.0 * i, 100.0 * i])
        return {"idx": torch.tensor(i), "logits": logits, "label": torch.tensor(i % 5)}


def _loader(n: int, batch_size: int, shuffle: bool = False) -> DataLoader:
    generator = torch.Generator().manual_seed(11) if shuffle else None
    return DataLoader(_Labelled(n), batch_size=batch_size, shuffle=shuffle, generator=generator)


def _rows(tensor: torch.Tensor) -> list:
    return tensor.tolist()


def _eval(A: Any, loader: DataLoader, dl: dict | None = None, **kwargs: Any) -> dict:
    """One evaluation pass: gather (logits, labels) as a pair and a dict, each step; list what arrives."""
    if dl:
        kwargs["dataloader_config"] = A.utils.DataLoaderConfiguration(**dl)
    accelerator = A.Accelerator(**kwargs)
    loader = accelerator.prepare(loader)
    out: dict[str, list] = {"logits": [], "labels": [], "dict_idx": [], "sizes": [], "sums": [], "mixed": []}
    for batch in loader:
        logits, labels = accelerator.gather_for_metrics((batch["logits"], batch["label"]))
        out["logits"].extend(_rows(logits))
        out["labels"].extend(_rows(labels))
        as_dict = accelerator.gather_for_metrics({"idx": batch["idx"], "nested": [batch["label"]]})
        out["dict_idx"].extend(_rows(as_dict["idx"]))
        out["sizes"].append([len(logits), len(as_dict["nested"][0])])
        out["sums"].append(_rows(accelerator.gather_for_metrics(batch["idx"].sum())))
        # a structure with a 0-d leaf: on one process nothing can be cut from it, so nothing is
        idx, total = accelerator.gather_for_metrics((batch["idx"], batch["idx"].sum()))
        out["mixed"].append([_rows(idx), _rows(total)])
    return out


@_case
def case_gather_for_metrics_pairs_uneven(A, ctx):
    return _eval(A, _loader(n=45, batch_size=4))


@_case
def case_gather_for_metrics_pairs_shuffled(A, ctx):
    return _eval(A, _loader(n=45, batch_size=4, shuffle=True))


@_case
def case_gather_for_metrics_pairs_split_batches(A, ctx):
    return _eval(A, _loader(n=45, batch_size=8), dl={"split_batches": True})


@_case
def case_gather_for_metrics_pairs_dispatch(A, ctx):
    return _eval(A, _loader(n=45, batch_size=4), dl={"dispatch_batches": True})


@_case
def case_gather_for_metrics_one_short_batch(A, ctx):
    return _eval(A, _loader(n=3, batch_size=8))


@_case
def case_gather_for_metrics_batch_size_one(A, ctx):
    return _eval(A, _loader(n=5, batch_size=1))


@_case
def case_gather_for_metrics_inside_training(A, ctx):
    """An evaluation loader run inside a training loop: its remainder must not leak into training steps."""
    accelerator = A.Accelerator()
    train, evaluation = accelerator.prepare(_loader(n=20, batch_size=4), _loader(n=13, batch_size=2))
    out: dict[str, list] = {"train": [], "eval": []}
    for step, batch in enumerate(train):
        out["train"].append(_rows(accelerator.gather_for_metrics(batch["idx"])))
        if step == 1:
            for eval_batch in evaluation:
                out["eval"].extend(_rows(accelerator.gather_for_metrics(eval_batch["idx"])))
    return out


@_case
def case_gather_for_metrics_objects_uneven(A, ctx):
    return gather_objects(A, _loader(n=13, batch_size=3), lambda i: {"i": i, "name": f"s{i}"})
