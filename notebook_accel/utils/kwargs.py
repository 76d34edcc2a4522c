"""Kwargs handlers: small dataclasses that customise a torch object the Accelerator creates.

Pass them as ``Accelerator(kwargs_handlers=[...])``. ``to_kwargs()`` returns only the fields the user
changed, so torch's own defaults apply to everything else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from ._kwargs_base import KwargsHandler
from ._validation import choice
from .enums import DDPCommunicationHookType

if TYPE_CHECKING:
    import torch

__all__ = [
    "AutocastKwargs",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "ProfileKwargs",
]
# The FP8 recipes (KwargsHandler subclasses) live with the fp8 integration: integrations/fp8/recipes.py.


@dataclass
class AutocastKwargs(KwargsHandler):
    """Customise ``torch.autocast`` (see its documentation for each field).

    Example: ``Accelerator(kwargs_handlers=[AutocastKwargs(cache_enabled=True)])``.
    """

    enabled: bool = True
    """Whether autocasting is on inside ``accelerator.autocast()``."""
    cache_enabled: bool = None
    """Whether autocast caches the casted weights (None: torch's default)."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise TypeError(f"AutocastKwargs: enabled must be a bool, got {self.enabled!r}")
        if self.cache_enabled is not None and not isinstance(self.cache_enabled, bool):
            raise TypeError(
                f"AutocastKwargs: cache_enabled must be a bool or None, got {self.cache_enabled!r}"
            )


_COMM_HOOKS = ("no", "fp16", "bf16", "power_sgd", "batched_power_sgd")
_COMM_WRAPPERS = ("no", "fp16", "bf16")


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Customise how the model is wrapped in ``torch.nn.parallel.DistributedDataParallel``.

    Example: ``Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])``.
    ``comm_hook`` / ``comm_wrapper`` / ``comm_state_option`` select a DDP communication hook, installed by
    ``register_comm_hook(model)``; they are not passed to the DDP constructor.
    """

    dim: int = 0
    """The dimension DDP scatters its inputs along (default 0)."""
    broadcast_buffers: bool = True
    """Broadcast the buffers from rank 0 at each forward (default True)."""
    bucket_cap_mb: int = 25
    """Size in MiB of the gradient buckets reduced together (default 25)."""
    find_unused_parameters: bool = False
    """Search the graph for parameters that got no gradient (needed when some go unused)."""
    check_reduction: bool = False
    """Deprecated torch flag, passed through as given."""
    gradient_as_bucket_view: bool = False
    """Let gradients be views into the reduction buckets (saves a copy)."""
    static_graph: bool = False
    """Promise that the set of used parameters never changes between iterations."""
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    """Gradient communication hook: one of "no", "fp16", "bf16", "power_sgd", "batched_power_sgd"."""
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    """Compression wrapper around a PowerSGD hook: "no", "fp16" or "bf16"."""
    comm_state_option: dict = field(default_factory=dict)
    """Options for the PowerSGD state (e.g. ``{"matrix_approximation_rank": 2}``)."""

    _not_kwargs = ("comm_hook", "comm_wrapper", "comm_state_option")

    def to_dict(self, ignore_keys: tuple[str, ...] = _not_kwargs) -> dict[str, Any]:
        """Return the fields as a ``{name: value}`` dict, leaving out ``ignore_keys`` (the comm-hook ones)."""
        return {name: value for name, value in super().to_dict().items() if name not in ignore_keys}

    def __post_init__(self) -> None:
        self.comm_hook = str(self.comm_hook).lower()
        self.comm_wrapper = str(self.comm_wrapper).lower()
        choice("DistributedDataParallelKwargs", "comm_hook", self.comm_hook, _COMM_HOOKS)
        choice("DistributedDataParallelKwargs", "comm_wrapper", self.comm_wrapper, _COMM_WRAPPERS)
        # Plain strings are accepted; stored as the enum (a str subclass, so "no" == comm_hook holds).
        self.comm_hook = DDPCommunicationHookType(self.comm_hook)
        self.comm_wrapper = DDPCommunicationHookType(self.comm_wrapper)
        if self.comm_wrapper != "no" and self.comm_hook not in ("power_sgd", "batched_power_sgd"):
            raise ValueError(
                f"DistributedDataParallelKwargs: comm_wrapper={self.comm_wrapper!r} wraps a PowerSGD hook; "
                f"set comm_hook to 'power_sgd' or 'batched_power_sgd' (got {self.comm_hook!r})"
            )
        if not isinstance(self.bucket_cap_mb, (int, float)) or self.bucket_cap_mb <= 0:
            raise ValueError(
                f"DistributedDataParallelKwargs: bucket_cap_mb must be > 0, got {self.bucket_cap_mb!r}"
            )

    def register_comm_hook(self, model: torch.nn.Module) -> None:
        """Install the configured communication hook on ``model`` (a DDP instance); no-op for "no"."""
        if self.comm_hook == "no":
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if self.comm_hook in ("fp16", "bf16"):
            hook = (
                default_hooks.fp16_compress_hook
                if self.comm_hook == "fp16"
                else default_hooks.bf16_compress_hook
            )
            model.register_comm_hook(state=None, hook=hook)
            return
        hook = (
            powerSGD_hook.powerSGD_hook
            if self.comm_hook == "power_sgd"
            else powerSGD_hook.batched_powerSGD_hook
        )
        if self.comm_wrapper == "fp16":
            hook = default_hooks.fp16_compress_wrapper(hook)
        elif self.comm_wrapper == "bf16":
            hook = default_hooks.bf16_compress_wrapper(hook)
        state = powerSGD_hook.PowerSGDState(process_group=None, **self.comm_state_option)
        model.register_comm_hook(state=state, hook=hook)


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Customise the ``torch.amp.GradScaler`` used for fp16 mixed precision.

    Example: ``Accelerator(kwargs_handlers=[GradScalerKwargs(backoff_factor=0.25)])``.
    """

    init_scale: float = 65536.0
    """The loss scale to start from (default 2**16)."""
    growth_factor: float = 2.0
    """What the scale is multiplied by after ``growth_interval`` steps without inf/NaN (default 2.0)."""
    backoff_factor: float = 0.5
    """What the scale is multiplied by when a step finds inf/NaN gradients (default 0.5)."""
    growth_interval: int = 2000
    """Clean steps before the scale grows (default 2000)."""
    enabled: bool = True
    """Whether the scaler scales at all (default True)."""

    def __post_init__(self) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"GradScalerKwargs: {name} must be a number, got {value!r}")
        if not self.init_scale > 0:
            raise ValueError(f"GradScalerKwargs: init_scale must be > 0, got {self.init_scale!r}")
        if not self.growth_factor > 1.0:
            raise ValueError(f"GradScalerKwargs: growth_factor must be > 1.0, got {self.growth_factor!r}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(
                f"GradScalerKwargs: backoff_factor must be in (0, 1), got {self.backoff_factor!r}"
            )
        if not isinstance(self.growth_interval, int) or self.growth_interval <= 0:
            raise ValueError(
                f"GradScalerKwargs: growth_interval must be a positive int, got {self.growth_interval!r}"
            )


