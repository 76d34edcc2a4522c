"""notebook_accel.widgets: ipywidgets panels over the headless core (installed from the top-level widgets/ folder)."""
