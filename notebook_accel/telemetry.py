"""Hook telemetry: what the device-alignment hooks do, reported to whoever listens.

Hooks report, per module, weight loads (bytes, seconds, whether the prefetcher had them ready),
offloads and forward spans as :class:`HookEvent` objects. A listener subscribes with
:func:`subscribe`; the offload panel is one such listener. With no subscriber the hooks build no
event and read no clock, so telemetry costs nothing measurable when unused.

:func:`weight_placement` answers "where do each module's weights live and where does it run" for
a model at any moment, from its hooks and tensors.

This module is the public face: the bus is :mod:`notebook_accel.hooks.events`,
``weight_placement`` lives in :mod:`notebook_accel.hooks.offloaded`.
"""

from __future__ import annotations

from .hooks.events import EVENT_KINDS as EVENT_KINDS  # the event kinds, for listeners
from .hooks.events import HookEvent, Subscription, has_subscribers, subscribe
from .hooks.events import emit as emit  # internal: what the hooks call; tests emit events through it
from .hooks.offloaded import weight_placement

__all__ = ["HookEvent", "Subscription", "subscribe", "has_subscribers", "weight_placement"]
