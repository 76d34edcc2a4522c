"""``ParallelismConfig`` read by the Accelerator: the device mesh, the engine it implies, tensor parallelism.

Decided once at construction: ``dp_shard_size > 1`` (alone or with ``cp``) means FSDP2 (an FSDP2
plugin is made when none was given), ``dp_replicate_size > 1`` on top means HSDP (FSDP2 over a 2-D
mesh), ``tp_size > 1`` applies the model's tensor-parallel plan over the ``tp`` dimension. The
mesh is built over the process group the state already initialised, so the same code runs on CPU
processes (gloo) and GPUs. Ranks sharing a tensor-/context-parallel group read the same batches,
so the dataloader is sharded over the data-parallel ranks only (``data_parallel_world``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from .._lazy import LazyModule
from ..parallelism_config import ParallelismConfig
from ..utils.environment import parse_flag_from_env

__all__ = ["ParallelismMixin", "apply_tensor_parallel", "build_mesh", "plugins_for_parallelism"]

logger = logging.getLogger(__name__)

# Tensor parallelism loads DTensor (and sympy, a second of import): imported when a plan is applied.
_tp = LazyModule("torch.distributed.tensor.parallel")
_fsdp_plugin = LazyModule("notebook_accel.integrations.fsdp.plugin")
_TP_STYLES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel"}


def plugins_for_parallelism(
    parallelism_config: Any, fsdp_plugin: Any, torch_tp_plugin: Any
) -> tuple[Any, Any]:
    """Return ``(parallelism_config, fsdp_plugin)`` with what the config implies filled in.

    A config comes from the argument, or from ``PARALLELISM_CONFIG_*`` when ``ACCELERATE_USE_PARALLELISM_CONFIG``
    is set; a ``TorchTensorParallelPlugin(tp_size=N)`` is the older spelling of ``tp_size=N``.
    """
    if parallelism_config is None and parse_flag_from_env("ACCELERATE_USE_PARALLELISM_CONFIG"):
        parallelism_config = ParallelismConfig()
    if torch_tp_plugin is not None and torch_tp_plugin.tp_size > 1:
        if parallelism_config is None:
            parallelism_config = ParallelismConfig(tp_size=torch_tp_plugin.tp_size)
        elif parallelism_config.tp_size != torch_tp_plugin.tp_size:
            raise ValueError(
                f"torch_tp_plugin.tp_size={torch_tp_plugin.tp_size} and parallelism_config.tp_size="
                f"{parallelism_config.tp_size} disagree; give the size once, in parallelism_config"
            )
    if parallelism_config is None:
        return None, fsdp_plugin
    if not isinstance(parallelism_config, ParallelismConfig):
        raise TypeError(
            f"parallelism_config must be a ParallelismConfig, got {type(parallelism_config).__name__}"
        )
    if parallelism_config.dp_shard_enabled or parallelism_config.cp_enabled:
        if fsdp_plugin is None:
            fsdp_plugin = _fsdp_plugin.FullyShardedDataParallelPlugin(fsdp_version=2)
        elif fsdp_plugin.fsdp_version != 2:
            raise ValueError(
                f"ParallelismConfig(dp_shard_size={parallelism_config.dp_shard_size}, cp_size="
                f"{parallelism_config.cp_size}) shards with FSDP2, but fsdp_plugin has fsdp_version=1: pass "
                "FullyShardedDataParallelPlugin(fsdp_version=2, ...) or no fsdp_plugin"
            )
    return parallelism_config, fsdp_plugin


def build_mesh(state: Any, parallelism_config: Any) -> Any:
    """Return the device mesh of ``parallelism_config`` over the launched processes (None without a config)."""
    if parallelism_config is None:
        return None
    plugin = state.fsdp_plugin
    parallelism_config.validate_world(
        state.num_processes, plugin.fsdp_version if plugin is not None else None
    )
    if parallelism_config.cp_enabled:
        raise ValueError(
            f"ParallelismConfig: cp_size={parallelism_config.cp_size} needs torch's context parallelism, which "
            "splits scaled-dot-product attention on CUDA devices: run on GPUs, or set cp_size=1"
        )
    if state.num_processes == 1:
        return None  # nothing to split; a single process trains the plain model
    return parallelism_config.build_device_mesh(state.device.type)


def apply_tensor_parallel(model: torch.nn.Module, mesh: Any, parallelism_config: Any) -> torch.nn.Module:
    """Return ``model`` with its tensor-parallel plan applied over the mesh's ``tp`` dimension."""
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if not plan:
        raise ValueError(
            f"ParallelismConfig(tp_size={parallelism_config.tp_size}): {type(model).__name__} has no tensor-parallel "
            "plan; give the model a `tp_plan` dict ({'submodule.name': 'colwise' | 'rowwise' | ParallelStyle}), "
            "or set tp_size=1"
        )
    styles = {}
    for name, style in plan.items():
        if isinstance(style, str):
            if style not in _TP_STYLES:
                raise ValueError(
                    f"tp_plan[{name!r}]={style!r} is not a known style; use one of {sorted(_TP_STYLES)} or a "
                    "torch ParallelStyle"
                )
            style = getattr(_tp, _TP_STYLES[style])()
        elif not isinstance(style, _tp.ParallelStyle):
            raise TypeError(f"tp_plan[{name!r}] must be a style name or a ParallelStyle, got {style!r}")
        styles[name] = style
    return _tp.parallelize_module(model, mesh["tp"], styles)


