"""Configurations passed to the Accelerator or to quantization: bitsandbytes, project layout, dataloaders."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from . import imports
from ._validation import choice

__all__ = ["BnbQuantizationConfig", "DataLoaderConfiguration", "ProjectConfiguration"]

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _to_dtype(owner: str, name: str, value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in _DTYPE_NAMES:
        return _DTYPE_NAMES[value]
    raise ValueError(
        f"{owner}: {name}={value!r} is not valid; use a torch.dtype or one of {list(_DTYPE_NAMES)}"
    )


def _str_list(owner: str, name: str, value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{owner}: {name} must be a list of module names (str), got {value!r}")
    return list(value)


@dataclass
class BnbQuantizationConfig:
    """Configure bitsandbytes quantization for ``load_and_quantize_model``: 8-bit or 4-bit (exactly one)."""

    load_in_8bit: bool = False
    """Quantize linear layers to LLM.int8()."""
    llm_int8_threshold: float = 6.0
    """Outlier threshold of LLM.int8() (8-bit only)."""
    load_in_4bit: bool = False
    """Quantize linear layers to 4 bits (FP4 / NF4)."""
    bnb_4bit_quant_type: str = "fp4"
    """4-bit data type: "fp4" or "nf4"."""
    bnb_4bit_use_double_quant: bool = False
    """Quantize the 4-bit quantization constants too (saves ~0.4 bit per parameter)."""
    bnb_4bit_compute_dtype: bool = "fp16"
    """Dtype of 4-bit matmuls: "fp32", "fp16", "bf16" or a torch.dtype."""
    torch_dtype: torch.dtype = None
    """Dtype of the modules left unquantized (default fp16 for 8-bit, the compute dtype for 4-bit)."""
    skip_modules: list[str] = None
    """Module names not to quantize (e.g. the LM head)."""
    keep_in_fp32_modules: list[str] = None
    """Module names kept unquantized in float32."""

    def __post_init__(self) -> None:
        owner = "BnbQuantizationConfig"
        for name in ("load_in_8bit", "load_in_4bit", "bnb_4bit_use_double_quant"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{owner}: {name} must be a bool, got {getattr(self, name)!r}")
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError(f"{owner}: load_in_8bit and load_in_4bit cannot both be True; pick one")
        if not self.load_in_8bit and not self.load_in_4bit:
            raise ValueError(f"{owner}: set load_in_8bit=True or load_in_4bit=True (both are False)")
        if not isinstance(self.llm_int8_threshold, (int, float)) or self.llm_int8_threshold < 0:
            raise ValueError(
                f"{owner}: llm_int8_threshold must be a number >= 0, got {self.llm_int8_threshold!r}"
            )
        if self.load_in_4bit and self.llm_int8_threshold != 6.0:
            logger.warning("BnbQuantizationConfig: llm_int8_threshold only applies to 8-bit quantization")
        choice(owner, "bnb_4bit_quant_type", self.bnb_4bit_quant_type, ("fp4", "nf4"))
        self.bnb_4bit_compute_dtype = _to_dtype(owner, "bnb_4bit_compute_dtype", self.bnb_4bit_compute_dtype)
        if self.torch_dtype is None:
            self.torch_dtype = torch.float16 if self.load_in_8bit else self.bnb_4bit_compute_dtype
        self.torch_dtype = _to_dtype(owner, "torch_dtype", self.torch_dtype)
        self.skip_modules = _str_list(owner, "skip_modules", self.skip_modules)
        self.keep_in_fp32_modules = _str_list(owner, "keep_in_fp32_modules", self.keep_in_fp32_modules)
        # What the quantized weights occupy, for size accounting: int8, or "int4" (half a byte).
        self.target_dtype: torch.dtype | str = torch.int8 if self.load_in_8bit else "int4"


@dataclass
class ProjectConfiguration:
    """Where the Accelerator saves checkpoints and logs, and how checkpoints are named and pruned."""

    project_dir: str = None
    """Root folder of the project (checkpoints go to ``project_dir/checkpoints``)."""
    logging_dir: str = None
    """Folder for tracker logs (default: ``project_dir``)."""
    automatic_checkpoint_naming: bool = False
    """Name checkpoints ``checkpoint_<iteration>`` inside the project folder."""
    total_limit: int = None
    """How many checkpoints to keep (oldest removed first); None keeps all."""
    iteration: int = 0
    """Number of the next checkpoint to write."""
    save_on_each_node: bool = False
    """Save on the local main process of every node, not only the global main process."""

    def set_directories(self, project_dir: str = None) -> None:
        """Set ``project_dir`` and, unless already set, ``logging_dir`` to it."""
        if project_dir is not None:
            project_dir = os.fspath(project_dir)
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    def __post_init__(self) -> None:
        owner = "ProjectConfiguration"
        if self.total_limit is not None and (
            isinstance(self.total_limit, bool)
            or not isinstance(self.total_limit, int)
            or self.total_limit < 1
        ):
            raise ValueError(f"{owner}: total_limit must be None or an int >= 1, got {self.total_limit!r}")
        if isinstance(self.iteration, bool) or not isinstance(self.iteration, int) or self.iteration < 0:
            raise ValueError(f"{owner}: iteration must be an int >= 0, got {self.iteration!r}")
        if self.logging_dir is not None:
            self.logging_dir = os.fspath(self.logging_dir)
        self.set_directories(self.project_dir)


@dataclass
class DataLoaderConfiguration:
    """How the Accelerator prepares dataloaders (batch splitting, dispatching, seeding, transfers)."""

    split_batches: bool = False
    """Split each batch across processes (batch size must divide by the number of processes)."""
    dispatch_batches: bool = None
    """Iterate the dataloader on the main process only and send slices to the others (None: only for iterable datasets)."""
    even_batches: bool = True
    """Repeat samples from the start so that every process gets the same number of batches."""
    use_seedable_sampler: bool = False
    """Use a sampler reseeded each epoch (``data_seed`` + epoch), for reproducible shuffling."""
    data_seed: int = None
    """Seed of the seedable sampler's generator (None: the global torch seed)."""
    non_blocking: bool = False
    """Copy batches to the device with ``non_blocking=True`` (with pinned memory)."""
    use_stateful_dataloader: bool = False
    """Use torchdata's StatefulDataLoader so the dataloader position is saved with ``save_state``."""

    def __post_init__(self) -> None:
        owner = "DataLoaderConfiguration"
        for name in (
            "split_batches",
            "even_batches",
            "use_seedable_sampler",
            "non_blocking",
            "use_stateful_dataloader",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{owner}: {name} must be a bool, got {getattr(self, name)!r}")
        if self.dispatch_batches is not None and not isinstance(self.dispatch_batches, bool):
            raise TypeError(
                f"{owner}: dispatch_batches must be a bool or None, got {self.dispatch_batches!r}"
            )
        if self.data_seed is not None and (
            isinstance(self.data_seed, bool) or not isinstance(self.data_seed, int)
        ):
            raise TypeError(f"{owner}: data_seed must be an int or None, got {self.data_seed!r}")
        if self.use_stateful_dataloader:
            if not imports.is_package_available("torchdata"):
                raise ImportError(
                    f"{owner}: use_stateful_dataloader=True requires `torchdata`: pip install 'torchdata>=0.8'"
                )
