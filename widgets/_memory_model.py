"""The memory estimator's model: how much memory a model needs per dtype, and whether this machine can run it.

Plain Python and torch (no ipywidgets, no matplotlib): ``MemoryModel`` computes a ``DtypeEstimate``
per dtype (weights, largest layer, inference, a training step with Adam, the verdict and the code
to load it) against this machine's memory; ``memory_estimator.MemoryEstimator`` is its view.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from notebook_accel.big_modeling import init_empty_weights
from notebook_accel.utils.device_planning.sizes import get_max_layer_size

from ._activations import ActivationTrace, normalize_sample_input, trace_activations
from ._base import _fmt_bytes, _size_literal
from ._machine import MachineInfo, machine_info
from ._modules import (
    COMPUTE_DTYPE,
    DTYPE_BYTES,
    dtype_name,
    module_sizes,
    suggest_no_split_classes,
    top_level,
)

__all__: list[str] = []

FITS = "fits"
FITS_CPU_OFFLOAD = "fits with CPU offload"
FITS_DISK_OFFLOAD = "fits with disk offload"
DOES_NOT_FIT = "does not fit"
_VERDICT_STYLE = {
    FITS: "success",
    FITS_CPU_OFFLOAD: "info",
    FITS_DISK_OFFLOAD: "warning",
    DOES_NOT_FIT: "danger",
}
_GIB = 1024**3
_TRAINING_VERDICT = {
    True: ("fits", "success"),
    False: ("does not fit", "danger"),
    None: ("n/a: quantised", ""),
}


@dataclass
class DtypeEstimate:
    """Memory a model needs with its weights stored in one dtype (all sizes in bytes)."""

    dtype: str
    total_size: int
    """Weights (parameters and buffers) stored in this dtype."""
    largest_layer: int
    """Size of the largest layer (what must fit at once on the execution device when offloading)."""
    largest_layer_names: list[str]
    inference: int
    """Weights plus the forward's activations (measured with a sample input, else +20% rule of thumb)."""
    training: int | None
    """Peak of a training step with Adam; None for int8/int4 (quantised weights are not trained directly)."""
    training_items: dict[str, int] = field(default_factory=dict)
    """The training memory itemised: weights, gradients, adam_exp_avg, adam_exp_avg_sq,
    master_weights (fp32 copy under mixed precision), activations, optimizer_step_temporaries.
    Activations and step temporaries are never live together, so ``training`` counts the larger."""
    training_fits: bool | None = None
    """Whether a training step fits on the execution devices (the GPUs, else RAM); None for int8/int4."""
    activations_measured: bool = False
    verdict: str = DOES_NOT_FIT
    code: str = ""
    """The call that would load a checkpoint of this model in this dtype on this machine."""

    @property
    def style(self) -> str:
        """Return the status style of the verdict (success, info, warning, danger)."""
        return _VERDICT_STYLE[self.verdict]

    @property
    def inference_verdict(self) -> str:
        """Return the loading/inference verdict as shown: ``verdict``, marked "inference only" unless training fits too.

        A model that loads but cannot take a training step must never read as plainly "fits".
        """
        if self.verdict == DOES_NOT_FIT or self.training_fits:
            return self.verdict
        return f"{self.verdict} (inference only)"

    @property
    def training_verdict(self) -> str:
        """Return the training step's verdict: "fits", "does not fit" or "n/a: quantised" (int8/int4)."""
        return _TRAINING_VERDICT[self.training_fits][0]

    @property
    def training_style(self) -> str:
        """Return the status style of the training verdict (success, danger, or "" when not applicable)."""
        return _TRAINING_VERDICT[self.training_fits][1]


class MemoryModel:
    """Memory needed by a model per dtype (weights, largest layer, inference, training with Adam) vs this machine.

    The arguments are ``MemoryEstimator``'s; a subclass (the view) redraws in ``_changed()``.
    """

    def __init__(
        self,
        model_or_factory: torch.nn.Module | Callable[[], torch.nn.Module],
        dtypes: Sequence[str | torch.dtype] = ("float32", "float16", "int8", "int4"),
        sample_input: Any = None,
        batch_size: int | None = None,
        no_split_module_classes: list[str] | None = None,
        machine: MachineInfo | None = None,
        offload_folder: str = "offload",
        headroom: float = 0.9,
        foreach: bool | None = None,
    ) -> None:
        if isinstance(model_or_factory, torch.nn.Module):
            self.model = model_or_factory
        elif callable(model_or_factory):
            with init_empty_weights():
                self.model = model_or_factory()
            if not isinstance(self.model, torch.nn.Module):
                raise TypeError(
                    f"The model factory returned {type(self.model).__name__}, not a torch.nn.Module; "
                    "pass a module or a function that builds one"
                )
        else:
            raise TypeError(
                f"MemoryEstimator needs a torch.nn.Module or a function building one, got {type(model_or_factory).__name__}"
            )
        if not dtypes:
            raise ValueError(f"dtypes is empty: give at least one of {list(DTYPE_BYTES)}")
        self.dtypes = [dtype_name(d) for d in dtypes]
        if not 0 < headroom <= 1:
            raise ValueError(
                f"headroom must be in (0, 1] (fraction of free memory to plan with), got {headroom}"
            )
        self.headroom = headroom
        if sample_input is not None:
            normalize_sample_input(sample_input)  # validate now, not on first recompute
        self.sample_input = sample_input
        self.no_split_module_classes = (
            suggest_no_split_classes(self.model)
            if no_split_module_classes is None
            else list(no_split_module_classes)
        )
        self.offload_folder = offload_folder
        self.machine = machine if machine is not None else machine_info(offload_folder)
        # torch's Adam defaults to the foreach implementation on CUDA, the per-tensor loop on CPU.
        self.foreach = bool(self.machine.gpus) if foreach is None else foreach
        self._batch_size = self._check_batch(batch_size)
        self._traces: dict[tuple[torch.dtype, int | None], ActivationTrace] = {}
        self.estimates: dict[str, DtypeEstimate] = {}
        self.recompute()

    # -- the estimates ------------------------------------------------------------------------------
    @staticmethod
    def _check_batch(batch_size: int | None) -> int | None:
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(
                f"batch_size must be a positive int (or None for the sample's own), got {batch_size!r}"
            )
        return batch_size

    @property
    def batch_size(self) -> int | None:
        """Return the batch size the activations are traced with (None: the sample input's own)."""
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int | None) -> None:
        self._batch_size = self._check_batch(value)
        self.recompute()
        self._changed()

    def _trace(self, compute: torch.dtype) -> ActivationTrace | None:
        if self.sample_input is None:
            return None
        key = (compute, self._batch_size)
        if key not in self._traces:
            self._traces[key] = trace_activations(self.model, self.sample_input, self._batch_size, compute)
        return self._traces[key]

    def _float_param_stats(self) -> tuple[int, int]:
        """Return (numel of the trainable floating-point parameters, numel of the largest one)."""
        total = largest = 0
        seen: set[int] = set()
        for p in self.model.parameters():
            if id(p) in seen or not p.is_floating_point() or not p.requires_grad:
                continue
            seen.add(id(p))
            total += p.numel()
            largest = max(largest, p.numel())
        return total, largest

    def estimate(self, dtype: str | torch.dtype) -> DtypeEstimate:
        """Return the :class:`DtypeEstimate` of the model with its weights in ``dtype``."""
        name = dtype_name(dtype)
        sizes = module_sizes(self.model, name)
        weights = sizes[""]
        largest, largest_names = get_max_layer_size(
            top_level(self.model), sizes, self.no_split_module_classes
        )
        trace = self._trace(COMPUTE_DTYPE[name])
        inference = weights + trace.inference_peak if trace else int(weights * 1.2)

        training: int | None = None
        items: dict[str, int] = {}
        if name in ("float32", "float16", "bfloat16"):
            n_train, n_largest = self._float_param_stats()
            grads = int(n_train * DTYPE_BYTES[name])
            fp32 = n_train * 4
            step_temp = fp32 if self.foreach else 2 * n_largest * 4
            fwd_bwd = trace.training_peak if trace else grads
            items = {
                "weights": weights,
                "gradients": grads,
                "adam_exp_avg": fp32,
                "adam_exp_avg_sq": fp32,
                "master_weights": fp32 if name != "float32" else 0,
                "activations": max(0, fwd_bwd - grads),
                "optimizer_step_temporaries": step_temp,
            }
            training = weights + 2 * fp32 + items["master_weights"] + max(fwd_bwd, grads + step_temp)
        est = DtypeEstimate(
            dtype=name,
            total_size=weights,
            largest_layer=int(largest),
            largest_layer_names=list(largest_names),
            inference=int(inference),
            training=training,
            training_items=items,
            activations_measured=trace is not None,
        )
        est.verdict, est.code = self._verdict(est)
        if training is not None:
            budgets = self.budgets()
            gpus = [v for k, v in budgets.items() if k != "cpu"]
            est.training_fits = training <= (sum(gpus) if gpus else budgets["cpu"])
        return est

    def recompute(self) -> None:
        """Recompute every dtype's estimate (after changing batch size, machine or sample input)."""
        self.estimates = {d: self.estimate(d) for d in self.dtypes}

    # -- this machine -----------------------------------------------------------------------
    def budgets(self) -> dict[int | str, int]:
        """Return the bytes this machine offers per device (GPUs' free memory, then RAM), after headroom."""
        budgets: dict[int | str, int] = {}
        for gpu in self.machine.gpus:
            if gpu.free is not None:
                budgets[gpu.index] = int(gpu.free * self.headroom)
        budgets["cpu"] = int(self.machine.ram_available * self.headroom)
        return budgets

    def _verdict(self, est: DtypeEstimate) -> tuple[str, str]:
        budgets = self.budgets()
        gpu = {k: v for k, v in budgets.items() if k != "cpu"}
        ram, disk = budgets["cpu"], self.machine.disk_free
        overhead = est.inference - est.total_size  # activations: always on the execution device
        layer_need = est.largest_layer + overhead
        if gpu:
            if est.inference <= sum(gpu.values()) and layer_need <= max(gpu.values()):
                verdict = FITS
            elif layer_need <= max(gpu.values()) and est.total_size + overhead <= sum(gpu.values()) + ram:
                verdict = FITS_CPU_OFFLOAD
            elif (
                layer_need <= max(gpu.values())
                and est.largest_layer <= ram
                and est.inference <= sum(gpu.values()) + ram + disk
            ):
                verdict = FITS_DISK_OFFLOAD
            else:
                verdict = DOES_NOT_FIT
        elif est.inference <= ram:
            verdict = FITS
        elif layer_need <= ram and est.inference <= ram + disk:
            verdict = FITS_DISK_OFFLOAD
        else:
            verdict = DOES_NOT_FIT
        return verdict, self._code(est, verdict, budgets)

    def _code(self, est: DtypeEstimate, verdict: str, budgets: dict[int | str, int]) -> str:
        if verdict == DOES_NOT_FIT:
            return (
                f"# {est.dtype}: {_fmt_bytes(est.inference)} needed, this machine offers "
                f"{_fmt_bytes(sum(budgets.values()))} of memory and {_fmt_bytes(self.machine.disk_free)} of disk"
            )
        gpu = [k for k in budgets if k != "cpu"]
        if verdict == FITS:
            device_map = '"auto"' if gpu else '{"": "cpu"}'
            max_memory = {k: budgets[k] for k in gpu}
        else:
            device_map = '"auto"'
            max_memory = dict(budgets)
        mm = ", ".join(f"{k!r}: {_size_literal(v)!r}" for k, v in max_memory.items())
        args = [f"device_map={device_map}"]
        if mm:
            args.append("max_memory={" + mm + "}")
        if self.no_split_module_classes:
            args.append(f"no_split_module_classes={self.no_split_module_classes!r}")
        if verdict == FITS_DISK_OFFLOAD:
            args.append(f"offload_folder={self.offload_folder!r}")
        if est.dtype in ("int8", "int4"):
            flag = "load_in_8bit" if est.dtype == "int8" else "load_in_4bit"
            note = "" if gpu else "# bitsandbytes' 8-bit/4-bit layers need a CUDA GPU in most installs\n"
            return (
                note + "from notebook_accel.utils import BnbQuantizationConfig, load_and_quantize_model\n\n"
                f"model = load_and_quantize_model(\n    model,\n    BnbQuantizationConfig({flag}=True),\n"
                '    weights_location="path/to/checkpoint",\n    ' + ",\n    ".join(args) + ",\n)"
            )
        return (
            "import torch\nfrom notebook_accel import load_checkpoint_and_dispatch\n\n"
            'model = load_checkpoint_and_dispatch(\n    model,\n    checkpoint="path/to/checkpoint",\n    '
            + ",\n    ".join(args + [f"dtype=torch.{est.dtype}"])
            + ",\n)"
        )

    def _changed(self) -> None:
        """Say that the estimates changed (a new batch size); the view redraws."""

    # -- what the view shows ----------------------------------------------------------------
    def rows(self) -> list[list[str]]:
        """Return the table rows: dtype, largest layer, total, inference, training, loading/inference verdict, training verdict."""
        out = []
        for est in self.estimates.values():
            out.append(
                [
                    est.dtype,
                    _fmt_bytes(est.largest_layer),
                    _fmt_bytes(est.total_size),
                    _fmt_bytes(est.inference),
                    _fmt_bytes(est.training),
                    est.inference_verdict,
                    est.training_verdict,
                ]
            )
        return out

    def machine_line(self) -> str:
        """Return one line on this machine's memory: RAM available (and its cgroup limit), each GPU's free memory, free disk."""
        m = self.machine
        gpus = ", ".join(f"GPU {g.index}: {_fmt_bytes(g.free)} free of {_fmt_bytes(g.total)}" for g in m.gpus)
        limit = f" (cgroup limit {_fmt_bytes(m.cgroup_limit)})" if m.cgroup_limit else ""
        return (
            f"This machine: RAM {_fmt_bytes(m.ram_available)} available of {_fmt_bytes(m.ram_total)}{limit}; "
            f"{gpus or 'no GPU'}; disk {_fmt_bytes(m.disk_free)} free"
        )

    def training_table(self) -> tuple[list[str], list[list[str]]]:
        """Return the training memory itemised: headers (``training item`` and the trained dtypes) and a row per item ([] for none)."""
        trainable = [e for e in self.estimates.values() if e.training_items]
        heads = ["training item"] + [e.dtype for e in trainable]
        if not trainable:
            return heads, []
        keys = list(trainable[0].training_items)
        return heads, [[k] + [_fmt_bytes(e.training_items[k]) for e in trainable] for k in keys]

    def chart_series(self) -> tuple[list[str], dict[str, list[float]], dict[str, float]]:
        """Return the chart's data in GiB: dtypes, ``{weights|inference|training: value per dtype}``, and the machine's lines."""
        ests = list(self.estimates.values())
        series = {
            "weights": [e.total_size / _GIB for e in ests],
            "inference": [e.inference / _GIB for e in ests],
            "training": [(e.training or 0) / _GIB for e in ests],
        }
        lines = {"RAM available": self.machine.ram_available / _GIB}
        if self.machine.gpus:
            lines["GPU free (sum)"] = self.machine.gpu_free_total / _GIB
        return list(self.estimates), series, lines

    def sample_batch(self) -> int:
        """Return the batch size of the sample input (1 without one): the view's batch-size field starts there."""
        if self.sample_input is None:
            return 1
        args, kwargs = normalize_sample_input(self.sample_input)
        first = (list(args) + list(kwargs.values()))[0]
        return first[0][0]
