"""Memory budgets per device: ``get_max_memory`` (what is available) and ``get_balanced_memory`` (spread evenly)."""

from __future__ import annotations

import logging
import math
from typing import Union

import torch
from torch import nn

from ..imports import cuda_device_count
from ._module_tree import build_tree
from .devices import GPU_LESS_KEYS, device_key
from .sizes import convert_file_size_to_int

__all__ = ["available_cpu_memory", "get_balanced_memory", "get_max_memory", "order_devices"]

logger = logging.getLogger(__name__)


def order_devices(keys: list[Union[int, str]]) -> list[Union[int, str]]:
    """Return device keys in filling order: GPUs by index, then "mps", "cpu" and "disk"."""
    gpus = sorted(k for k in keys if isinstance(k, int))
    return gpus + [k for k in GPU_LESS_KEYS if k in keys]


def _budget_key(key: Union[int, str, torch.device]) -> Union[int, str]:
    """Return the device-map key of a ``max_memory`` key; only GPUs, "mps", "cpu" and "disk" get a budget."""
    device = device_key(key)
    if not isinstance(device, int) and device not in GPU_LESS_KEYS:
        raise ValueError(
            f"Device {key!r} is not recognized in max_memory: use GPU indices (0, 1, ... or 'cuda:0'), "
            "'mps', 'cpu' or 'disk'."
        )
    return device


def _cgroup_memory_left() -> int | None:
    """Return the bytes left under this process's cgroup memory limit, or None when there is no limit."""
    candidates = (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    )
    for limit_path, usage_path in candidates:
        try:
            with open(limit_path) as f:
                raw = f.read().strip()
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if raw == "max" or not raw.isdigit() or int(raw) >= 2**60:
            return None
        return max(int(raw) - usage, 0)
    return None


def available_cpu_memory() -> int:
    """Return the host memory available now, in bytes (capped by this process's cgroup limit, if any)."""
    # Imported here: psutil (with the C extension and `resource` it loads) adds ~2.3 MB to every process
    # that imports the device-map code (benchmarks/bench_loading.py's peak RSS), and only this query needs it.
    import psutil

    available = psutil.virtual_memory().available
    left = _cgroup_memory_left()
    return available if left is None else min(available, left)


def _budget_bytes(key: Union[int, str], value: Union[int, float, str]) -> int:
    """Return the budget ``value`` given for device ``key`` in bytes; raise naming both when it is unusable."""
    if isinstance(value, float):
        # transformers scales budgets (e.g. 0.9 * free memory) and passes the floats on.
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"max_memory[{key!r}] = {value!r} is not a usable budget: give a number of bytes >= 0 "
                "or a string like '10GiB'."
            )
        return int(value)
    try:
        return convert_file_size_to_int(value)
    except (ValueError, TypeError) as err:
        raise type(err)(f"max_memory[{key!r}]: {err}") from None


