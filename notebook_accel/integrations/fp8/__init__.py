"""fp8 training: the recipe kwargs (``recipes``), TransformerEngine (``transformer_engine``) and torchao (``ao``)."""
