"""Activation memory of one forward (and backward) pass, measured without allocating real memory.

The model runs once on fake tensors (``torch._subclasses.FakeTensorMode``: shapes, dtypes and
devices propagate through the real operators' meta kernels, no data is allocated) with its
parameters swapped for fake ones through ``torch.func.functional_call``. A ``TorchDispatchMode``
sees every operator's outputs below autograd, so it also sees what autograd saves for backward and
the gradients it creates. It counts each new storage once (views share their base's storage) and
forgets it when the storage object is freed: the peak of those live bytes is what the pass would
allocate on top of the weights.

Limitation: a fused kernel's private workspace (e.g. the inference fast path of
``nn.TransformerEncoderLayer`` in eval mode, which is one operator) is invisible at operator level;
only its inputs and outputs are counted.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["ActivationTrace", "trace_activations", "normalize_sample_input"]


class _LiveBytes(TorchDispatchMode):
    """Count the bytes of live tensor storages created by the operators run under this mode."""

    def __init__(self, ignore: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.live = 0
        self.peak = 0
        for tensor in ignore:  # the weights: present before and after, not part of the pass
            self._seen[tensor.untyped_storage()] = 0

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes

    def track(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as live (once) until it is freed."""
        storage = tensor.untyped_storage()
        if storage in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen[storage] = nbytes
        # Storages keep one Python object while the C++ storage lives (PyObject preservation), so
        # the finalizer runs when the memory would really be released, e.g. when autograd drops a
        # saved tensor during backward.
        weakref.finalize(storage, self._release, nbytes)
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self.track(item)
        return out


@dataclass(frozen=True)
class ActivationTrace:
    """Bytes a pass allocates on top of the weights (inputs included)."""

    inference_peak: int
    """Peak live bytes of one forward under ``torch.no_grad()``."""
    training_peak: int
    """Peak live bytes of one forward plus backward (saved activations and the gradients)."""
    gradients: int
    """Bytes of the parameter gradients the backward created."""
    inputs: int
    """Bytes of the inputs themselves."""


def normalize_sample_input(sample_input: Any) -> tuple[tuple, dict]:
    """Return ``(args, kwargs)`` of :class:`torch.Size`-like specs ``(shape, dtype or None)``.

    Accepts a tensor, a shape (tuple of ints), a dict of those (keyword arguments) or a list/tuple
    of those (positional arguments). Only shapes and dtypes are kept; dimension 0 is the batch.
    """

    def spec(item: Any, where: str) -> tuple[tuple[int, ...], torch.dtype | None]:
        if isinstance(item, torch.Tensor):
            if item.dim() == 0:
                raise ValueError(f"sample_input {where} is a 0-d tensor; it needs a batch dimension first")
            return tuple(item.shape), item.dtype
        if isinstance(item, (tuple, list, torch.Size)) and item and all(isinstance(d, int) for d in item):
            if any(d <= 0 for d in item):
                raise ValueError(f"sample_input {where} has a non-positive dimension: {tuple(item)}")
            return tuple(item), None
        raise TypeError(
            f"sample_input {where} must be a tensor or a shape (tuple of ints), got {type(item).__name__}: {item!r}"
        )

    if isinstance(sample_input, Mapping):
        return (), {str(k): spec(v, f"[{k!r}]") for k, v in sample_input.items()}
    if (
        isinstance(sample_input, (tuple, list))
        and sample_input
        and not all(isinstance(d, int) for d in sample_input)
    ):
        return tuple(spec(v, f"[{i}]") for i, v in enumerate(sample_input)), {}
    return (spec(sample_input, "(the only input)"),), {}


def _describe(args_spec: tuple, kwargs_spec: dict) -> str:
    """Return the sample input as shapes and dtypes, e.g. ``(4, 16) int64`` (not the tensors' values)."""

    def one(spec: tuple) -> str:
        shape, dtype = spec
        return f"{shape}" + (f" {str(dtype).replace('torch.', '')}" if dtype is not None else "")

    parts = [one(a) for a in args_spec] + [f"{k}={one(v)}" for k, v in kwargs_spec.items()]
    return ", ".join(parts)


def _make_input(
    spec: tuple[tuple[int, ...], torch.dtype | None], batch_size: int | None, compute_dtype: torch.dtype
) -> torch.Tensor:
    """Return a zero tensor for one input spec: dimension 0 set to ``batch_size``, floats in ``compute_dtype``."""
    shape, dtype = spec
    if batch_size is not None:
        shape = (int(batch_size),) + tuple(shape[1:])
    if dtype is None or dtype.is_floating_point:
        dtype = compute_dtype
    # zeros, not empty: integer inputs (token ids) must be valid indices for embeddings.
    return torch.zeros(shape, dtype=dtype, device="cpu")


def _fake_like(tensor: torch.Tensor, grad: bool, compute_dtype: torch.dtype) -> torch.Tensor:
    """Return an empty CPU tensor shaped like ``tensor`` (floats in ``compute_dtype``), needing grad if asked."""
    dtype = compute_dtype if tensor.is_floating_point() else tensor.dtype
    fake = torch.empty(tensor.shape, dtype=dtype, device="cpu")
    return fake.requires_grad_(grad and fake.is_floating_point())


def _traced_pass(
    model: torch.nn.Module,
    inputs_spec: tuple[tuple, dict],
    batch_size: int | None,
    compute_dtype: torch.dtype,
    training: bool,
) -> tuple[int, int, int]:
    """Return ``(peak live bytes, gradient bytes, input bytes)`` of one forward (and backward when ``training``)."""
    model.train(training)  # dropout/batch-norm behave as in a real inference or training step
    mode = FakeTensorMode()
    with mode:
        # One fake per distinct parameter: functional_call(tie_weights=True) re-ties the aliases.
        params = {n: _fake_like(p, p.requires_grad, compute_dtype) for n, p in model.named_parameters()}
        buffers = {n: _fake_like(b, False, compute_dtype) for n, b in model.named_buffers()}
        # normalize_sample_input gives flat specs: a tuple of them and a dict of them, never nested.
        args = tuple(_make_input(spec, batch_size, compute_dtype) for spec in inputs_spec[0])
        kwargs = {name: _make_input(spec, batch_size, compute_dtype) for name, spec in inputs_spec[1].items()}
    counter = _LiveBytes(ignore=list(params.values()) + list(buffers.values()))
    for tensor in tree_flatten((args, kwargs))[0]:
        if isinstance(tensor, torch.Tensor):
            counter.track(tensor)
    input_bytes = counter.live
    with mode, counter, torch.set_grad_enabled(training):
        out = functional_call(model, {**params, **buffers}, args, kwargs, tie_weights=True, strict=False)
        if training:
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs:
                loss = sum(t.float().sum() for t in outs)
                del out, outs
                loss.backward()
                del loss
    grads = sum(p.grad.untyped_storage().nbytes() for p in params.values() if p.grad is not None)
    return counter.peak, grads, input_bytes


def trace_activations(
    model: torch.nn.Module,
    sample_input: Any,
    batch_size: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> ActivationTrace:
    """Return an :class:`ActivationTrace` of ``model`` on ``sample_input`` (see :func:`normalize_sample_input`).

    Floating-point weights and inputs are traced in ``compute_dtype``; ``batch_size`` replaces
    dimension 0 of every input. The model may live on any device, the meta device included; no
    real memory is allocated and the model itself is not modified.
    """
    inputs_spec = normalize_sample_input(sample_input)
    was_training = model.training
    try:
        inference_peak, _, input_bytes = _traced_pass(model, inputs_spec, batch_size, compute_dtype, False)
        training_peak, grads, _ = _traced_pass(model, inputs_spec, batch_size, compute_dtype, True)
    except Exception as exc:
        raise RuntimeError(
            f"Tracing {type(model).__name__} on sample_input {_describe(*inputs_spec)} failed with "
            f"{type(exc).__name__}: {exc}. Check that model(*sample_input) runs, or pass sample_input=None "
            "to estimate without measured activations."
        ) from exc
    finally:
        model.train(was_training)
    return ActivationTrace(inference_peak, training_peak, grads, input_bytes)
