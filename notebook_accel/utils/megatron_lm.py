"""``accelerate.utils.megatron_lm``: the placeholders, train steps and engine of the Megatron-LM integration.

Served from :mod:`notebook_accel.integrations.megatron.lm` (every name of its ``__all__``), imported the first time a name is asked for.
"""

from .._lazy import forward

__getattr__, __dir__ = forward(__name__, "notebook_accel.integrations.megatron.lm")
