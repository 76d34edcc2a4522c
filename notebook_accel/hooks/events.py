"""The telemetry bus: what the device-alignment hooks do, reported to whoever listens.

A leaf module (it imports nothing of this library), published as ``notebook_accel.telemetry``.

Hooks report, per module, weight loads (bytes, seconds, whether the prefetcher had them ready),
offloads and forward spans as :class:`HookEvent` objects; a model streaming its weights to a GPU
also reports each copy and each wait of the compute stream, timed on the device. A listener subscribes with
:func:`subscribe`; the offload panel is one such listener.

With no subscriber the hooks build no event and read no clock: they test the module-level flag
``_ACTIVE`` (one global lookup) and move on, so telemetry costs nothing measurable when unused
(see ``benchmarks/bench_hooks.py``).

:func:`~notebook_accel.telemetry.weight_placement` (in :mod:`notebook_accel.hooks.offloaded`)
answers "where do each module's weights live and where does it run" for a model at any moment.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["EVENT_KINDS", "HookEvent", "Subscription", "emit", "has_subscribers", "subscribe"]

logger = logging.getLogger(__name__)

EVENT_KINDS = ("load", "offload", "forward", "transfer", "wait")

# Read by the hooks on every call: a plain module global so the check is one dict lookup.
_ACTIVE = False
_LOCK = threading.Lock()
_CALLBACKS: dict[int, Callable[[HookEvent], None]] = {}
_NEXT_ID = 0


@dataclass(frozen=True)
class HookEvent:
    """One thing a hook did to one module."""

    kind: str
    """``"load"`` (weights brought to the execution device), ``"offload"`` (weights released),
    ``"forward"`` (the module's forward span, hook work included), and, when streaming to a GPU,
    ``"transfer"`` (one host-to-device copy of a unit's weights; ``seconds`` is the copy's time on the
    device) and ``"wait"`` (the compute stream waiting for a unit's copy; ``seconds`` is the time it
    stalled, measured on the device). Those two are reported once the device finished them, a few
    modules later; ``module`` is the unit's name (a device-map block, or a module)."""
    module: str
    """Qualified module name (``""`` for the root model)."""
    device: str
    """Where the weights were moved to, or where the forward ran."""
    source: str
    """Where the weights came from: ``"cpu"``, ``"disk"``, ``"cuda:0"``..."""
    nbytes: int
    """Bytes of the tensors concerned."""
    seconds: float
    """Duration of the event in the calling thread."""
    time: float
    """``time.perf_counter()`` at the end of the event."""
    prefetched: bool = False
    """True when a load was served by the background prefetcher."""

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"HookEvent kind {self.kind!r} is not one of {EVENT_KINDS}")


class Subscription:
    """Handle returned by :func:`subscribe`; ``close()`` (or leaving the ``with`` block) unsubscribes."""

    def __init__(self, key: int, callback: Callable[[HookEvent], None]) -> None:
        self._key = key
        self.callback = callback

    @property
    def closed(self) -> bool:
        """Return whether this subscription no longer receives events."""
        return self._key not in _CALLBACKS

    def close(self) -> None:
        """Stop receiving events; calling it again does nothing."""
        global _ACTIVE
        with _LOCK:
            _CALLBACKS.pop(self._key, None)
            _ACTIVE = bool(_CALLBACKS)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"Subscription({getattr(self.callback, '__qualname__', self.callback)!r}, {state})"


def subscribe(callback: Callable[[HookEvent], None]) -> Subscription:
    """Return a :class:`Subscription` through which ``callback`` receives every :class:`HookEvent`.

    The callback runs in the thread that produced the event (the forward's thread, or the
    prefetcher's thread for background loads); it should be quick. An exception it raises is
    logged and swallowed: a broken listener never breaks a forward pass.
    """
    global _ACTIVE, _NEXT_ID
    if not callable(callback):
        raise TypeError(f"subscribe() needs a callable taking a HookEvent, got {type(callback).__name__}")
    with _LOCK:
        key = _NEXT_ID
        _NEXT_ID += 1
        _CALLBACKS[key] = callback
        _ACTIVE = True
    return Subscription(key, callback)


def has_subscribers() -> bool:
    """Return True when at least one subscription is open (hooks build events only then)."""
    return _ACTIVE


def emit(event: HookEvent) -> None:
    """Deliver ``event`` to every subscriber (internal: called by the hooks)."""
    for callback in list(_CALLBACKS.values()):
        try:
            callback(event)
        except Exception:  # a listener must not break the model's forward
            logger.exception("telemetry subscriber %r raised on %s", callback, event)
