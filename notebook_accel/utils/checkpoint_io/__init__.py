"""Reading and writing checkpoint files: finding, loading, sharding (``checkpoints``) and reading a
safetensors header without loading its tensors (``safetensors_header``). Offloaded weights are in
``utils/offload.py`` (Accelerate's ``utils.offload`` path)."""
