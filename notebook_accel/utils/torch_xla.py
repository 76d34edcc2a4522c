"""``accelerate.utils.torch_xla``: installing torch_xla in Colab.

Served from :mod:`notebook_accel.integrations.xla` (every name of its ``__all__``), imported the first time a name is asked for.
"""

from .._lazy import forward

__getattr__, __dir__ = forward(__name__, "notebook_accel.integrations.xla")
