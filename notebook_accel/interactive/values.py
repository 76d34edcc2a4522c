"""What the kernel gets of a rank's value: its display forms, a digest to compare it by, the value only when small.

Rank side, ``value_payload`` builds the reply to a command: the value's ``repr`` and ``_repr_html_``, a
digest of its contents (tensors by dtype, shape and bytes, so two ranks' values can be compared without
moving them), and the pickled value itself when it fits ``limit`` (None: always, as ``pull`` and
``ranks.run`` ask). CUDA tensors are pickled as CPU tensors, wherever they sit in the value: a rank's
GPU memory never lands on the kernel's GPU.

Kernel side, ``cell_result`` turns that payload into a ``CellResult``; ``same_value`` says whether two
ranks' values are equal (same digest, or ``==`` giving True where both values came over).
"""

from __future__ import annotations

import hashlib
import io
import pickle
import re
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..utils._wire import dumps_by_value

__all__ = [
    "DEFAULT_VALUE_LIMIT",
    "CellResult",
    "ValueOnRankError",
    "cell_result",
    "digest",
    "dumps_cpu",
    "format_size",
    "parse_size",
    "same_value",
    "value_payload",
]

DEFAULT_VALUE_LIMIT = 1_000_000
"""Bytes (pickled) up to which a cell's last value comes to the kernel with its display forms."""

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


class ValueOnRankError(LookupError):
    """A cell's value stayed on its rank (over the value limit): ``ranks.pull`` fetches it."""


def parse_size(size: object, what: str = "value_limit") -> int | None:
    """Return ``size`` in bytes: an int, a string like ``"50MB"`` / ``"2GiB"``, or None (no limit)."""
    if size is None or (isinstance(size, str) and size.strip().lower() in ("none", "inf", "unlimited")):
        return None
    if isinstance(size, bool) or not isinstance(size, (int, float, str)):
        raise TypeError(
            f"{what}={size!r} is not a size; give bytes (1_000_000), a string like '50MB', or None for no limit"
        )
    if isinstance(size, str):
        match = _SIZE.match(size)
        if match is None:
            raise ValueError(
                f"{what}={size!r} is not a size; write it like '500KB', '50MB' or '2GiB' (or give bytes, or None)"
            )
        unit = (match.group(2) or "").lower()
        base = 1024 if "i" in unit else 1000
        scale = 1 if unit in ("", "b") else base ** ("kmgt".index(unit[0]) + 1)
        size = float(match.group(1)) * scale
    if size < 0 or size != size:
        raise ValueError(f"{what}={size!r} must be 0 or more bytes (or None for no limit)")
    return int(size)


def format_size(num_bytes: float | None) -> str:
    """Return ``num_bytes`` for people: ``"16.8 MB"``, ``"900 B"``; ``"no limit"`` for None."""
    if num_bytes is None:
        return "no limit"
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{int(num_bytes)} B"


# ----------------------------------------------------------------------------------- rank side


def _torch() -> Any:
    return sys.modules.get("torch")  # a value holding a tensor means torch is imported already


def _cpu_reducer(torch: ModuleType, obj: object, protocol: int) -> Any:
    """Return how to pickle a non-CPU tensor as its CPU copy (a Parameter stays a Parameter)."""
    data = obj.detach().cpu()
    if isinstance(obj, torch.nn.Parameter):
        data = torch.nn.Parameter(data, requires_grad=obj.requires_grad)
    return data.__reduce_ex__(protocol)


def dumps_cpu(value: object) -> bytes:
    """Return ``value`` pickled (cloudpickle: classes of a rank's ``__main__`` by value), tensors as CPU tensors.

    Raises TypeError (``utils._wire.dumps_by_value``'s, the pickling error its ``__cause__``) when it cannot be.
    """
    torch = _torch()

    def on_cpu(obj: object) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            return _cpu_reducer(torch, obj, _PROTOCOL)
        return NotImplemented

    return dumps_by_value(
        value,
        what="the value",
        to="the kernel",
        fix="return or pull a picklable part of it",
        reduce=on_cpu if torch is not None else None,
    )


def _tensor_bytes(torch: ModuleType, tensor: Any) -> Any:
    """Return a buffer of ``tensor``'s contents (a CPU copy of a GPU tensor), or None when it has none."""
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type == "meta":
        return None
    flat = tensor.detach().resolve_conj().resolve_neg().reshape(-1).contiguous()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.view(torch.uint8).numpy()


