"""Mixed precision for the Accelerator, in one place: the resolved mode, autocast, fp32 outputs, the scaler.

The Accelerator builds one :class:`Precision` when it is created and asks it for everything that
depends on the mode: the autocast context (``Accelerator.autocast`` and the prepared model's forward
use the same one), the wrapper that hands fp32 outputs back, and the fp16 gradient scaler. The list
of modes and their validation are :func:`notebook_accel.utils.enums.check_mixed_precision`: the
process state and the launcher need them too, and they sit below this package.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from collections.abc import Mapping
from typing import Any

import torch

from .._lazy import LazyModule
from ..utils.enums import DistributedType

__all__ = ["Precision"]

# The tensor operations load when a model is first wrapped for mixed precision.
_ops = LazyModule("notebook_accel.utils.operations")

# Modes torch.autocast runs natively, with the dtype it computes in. fp8 runs through an engine
# (Transformer Engine, torchao, MS-AMP) and "no" is plain fp32.
_AUTOCAST_DTYPES: Mapping[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Engines that scale the loss themselves: the Accelerator must not add a GradScaler of its own.
_SELF_SCALING = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


def _handler_kwargs(handler: Any) -> dict[str, Any]:
    if handler is None:
        return {}
    if isinstance(handler, Mapping):
        return dict(handler)
    return handler.to_kwargs()


def _autocast(device_type: str, dtype: torch.dtype, kwargs: Mapping[str, Any]) -> torch.autocast:
    # The one place a torch.autocast is built (Accelerator.autocast and the wrapped forward).
    return torch.autocast(device_type=device_type, dtype=dtype, **kwargs)


@dataclasses.dataclass(frozen=True)
class Precision:
    """The mixed-precision mode of one Accelerator and the device type it computes on.

    ``autocast_handler`` is the ``AutocastKwargs`` given to the Accelerator (or None).
    """

    mode: str
    device_type: str
    autocast_handler: Any = None

    @property
    def native_amp(self) -> bool:
        """Return whether the mode runs under ``torch.autocast`` (fp16 or bf16)."""
        return self.mode in _AUTOCAST_DTYPES

    @property
    def dtype(self) -> torch.dtype | None:
        """Return the autocast dtype (float16 / bfloat16), None when there is no autocast."""
        return _AUTOCAST_DTYPES.get(self.mode)

    def autocast(self, autocast_handler: Any = None) -> contextlib.AbstractContextManager:
        """Return the autocast context of this mode (a null context without native AMP).

        ``autocast_handler`` overrides the Accelerator's ``AutocastKwargs`` for this context only.
        """
        if not self.native_amp:
            return contextlib.nullcontext()
        handler = autocast_handler if autocast_handler is not None else self.autocast_handler
        return _autocast(self.device_type, self.dtype, _handler_kwargs(handler))

    def wrap_forward(self, model: torch.nn.Module) -> None:
        """Make ``model.forward`` run under :meth:`autocast` and hand back fp32 outputs (no-op without AMP).

        The original forward is kept in ``model._original_forward``, which is how
        ``unwrap_model(keep_fp32_wrapper=False)`` takes the wrapper off. When the forward is the
        model's own method, the wrapper is bound as a method too, so ``copy.deepcopy(model)`` gives a
        copy whose forward runs the copy.
        """
        if not self.native_amp or "_original_forward" in model.__dict__:
            return  # nothing to do, or already wrapped by an earlier prepare
        original = model.forward
        own_method = getattr(original, "__self__", None) is model and hasattr(original, "__func__")
        # Resolved once here rather than on every forward call.
        device_type, dtype, kwargs = self.device_type, self.dtype, _handler_kwargs(self.autocast_handler)
        if own_method:
            function = original.__func__

            @functools.wraps(function)
            def forward(module: torch.nn.Module, *args: Any, **kw: Any) -> Any:
                with _autocast(device_type, dtype, kwargs):
                    return function(module, *args, **kw)

            wrapped: Any = types.MethodType(_ops.convert_outputs_to_fp32(forward), model)
        else:

            @functools.wraps(original)
            def forward(*args: Any, **kw: Any) -> Any:
                with _autocast(device_type, dtype, kwargs):
                    return original(*args, **kw)

            wrapped = _ops.convert_outputs_to_fp32(forward)
        model._original_forward = original
        model.forward = wrapped

    def grad_scaler(self, distributed_type: DistributedType, scaler_handler: Any = None) -> Any:
        """Return the fp16 ``torch.amp.GradScaler`` (GradScalerKwargs applied), or None when none is needed.

        Only fp16 needs loss scaling; DeepSpeed and Megatron-LM scale inside their engines.
        """
        if self.mode != "fp16" or distributed_type in _SELF_SCALING:
            return None
        return torch.amp.GradScaler(self.device_type, **_handler_kwargs(scaler_handler))
