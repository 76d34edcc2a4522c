"""Resolve the process world (ranks, device, backend, flags) from the torchrun environment contract.

This is the one place that reads the process environment for the state singletons: ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and the
``ACCELERATE_*`` flags. ``resolve_world`` turns them into a frozen :class:`ProcessWorld`, initialising
the default ``torch.distributed`` process group when more than one process takes part (or adopting
one that a user or torchrun already initialised). Device queries never initialise CUDA.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

# Looked up through the module at call time, so tests (and users) can patch what the machine reports.
from ..utils import imports as _imports
from ..utils.enums import DistributedType, check_mixed_precision
from ..utils.environment import parse_flag_from_env

__all__ = ["ProcessWorld", "resolve_world"]

logger = logging.getLogger(__name__)

# Device type -> distributed type of a multi-process run on that device type.
_MULTI_TYPES = {
    "cpu": DistributedType.MULTI_CPU,
    "cuda": DistributedType.MULTI_GPU,
    "xpu": DistributedType.MULTI_XPU,
    "npu": DistributedType.MULTI_NPU,
    "mlu": DistributedType.MULTI_MLU,
}


@dataclasses.dataclass(frozen=True)
class ProcessWorld:
    """Who this process is in the run, and where it computes."""

    distributed_type: DistributedType
    num_processes: int
    process_index: int
    local_process_index: int
    device: torch.device
    backend: str | None
    debug: bool
    fork_launched: bool
    use_cpu: bool
    mixed_precision: str

    def as_dict(self) -> dict[str, Any]:
        """Return the fields as a shallow dict (devices are not deep-copied)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _env_int(name: str, default: int | None = None) -> int | None:
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _default_device(cpu: bool) -> torch.device:
    """Return the single-process device: cuda:0, else mps, else cpu (CUDA is only counted, never initialised)."""
    if cpu:
        return torch.device("cpu")
    if _imports.is_cuda_available():
        return torch.device("cuda", 0)
    if _imports.is_mps_available():
        return torch.device("mps")
    return torch.device("cpu")


def _env_device() -> torch.device | None:
    """Return the device ``ACCELERATE_TORCH_DEVICE`` pins (index kept as given), or None when unset."""
    raw = os.environ.get("ACCELERATE_TORCH_DEVICE", "")
    if raw == "":
        return None
    try:
        return torch.device(raw)
    except RuntimeError as err:
        raise ValueError(
            f"ACCELERATE_TORCH_DEVICE={raw!r} is not a torch device ({err}): use e.g. 'cpu', 'cuda:1' "
            "or 'mps', or unset it"
        ) from None


def _multi_device(cpu: bool, backend: str | None, local_rank: int) -> torch.device:
    """Return the device of rank ``local_rank`` on this node for a multi-process run."""
    wants_cpu = cpu or (backend is not None and "nccl" not in backend)
    if wants_cpu:
        return torch.device("cpu")
    count = _imports.cuda_device_count()
    if count == 0:
        if backend is not None and "nccl" in backend:
            raise ValueError(
                f"backend {backend!r} needs CUDA devices but none is visible: use backend='gloo' or cpu=True"
            )
        return torch.device("cpu")
    if local_rank >= count:
        raise ValueError(
            f"LOCAL_RANK={local_rank} but only {count} CUDA device(s) are visible on this node: launch at most "
            f"{count} process(es) per node, or pass cpu=True to run on CPU"
        )
    return torch.device("cuda", local_rank)


def _flags(cpu: bool) -> dict[str, Any]:
    mixed = check_mixed_precision(
        os.environ.get("ACCELERATE_MIXED_PRECISION", "no") or "no", "ACCELERATE_MIXED_PRECISION"
    )
    return {
        "debug": parse_flag_from_env("ACCELERATE_DEBUG_MODE"),
        # The notebook launcher sets ACCELERATE_FORK_LAUNCHED (Accelerate's launcher sets FORK_LAUNCHED).
        "fork_launched": parse_flag_from_env("ACCELERATE_FORK_LAUNCHED")
        or parse_flag_from_env("FORK_LAUNCHED"),
        "use_cpu": bool(cpu) or parse_flag_from_env("ACCELERATE_USE_CPU"),
        "mixed_precision": mixed,
    }


