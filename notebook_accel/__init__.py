"""notebook_accel: multi-process training and big-model inference from a Jupyter kernel.

The public names are those of Hugging Face Accelerate, so ``import notebook_accel as accelerate``
runs code written for it. Names load lazily: importing the package does not import
torch.distributed, safetensors, ipywidgets, matplotlib or IPython.
"""

from __future__ import annotations

from ._lazy import attach

# The Accelerate API level implemented here: what scripts that gate on ``accelerate.__version__``
# (diffusers' training examples register their save/load-state hooks only from 0.16.0 on) must read,
# under ``install_as_accelerate()`` and under ``import notebook_accel as accelerate`` alike. This
# distribution's own release is ``__notebook_accel_version__`` (``importlib.metadata.version("notebook-accel")``).
__version__ = "1.15.0"
__notebook_accel_version__ = "0.1.0"

_TABLE: dict[str, str] = {
    # state
    "PartialState": ".state",
    "AcceleratorState": ".state",
    "GradientState": ".state",
    # launch and training
    "notebook_launcher": ".launchers",
    "debug_launcher": ".launchers",
    # several machines: the nodes a launch or interactive ranks run on
    "Nodes": ".nodes.spec",
    # interactive ranks: a process group kept alive between cells
    "start_ranks": ".interactive",
    "interactive": ".interactive",
    "Accelerator": ".accelerator",
    "skip_first_batches": ".data_loader",
    # big models
    "init_empty_weights": ".big_modeling",
    "init_on_device": ".big_modeling",
    "cpu_offload": ".big_modeling",
    "cpu_offload_with_hook": ".big_modeling",
    "disk_offload": ".big_modeling",
    "dispatch_model": ".big_modeling",
    "load_checkpoint_and_dispatch": ".big_modeling",
    "load_checkpoint_in_model": ".utils",
    "infer_auto_device_map": ".utils",
    # pipeline-parallel inference
    "prepare_pippy": ".inference",
    # utilities re-exported at the top level
    "DistributedType": ".utils",
    "DDPCommunicationHookType": ".utils",
    "is_rich_available": ".utils",
    "AutocastKwargs": ".utils",
    "DistributedDataParallelKwargs": ".utils",
    "GradScalerKwargs": ".utils",
    "InitProcessGroupKwargs": ".utils",
    "DeepSpeedPlugin": ".utils",
    "FullyShardedDataParallelPlugin": ".utils",
    "ParallelismConfig": ".utils",
    "ProfileKwargs": ".utils",
    "DataLoaderConfiguration": ".utils",
    "find_executable_batch_size": ".utils",
    "synchronize_rng_states": ".utils",
    # libraries that import `accelerate` by name run on us
    "install_as_accelerate": "._alias",
    "uninstall_as_accelerate": "._alias",
    # `%load_ext notebook_accel`: IPython looks this name up, which loads the %ranks magics (and no
    # IPython before that)
    "load_ipython_extension": ".interactive.magics",
}

# The subpackages that are attributes of Accelerate's package once it is imported (its __init__ imports
# them): here each is imported the first time it is read, so `accelerate.utils.set_seed(0)` works after
# `import notebook_accel as accelerate` and the import itself stays as cheap.
_SUBMODULES = (
    "accelerator", "big_modeling", "checkpointing", "commands", "data_loader", "hooks", "inference",
    "launchers", "logging", "optimizer", "parallelism_config", "scheduler", "state", "tracking", "utils",
)

__all__ = sorted(_TABLE) + ["__notebook_accel_version__", "__version__"]
__getattr__, __dir__ = attach(__name__, _TABLE, _SUBMODULES)
