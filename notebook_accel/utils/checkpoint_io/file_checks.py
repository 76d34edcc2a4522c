"""Checks on files a load is about to read, each failure naming the file: stay inside the folder, not empty, not cut short.

Readers deep in torch and safetensors report a broken file without its name (``EOFError`` with no text,
``SafetensorError: header too small``, a zip reader's "failed finding central directory"); these helpers
read or probe a file and turn such failures into a ``ValueError`` that names the file and what looks wrong
with it. ``path_inside`` is the one check that a name read from an index (a checkpoint's shard, an offloaded
weight) stays inside the index's folder.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable
from typing import Any

import torch

from .safetensors_header import read_header

__all__ = ["broken_file_error", "path_inside", "safetensors_keys", "torch_load_named"]


def path_inside(
    folder: str | os.PathLike, relative: str, what: str, folder_kind: str, follow_symlinks: bool = True
) -> str:
    """Return ``folder/relative``; raise ValueError when the name leaves ``folder`` (``..`` or an absolute path).

    ``follow_symlinks`` also refuses a name whose symlinks lead out of the folder (the offload folder is
    ours to write); a checkpoint folder may hold links into a cache (the Hugging Face hub's snapshots link
    their files to ``../../blobs``), so for it only the name itself is checked.
    """
    base = os.path.abspath(os.fspath(folder))
    target = os.path.normpath(os.path.join(base, relative))
    if follow_symlinks:
        base, target = os.path.realpath(base), os.path.realpath(target)
    if os.path.isabs(relative) or os.path.commonpath([base, target]) != base:
        raise ValueError(
            f"{what} {relative!r} leaves the {folder_kind} {os.fspath(folder)!r}; names it lists must stay "
            "inside it (no '..', no absolute paths)"
        )
    return target


def _size(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def broken_file_error(
    path: str | os.PathLike, exc: BaseException, what: str = "checkpoint file"
) -> ValueError:
    """Return a ValueError naming ``path`` that a reader failed on with ``exc``: empty, truncated or unreadable."""
    path = os.fspath(path)
    size = _size(path)
    detail = str(exc).strip() or type(exc).__name__
    if size == 0:
        state = "is empty (0 bytes)"
    elif isinstance(exc, EOFError) or "central directory" in detail or "truncated" in detail:
        state = f"looks truncated ({size} bytes; {detail})"
    else:
        state = f"could not be read ({detail})"
    return ValueError(
        f"{what} {path!r} {state}: its save was probably interrupted or the disk was full. Save it again, "
        "or load an earlier checkpoint"
    )


def safetensors_keys(path: str | os.PathLike, what: str = "checkpoint file") -> list[str]:
    """Return the tensor names in the safetensors file at ``path`` after checking its header (cheap: no data read)."""
    try:
        return list(read_header(path).entries)
    except ValueError as exc:
        raise ValueError(
            f"{what} {os.fspath(path)!r} is empty, truncated or not a safetensors file ({exc}). Save it again, "
            "or load an earlier checkpoint"
        ) from None


def torch_load_named(
    path: str | os.PathLike,
    what: str = "checkpoint file",
    loader: Callable[..., Any] = torch.load,
    **load_kwargs: Any,
) -> Any:
    """Return ``loader(path, **load_kwargs)`` (``torch.load``); an empty or cut-short file raises a ValueError naming it."""
    path = os.fspath(path)
    if _size(path) == 0:
        raise broken_file_error(path, EOFError(), what)
    if zipfile.is_zipfile(path) is False and _looks_like_zip_start(path):
        # A zip archive whose end (the central directory) is missing: cut short while it was written.
        raise broken_file_error(path, EOFError("the zip archive's central directory is missing"), what)
    try:
        return loader(path, **load_kwargs)
    except (EOFError, zipfile.BadZipFile) as exc:
        raise broken_file_error(path, exc, what) from None
    except RuntimeError as exc:
        if "PytorchStreamReader" in str(exc) or "zip archive" in str(exc):
            raise broken_file_error(path, exc, what) from None
        raise


def _looks_like_zip_start(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"
