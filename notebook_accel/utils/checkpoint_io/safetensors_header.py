"""The header of a safetensors file, read and checked as the format specifies, before any byte is mapped.

The format (https://github.com/huggingface/safetensors, "Format"): 8 bytes, a little-endian u64 ``N``;
``N`` bytes of UTF-8 JSON (an object, possibly padded with spaces) mapping each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` plus an optional ``"__metadata__"`` map of
strings; then the byte buffer. Offsets are relative to the buffer; the tensors cover it contiguously,
without holes or overlaps, and each one spans exactly ``numel x itemsize`` bytes. safetensors itself
caps ``N`` at 100 MB. A file breaking any rule raises ``ValueError`` naming the file and the rule, so
a wrong header never hands out another tensor's bytes.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MAX_HEADER_BYTES", "SAFETENSORS_DTYPES", "SafetensorsHeader", "read_header"]

MAX_HEADER_BYTES = 100_000_000

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}
# Byte sizes of the format's dtypes that torch has no plain type for (read through safetensors itself).
_OTHER_SIZES = {"F8_E8M0": 1, "C64": 8}


@dataclass(frozen=True)
class SafetensorsHeader:
    """The checked header: ``entries`` (name -> dtype, shape, offsets), where the buffer starts, metadata."""

    path: str
    entries: dict[str, dict[str, Any]]
    data_start: int
    metadata: dict[str, str]


def _bad(path: str, rule: str) -> ValueError:
    return ValueError(f"{path!r} is not a valid safetensors file: {rule}")


def _itemsize(path: str, name: str, dtype: Any) -> int | None:
    if dtype in SAFETENSORS_DTYPES:
        return SAFETENSORS_DTYPES[dtype].itemsize
    if dtype in _OTHER_SIZES:
        return _OTHER_SIZES[dtype]
    if isinstance(dtype, str) and dtype.startswith(("F4", "F6")):
        return None  # sub-byte types: their size check is left to safetensors
    raise _bad(path, f"tensor {name!r} has unknown dtype {dtype!r}")


def _check_entry(path: str, name: str, info: Any) -> tuple[int, int]:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise _bad(path, f"entry {name!r} must be an object with dtype, shape and data_offsets; got {info!r}")
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise _bad(path, f"tensor {name!r} has shape {shape!r}; a shape is a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise _bad(
            path,
            f"tensor {name!r} has data_offsets {offsets!r}; expected [begin, end] with 0 <= begin <= end",
        )
    itemsize = _itemsize(path, name, info["dtype"])
    if itemsize is not None and offsets[1] - offsets[0] != math.prod(shape) * itemsize:
        raise _bad(
            path,
            f"tensor {name!r} ({info['dtype']} {shape}) needs {math.prod(shape) * itemsize} bytes but its "
            f"data_offsets {offsets} span {offsets[1] - offsets[0]}",
        )
    return offsets[0], offsets[1]


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Return the checked header of the safetensors file at ``path``; raise ValueError naming a broken rule."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            empty = ": the file is empty" if size == 0 else ": the file is cut short"
            raise _bad(path, f"it holds {size} bytes, fewer than the 8-byte header length{empty}")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise _bad(
                path,
                f"its header length {length} exceeds the file ({size} bytes) or the 100 MB limit: the file "
                "is cut short or not a safetensors file",
            )
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(path, f"its header is not UTF-8 JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _bad(path, f"its header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _bad(path, "__metadata__ must map strings to strings")
    spans = sorted((_check_entry(path, name, info), name) for name, info in header.items())
    end = 0
    for (begin, stop), name in spans:
        if begin != end:
            raise _bad(
                path, f"tensor {name!r} starts at byte {begin} of the data, expected {end} (hole or overlap)"
            )
        end = stop
    if 8 + length + end != size:
        short = ": the file is cut short" if size - 8 - length < end else ""
        raise _bad(
            path, f"its tensors cover {end} bytes of data but the file holds {size - 8 - length}{short}"
        )
    return SafetensorsHeader(path, header, 8 + length, metadata)
