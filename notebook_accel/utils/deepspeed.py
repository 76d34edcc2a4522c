"""``accelerate.utils.deepspeed``: DeepSpeed's config object, the placeholders and the engine wrappers.

Served from :mod:`notebook_accel.integrations.deepspeed.config` (every name of its ``__all__``), imported the first time a name is asked for.
"""

from .._lazy import forward

__getattr__, __dir__ = forward(__name__, "notebook_accel.integrations.deepspeed.config")
