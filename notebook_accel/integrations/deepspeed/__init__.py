"""DeepSpeed: the plugin (``plugin``), the config object and placeholders (``config``), the wrappers (``engine``)."""
