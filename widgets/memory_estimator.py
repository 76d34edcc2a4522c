"""MemoryEstimator: how much memory a model needs per dtype, and whether this machine can run it.

The panel is a model (``_memory_model.MemoryModel``: the estimates, plain Python and torch) with this
thin ipywidgets view: a table, a chart, the verdicts and the code to load the model in the chosen dtype.
"""

from __future__ import annotations

import html
from typing import Any

from ._base import _badge, _import_ipywidgets, _Panel, _table, _text_table
from ._charts import grouped_bars_png, png_img_tag
from ._memory_model import DtypeEstimate, MemoryModel

__all__ = ["MemoryEstimator", "DtypeEstimate"]


class MemoryEstimator(MemoryModel, _Panel):
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

    def _changed(self) -> None:
        self.refresh()

    # -- rendering --------------------------------------------------------------------------
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

    def chart_png(self) -> bytes:
        """Return a PNG bar chart: weights, inference and training per dtype against this machine's memory."""
        labels, series, lines = self.chart_series()
        return grouped_bars_png(labels, series, "Memory per dtype", hlines=lines)

    def _html(self) -> str:
        rows = self._badged_rows()
        parts = [
            f"<b>MemoryEstimator</b> — {html.escape(type(self.model).__name__)}"
            + (f", batch size {self._batch_size}" if self._batch_size else ""),
            _table(self._HEADERS, rows, escape=False),
            f"<small>{html.escape(self.machine_line())}</small>",
        ]
        heads, items = self.training_table()
        if items:
            parts.append(_table(heads, items))
        parts.append(png_img_tag(self.chart_png(), "memory per dtype"))
        return "<br>".join(parts)

    def _text(self) -> str:
        act = "measured" if self.sample_input is not None else "rule of thumb (+20%)"
        return (
            f"MemoryEstimator({type(self.model).__name__}, activations: {act})\n"
            + _text_table(self._HEADERS, self.rows())
            + "\n"
            + self.machine_line()
        )

    def _build_widget(self) -> Any:
        w = _import_ipywidgets()
        self._w_batch = w.BoundedIntText(
            value=self._batch_size or self.sample_batch(),
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

    def _on_batch(self, change: dict) -> None:
        if self.sample_input is not None and change["new"] != self._batch_size:
            self.batch_size = int(change["new"])

    def _refresh_widget(self) -> None:
        self._w_table.value = _table(self._HEADERS, self._badged_rows(), escape=False)
        heads, items = self.training_table()
        self._w_items.value = _table(heads, items) if items else ""
        self._w_machine.value = f"<small>{html.escape(self.machine_line())}</small>"
        self._w_chart.value = self.chart_png()
        est = self.estimates[self._w_dtype.value]
        self._w_verdict.description = f"loading / inference: {est.inference_verdict}"
        self._w_verdict.button_style = est.style
        self._w_training.description = f"training: {est.training_verdict}"
        self._w_training.button_style = est.training_style
        self._w_code.value = est.code
