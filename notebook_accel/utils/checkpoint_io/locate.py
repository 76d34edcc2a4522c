"""Finding a checkpoint's files: one weights file, an index of shards (checked against them), or a folder.

Every shard an index names must stay inside the index's folder, exist, and (safetensors: read from its
header) hold the tensors the index maps to it, so a bad index is named before any weight is read.
"""

from __future__ import annotations

import json
import os
from typing import Any, Union

from ..constants import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME
from .file_checks import path_inside, safetensors_keys

__all__ = ["CheckpointNotFoundError", "find_checkpoint_files"]


class CheckpointNotFoundError(FileNotFoundError, ValueError):
    """No checkpoint at the path given (a ValueError too, as Accelerate raises for it)."""


def _read_index(index_path: str) -> tuple[list[str], dict[str, str]]:
    """Return ``(shard files, weight map)`` of an index after checking it against its shards.

    The index is ``{"weight_map": {name: shard}, ...}`` or that map alone. Every shard must stay inside
    the index's folder, exist and (safetensors: read from its header, which
    costs no data read) hold the tensors the index maps to it.
    """
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"The checkpoint index {index_path} is not valid JSON: {err}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if (
        weight_map is None
        and isinstance(index, dict)
        and index
        and all(isinstance(v, str) for v in index.values())
    ):
        weight_map = (
            index  # a flat index: weight name -> shard file, with no "weight_map" key (1.15 reads it too)
        )
    if not isinstance(weight_map, dict):
        raise ValueError(
            f"The checkpoint index {index_path} has no 'weight_map' dict of weight name -> shard file "
            "(nor is it such a dict itself)."
        )
    folder = os.path.dirname(index_path)
    by_file: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        path = os.path.join(folder, shard)
        if path not in by_file:
            where = f"shard of the index {index_path!r} (holding {key!r})"
            path_inside(folder or ".", shard, where, "checkpoint folder", follow_symlinks=False)
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"Shard file {path!r} (holding {key!r}) named by the index {index_path!r} does not exist."
                )
        by_file.setdefault(path, []).append(key)
    for path, keys in by_file.items():
        if path.endswith(".safetensors"):
            _check_shard_holds(index_path, path, keys, safetensors_keys(path))
    return list(by_file), weight_map


def _check_shard_holds(index_path: str, shard_path: str, wanted: list[str], keys: Any) -> None:
    """Raise ValueError naming the index, the shard and the tensors the index maps to it that it does not hold."""
    held = set(keys)
    absent = [key for key in wanted if key not in held]
    if absent:
        shown = ", ".join(repr(k) for k in absent[:5]) + (
            f" and {len(absent) - 5} more" if len(absent) > 5 else ""
        )
        raise ValueError(
            f"The checkpoint index {index_path!r} maps {shown} to the shard {shard_path!r}, which does not hold "
            f"{'it' if len(absent) == 1 else 'them'}: the index and the shards do not belong together (was "
            "the checkpoint saved again with other shards?). Rewrite the index or save the checkpoint again."
        )


def _is_index_file(path: str) -> bool:
    """Return whether ``path`` is a JSON index (any name): ``.json``, or a file whose text starts with ``{``."""
    if path.endswith(".json"):
        return True
    if path.endswith(".safetensors"):
        return False
    with open(path, "rb") as f:
        head = f.read(64)
    # A safetensors header length can start with the byte "{", but its high bytes are NULs; JSON has none.
    return b"\0" not in head and head.lstrip().startswith(b"{")


def find_checkpoint_files(checkpoint: Union[str, os.PathLike]) -> tuple[list[str], str | None]:
    """Return ``(files, index_path)`` for the four checkpoint forms; safetensors wins when both formats exist.

    Forms: one weights file; an index of shards (a ``weight_map`` in JSON, any file name); a folder holding
    one ``.index.json``; a folder holding ``model.safetensors`` or ``pytorch_model.bin``.
    """
    files, index_path, _ = _locate(os.fspath(checkpoint))
    return files, index_path


def _locate(path: str) -> tuple[list[str], str | None, dict[str, str] | None]:
    """Return ``(files, index_path, weight_map)``; see :func:`find_checkpoint_files`."""
    if os.path.isfile(path):
        if _is_index_file(path):
            return _indexed(path)
        return [path], None, None
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"Checkpoint {path!r} is neither a file nor a folder.")
    entries = set(os.listdir(path))
    # safetensors before .bin; within a format a single file before an index, as Accelerate does.
    for name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME):
        if name in entries:
            full = os.path.join(path, name)
            return _indexed(full) if name.endswith(".json") else ([full], None, None)
    indexes = sorted(f for f in entries if f.endswith(".index.json"))
    if len(indexes) > 1:
        raise ValueError(
            f"{path} holds more than one `.index.json` file ({', '.join(indexes)}): delete the irrelevant ones "
            "or pass the index file itself."
        )
    if indexes:
        return _indexed(os.path.join(path, indexes[0]))
    raise CheckpointNotFoundError(
        f"{path} is not a folder containing a `.index.json` file or a {SAFE_WEIGHTS_NAME} or {WEIGHTS_NAME} file."
    )


def _indexed(index_path: str) -> tuple[list[str], str, dict[str, str]]:
    files, weight_map = _read_index(index_path)
    return files, index_path, weight_map
