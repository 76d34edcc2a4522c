"""``accelerate.utils.ao``: torchao fp8 layer conversion.

Served from :mod:`notebook_accel.integrations.fp8.ao` (every name of its ``__all__``), imported the first time a name is asked for.
"""

from .._lazy import forward

__getattr__, __dir__ = forward(__name__, "notebook_accel.integrations.fp8.ao")
