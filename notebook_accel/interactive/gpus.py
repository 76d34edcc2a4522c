"""Which GPU each interactive rank gets, and how ranks start once CUDA is initialised in the kernel.

``gpus=[0, 1]`` (``%ranks start 2 --gpus 0,1``) gives rank ``r`` the device ``gpus[r]``: the ranks see
only those devices (``CUDA_VISIBLE_DEVICES``, set in each rank before CUDA starts there), in that
order, so rank ``r`` uses ``cuda:r`` (its ``LOCAL_RANK``, as ``PartialState`` picks it), and its
namespace holds it as ``device``.

A forked process cannot use CUDA once its parent initialised it. With ``start_method=None`` (the
default) the ranks are forked while CUDA is untouched in the kernel, and spawned once it is (after
``model.cuda()`` in a kernel cell, or a library that initialises CUDA): the start and ``restart()`` go
on, with a warning saying what spawn costs (the ranks are fresh interpreters: the kernel's variables,
functions and imports are not inherited; push or import what they need). An explicit
``start_method="fork"`` is kept, and the launcher's error then names both ways out.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

__all__ = ["SPAWN_NOTE", "check_gpus", "choose_start_method", "cuda_initialised", "parse_gpus", "use_gpus"]

SPAWN_NOTE = (
    "CUDA is already initialised in this kernel, and a forked rank cannot use CUDA after that: the ranks are "
    "started with spawn instead of fork. Spawned ranks are fresh interpreters: the kernel's variables, "
    "functions and imports are NOT inherited (import them in a %%ranks cell, or send values with "
    "%ranks push NAME / ranks.push_many(...)), and starting takes a few seconds longer. To fork, restart "
    "the kernel and start the ranks before anything touches CUDA."
)


def cuda_initialised() -> bool:
    """Return True when CUDA is initialised in this process (never initialises it)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    return bool(cuda is not None and cuda.is_initialized())


def parse_gpus(text: str) -> list[int]:
    """Return the device indices of ``"0,1"`` (``%ranks start --gpus``); ValueError naming a bad one."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ValueError(
                f"--gpus {text!r}: {part!r} is not a device index; give one index per rank, e.g. --gpus 0,1"
            )
        out.append(int(part))
    return out


def check_gpus(
    gpus: Sequence[int] | None, num_processes: int | None, device_count: int
) -> tuple[int, ...] | None:
    """Return ``gpus`` as a tuple, checked against the ranks and the visible devices (None: not given).

    Raises TypeError for something that is not a list of indices, ValueError for a bad index, a
    device named twice, or a count that differs from ``num_processes``.
    """
    if gpus is None:
        return None
    if isinstance(gpus, (str, bytes)) or not isinstance(gpus, Sequence):
        raise TypeError(f"gpus={gpus!r} must be a list of device indices, one per rank, e.g. gpus=[0, 1]")
    for gpu in gpus:
        if not isinstance(gpu, int) or isinstance(gpu, bool) or gpu < 0:
            raise ValueError(f"gpus={list(gpus)!r}: {gpu!r} is not a device index (0, 1, ...)")
    if not gpus:
        raise ValueError(
            "gpus=[] names no device; give one index per rank, e.g. gpus=[0, 1], or leave it out"
        )
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"gpus={list(gpus)!r} names a device twice; each rank needs a device of its own")
    if num_processes is not None and len(gpus) != num_processes:
        raise ValueError(
            f"gpus={list(gpus)!r} names {len(gpus)} device(s) for {num_processes} rank(s); give one per rank "
            f"(or num_processes={len(gpus)})"
        )
    if device_count == 0:
        raise ValueError(
            f"gpus={list(gpus)!r}: no CUDA device is visible on this machine; leave gpus out to run on the CPU"
        )
    missing = [gpu for gpu in gpus if gpu >= device_count]
    if missing:
        raise ValueError(
            f"gpus={list(gpus)!r}: device(s) {missing} do not exist; this machine shows {device_count} CUDA "
            f"device(s), 0..{device_count - 1}"
        )
    return tuple(gpus)


def choose_start_method(
    start_method: str | None, uses_cuda: bool, initialised: bool
) -> tuple[str, str | None]:
    """Return ``(start method, note to show or None)``: None means fork, or spawn once CUDA is initialised here."""
    if start_method is not None:
        return start_method, None
    if uses_cuda and initialised:
        return "spawn", SPAWN_NOTE
    return "fork", None


def use_gpus(gpus: Sequence[int] | None) -> None:
    """Show a rank only its devices (call in the rank, before CUDA starts there)."""
    if gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
