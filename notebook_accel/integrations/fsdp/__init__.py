"""FSDP 1 and 2: the plugin (``plugin``), wrapping a model (``wrap``), FSDP2 helpers (``fsdp2``) and saving or
loading sharded models and optimizers (``checkpoints``)."""
