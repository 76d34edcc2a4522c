"""Megatron-LM: the plugin (``plugin``), model-config parsers (``config``), the script-side placeholders
(``lm``), the train steps (``train_steps``) and the engine wrappers (``engine``)."""
