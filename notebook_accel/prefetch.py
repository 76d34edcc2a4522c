"""Prefetching offload: load block i+1's weights on a background thread while block i computes.

The public face of :mod:`notebook_accel.hooks.prefetch` (see it for how the order is learnt and
what a background load does).
"""

from __future__ import annotations

from .hooks.prefetch import PAGES_READY, THREAD_NAME_PREFIX, Prefetcher, enable_prefetch

__all__ = ["Prefetcher", "enable_prefetch", "THREAD_NAME_PREFIX", "PAGES_READY"]