class ParallelismMixin:
    """The Accelerator's view of the mesh: ranks in each parallel dimension (Accelerate's properties)."""

    state: Any
    _torch_device_mesh: Any = None

    @property
    def parallelism_config(self) -> Any:
        """The ``ParallelismConfig`` in use (None when the engines were chosen without one)."""
        return self.state.parallelism_config

    @property
    def torch_device_mesh(self) -> Any:
        """The ``DeviceMesh`` built from ``parallelism_config`` (None without one or on a single process)."""
        return self._torch_device_mesh

    def _mesh_rank(self, *names: str) -> int:
        mesh = self.torch_device_mesh
        if mesh is None:
            return 0
        try:  # flattened dimensions ("dp", "dp_shard_cp") are reachable by name but not listed
            return mesh[names[0] if len(names) == 1 else names].get_local_rank()
        except (KeyError, ValueError, RuntimeError):
            return 0  # a dimension of size 1 is not in the mesh: every rank is index 0 in it

    @property
    def data_parallel_rank(self) -> int:
        """This process's index among the data-parallel ranks (replicas and shards together)."""
        config = self.parallelism_config
        if config is None:
            return self.process_index
        return self._mesh_rank("dp") if config.dp_dim_names else 0

    @property
    def data_parallel_shard_rank(self) -> int:
        """This process's index within its shard group (``dp_shard``)."""
        return self._mesh_rank("dp_shard")

    @property
    def tensor_parallel_rank(self) -> int:
        """This process's index within its tensor-parallel group (``tp``)."""
        return self._mesh_rank("tp")

    @property
    def context_parallel_rank(self) -> int:
        """This process's index within its context-parallel group (``cp``)."""
        return self._mesh_rank("cp")

    @property
    def pipeline_parallel_rank(self) -> int:
        """Always 0: pipeline parallelism is not part of ``ParallelismConfig``."""
        return 0

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        """Whether a ``ParallelismConfig`` drives the engines (FSDP2 / HSDP / TP over a device mesh)."""
        return self.parallelism_config is not None

    def data_parallel_world(self) -> tuple[int, int]:
        """Return ``(number of data-parallel ranks, this rank's index)``: how the dataloader is sharded."""
        config = self.parallelism_config
        if config is None or self.torch_device_mesh is None:
            return self.num_processes, self.process_index
        return config.data_parallel_size, self.data_parallel_rank

    @contextlib.contextmanager
    def maybe_context_parallel(
        self, buffers: Any = None, buffer_seq_dims: Any = None, no_restore_buffers: Any = None
    ) -> Iterator[None]:
        """Run the block as is: context parallelism (``cp_size > 1``) is refused at construction here."""
        yield
