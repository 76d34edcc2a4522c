"""What the golden case files share: the table each registers its cases in, and a dataset of ``n`` samples.

A case is a function ``case_<name>`` of the library's top-level module (and, for the training programs,
the run's facts) returning plain JSON; ``scripts/record_accelerate_goldens.py`` and
``scripts/record_bigmodel_goldens.py`` record each under Accelerate 1.15, the golden tests run it on ours.
This file imports neither library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset

__all__ = ["Samples", "gather_objects", "registrar"]


def registrar(table: dict[str, Callable[..., Any]]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Return the decorator that registers a function ``case_<name>`` in ``table`` as ``<name>``."""

    def case(fn: Callable[..., Any]) -> Callable[..., Any]:
        table[fn.__name__.removeprefix("case_")] = fn
        return fn

    return case


class Samples(Dataset):
    """``n`` samples; a subclass says what sample ``i`` holds (``__getitem__``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} says what sample {i} holds")


def gather_objects(A: Any, loader: Any, per_sample: Callable[[int], Any], **gather: Any) -> dict:
    """Return ``{"seen": [...]}``: what ``gather_for_metrics`` gives back of ``per_sample(i)`` for each batch's indices.

    ``A`` is the library's top-level module; ``loader`` is prepared by a fresh Accelerator; ``gather`` goes to
    ``gather_for_metrics`` (``use_gather_object=True``...).
    """
    accelerator = A.Accelerator()
    seen = []
    for batch in accelerator.prepare(loader):
        seen.extend(accelerator.gather_for_metrics([per_sample(i) for i in batch["idx"].tolist()], **gather))
    return {"seen": seen}
