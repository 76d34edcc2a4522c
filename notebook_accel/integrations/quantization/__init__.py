"""bitsandbytes quantization: the layer swaps (``bnb``) and ``load_and_quantize_model`` (``quantize``)."""
