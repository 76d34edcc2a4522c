"""A checkpoint folder that appears whole or not at all, written by every process of a run.

``atomic_directory`` gives the processes a temporary folder to write into and swaps it into place
once all of them are done; ``recover_directory`` finishes or undoes a swap that a kill interrupted.
The processes agree after each step (``failed_processes``), so a failure on one of them is raised on
all of them instead of leaving the others at a barrier.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .utils.atomic_files import atomic_write, fsync_tree
from .utils.operations import reduce

__all__ = ["atomic_directory", "failed_processes", "recover_directory"]

logger = logging.getLogger(__name__)


def failed_processes(state: Any, ok: bool) -> list[int]:
    """Return the indices of the processes that arrive with ``ok`` False; every process must call it.

    A barrier that carries one flag per process (a sum over processes), so that a process whose part
    of a collective save failed does not leave the others waiting at the next barrier forever: all
    learn of it and raise.
    """
    flags = torch.zeros(state.num_processes, dtype=torch.bool, device=state.device)
    flags[state.process_index] = not ok
    return torch.nonzero(reduce(flags, "sum")).flatten().tolist()


def _agree(state: Any, final: Path, step: str) -> None:
    """Wait for every process; raise RuntimeError naming those whose ``step`` failed (they raise their own error)."""
    failed = failed_processes(state, True)
    if failed:
        raise RuntimeError(
            f"save_state failed on process(es) {failed} while {step} (the error is raised there); "
            f"{str(final)!r} holds the checkpoint it held before this save"
        )


@contextmanager
def _fail_together(state: Any) -> Iterator[None]:
    """Tell the other processes (through ``failed_processes``) when the block raises here, then re-raise."""
    try:
        yield
    except BaseException:
        failed_processes(state, False)
        raise


@contextmanager
def atomic_directory(final: str | os.PathLike, state: Any, is_writer: bool) -> Iterator[Path]:
    """Yield a temporary folder that replaces ``final`` once every process has written into it.

    All processes must enter; ``state`` provides ``wait_for_everyone`` (and, with several processes,
    their group). The writer creates the temporary folder and, after the last process is done, swaps
    it into place: a complete old or a complete new folder exists at every moment. When a step fails
    on some processes, those raise their error and the others a RuntimeError naming them (none waits
    for the rest forever); the temporary folder goes and ``final`` keeps the earlier checkpoint.
    """
    final = Path(final)
    tmp = final.parent / f".{final.name}.partial"
    with _fail_together(state):
        if is_writer:
            recover_directory(final)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
    _agree(state, final, "preparing the folder")
    try:
        with _fail_together(state):
            tmp.mkdir(parents=True, exist_ok=True)  # a process on a node without the shared folder
            yield tmp
        _agree(state, final, "writing its part")
    except BaseException:
        # What a failed save wrote goes at once (a full disk stays full otherwise, failing the next
        # save elsewhere too); the earlier checkpoint at ``final`` was never touched.
        if is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    with _fail_together(state):
        if is_writer:
            _swap_into_place(final, tmp)  # a kill or error half-way is undone by recover_directory
    _agree(state, final, "moving the new checkpoint into place")


def _swap_into_place(final: Path, tmp: Path) -> None:
    """Replace ``final`` by the complete folder ``tmp``; a kill at any point leaves a recoverable state."""
    old = final.parent / f".{final.name}.old"
    marker = final.parent / f".{final.name}.swapping"
    fsync_tree(tmp)  # the data is on disk before any name points at it
    if old.exists():
        shutil.rmtree(old)
    # The marker says "tmp is complete": recover_directory then finishes the swap instead of
    # reverting to the old folder.
    atomic_write(os.fspath(marker), lambda t: Path(t).write_text(tmp.name))
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_tree(final.parent, files=False)
    marker.unlink()
    if old.exists():
        shutil.rmtree(old)


def recover_directory(final: str | os.PathLike) -> bool:
    """Return True after putting back a checkpoint folder that a kill between two renames left hidden.

    A kill after the old folder was moved aside leaves ``.NAME.old`` (complete) and, once the new
    folder was fully written, ``.NAME.swapping`` beside a complete ``.NAME.partial``: the newer
    complete folder wins. Run before every save into and every load from ``final``.
    """
    final = Path(final)
    if final.exists():
        return False
    tmp, old = final.parent / f".{final.name}.partial", final.parent / f".{final.name}.old"
    marker = final.parent / f".{final.name}.swapping"
    source = tmp if marker.exists() and tmp.is_dir() else old if old.is_dir() else None
    if source is None:
        return False
    try:
        os.replace(source, final)
    except FileNotFoundError:  # another process of the same run restored it first
        return final.exists()
    logger.warning("checkpoint %s was hidden by an interrupted save; restored it from %s", final, source.name)
    marker.unlink(missing_ok=True)
    for leftover in (tmp, old):  # the other one is stale (older, or not known complete)
        shutil.rmtree(leftover, ignore_errors=True)
    return True