_BACKENDS = ("nccl", "gloo", "mpi", "ucc", "xccl", "ccl", "hccl", "cncl", "mccl", "tccl", "smddp", "xla")


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Customise ``torch.distributed.init_process_group`` (backend, init method, timeout).

    Example: ``InitProcessGroupKwargs(timeout=timedelta(seconds=800))``. The documented default
    backend is "nccl"; the state picks gloo on CPU unless the backend was changed here.
    """

    backend: str | None = "nccl"
    """The torch.distributed backend: "nccl" (the documented default), "gloo", ..."""
    init_method: str | None = None
    """Where the processes rendezvous (default: the ``MASTER_ADDR``/``MASTER_PORT`` environment)."""
    timeout: timedelta | None = None
    """None leaves torch's default for the backend."""

    def __post_init__(self) -> None:
        if self.backend is not None:
            if not isinstance(self.backend, str):
                raise TypeError(f"InitProcessGroupKwargs: backend must be a str, got {self.backend!r}")
            # torch accepts "cpu:gloo,cuda:nccl" device-specific lists; check each backend in it.
            for part in self.backend.lower().split(","):
                name = part.split(":")[-1].strip()
                choice("InitProcessGroupKwargs", "backend", name, _BACKENDS)
        if self.init_method is not None and not isinstance(self.init_method, str):
            raise TypeError(
                f"InitProcessGroupKwargs: init_method must be a URL string, got {self.init_method!r}"
            )
        if self.timeout is not None:
            if not isinstance(self.timeout, timedelta):
                raise TypeError(
                    f"InitProcessGroupKwargs: timeout must be a datetime.timedelta, got {self.timeout!r} "
                    "(e.g. timedelta(seconds=800))"
                )
            if self.timeout.total_seconds() <= 0:
                raise ValueError(f"InitProcessGroupKwargs: timeout must be positive, got {self.timeout!r}")