def get_max_memory(
    max_memory: dict[Union[int, str], Union[int, float, str]] | None = None,
) -> dict[Union[int, str], int]:
    """Return a ``{device: bytes}`` budget: ``max_memory`` parsed and ordered, or what is available now.

    Budgets are ints or floats (bytes) or strings such as "700KB", "10GiB"; keys are GPU indices,
    "mps", "cpu" and "disk". String budgets in the caller's dict are replaced by their byte counts in
    place (as Accelerate does; transformers relies on it); the returned dict is a new one, ordered
    GPUs first, then "mps", "cpu", "disk". A malformed size raises ValueError, a negative one
    ValueError, a value of another type TypeError, each naming the device and the value.

    Without ``max_memory``: each CUDA GPU's free memory (queried only when CUDA devices exist), the MPS device,
    and the CPU's available RAM (psutil, capped by the cgroup limit inside containers).
    """
    if max_memory is None:
        budget: dict[Union[int, str], int] = {}
        # cuda_device_count() does not initialise CUDA; mem_get_info does, so it only runs for GPUs that
        # exist (the user is about to run on them).
        for index in range(cuda_device_count()):
            try:
                budget[index] = torch.cuda.mem_get_info(index)[0]
            except RuntimeError as err:  # pragma: no cover - depends on the driver
                logger.warning("Could not query free memory of GPU %d: %s", index, err)
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            budget["mps"] = available_cpu_memory()
        budget["cpu"] = available_cpu_memory()
        return budget
    if not isinstance(max_memory, dict):
        raise TypeError(
            f"max_memory must be a dict like {{0: '10GiB', 'cpu': '30GiB'}}, not {type(max_memory).__name__}."
        )
    parsed: dict[Union[int, str], int] = {}
    for key, value in max_memory.items():
        parsed[_budget_key(key)] = _budget_bytes(key, value)
    # As Accelerate does, the caller's strings become ints in place: transformers compares its own
    # dict with the result (min(max_memory[d], budget[d])) and needs numbers there. All entries were
    # validated first, so a bad one leaves the caller's dict untouched.
    for key, value in max_memory.items():
        if isinstance(value, str):
            max_memory[key] = parsed[_budget_key(key)]
    gpus = [k for k in parsed if isinstance(k, int)]
    if gpus:
        available = cuda_device_count()
        missing = [k for k in gpus if k >= available]
        if missing and available > 0:
            logger.warning("max_memory names GPUs %s but only %d are visible.", missing, available)
    return {k: parsed[k] for k in order_devices(list(parsed))}


def get_balanced_memory(
    model: nn.Module,
    max_memory: dict[Union[int, str], Union[int, str]] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: Union[str, torch.dtype, None] = None,
    special_dtypes: dict[str, Union[str, torch.dtype]] | None = None,
    low_zero: bool = False,
) -> dict[Union[int, str], int]:
    """Return a ``max_memory`` dict that makes ``infer_auto_device_map`` spread ``model`` evenly over the GPUs.

    Each GPU but the last gets the model size divided by the GPU count plus a margin (1.25x the larger of the
    biggest no-split block and the mean leaf-module size); ``low_zero`` keeps GPU 0 as empty as possible.

    Args:
        model: The model to spread.
        max_memory: Device -> budget (default: what is available).
        no_split_module_classes: Module classes kept whole; the margin covers the largest of them.
        dtype: Count floating tensors at this element size.
        special_dtypes: Tensor name -> dtype, overriding ``dtype``.
        low_zero: Keep GPU 0 as empty as possible (for what generation puts there).
    """
    user_set = max_memory is not None
    budget = get_max_memory(max_memory)
    gpus = [k for k, v in budget.items() if isinstance(k, int) and v > 0]
    if not gpus:
        return budget
    if len(gpus) == 1:
        low_zero = False
        if not user_set:
            # Leave 10% of the only GPU for activations when the user gave no budget.
            budget[gpus[0]] = int(budget[gpus[0]] * 0.9)
            logger.info("Using 90%% of GPU %d's free memory for weights.", gpus[0])
    if isinstance(no_split_module_classes, str):
        no_split_module_classes = [no_split_module_classes]
    no_split = set(no_split_module_classes or [])
    tree = build_tree(model, dtype=dtype, special_dtypes=special_dtypes)
    total = tree.size[0]
    shares = len(gpus) - 1 if low_zero else len(gpus)
    per_gpu = total // max(shares, 1)

    biggest_block = 0
    leaf_sizes: list[int] = []
    for node in range(1, len(tree.names)):
        if tree.kinds[node] != 0:
            continue
        module = tree.objs[node]
        if type(module).__name__ in no_split:
            biggest_block = max(biggest_block, tree.size[node])
        if not module._modules and tree.size[node] > 0:
            leaf_sizes.append(tree.size[node])
    mean_leaf = sum(leaf_sizes) // max(len(leaf_sizes), 1)
    per_gpu += int(1.25 * max(biggest_block, mean_leaf))

    # The last GPU keeps its full budget in case the margin was not enough.
    for index in gpus[:-1]:
        if low_zero and index == gpus[0]:
            continue
        budget[index] = min(per_gpu, budget[index])
    if low_zero:
        others = sum(budget[i] for i in gpus[1:])
        budget[gpus[0]] = min(max(0, total - others), budget[gpus[0]])
    return budget
