"""Which optional packages are installed (``is_<package>_available``), answered without importing them.

``importlib.util.find_spec`` finds a module without running it, so asking is cheap and has no side
effects; the answers are cached. A ``min_version`` reads the distribution's metadata.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from typing import Any

from .versions import compare_versions

__all__ = [
    "is_4bit_bnb_available",
    "is_8bit_bnb_available",
    "is_aim_available",
    "is_amdsmi_available",
    "is_bitsandbytes_multi_backend_available",
    "is_bnb_available",
    "is_boto3_available",
    "is_clearml_available",
    "is_comet_ml_available",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_dvclive_available",
    "is_import_timer_available",
    "is_ipython_available",
    "is_lomo_available",
    "is_matplotlib_available",
    "is_megatron_lm_available",
    "is_mlflow_available",
    "is_msamp_available",
    "is_numpy_available",
    "is_package_available",
    "is_pandas_available",
    "is_peft_available",
    "is_pippy_available",
    "is_pynvml_available",
    "is_pytest_available",
    "is_rich_available",
    "is_safetensors_available",
    "is_sagemaker_available",
    "is_schedulefree_available",
    "is_swanlab_available",
    "is_tensorboard_available",
    "is_timm_available",
    "is_torchao_available",
    "is_torchdata_available",
    "is_torchdata_stateful_dataloader_available",
    "is_torchvision_available",
    "is_tqdm_available",
    "is_trackio_available",
    "is_transformer_engine_available",
    "is_transformer_engine_mxfp8_available",
    "is_transformers_available",
    "is_triton_available",
    "is_wandb_available",
]


@functools.cache
def is_package_available(name: str, distribution: str | None = None) -> bool:
    """Return True when module ``name`` can be imported (and ``distribution`` is installed, if given)."""
    try:
        if importlib.util.find_spec(name) is None:
            return False
    except (ImportError, ValueError):
        # find_spec raises for a dotted name whose parent is missing, or a half-installed module.
        return False
    if distribution is not None:
        try:
            importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return False
    return True


def _at_least(distribution: str, min_version: Any) -> bool:
    """Return whether ``distribution`` is installed at ``min_version`` or newer (any version when None)."""
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return min_version is None or compare_versions(distribution, ">=", str(min_version))


def is_safetensors_available() -> bool:
    """Return whether ``safetensors`` is installed."""
    return is_package_available("safetensors")


def is_tqdm_available() -> bool:
    """Return whether ``tqdm`` is installed."""
    return is_package_available("tqdm")


def is_ipython_available() -> bool:
    """Return whether ``IPython`` is installed."""
    return is_package_available("IPython")


def is_bnb_available(min_version: str | None = None) -> bool:
    """Return whether ``bitsandbytes`` is installed (at ``min_version`` or newer, when given)."""
    return is_package_available("bitsandbytes") and _at_least("bitsandbytes", min_version)


def is_4bit_bnb_available() -> bool:
    """Return whether the installed bitsandbytes has 4-bit layers (0.39.0 and newer)."""
    return is_bnb_available("0.39.0")


def is_8bit_bnb_available() -> bool:
    """Return whether the installed bitsandbytes has the 8-bit layers Accelerate uses (0.37.2 and newer)."""
    return is_bnb_available("0.37.2")


def is_bitsandbytes_multi_backend_available() -> bool:
    """Return whether bitsandbytes is installed with its multi-backend (non-CUDA) support."""
    # The multi-backend builds list "multi_backend" among the features the package announces.
    return is_bnb_available() and "multi_backend" in getattr(
        importlib.import_module("bitsandbytes"), "features", ()
    )


def is_deepspeed_available() -> bool:
    """Return whether ``deepspeed`` is installed."""
    return is_package_available("deepspeed", "deepspeed")


def is_megatron_lm_available() -> bool:
    """Return whether Megatron-LM (``megatron.core``) is installed."""
    return is_package_available("megatron") and is_package_available("megatron.core")


def is_transformer_engine_available() -> bool:
    """Return whether NVIDIA ``transformer_engine`` is installed."""
    return is_package_available("transformer_engine")


def is_transformer_engine_mxfp8_available() -> bool:
    """Return whether TransformerEngine is installed and reports MXFP8 support on this device."""
    if not is_transformer_engine_available():
        return False
    import transformer_engine.pytorch as te

    check = getattr(getattr(te, "fp8", None), "check_mxfp8_support", None)
    return bool(check is not None and check()[0])


def is_msamp_available() -> bool:
    """Return whether Microsoft ``msamp`` (MS-AMP) is installed."""
    return is_package_available("msamp")


def is_numpy_available(min_version: str = "1.25.0") -> bool:
    """Return whether ``numpy`` is installed at ``min_version`` or newer."""
    return is_package_available("numpy") and _at_least("numpy", min_version)


def is_pippy_available() -> bool:
    """Return whether torch ships pipeline parallelism (``torch.distributed.pipelining``)."""
    return is_package_available("torch.distributed.pipelining")


def is_torchdata_stateful_dataloader_available() -> bool:
    """Return whether ``torchdata`` with its ``StatefulDataLoader`` is installed."""
    return is_package_available("torchdata") and is_package_available("torchdata.stateful_dataloader")


def is_tensorboard_available() -> bool:
    """Return whether TensorBoard logging is possible (``tensorboard`` or ``tensorboardX``)."""
    return is_package_available("tensorboard") or is_package_available("tensorboardX")


def _simple(module: str, what: str):
    """Return an ``is_<module>_available`` check for a package with nothing more to ask."""

    def check() -> bool:
        return is_package_available(module)

    check.__name__ = check.__qualname__ = f"is_{what}_available"
    check.__doc__ = f"Return whether ``{module}`` is installed."
    check.__module__ = __name__
    return check


is_wandb_available = _simple("wandb", "wandb")
is_comet_ml_available = _simple("comet_ml", "comet_ml")
is_mlflow_available = _simple("mlflow", "mlflow")
is_aim_available = _simple("aim", "aim")
is_clearml_available = _simple("clearml", "clearml")
is_dvclive_available = _simple("dvclive", "dvclive")
is_swanlab_available = _simple("swanlab", "swanlab")
is_trackio_available = _simple("trackio", "trackio")
is_amdsmi_available = _simple("amdsmi", "amdsmi")
is_boto3_available = _simple("boto3", "boto3")
is_datasets_available = _simple("datasets", "datasets")
is_import_timer_available = _simple("import_timer", "import_timer")
is_lomo_available = _simple("lomo_optim", "lomo")
is_matplotlib_available = _simple("matplotlib", "matplotlib")
is_pandas_available = _simple("pandas", "pandas")
is_peft_available = _simple("peft", "peft")
is_pynvml_available = _simple("pynvml", "pynvml")
is_pytest_available = _simple("pytest", "pytest")
is_rich_available = _simple("rich", "rich")
is_sagemaker_available = _simple("sagemaker", "sagemaker")
is_schedulefree_available = _simple("schedulefree", "schedulefree")
is_timm_available = _simple("timm", "timm")
is_torchao_available = _simple("torchao", "torchao")
is_torchdata_available = _simple("torchdata", "torchdata")
is_torchvision_available = _simple("torchvision", "torchvision")
is_transformers_available = _simple("transformers", "transformers")
is_triton_available = _simple("triton", "triton")