def _local_rank(rank: int) -> int:
    """Return LOCAL_RANK, else ``rank`` modulo LOCAL_WORLD_SIZE, else ``rank`` (one process per node)."""
    local_world = _env_int("LOCAL_WORLD_SIZE")
    return _env_int("LOCAL_RANK", rank % local_world if local_world else rank)


def _multi_world(
    flags: dict[str, Any], device: torch.device, backend: str, rank: int, world_size: int, local_rank: int
) -> ProcessWorld:
    """Return the world of one rank of a multi-process run (its distributed type follows ``device``)."""
    return ProcessWorld(
        distributed_type=_MULTI_TYPES.get(device.type, DistributedType.MULTI_CPU),
        num_processes=world_size,
        process_index=rank,
        local_process_index=local_rank,
        device=device,
        backend=backend,
        **flags,
    )


def _adopt_group(flags: dict[str, Any]) -> ProcessWorld:
    """Return the world of a process group that someone else (user code, torchrun) initialised."""
    import torch.distributed as dist

    backend = str(dist.get_backend())
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = _local_rank(rank)
    device = _env_device() or _multi_device(flags["use_cpu"], backend, local_rank)
    logger.debug("adopting the initialised %s process group (rank %d of %d)", backend, rank, world_size)
    return _multi_world(flags, device, backend, rank, world_size, local_rank)


def _xla_world(flags: dict[str, Any]) -> ProcessWorld:
    """Return the world of a torch_xla (TPU) process, as torch_xla's runtime reports it."""
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    local = xr.local_ordinal() if hasattr(xr, "local_ordinal") else xm.get_local_ordinal()
    return ProcessWorld(
        distributed_type=DistributedType.XLA,
        num_processes=xr.world_size(),
        process_index=xr.global_ordinal(),
        local_process_index=local,
        device=xm.xla_device(),
        backend="xla",
        **flags,
    )


def resolve_world(cpu: bool = False, init_kwargs: Mapping[str, Any] | None = None) -> ProcessWorld:
    """Return this process's :class:`ProcessWorld`, initialising the default process group if needed.

    ``init_kwargs`` are the ``InitProcessGroupKwargs(...).to_kwargs()`` fields (``backend``,
    ``init_method``, ``timeout``, ...) passed through to ``torch.distributed.init_process_group``.
    """
    import torch.distributed as dist

    flags = _flags(cpu)
    kwargs = {k: v for k, v in dict(init_kwargs or {}).items() if v is not None}
    if dist.is_available() and dist.is_initialized():
        return _adopt_group(flags)
    if not flags["use_cpu"]:
        # On a TPU runtime torch_xla owns the process world (xmp.spawn sets it up, not torchrun).
        if _imports.is_torch_xla_available(check_is_tpu=True):
            return _xla_world(flags)
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size < 1:
        raise ValueError(f"WORLD_SIZE={world_size} must be at least 1")
    if world_size == 1:
        return ProcessWorld(
            distributed_type=DistributedType.NO,
            num_processes=1,
            process_index=0,
            local_process_index=0,
            device=_env_device() or _default_device(flags["use_cpu"]),
            backend=None,
            **flags,
        )
    if not dist.is_available():
        raise RuntimeError(f"WORLD_SIZE={world_size} but this torch build has no torch.distributed support")
    rank = _env_int("RANK")
    if rank is None or not 0 <= rank < world_size:
        raise ValueError(
            f"WORLD_SIZE={world_size} needs RANK in [0, {world_size - 1}], got RANK={os.environ.get('RANK')!r}: "
            "launch with torchrun or notebook_launcher, or unset WORLD_SIZE for a single process"
        )
    if "init_method" not in kwargs:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            raise ValueError(
                f"WORLD_SIZE={world_size} but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: set MASTER_ADDR and MASTER_PORT "
                "(torchrun and notebook_launcher do), pass init_method=..., or unset WORLD_SIZE"
            )
    local_rank = _local_rank(rank)
    backend = kwargs.pop("backend", None)
    device = _multi_device(flags["use_cpu"], backend, local_rank)
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        # Bind the rank to its GPU before NCCL creates communicators on it.
        torch.cuda.set_device(device)
    kwargs.setdefault("rank", rank)
    kwargs.setdefault("world_size", world_size)
    logger.debug("init_process_group(backend=%r, rank=%d, world_size=%d)", backend, rank, world_size)
    dist.init_process_group(backend=backend, **kwargs)
    return _multi_world(flags, device, backend, rank, world_size, local_rank)