_PROFILER_ACTIVITIES = ("cpu", "xpu", "mtia", "cuda", "hpu")
_SCHEDULE_KEYS = ("wait", "warmup", "active", "repeat", "skip_first")


@dataclass
class ProfileKwargs(KwargsHandler):
    """Configure ``torch.profiler.profile`` for ``Accelerator.profile()``.

    Example: ``Accelerator(kwargs_handlers=[ProfileKwargs(activities=["cpu"], record_shapes=True,
    output_trace_dir="traces")])``; each rank then writes ``traces/trace_rank<N>.json`` (Chrome format).
    """

    activities: list[Literal["cpu", "xpu", "mtia", "cuda", "hpu"]] | None = None
    """Activity groups to record, from "cpu", "xpu", "mtia", "cuda", "hpu" (None: torch's default, all available)."""
    schedule_option: dict[str, int] | None = None
    """``torch.profiler.schedule`` keys: wait, warmup, active (required together), repeat, skip_first."""
    on_trace_ready: Callable | None = None
    """Called with the profiler each time a scheduled cycle ends."""
    record_shapes: bool = False
    """Record the input shapes of each operator."""
    profile_memory: bool = False
    """Track tensor memory allocation and release."""
    with_stack: bool = False
    """Record the source file and line of each operator."""
    with_flops: bool = False
    """Estimate FLOPs of matrix multiplications and convolutions."""
    with_modules: bool = False
    """Record the module hierarchy of each operator."""
    output_trace_dir: str | None = None
    """Folder where each rank exports its Chrome trace (None: no file)."""

    def __post_init__(self) -> None:
        owner = "ProfileKwargs"
        if self.activities is not None:
            if isinstance(self.activities, str):
                raise TypeError(
                    f"{owner}: activities must be a list such as ['cpu'], got {self.activities!r}"
                )
            for activity in self.activities:
                choice(owner, "activities", activity, _PROFILER_ACTIVITIES)
        if self.schedule_option is not None:
            unknown = sorted(set(self.schedule_option) - set(_SCHEDULE_KEYS))
            if unknown:
                raise ValueError(
                    f"{owner}: unknown schedule_option keys {unknown}; use {list(_SCHEDULE_KEYS)}"
                )
            missing = [key for key in ("wait", "warmup", "active") if key not in self.schedule_option]
            if missing:
                raise ValueError(
                    f"{owner}: schedule_option needs {missing} (wait, warmup and active are required)"
                )
            for key, value in self.schedule_option.items():
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{owner}: schedule_option[{key!r}] must be an int >= 0, got {value!r}")
            if self.schedule_option["active"] < 1:
                raise ValueError(f"{owner}: schedule_option['active'] must be >= 1, got 0")
        if self.on_trace_ready is not None and not callable(self.on_trace_ready):
            raise TypeError(f"{owner}: on_trace_ready must be callable, got {self.on_trace_ready!r}")

    def _get_profiler_activity(self, activity: str) -> Any:
        """Return the ``torch.profiler.ProfilerActivity`` member named ``activity``."""
        import torch.profiler

        member = getattr(torch.profiler.ProfilerActivity, activity.upper(), None)
        if member is None:
            raise ValueError(
                f"ProfileKwargs: this torch build has no {activity!r} profiler activity; "
                f"available: {[a.name.lower() for a in torch.profiler.supported_activities()]}"
            )
        return member

    def build(self) -> Any:
        """Return a ``torch.profiler.profile`` configured by these fields (not yet started)."""
        import torch.profiler

        activities = None
        if self.activities is not None:
            activities = [self._get_profiler_activity(name) for name in self.activities]
        schedule = (
            torch.profiler.schedule(**self.schedule_option) if self.schedule_option is not None else None
        )
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )
