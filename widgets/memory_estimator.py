"""MemoryEstimator: how much memory a model needs per dtype, and whether this machine can run it."""

from __future__ import annotations

import html
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from notebook_accel.big_modeling import init_empty_weights
from notebook_accel.utils.device_planning.sizes import get_max_layer_size

from ._activations import ActivationTrace, normalize_sample_input, trace_activations
from ._base import _badge, _fmt_bytes, _import_ipywidgets, _Panel, _size_literal, _table, _text_table
from ._charts import grouped_bars_png, png_img_tag
from ._machine import MachineInfo, machine_info
from ._modules import (
    COMPUTE_DTYPE,
    DTYPE_BYTES,
    dtype_name,
    module_sizes,
    suggest_no_split_classes,
    top_level,
)

__all__ = ["MemoryEstimator", "DtypeEstimate"]

logger = logging.getLogger(__name__)

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


class MemoryEstimator(_Panel):
    """Memory needed by a model per dtype (weights, largest layer, inference, training with Adam) vs this machine.

    Example::

        from notebook_accel.widgets import MemoryEstimator
        est = MemoryEstimator(lambda: MyModel(config), sample_input=(1, 512), batch_size=8)
        est.display()                        # table, bar chart, verdicts, code to load
        est.estimates["float16"].training    # bytes of one training step with Adam
        est.batch_size = 32                  # re-traces the activations

    ``model_or_factory`` is a module (real or on the meta device) or a function building one; the
    function runs under ``init_empty_weights()`` so nothing is allocated. ``sample_input`` (a tensor,
    a shape, or a list/dict of them; dim 0 is the batch) enables measured activation memory: one
    forward and backward are traced on fake tensors, so nothing real is allocated either.
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

    # -- model ------------------------------------------------------------------------------
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
        self.refresh()

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

    # -- rendering --------------------------------------------------------------------------
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

    _HEADERS = [
        "dtype",
        "largest layer",
        "total size",
        "inference",
        "training (Adam)",
        "loading / inference",
        "training step",
    ]

    def _badged_rows(self) -> list[list[str]]:
        """Return the table rows as HTML cells, the two verdicts as coloured badges."""
        return [
            [html.escape(c) for c in r[:-2]]
            + [_badge(e.inference_verdict, e.style), _badge(e.training_verdict, e.training_style)]
            for r, e in zip(self.rows(), self.estimates.values())
        ]

    def _machine_line(self) -> str:
        m = self.machine
        gpus = ", ".join(f"GPU {g.index}: {_fmt_bytes(g.free)} free of {_fmt_bytes(g.total)}" for g in m.gpus)
        limit = f" (cgroup limit {_fmt_bytes(m.cgroup_limit)})" if m.cgroup_limit else ""
        return (
            f"This machine: RAM {_fmt_bytes(m.ram_available)} available of {_fmt_bytes(m.ram_total)}{limit}; "
            f"{gpus or 'no GPU'}; disk {_fmt_bytes(m.disk_free)} free"
        )

    def _items_rows(self) -> list[list[str]]:
        trainable = [e for e in self.estimates.values() if e.training_items]
        if not trainable:
            return []
        keys = list(trainable[0].training_items)
        return [[k] + [_fmt_bytes(e.training_items[k]) for e in trainable] for k in keys]

    def chart_png(self) -> bytes:
        """Return a PNG bar chart: weights, inference and training per dtype against this machine's memory."""
        labels = list(self.estimates)
        ests = list(self.estimates.values())
        series = {
            "weights": [e.total_size / _GIB for e in ests],
            "inference": [e.inference / _GIB for e in ests],
            "training": [(e.training or 0) / _GIB for e in ests],
        }
        lines = {"RAM available": self.machine.ram_available / _GIB}
        if self.machine.gpus:
            lines["GPU free (sum)"] = self.machine.gpu_free_total / _GIB
        return grouped_bars_png(labels, series, "Memory per dtype", hlines=lines)

    def _html(self) -> str:
        rows = self._badged_rows()
        parts = [
            f"<b>MemoryEstimator</b> — {html.escape(type(self.model).__name__)}"
            + (f", batch size {self._batch_size}" if self._batch_size else ""),
            _table(self._HEADERS, rows, escape=False),
            f"<small>{html.escape(self._machine_line())}</small>",
        ]
        items = self._items_rows()
        if items:
            heads = ["training item"] + [e.dtype for e in self.estimates.values() if e.training_items]
            parts.append(_table(heads, items))
        parts.append(png_img_tag(self.chart_png(), "memory per dtype"))
        return "<br>".join(parts)

    def _text(self) -> str:
        act = "measured" if self.sample_input is not None else "rule of thumb (+20%)"
        return (
            f"MemoryEstimator({type(self.model).__name__}, activations: {act})\n"
            + _text_table(self._HEADERS, self.rows())
            + "\n"
            + self._machine_line()
        )

    def _build_widget(self) -> Any:
        w = _import_ipywidgets()
        self._w_batch = w.BoundedIntText(
            value=self._batch_size or self._sample_batch(),
            min=1,
            max=1_000_000,
            description="batch size",
            disabled=self.sample_input is None,
        )
        self._w_batch.observe(self._on_batch, names="value")
        self._w_table = w.HTML()
        self._w_items = w.HTML()
        self._w_chart = w.Image(format="png")
        self._w_dtype = w.ToggleButtons(options=self.dtypes, value=self.dtypes[0], description="code for")
        self._w_dtype.observe(lambda _c: self._refresh_widget(), names="value")
        self._w_verdict = w.Button(disabled=True, layout=w.Layout(width="auto"))
        self._w_training = w.Button(disabled=True, layout=w.Layout(width="auto"))
        self._w_code = w.Textarea(layout=w.Layout(width="100%", height="12em"))
        self._w_machine = w.HTML()
        return w.VBox(
            [
                self._w_batch,
                self._w_table,
                self._w_machine,
                # Wraps below the chart when the panel is narrow, instead of running off its edge.
                w.HBox([self._w_chart, self._w_items], layout=w.Layout(flex_flow="row wrap", width="100%")),
                self._w_dtype,
                # The two verdicts of the chosen dtype on a row of their own: beside the dtype
                # buttons they were squeezed to "fits (infer..." at 1280 px.
                w.HBox([self._w_verdict, self._w_training], layout=w.Layout(flex_flow="row wrap")),
                self._w_code,
            ]
        )

    def _sample_batch(self) -> int:
        if self.sample_input is None:
            return 1
        args, kwargs = normalize_sample_input(self.sample_input)
        first = (list(args) + list(kwargs.values()))[0]
        return first[0][0]

    def _on_batch(self, change: dict) -> None:
        if self.sample_input is not None and change["new"] != self._batch_size:
            self.batch_size = int(change["new"])

    def _refresh_widget(self) -> None:
        self._w_table.value = _table(self._HEADERS, self._badged_rows(), escape=False)
        items = self._items_rows()
        heads = ["training item"] + [e.dtype for e in self.estimates.values() if e.training_items]
        self._w_items.value = _table(heads, items) if items else ""
        self._w_machine.value = f"<small>{html.escape(self._machine_line())}</small>"
        self._w_chart.value = self.chart_png()
        est = self.estimates[self._w_dtype.value]
        self._w_verdict.description = f"loading / inference: {est.inference_verdict}"
        self._w_verdict.button_style = est.style
        self._w_training.description = f"training: {est.training_verdict}"
        self._w_training.button_style = est.training_style
        self._w_code.value = est.code
