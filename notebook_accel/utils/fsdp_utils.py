"""``accelerate.utils.fsdp_utils``: saving and loading FSDP models and optimizers.

Served from :mod:`notebook_accel.integrations.fsdp.checkpoints` (every name of its ``__all__``), imported the first time a name is asked for.
"""

from .._lazy import forward

__getattr__, __dir__ = forward(__name__, "notebook_accel.integrations.fsdp.checkpoints")