def _feed(h: Any, value: object, torch: ModuleType, depth: int) -> None:
    """Add ``value`` to the hash ``h``: containers item by item, tensors by dtype, shape and bytes."""
    kind = type(value)
    if torch is not None and isinstance(value, torch.Tensor):
        h.update(f"T{kind.__qualname__}|{value.dtype}|{tuple(value.shape)}|{value.device.type}|".encode())
        data = _tensor_bytes(torch, value)
        h.update(memoryview(data) if data is not None else repr(value).encode())
        return
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray) and value.dtype != object:
        h.update(f"A|{value.dtype.str}|{value.shape}|".encode())
        h.update(memoryview(numpy.ascontiguousarray(value).reshape(-1).view(numpy.uint8)))
        return
    if depth < 50 and kind in (list, tuple, dict):
        items = value.items() if kind is dict else enumerate(value)
        h.update(f"{kind.__name__}|{len(value)}|".encode())
        for key, item in items:
            _feed(h, key, torch, depth + 1)
            _feed(h, item, torch, depth + 1)
        return
    if torch is not None and depth < 50 and isinstance(value, torch.nn.Module):
        # What a module is: its type, its structure (repr), train/eval, and its parameters and buffers.
        h.update(f"M{kind.__module__}.{kind.__qualname__}|{value!r}|{value.training}|".encode())
        _feed(h, dict(value.state_dict()), torch, depth + 1)
        return
    h.update(b"P")
    h.update(_comparable_pickle(value, torch))


def _comparable_pickle(value: object, torch: ModuleType) -> bytes:
    """Return ``value`` pickled so that equal contents give equal bytes in any process.

    Classes and functions go by name (a rank's ``__main__`` ones too: cloudpickle would tag each
    with a random id), and every tensor inside by the digest of its contents (torch's own pickling
    of a storage differs from one process to the next).
    """
    import cloudpickle

    def tensor_id(obj: object) -> str | None:
        if torch is not None and isinstance(obj, torch.Tensor):
            inner = hashlib.sha256()
            _feed(inner, obj, torch, 0)
            return inner.hexdigest()
        return None

    for base in (pickle.Pickler, cloudpickle.CloudPickler):  # by value only what has no name to go by
        buffer = io.BytesIO()
        pickler = base(buffer, protocol=_PROTOCOL)
        pickler.persistent_id = tensor_id
        try:
            pickler.dump(value)
        except Exception:
            if base is cloudpickle.CloudPickler:
                raise
            continue
        return buffer.getvalue()
    raise AssertionError("unreachable")  # pragma: no cover


def digest(value: object) -> str | None:
    """Return a digest of ``value``'s contents (equal values give equal digests), or None if it has none.

    Tensors and arrays are hashed by dtype, shape and bytes; lists, tuples and dicts item by item;
    modules by type, structure and state_dict; anything else by its pickled bytes. A value that
    cannot be pickled has no digest.
    """
    h = hashlib.sha256()
    try:
        _feed(h, value, _torch(), 0)
    except Exception:
        return None
    return h.hexdigest()


def _estimate(value: object, torch: ModuleType) -> int | None:
    """Return about how many bytes ``value`` pickles to, for values known to be big without pickling them."""
    if torch is not None:
        if isinstance(value, torch.Tensor) and value.layout == torch.strided:
            return value.numel() * value.element_size()
        if isinstance(value, torch.nn.Module):
            return sum(t.numel() * t.element_size() for t in value.state_dict().values())
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray) and value.dtype != object:
        return value.nbytes
    return None


def _type_name(value: object) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _display_forms(value: object, payload: dict[str, Any]) -> None:
    try:
        payload["text"] = repr(value)
    except Exception as exc:
        payload["text"] = f"<repr of {type(value).__name__} failed: {exc!r}>"
    html = getattr(value, "_repr_html_", None)
    if callable(html) and not isinstance(value, type):
        try:
            payload["html"] = html()
        except Exception:
            payload["html"] = None


def value_payload(
    value: Any, *, limit: int | None = None, compare: bool = False, with_repr: bool = True
) -> dict[str, Any]:
    """Return what the kernel gets of ``value``: its display forms, digest (``compare``) and, if it fits ``limit``, itself.

    Keys: ``text``, ``html``, ``value`` (the pickled value, or None), ``digest``, ``type``, ``size``
    (pickled bytes, or the estimate that kept it here), ``stayed`` (True when over ``limit``) and
    ``unpicklable`` (why pickling failed).
    """
    payload: dict[str, Any] = {"text": None, "html": None, "value": None, "digest": None}
    if value is None:
        return payload
    if with_repr:
        _display_forms(value, payload)
    payload["type"] = _type_name(value)
    if compare:
        payload["digest"] = digest(value)
    estimate = _estimate(value, _torch()) if limit is not None else None
    if estimate is not None and estimate > limit:
        payload.update(stayed=True, size=estimate)
        return payload
    try:
        blob = dumps_cpu(value)
    except TypeError as exc:
        cause = exc.__cause__ or exc
        payload["unpicklable"] = f"{type(cause).__name__}: {cause}"
        return payload
    payload["size"] = len(blob)
    if limit is not None and len(blob) > limit:
        payload["stayed"] = True
    else:
        payload["value"] = blob
    return payload


# ----------------------------------------------------------------------------------- kernel side


class CellResult:
    """What one rank gave back for a piece of code.

    ``value`` is the last expression's value (None without one, or when it could not be pickled
    back); when the value was over the value limit it stayed on the rank and reading ``value``
    raises ``ValueOnRankError`` saying how to fetch it (``ranks.pull``).
    """

    def __init__(
        self,
        rank: int,
        value: Any = None,
        text: str | None = None,
        html: str | None = None,
        ok: bool = True,
        error: str | None = None,
        unpicklable: str | None = None,
        *,
        digest: str | None = None,
        stayed: str | None = None,
        shipped: bool = False,
    ) -> None:
        self.rank = rank
        self._value = value
        self.text = text
        """``repr`` of the value (None when there is no last expression or it is None)."""
        self.html = html
        """``value._repr_html_()`` where the value has one."""
        self.ok = ok
        """False when the code raised on this rank (``error`` holds its traceback)."""
        self.error = error
        self.unpicklable = unpicklable
        """Why the value could not be sent back (its type and pickle's complaint), if it could not."""
        self.digest = digest
        """A digest of the value's contents computed on the rank (None: not computed, or not possible)."""
        self.stayed = stayed
        """Why the value stayed on the rank and how to fetch it (None: it came, or there is none)."""
        self.shipped = shipped
        """True when the value itself came to the kernel."""

    @property
    def value(self) -> Any:
        """Return the value of the last expression (raise ValueOnRankError if it stayed on the rank)."""
        if self.stayed is not None:
            raise ValueOnRankError(self.stayed)
        return self._value

    def __repr__(self) -> str:
        shown = f"<stayed on rank {self.rank}>" if self.stayed is not None else repr(self._value)
        return f"CellResult(rank={self.rank}, value={shown}, text={self.text!r}, ok={self.ok})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CellResult):
            return NotImplemented
        return vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by contents


def _stayed_message(rank: int, payload: dict[str, Any], limit: int | None, name: str) -> str:
    return (
        f"the value of rank {rank} (a {payload.get('type')}, {format_size(payload.get('size'))} pickled) stayed on "
        f"the rank: it is over the value limit ({format_size(limit)}). Fetch it with ranks.pull({name!r}, on={rank}) "
        f"(%ranks pull {name} --on {rank}); a rank keeps a cell's last value as {name}. Or raise the limit: "
        "%ranks value-limit 500MB (ranks.value_limit = '500MB')"
    )


def cell_result(rank: int, payload: dict[str, Any], limit: int | None = None) -> CellResult:
    """Return the CellResult of rank ``rank``'s ``payload`` (the value unpickled here when it came)."""
    result = CellResult(
        rank, text=payload.get("text"), html=payload.get("html"), digest=payload.get("digest")
    )
    if payload.get("unpicklable"):
        result.unpicklable = f"a {payload.get('type')}: {payload['unpicklable']}"
    elif payload.get("stayed"):
        result.stayed = _stayed_message(rank, payload, limit, "_")
    elif payload.get("value") is not None:
        try:
            result._value = pickle.loads(payload["value"])
            result.shipped = True
        except Exception as exc:
            result.unpicklable = f"unpickling it here failed: {type(exc).__name__}: {exc}"
    return result


def _equal_here(a: object, b: object) -> bool:
    try:
        same = a == b
    except Exception:
        return False
    return same if isinstance(same, bool) else False


def same_value(a: CellResult, b: CellResult, equal: Callable[[Any, Any], bool] = _equal_here) -> bool:
    """Return True when ranks ``a`` and ``b`` hold equal values: same digest, or ``==`` True on values that came."""
    if a.digest is not None and a.digest == b.digest:
        return True
    if a.shipped and b.shipped:
        return equal(a._value, b._value)
    return False
