"""notebook_accel.widgets: ipywidgets panels over the headless core (installed from the top-level widgets/ folder).

Each panel is a plain-Python model whose attributes hold everything it computes, with an
ipywidgets 8 view built on first use of ``.widget`` / ``.display()``, a static HTML snapshot
(``_repr_html_``) and a text ``repr``. Importing this package imports neither ipywidgets nor
matplotlib, and nothing here initialises CUDA.
"""

from __future__ import annotations

from notebook_accel._lazy import attach

__all__ = ["DeviceMapExplorer", "LaunchPanel", "MemoryEstimator", "OffloadMonitor"]

_TABLE = {
    "MemoryEstimator": ".memory_estimator",
    "DeviceMapExplorer": ".device_map_explorer",
    "OffloadMonitor": ".offload_monitor",
    "LaunchPanel": ".launch_panel",
}
__getattr__, __dir__ = attach(__name__, _TABLE)
