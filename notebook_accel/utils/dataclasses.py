"""``accelerate.utils.dataclasses``: Accelerate keeps its configuration classes in one module; ours live in
small topic modules (kwargs, enums, constants, configs, plugins; ``ParallelismConfig`` and its handler
configs in ``notebook_accel.parallelism_config``; the engines' plugins and fp8 recipes in
``notebook_accel.integrations``). This face serves every public name of those modules,
each module imported the first time one of its names is asked for (cheap modules first, so a look-up of
an enum never loads the process state or an engine).
"""

from .._lazy import forward

__getattr__, __dir__ = forward(
    __name__,
    ".enums",
    ".constants",
    ".kwargs",
    ".configs",
    ".environment",
    ".versions",
    ".package_checks",
    ".imports",
    ".plugins",
    "._ops_structure",
    ".other",
    "notebook_accel.parallelism_config",
    "notebook_accel.integrations.fp8.recipes",
    "notebook_accel.integrations.deepspeed.plugin",
    "notebook_accel.integrations.fsdp.plugin",
    "notebook_accel.integrations.megatron.plugin",
    "notebook_accel.integrations.megatron.config",
)
