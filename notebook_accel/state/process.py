"""The state singletons: ``PartialState``, ``AcceleratorState`` and ``GradientState``.

Every instance of one of these classes shares the same attributes (a class-level dict, the "Borg"
pattern), so ``PartialState()`` anywhere in a process sees what the first call set up. The first
``PartialState()`` reads the torchrun environment contract (see ``notebook_accel.state.world``) and initialises the
default process group when ``WORLD_SIZE > 1``; ``_reset_state()`` forgets everything (tests, a relaunch
in the same kernel).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..utils.enums import DistributedType, PrecisionType, check_mixed_precision
from ..utils.environment import parse_flag_from_env
from ..utils.imports import is_ipex_available
from ..utils.plugins import TorchDynamoPlugin
from .split import take_share
from .world import _default_device, resolve_world

__all__ = ["AcceleratorState", "PartialState"]

logger = logging.getLogger(__name__)


def _go_on() -> None:
    """The turn of a process that has nobody to wait for."""


class _ProcessControl:
    """Process-control helpers shared by ``PartialState`` and ``AcceleratorState``.

    They only need ``num_processes``, ``process_index``, ``local_process_index`` and
    ``distributed_type`` in the instance dict.
    """

    num_processes: int
    process_index: int
    local_process_index: int
    distributed_type: DistributedType
    device: torch.device

    @property
    def use_distributed(self) -> bool:
        """Return whether collectives are needed (a distributed type and more than one process)."""
        return self.distributed_type != DistributedType.NO and self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        """Return whether this is the global main process (rank 0)."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """Return whether this is the main process of this node (local rank 0)."""
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        """Return whether this is the last process (rank ``num_processes - 1``)."""
        return self.process_index == self.num_processes - 1

    def wait_for_everyone(self) -> None:
        """Return once every process has reached this call (a no-op in a single process)."""
        if not self.use_distributed:
            return
        import torch.distributed as dist

        if self.distributed_type == DistributedType.XLA:
            import torch_xla.core.xla_model as xm

            xm.rendezvous("notebook_accel.wait_for_everyone")
        elif self.device.type == "cuda" and dist.get_backend() == "nccl":
            # Naming the device avoids NCCL guessing (and warning about) the rank's GPU.
            dist.barrier(device_ids=[self.device.index or 0])
        else:
            dist.barrier()

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Yield this process's contiguous share of ``inputs`` (list, tuple, tensor, array, dataset or dict).

        The first ``len(inputs) % num_processes`` processes get one element more. With
        ``apply_padding=True`` every share has the same length: shorter shares repeat their last
        element (drop those after a ``gather``). With one process, ``inputs`` is yielded unchanged.
        """
        if self.num_processes == 1:
            yield inputs
            return
        yield take_share(inputs, self.num_processes, self.process_index, apply_padding)

    @contextlib.contextmanager
    def _goes_first(self, is_first: bool) -> Iterator[None]:
        # One barrier: the first processes meet it after their block, the others before theirs.
        before, after = (_go_on, self.wait_for_everyone) if is_first else (self.wait_for_everyone, _go_on)
        before()
        yield
        after()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the with-block on the main process first, then on the others (after a barrier)."""
        with self._goes_first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Run the with-block on each node's local main process first, then on the others."""
        with self._goes_first(self.is_local_main_process):
            yield

    def _run_where(self, function: Callable, predicate: Callable[[], bool]) -> Callable:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # Decided at call time, so functions decorated before a relaunch follow the new ranks.
            if predicate():
                return function(*args, **kwargs)
            return None

        return wrapper

    def on_main_process(self, function: Callable | None = None) -> Callable:
        """Return ``function`` wrapped to run on the main process only (returning None elsewhere)."""
        if function is None:
            return self.on_main_process
        return self._run_where(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable | None = None) -> Callable:
        """Return ``function`` wrapped to run on each node's local main process only."""
        if function is None:
            return self.on_local_main_process
        return self._run_where(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable) -> Callable:
        """Return ``function`` wrapped to run on the last process only."""
        if not callable(function):
            raise TypeError(f"on_last_process needs a function to decorate, got {function!r}")
        return self._run_where(function, lambda: self.is_last_process)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        """Return ``function`` wrapped to run only on process ``process_index``.

        Usable as ``@state.on_process(process_index=2)`` (a decorator factory) or
        ``state.on_process(fn, process_index=2)``.
        """
        if isinstance(function, int) and not isinstance(function, bool) and process_index is None:
            function, process_index = None, function  # on_process(2) spelled positionally
        _check_index("process_index", process_index)
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._run_where(function, lambda: self.process_index == process_index)

    def on_local_process(
        self, function: Callable | None = None, local_process_index: int | None = None
    ) -> Callable:
        """Return ``function`` wrapped to run only on local process ``local_process_index`` of each node."""
        if isinstance(function, int) and not isinstance(function, bool) and local_process_index is None:
            function, local_process_index = None, function
        _check_index("local_process_index", local_process_index)
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return self._run_where(function, lambda: self.local_process_index == local_process_index)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: say why when the shared state was reset under us.
        # The text starts as Accelerate 1.15's does: libraries match on it.
        cls = type(self).__name__
        if not name.startswith("__") and not type(self)._shared_state:
            raise AttributeError(
                f"`{cls}` object has no attribute `{name}`. This happens if `{cls}._reset_state()` was "
                f"called and an `Accelerator` or `PartialState` was not reinitialized: create {cls}() again"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Print like ``print()``, on the local main process only (returns None)."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def set_device(self) -> None:
        """Make ``self.device`` the current device of its backend (CUDA, XPU, NPU...); a no-op on CPU/MPS."""
        if self.device.type in ("cpu", "mps", "meta"):
            return
        module = getattr(torch, self.device.type, None)
        if module is None or not hasattr(module, "set_device"):
            raise RuntimeError(
                f"cannot set device {self.device}: torch.{self.device.type} has no set_device()"
            )
        module.set_device(self.device)


def _check_index(name: str, value: Any) -> None:
    if value is None:
        method = "on_process" if name == "process_index" else "on_local_process"
        raise ValueError(f"{name} is required: use @state.{method}({name}=0) with the index to run on")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def _describe(state: Any) -> str:
    backend = f"  Backend: {state.backend}" if state.backend else ""
    return (
        f"Distributed environment: {state.distributed_type}{backend}\n"
        f"Num processes: {state.num_processes}\n"
        f"Process index: {state.process_index}\n"
        f"Local process index: {state.local_process_index}\n"
        f"Device: {state.device}\n"
    )


class PartialState(_ProcessControl):
    """Singleton with the process world (device, ranks, distributed type) and process-control helpers.

    ``PartialState(cpu=False, **kwargs)``: ``cpu=True`` (or ``ACCELERATE_USE_CPU=1``) forces the CPU;
    ``kwargs`` are ``InitProcessGroupKwargs(...).to_kwargs()`` passed to ``init_process_group``. Only the
    first instantiation in a process reads the environment; later ones share its state.
    """

    _shared_state: dict[str, Any] = {}

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = self._shared_state
        if not self.initialized:
            world = resolve_world(cpu, kwargs).as_dict()
            world["_mixed_precision"] = world.pop("mixed_precision")
            self.__dict__.update(world)

    @property
    def initialized(self) -> bool:
        """Return whether the shared state has been set up."""
        return bool(self._shared_state)

    @property
    def mixed_precision(self) -> str:
        """Return the mixed precision mode from ``ACCELERATE_MIXED_PRECISION`` ("no" when unset)."""
        return self._mixed_precision

    @property
    def default_device(self) -> torch.device:
        """Return the device a single process would use here (cuda:0, mps or cpu)."""
        return _default_device(self.use_cpu)

    @property
    def use_ipex(self) -> bool:
        """Return whether Intel Extension for PyTorch is requested (ACCELERATE_USE_IPEX) and installed."""
        return parse_flag_from_env("ACCELERATE_USE_IPEX") and is_ipex_available()

    def destroy_process_group(self, group: Any = None) -> None:
        """Destroy ``group`` (the default process group when None), if one is initialised."""
        import torch.distributed as dist

        if self.distributed_type == DistributedType.NO or not (dist.is_available() and dist.is_initialized()):
            return
        dist.destroy_process_group(group)

    def __repr__(self) -> str:
        return _describe(self)

    @classmethod
    def _reset_state(cls) -> None:
        """Forget the shared state; the next ``PartialState()`` reads the environment again."""
        cls._shared_state.clear()


class AcceleratorState(_ProcessControl):
    """Singleton with everything of :class:`PartialState` plus mixed precision and the plugins in use.

    ``mixed_precision`` comes from the argument, else ``ACCELERATE_MIXED_PRECISION``, else "no".
    A DeepSpeed / FSDP / Megatron-LM plugin sets ``distributed_type`` to DEEPSPEED / FSDP / MEGATRON_LM.

    Args:
        mixed_precision: "no", "fp16", "bf16" or "fp8" (default ``ACCELERATE_MIXED_PRECISION``, else "no").
        cpu: Run on the CPU even where an accelerator is visible.
        dynamo_plugin: The ``TorchDynamoPlugin`` in use, if any.
        deepspeed_plugin: The ``DeepSpeedPlugin`` (or dict of them) in use, if any.
        fsdp_plugin: The ``FullyShardedDataParallelPlugin`` in use, if any.
        torch_tp_plugin: The ``TorchTensorParallelPlugin`` in use, if any.
        megatron_lm_plugin: The ``MegatronLMPlugin`` in use, if any.
        parallelism_config: The ``ParallelismConfig`` in use, if any.
        **kwargs: Passed to ``PartialState`` (e.g. process-group options).
    """

    _shared_state: dict[str, Any] = {}

    def __init__(
        self,
        mixed_precision: str | None = None,
        cpu: bool = False,
        dynamo_plugin: Any = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        parallelism_config: Any = None,
        _from_accelerator: bool = False,
        **kwargs: Any,
    ) -> None:
        self.__dict__ = self._shared_state
        if isinstance(mixed_precision, PrecisionType):  # checked already (the Accelerator's resolve_flags)
            mixed_precision = mixed_precision.value
        elif mixed_precision is not None:
            mixed_precision = check_mixed_precision(mixed_precision)
        if self.initialized:
            if mixed_precision is not None and mixed_precision != self._mixed_precision:
                raise ValueError(
                    f"AcceleratorState is already initialised with mixed_precision={self._mixed_precision!r}, "
                    f"cannot switch to {mixed_precision!r}: call AcceleratorState._reset_state() (or restart "
                    "the kernel) before creating the Accelerator with the new value"
                )
            if not PartialState._shared_state:
                # Only the process state was reset (`PartialState._reset_state()`): it is read again, as
                # on a first build, so `PartialState._shared_state` is filled whenever a state exists.
                PartialState(cpu, **kwargs)
            return
        partial = PartialState(cpu, **kwargs)
        self.__dict__.update(partial._shared_state)
        self._mixed_precision = mixed_precision if mixed_precision is not None else partial.mixed_precision
        self.dynamo_plugin = dynamo_plugin if dynamo_plugin is not None else TorchDynamoPlugin()
        self.fsdp_plugin = fsdp_plugin
        self.torch_tp_plugin = torch_tp_plugin
        self.megatron_lm_plugin = megatron_lm_plugin
        self.parallelism_config = parallelism_config
        self.deepspeed_plugins = _as_deepspeed_plugins(deepspeed_plugin)
        self._from_accelerator = _from_accelerator
        if self.deepspeed_plugins:
            self.distributed_type = DistributedType.DEEPSPEED
            self.select_deepspeed_plugin(next(iter(self.deepspeed_plugins)))
        elif fsdp_plugin is not None:
            self.distributed_type = DistributedType.FSDP
        elif megatron_lm_plugin is not None:
            self.distributed_type = DistributedType.MEGATRON_LM
        self._initialized = True

    @property
    def initialized(self) -> bool:
        """Return whether the AcceleratorState has been set up (by an ``Accelerator`` or directly)."""
        return bool(self._shared_state.get("_initialized", False))

    @property
    def fork_launched(self) -> bool:
        """Return whether this process was forked by ``notebook_launcher`` (``ACCELERATE_FORK_LAUNCHED``)."""
        return bool(self.__dict__.get("fork_launched", False))

    @property
    def mixed_precision(self) -> str:
        """Return the mixed precision mode: "no", "fp16", "bf16" or "fp8"."""
        return self._mixed_precision

    @property
    def deepspeed_plugin(self) -> Any:
        """Return the selected DeepSpeed plugin, or None."""
        for plugin in (self.__dict__.get("deepspeed_plugins") or {}).values():
            if getattr(plugin, "selected", False):
                return plugin
        return None

    @property
    def is_fsdp2(self) -> bool:
        """Return whether FSDP version 2 is in use."""
        return (
            self.distributed_type == DistributedType.FSDP
            and getattr(self.fsdp_plugin, "fsdp_version", 1) == 2
        )

    @property
    def use_ipex(self) -> bool:
        """Return whether Intel Extension for PyTorch is requested (ACCELERATE_USE_IPEX) and installed."""
        return PartialState().use_ipex

    def get_deepspeed_plugin(self, name: str) -> Any:
        """Return the DeepSpeed plugin registered under ``name``."""
        plugins = self.__dict__.get("deepspeed_plugins") or {}
        if name not in plugins:
            raise ValueError(f"No DeepSpeed plugin named {name!r}: registered names are {sorted(plugins)}")
        return plugins[name]

    def select_deepspeed_plugin(self, name: str | None = None) -> None:
        """Activate the DeepSpeed plugin ``name`` (the first one when None) and deactivate the others."""
        plugins = self.__dict__.get("deepspeed_plugins") or {}
        if not plugins:
            raise ValueError(
                "No DeepSpeed plugin is registered: pass deepspeed_plugin=... to the Accelerator"
            )
        if name is None:
            name = next(iter(plugins))
        self.get_deepspeed_plugin(name)  # an unknown name raises before any flag changes
        for key, plugin in plugins.items():
            plugin.selected = key == name

    def destroy_process_group(self, group: Any = None) -> None:
        """Destroy ``group`` (the default one when None); under a fork launcher the default group is left alone.

        When the process was started by ``notebook_launcher`` (``ACCELERATE_FORK_LAUNCHED=1``, or
        Accelerate's ``FORK_LAUNCHED=1``), the launcher owns the default group: it lives as long as
        the worker process, which ends with the launch. Tearing it down from inside the function
        would break collectives the launcher (or code after the call) still runs, so
        ``destroy_process_group()`` with no group does nothing there; an explicit ``group`` is
        still destroyed. ``PartialState().destroy_process_group()`` always destroys.
        """
        if self.fork_launched and group is None:
            logger.debug("fork-launched process: leaving the default process group to the launcher")
            return
        PartialState().destroy_process_group(group)

    def __repr__(self) -> str:
        return _describe(self) + f"Mixed precision type: {self.mixed_precision}\n"

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Forget the shared state (and PartialState's too when ``reset_partial_state``)."""
        cls._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()


def _as_deepspeed_plugins(deepspeed_plugin: Any) -> dict[str, Any]:
    if deepspeed_plugin is None:
        return {}
    if isinstance(deepspeed_plugin, dict):
        if not deepspeed_plugin:
            raise ValueError("deepspeed_plugin is an empty dict: give at least one name -> DeepSpeedPlugin")
        return dict(deepspeed_plugin)
    return {"default": deepspeed_plugin}
