"""``ParallelismConfig``: how the world's ranks split into data-, shard-, tensor-, context- and sequence-parallel groups.

The sizes multiply to the number of processes; each size > 1 becomes one named dimension of a torch
``DeviceMesh`` (order: ``dp_replicate``, ``dp_shard``, ``cp``, ``sp``, ``tp``, outermost first, so
that ranks sharing a tensor-parallel group are neighbours). The Accelerator reads the config to
choose its engine: shards (``dp_shard_size > 1``) mean FSDP2, shards and replicas mean HSDP, ``tp``
applies the model's tensor-parallel plan. Unset sizes read ``PARALLELISM_CONFIG_<FIELD>`` (what
``accelerate launch`` exports).

This is Accelerate's path ``accelerate.parallelism_config`` (which also offers ``DistributedType`` and
``is_torch_version``). Nothing below the accelerator needs the class (the state only keeps the object it
is given), so it lives here, above ``utils`` and ``state``; ``notebook_accel.utils`` and
``notebook_accel.utils.dataclasses`` serve its names lazily, as Accelerate does at those paths.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from .utils._validation import choice as _choice
from .utils._validation import env as _env
from .utils.enums import DistributedType
from .utils.imports import is_torch_version

__all__ = [
    "DeepSpeedSequenceParallelConfig",
    "DistributedType",
    "ParallelismConfig",
    "TorchContextParallelConfig",
    "TorchTensorParallelConfig",
    "is_torch_version",
]

_OWNER = "ParallelismConfig"
_SIZES = ("dp_replicate", "dp_shard", "cp", "sp", "tp")  # mesh order, outermost first
_CP_STRATEGIES = ("allgather", "alltoall")


@dataclass
class TorchTensorParallelConfig:
    """Options of torch tensor parallelism (``ParallelismConfig(tp_handler=...)``)."""

    enable_async_tp: bool = False
    """Overlap the tensor-parallel collectives with compute (torch's async TP; CUDA only)."""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_async_tp, bool):
            raise TypeError(
                f"TorchTensorParallelConfig: enable_async_tp must be a bool, got {self.enable_async_tp!r}"
            )


@dataclass
class TorchContextParallelConfig:
    """Options of torch context parallelism (``ParallelismConfig(cp_handler=...)``)."""

    cp_comm_strategy: str | None = None
    """How ranks exchange key/value shards: "allgather" (default) or "alltoall"."""

    def __post_init__(self) -> None:
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = _env("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "allgather")
        if self.cp_comm_strategy not in _CP_STRATEGIES:
            # 1.15's text first (code matches on it), then where the value came from.
            raise ValueError(
                f"Invalid cp_comm_strategy: {self.cp_comm_strategy}. Must be one of 'allgather' or 'alltoall'.\n"
                "Set TorchContextParallelConfig(cp_comm_strategy=...) or PARALLELISM_CONFIG_CP_COMM_STRATEGY."
            )


@dataclass
class DeepSpeedSequenceParallelConfig:
    """Options of DeepSpeed's sequence parallelism (ALST/Ulysses; ``ParallelismConfig(sp_handler=...)``)."""

    sp_seq_length: int | None = None
    """Sequence length every batch is padded to (None with variable lengths)."""
    sp_seq_length_is_variable: bool | None = None
    """Whether batches may have different sequence lengths (default True)."""
    sp_attn_implementation: str | None = None
    """The attention implementation the sequence-parallel wrapper uses (e.g. "sdpa", "flash_attention_2")."""

    def __post_init__(self) -> None:
        if self.sp_seq_length_is_variable is None:
            self.sp_seq_length_is_variable = True
        if self.sp_seq_length is not None and (
            isinstance(self.sp_seq_length, bool)
            or not isinstance(self.sp_seq_length, int)
            or self.sp_seq_length < 1
        ):
            raise ValueError(
                f"DeepSpeedSequenceParallelConfig: sp_seq_length must be a positive int, got {self.sp_seq_length!r}"
            )


def _size(name: str, value: Any) -> int:
    """Return the validated size of dimension ``name`` (argument, then its environment variable, then 1)."""
    if value is None:
        value = _env(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1")
        value = int(value) if value.strip().lstrip("-").isdigit() else value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_OWNER}: {name}_size must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{_OWNER}: {name}_size must be at least 1, got {value}")
    return value


@dataclass
class ParallelismConfig:
    """Split the processes into parallel groups; ``Accelerator(parallelism_config=...)`` builds the mesh from it.

    ``dp_shard_size > 1`` alone is FSDP (FSDP2), ``dp_replicate_size > 1`` with ``dp_shard_size > 1`` is
    HSDP; ``dp_replicate_size > 1`` alone is rejected by the Accelerator (plain DDP needs no config).
    Example: ``ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)`` on 4 processes.
    """

    dp_replicate_size: int | None = None
    """Replica groups: ranks holding the same shards, gradients all-reduced across them (default 1)."""
    dp_shard_size: int | None = None
    """Ranks one model copy is sharded over (FSDP) (default 1)."""
    tp_size: int | None = None
    """Ranks each layer is split over (tensor parallelism) (default 1)."""
    cp_size: int | None = None
    """Ranks a sequence is split over (context parallelism) (default 1)."""
    cp_backend: Literal["torch"] = None
    """Context-parallel engine: "torch" (with FSDP2)."""
    sp_size: int | None = None
    """Ranks a sequence is split over by DeepSpeed's sequence parallelism (default 1)."""
    sp_backend: Literal["deepspeed"] = None
    """Sequence-parallel engine: "deepspeed" (ALST/Ulysses)."""
    tp_handler: TorchTensorParallelConfig | None = None
    """Tensor-parallel options (default built when tp_size > 1)."""
    cp_handler: TorchContextParallelConfig | None = None
    """Context-parallel options (default built when cp_size > 1)."""
    sp_handler: DeepSpeedSequenceParallelConfig | None = None
    """Sequence-parallel options (default built when sp_size > 1)."""

    def __post_init__(self) -> None:
        for name in _SIZES:
            setattr(self, f"{name}_size", _size(name, getattr(self, f"{name}_size")))
        if self.cp_backend is None:
            self.cp_backend = _env("PARALLELISM_CONFIG_CP_BACKEND", "torch")
        _choice(_OWNER, "cp_backend", self.cp_backend, ("torch",))
        if self.sp_backend is None:
            self.sp_backend = _env("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")
        _choice(_OWNER, "sp_backend", self.sp_backend, ("deepspeed",))
        if self.cp_enabled and self.sp_enabled:
            raise ValueError(
                f"{_OWNER}: context and sequence parallelism exclude each other (cp_size={self.cp_size}, "
                f"sp_size={self.sp_size}); set one of them to 1"
            )
        for enabled, attr, cls in (
            (self.tp_enabled, "tp_handler", TorchTensorParallelConfig),
            (self.cp_enabled, "cp_handler", TorchContextParallelConfig),
            (self.sp_enabled, "sp_handler", DeepSpeedSequenceParallelConfig),
        ):
            handler = getattr(self, attr)
            if handler is None and enabled:
                setattr(self, attr, cls())
            elif handler is not None and not isinstance(handler, cls):
                raise TypeError(f"{_OWNER}: {attr} must be a {cls.__name__}, got {handler!r}")
        self.device_mesh: Any = None

    # ------------------------------------------------------------------------------ sizes
    @property
    def total_size(self) -> int:
        """The number of processes this layout needs: the product of all sizes."""
        return self.data_parallel_size * self.non_data_parallel_size * self.sp_size

    @property
    def data_parallel_size(self) -> int:
        """The product of the replicate and shard sizes (how many different batches a step sees)."""
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def non_data_parallel_size(self) -> int:
        """The product of the tensor- and context-parallel sizes (ranks that see the same batch)."""
        return self.tp_size * self.cp_size

    @property
    def dp_replicate_enabled(self) -> bool:
        """True if ``dp_replicate_size > 1``."""
        return self.dp_replicate_size > 1

    @property
    def dp_shard_enabled(self) -> bool:
        """True if ``dp_shard_size > 1``."""
        return self.dp_shard_size > 1

    @property
    def tp_enabled(self) -> bool:
        """True if ``tp_size > 1``."""
        return self.tp_size > 1

    @property
    def cp_enabled(self) -> bool:
        """True if ``cp_size > 1``."""
        return self.cp_size > 1

    @property
    def sp_enabled(self) -> bool:
        """True if ``sp_size > 1``."""
        return self.sp_size > 1

    # ------------------------------------------------------------------------------ mesh dimension names
    def _enabled(self, *names: str) -> list[str]:
        return [name for name in names if getattr(self, f"{name}_size") > 1]

    @property
    def active_mesh_dims(self) -> list[str]:
        """Names of all mesh dimensions with a size > 1, outermost first."""
        return self._enabled(*_SIZES)

    @property
    def dp_dim_names(self) -> list[str]:
        """Names of the enabled data-parallel dimensions (each gets its own batches)."""
        return self._enabled("dp_replicate", "dp_shard")

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """Names of the enabled dimensions flattened into the mesh FSDP shards over (``dp_shard_cp``)."""
        return self._enabled("dp_shard", "cp")

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """Names of the enabled dimensions the loss is averaged over (``dp_cp``)."""
        return self._enabled("dp_replicate", "dp_shard", "cp")

    @property
    def fsdp_dim_names(self) -> list[str]:
        """Names of the mesh dimensions FSDP2 is applied over: replicas (if any), then ``dp_shard_cp``."""
        return self._enabled("dp_replicate") + ["dp_shard_cp"]

    @property
    def non_dp_dim_names(self) -> list[str]:
        """Names of the enabled dimensions whose ranks receive the same batch (``cp``, ``tp``)."""
        return self._enabled("cp", "tp")

    def _get_mesh(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Return ``(dimension names, sizes)`` for ``init_device_mesh`` (one ``dp_shard`` dim of 1 when all are 1)."""
        names = tuple(self.active_mesh_dims) or ("dp_shard",)
        return names, tuple(getattr(self, f"{name}_size") for name in names)

    def build_device_mesh(self, device_type: str) -> Any:
        """Return the ``DeviceMesh`` of this layout on ``device_type`` (with the joint ``dp``, ``dp_shard_cp``, ``dp_cp`` dims).

        As in Accelerate 1.15: None when every size is 1 (nothing to split, whatever the world);
        otherwise the default process group is initialised from the torchrun environment if it is not
        yet, and must hold exactly ``total_size`` ranks.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if self.total_size == 1:
            self.device_mesh = None
            return None
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
        if world is not None and world != self.total_size:
            raise ValueError(
                f"{_OWNER}: the sizes multiply to {self.total_size} ({self._sizes_text()}) but there are {world} "
                "processes; make dp_replicate_size * dp_shard_size * cp_size * sp_size * tp_size equal the number "
                "of processes"
            )
        names, shape = self._get_mesh()
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        for joint, parts in (
            ("dp", self.dp_dim_names),
            ("dp_shard_cp", self.dp_shard_cp_dim_names or ["dp_shard"] * ("dp_shard" in names)),
            ("dp_cp", self.dp_cp_dim_names),
        ):
            if parts:
                mesh[list(parts)]._flatten(joint)  # a list of names, as 1.15 indexes the mesh
        self.device_mesh = mesh
        return mesh

    def get_device_mesh(self, device_type: str | None = None) -> Any:
        """Return the mesh built earlier, or build it on ``device_type`` (e.g. "cpu", "cuda")."""
        if self.device_mesh is not None:
            return self.device_mesh
        if device_type is None:
            raise ValueError(f"{_OWNER}: no device mesh built yet; pass device_type, e.g. 'cpu' or 'cuda'")
        return self.build_device_mesh(device_type)

    def _sizes_text(self) -> str:
        return ", ".join(f"{name}_size={getattr(self, f'{name}_size')}" for name in _SIZES)

    def to_json(self) -> str:
        """Return the sizes and backends as a JSON object string."""
        data = {f"{name}_size": getattr(self, f"{name}_size") for name in _SIZES}
        data.update(cp_backend=self.cp_backend, sp_backend=self.sp_backend)
        return json.dumps(data, sort_keys=True)

    def validate_world(self, num_processes: int, fsdp_version: int | None) -> None:
        """Raise ValueError when this layout cannot run on ``num_processes`` with FSDP ``fsdp_version`` (None: no FSDP)."""
        if self.total_size != num_processes:
            raise ValueError(
                f"{_OWNER}: the sizes multiply to {self.total_size} ({self._sizes_text()}) but the launch has "
                f"{num_processes} processes; choose sizes whose product is {num_processes}"
            )
        if self.dp_replicate_enabled and not self.dp_shard_enabled:
            raise ValueError(
                f"{_OWNER}: dp_replicate_size={self.dp_replicate_size} with dp_shard_size=1 is plain data "
                "parallelism: drop parallelism_config (DDP is the default; tune it with "
                "DistributedDataParallelKwargs), or set dp_shard_size > 1 for HSDP"
            )
        if (self.dp_shard_enabled or self.cp_enabled) and fsdp_version == 1:
            raise ValueError(
                f"{_OWNER}: dp_shard_size={self.dp_shard_size}, cp_size={self.cp_size} shard with FSDP2; "
                "pass FullyShardedDataParallelPlugin(fsdp_version=2) or no fsdp_plugin"
            )
        if self.sp_enabled:
            raise ValueError(
                f"{_OWNER}: sp_size={self.sp_size} needs DeepSpeed's sequence parallelism (ALST/Ulysses) on GPUs: "
                "pip install deepspeed and run on CUDA devices, or set sp_size=1"
            )
