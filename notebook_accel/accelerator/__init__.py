"""``Accelerator``, at the path Accelerate users import (``accelerate.accelerator``).

- :mod:`.flags`: the user's constructor flags, resolved and checked;
- :mod:`.wrapping`: which wrapper a model gets (DDP, FSDP, torch.compile, DeepSpeed);
- :mod:`.checkpoint`: ``save_state`` / ``load_state`` and the objects registered for checkpointing;
- :mod:`.tracking`: the experiment trackers an accelerator logs to;
- :mod:`.core`: the ``Accelerator`` class, a thin face over the above.

This package never imports hooks, big_modeling or the launcher (see docs/architecture.md).
"""

from __future__ import annotations

from ..optimizer import AcceleratedOptimizer
from ..scheduler import AcceleratedScheduler
from ..state import AcceleratorState, GradientState
from ..tracking import GeneralTracker, filter_trackers
from ..utils.enums import PrecisionType
from .core import Accelerator

# Besides Accelerator, the names code written for Accelerate imports from accelerate.accelerator.
__all__ = [
    "AcceleratedOptimizer",
    "AcceleratedScheduler",
    "Accelerator",
    "AcceleratorState",
    "GeneralTracker",
    "GradientState",
    "PrecisionType",
    "filter_trackers",
]
