"""The process world and the state singletons, at the path Accelerate users import (``accelerate.state``).

- :mod:`.world`: read the launch environment once into a frozen ``ProcessWorld``;
- :mod:`.split`: one process's share of a list, tensor or dict (``split_between_processes``);
- :mod:`.process`: ``PartialState`` and ``AcceleratorState``, the shared ("Borg") singletons over it;
- :mod:`.gradient`: ``GradientState``, the gradient-accumulation and dataloader bookkeeping.

This package imports only :mod:`notebook_accel.utils` (see docs/architecture.md).
"""

from __future__ import annotations

from ..utils.enums import DistributedType
from ..utils.environment import parse_flag_from_env
from .gradient import GradientState
from .process import AcceleratorState, PartialState

# Besides the singletons, names code written for Accelerate imports from accelerate.state.
__all__ = ["AcceleratorState", "DistributedType", "GradientState", "PartialState", "parse_flag_from_env"]
