"""Forward hooks that see args and kwargs: the hook family, and helpers to attach and remove them.

``add_hook_to_module`` replaces ``module.forward`` by a thin wrapper (a ``functools.partial`` of a
module-level function and the hook's bound callbacks, so hooked models still deepcopy and pickle)
that calls the hook's
``pre_forward``, the original forward (kept as ``module._old_forward``) and ``post_forward``; the
hook itself is ``module._hf_hook``. The wrapper is chosen once, at attach time, from what the hook
overrides: a hook without ``pre_forward`` (or ``post_forward``) pays no call for it, and nothing
enters ``torch.no_grad()`` unless ``hook.no_grad``. The wrapper keeps the forward's name, docstring
and signature; ``remove_hook_from_module`` restores the original forward exactly.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ._hooks_align import AlignDevicesHook, _as_device, _move
from ._hooks_base import ModelHook, SequentialHook

__all__ = [
    "ModelHook",
    "SequentialHook",
    "AlignDevicesHook",
    "LayerwiseCastingHook",
    "UserCpuOffloadHook",
    "CpuOffload",
    "add_hook_to_module",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
    "attach_execution_device_hook",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_layerwise_casting_hooks",
]

logger = logging.getLogger(__name__)


# -- the hooked forward --------------------------------------------------------------------------
# ``module.forward`` becomes ``partial(variant, module, hook, pre_forward, post_forward)``. Four
# variants so that a hook pays only for the callbacks it defines; the bound callbacks are taken
# once, at attach time (a hook is replaced through add_hook_to_module, never by assigning
# ``_hf_hook``). ``_old_forward`` is read from the module at each call and the partial holds no
# closure, so ``copy.deepcopy`` / pickle of a hooked model give a model calling its own hook.
def _forward_full(module: nn.Module, hook: ModelHook, pre: Any, post: Any, *args: Any, **kwargs: Any) -> Any:
    args, kwargs = pre(module, *args, **kwargs)
    if hook.no_grad:
        with torch.no_grad():
            output = module._old_forward(*args, **kwargs)
    else:
        output = module._old_forward(*args, **kwargs)
    return post(module, output)


def _forward_pre(module: nn.Module, hook: ModelHook, pre: Any, post: Any, *args: Any, **kwargs: Any) -> Any:
    args, kwargs = pre(module, *args, **kwargs)
    if hook.no_grad:
        with torch.no_grad():
            return module._old_forward(*args, **kwargs)
    return module._old_forward(*args, **kwargs)


def _forward_post(module: nn.Module, hook: ModelHook, pre: Any, post: Any, *args: Any, **kwargs: Any) -> Any:
    if hook.no_grad:
        with torch.no_grad():
            return post(module, module._old_forward(*args, **kwargs))
    return post(module, module._old_forward(*args, **kwargs))


def _forward_none(module: nn.Module, hook: ModelHook, pre: Any, post: Any, *args: Any, **kwargs: Any) -> Any:
    if hook.no_grad:
        with torch.no_grad():
            return module._old_forward(*args, **kwargs)
    return module._old_forward(*args, **kwargs)


def _overrides(hook: ModelHook, name: str) -> bool:
    if name in getattr(hook, "__dict__", {}):
        return True
    return getattr(type(hook), name, None) is not getattr(ModelHook, name)


def _pick_forward(hook: ModelHook):
    if isinstance(hook, SequentialHook):
        return _forward_full
    pre, post = _overrides(hook, "pre_forward"), _overrides(hook, "post_forward")
    if pre and post:
        return _forward_full
    if pre:
        return _forward_pre
    if post:
        return _forward_post
    return _forward_none


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Return ``module`` with ``hook`` attached: its forward now runs the hook's callbacks around it.

    An existing hook is replaced, unless ``append`` is True: then both are chained in a
    :class:`SequentialHook` (existing one first). Undo with :func:`remove_hook_from_module`.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"add_hook_to_module needs a torch.nn.Module, got {type(module).__name__}")
    if not all(
        hasattr(hook, m) for m in ("init_hook", "pre_forward", "post_forward", "detach_hook", "no_grad")
    ):
        raise TypeError(
            "add_hook_to_module needs a ModelHook (init_hook/pre_forward/post_forward/detach_hook/no_grad): "
            f"subclass notebook_accel.hooks.ModelHook, got {type(hook).__name__}"
        )
    if append and getattr(module, "_hf_hook", None) is not None:
        old_hook = module._hf_hook
        remove_hook_from_module(module)
        hook = SequentialHook(old_hook, hook)
    if "_old_forward" in module.__dict__:
        old_forward = module._old_forward
    else:
        old_forward = module.forward
        module._old_forward = old_forward
    module = hook.init_hook(module)
    module._hf_hook = hook
    wrapper = functools.partial(_pick_forward(hook), module, hook, hook.pre_forward, hook.post_forward)
    functools.update_wrapper(wrapper, old_forward)
    try:
        import inspect

        wrapper.__signature__ = inspect.signature(old_forward)
    except (TypeError, ValueError):
        pass
    module.forward = wrapper
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Return ``module`` with any hook attached by :func:`add_hook_to_module` detached (and its forward restored)."""
    hook = module.__dict__.get("_hf_hook")
    if hook is not None:
        hook.detach_hook(module)
    module.__dict__.pop("_hf_hook", None)
    if "_old_forward" in module.__dict__:
        old_forward = module.__dict__.pop("_old_forward")
        if getattr(old_forward, "__self__", None) is module and getattr(
            old_forward, "__func__", None
        ) is getattr(type(module), "forward", None):
            # The original forward was the class method: drop the instance attribute altogether.
            module.__dict__.pop("forward", None)
        else:
            module.forward = old_forward
    # Attributes dispatch_model added (the guarded ``to`` / ``cuda``).
    for name in module.__dict__.pop("_hf_added_attributes", ()):
        module.__dict__.pop(name, None)
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse=True)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Remove every hook from ``module``'s submodules (not from ``module`` itself); return nothing.

    Offloaded weights are materialised back where they are stored (CPU; memory-mapped for disk),
    so the model runs without hooks where its weights are.
    """
    for child in module.children():
        remove_hook_from_module(child)
        remove_hook_from_submodules(child)


def _find_align_hook(module: nn.Module) -> AlignDevicesHook | None:
    """Return the AlignDevicesHook attached to ``module`` (in a SequentialHook: the offloading one first)."""
    hook = module.__dict__.get("_hf_hook")
    if isinstance(hook, AlignDevicesHook):
        return hook
    if isinstance(hook, SequentialHook):
        found = [sub for sub in hook.hooks if isinstance(sub, AlignDevicesHook)]
        offloading = [sub for sub in found if sub.offload]
        return (offloading or found or [None])[0]
    return None


# -- other hooks ---------------------------------------------------------------------------------
class LayerwiseCastingHook(ModelHook):
    """Keep a module's weights in ``storage_dtype`` and cast them to ``compute_dtype`` for each forward."""

    _is_stateful = False

    def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool) -> None:
        for label, dtype in (("storage_dtype", storage_dtype), ("compute_dtype", compute_dtype)):
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"LayerwiseCastingHook {label} must be a torch.dtype, got {dtype!r}")
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        self.non_blocking = non_blocking

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        module.to(dtype=self.compute_dtype, non_blocking=self.non_blocking)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return output


def _default_execution_device() -> torch.device:
    """Return MPS if available, else GPU 0 if there is one, else the CPU (without initialising CUDA)."""
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    if torch.cuda.device_count() > 0:
        return torch.device("cuda", 0)
    return torch.device("cpu")


class CpuOffload(ModelHook):
    """Move a whole model to ``execution_device`` at its forward; it stays there until offloaded again.

    With ``prev_module_hook`` (a :class:`UserCpuOffloadHook`), that previous model is offloaded to
    the CPU just before this one runs.
    """

    def __init__(
        self, execution_device: Any = None, prev_module_hook: UserCpuOffloadHook | None = None
    ) -> None:
        self.prev_module_hook = prev_module_hook
        self.execution_device = _as_device(execution_device) if execution_device is not None else None
        if self.execution_device is None:
            self.execution_device = _default_execution_device()

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to("cpu")

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.prev_module_hook is not None:
            self.prev_module_hook.offload()
        module.to(self.execution_device)
        return _move(args, self.execution_device), _move(kwargs, self.execution_device)


class UserCpuOffloadHook:
    """Handle returned by ``cpu_offload_with_hook``: ``offload()`` sends the model back to the CPU, ``remove()`` unhooks it."""

    def __init__(self, model: nn.Module, hook: ModelHook) -> None:
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        """Move the model back to the CPU (it returns to the execution device at its next forward)."""
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        """Detach the hook from the model; the model stays where it is."""
        remove_hook_from_module(self.model)


# -- attach helpers ------------------------------------------------------------------------------
def _is_preload(module: nn.Module, preload_module_classes: list[str] | None) -> bool:
    return preload_module_classes is not None and type(module).__name__ in preload_module_classes


def attach_execution_device_hook(
    module: nn.Module,
    execution_device: int | str | torch.device,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict[int, dict[torch.device, torch.Tensor]] | None = None,
) -> None:
    """Attach an ``AlignDevicesHook(execution_device)`` to every submodule with weights and no hook yet."""
    if "_hf_hook" not in module.__dict__ and (
        next(iter(module.parameters()), None) is not None or next(iter(module.buffers()), None) is not None
    ):
        add_hook_to_module(
            module, AlignDevicesHook(execution_device, skip_keys=skip_keys, tied_params_map=tied_params_map)
        )
    if _is_preload(module, preload_module_classes):
        return
    for child in module.children():
        attach_execution_device_hook(
            child,
            execution_device,
            skip_keys=skip_keys,
            preload_module_classes=preload_module_classes,
            tied_params_map=tied_params_map,
        )


def attach_align_device_hook(
    module: nn.Module,
    execution_device: torch.device | None = None,
    offload: bool = False,
    weights_map: Mapping | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict[int, dict[torch.device, torch.Tensor]] | None = None,
) -> None:
    """Attach an AlignDevicesHook to every submodule with own parameters/buffers (recursively).

    Instances of ``preload_module_classes`` get one hook that loads all their weights, submodules
    included, at the start of their forward.
    """
    from .utils.offload import PrefixedDataset

    has_direct = next(iter(module.parameters(recurse=False)), None) is not None or any(
        b is not None for b in module._buffers.values()
    )
    full_offload = offload and _is_preload(module, preload_module_classes)
    if has_direct or full_offload:
        prefixed = None
        if weights_map is not None:
            prefixed = PrefixedDataset(weights_map, f"{module_name}." if module_name else "")
        hook = AlignDevicesHook(
            execution_device=execution_device,
            offload=offload,
            weights_map=prefixed,
            offload_buffers=offload_buffers,
            place_submodules=full_offload,
            skip_keys=skip_keys,
            tied_params_map=tied_params_map,
            module_name=module_name,
        )
        add_hook_to_module(module, hook, append=True)
    if full_offload:
        return
    for child_name, child in module.named_children():
        attach_align_device_hook(
            child,
            execution_device=execution_device,
            offload=offload,
            weights_map=weights_map,
            offload_buffers=offload_buffers,
            module_name=f"{module_name}.{child_name}" if module_name else child_name,
            skip_keys=skip_keys,
            preload_module_classes=preload_module_classes,
            tied_params_map=tied_params_map,
        )


def attach_align_device_hook_on_blocks(
    module: nn.Module,
    execution_device: torch.device | dict[str, torch.device] | None = None,
    offload: bool | dict[str, bool] = False,
    weights_map: Mapping | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict[int, dict[torch.device, torch.Tensor]] | None = None,
) -> None:
    """Attach AlignDevicesHooks per block, with ``execution_device`` / ``offload`` given per block name.

    A block kept on its device gets one hook placing all its weights (``place_submodules``); an
    offloaded block gets a hook per submodule with weights (see :func:`attach_align_device_hook`).
    """
    # An offloaded block, whatever form ``execution_device`` / ``offload`` take: only its device varies.
    attach_offloaded = functools.partial(
        attach_align_device_hook,
        module,
        offload=True,
        weights_map=weights_map,
        offload_buffers=offload_buffers,
        module_name=module_name,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        tied_params_map=tied_params_map,
    )
    if not isinstance(execution_device, Mapping) and not isinstance(offload, Mapping):
        if not offload:
            hook = AlignDevicesHook(
                execution_device=execution_device,
                io_same_device=True,
                skip_keys=skip_keys,
                place_submodules=True,
                tied_params_map=tied_params_map,
                module_name=module_name,
            )
            add_hook_to_module(module, hook)
        else:
            attach_offloaded(execution_device=execution_device)
        return
    if not isinstance(execution_device, Mapping):
        execution_device = dict.fromkeys(offload, execution_device)
    if not isinstance(offload, Mapping):
        offload = dict.fromkeys(execution_device, offload)

    if module_name in execution_device and module_name in offload and not offload[module_name]:
        hook = AlignDevicesHook(
            execution_device=execution_device[module_name],
            offload_buffers=offload_buffers,
            io_same_device=(module_name == ""),
            place_submodules=True,
            skip_keys=skip_keys,
            tied_params_map=tied_params_map,
            module_name=module_name,
        )
        add_hook_to_module(module, hook)
        attach_execution_device_hook(
            module, execution_device[module_name], skip_keys=skip_keys, tied_params_map=tied_params_map
        )
    elif module_name in execution_device and module_name in offload:
        attach_offloaded(execution_device=execution_device[module_name])
        if "_hf_hook" not in module.__dict__:
            hook = AlignDevicesHook(
                execution_device=execution_device[module_name],
                io_same_device=(module_name == ""),
                skip_keys=skip_keys,
                tied_params_map=tied_params_map,
                module_name=module_name,
            )
            add_hook_to_module(module, hook)
        attach_execution_device_hook(
            module,
            execution_device[module_name],
            skip_keys=skip_keys,
            preload_module_classes=preload_module_classes,
            tied_params_map=tied_params_map,
        )
    elif module_name == "":
        hook = AlignDevicesHook(
            execution_device=execution_device.get(""),
            io_same_device=True,
            skip_keys=skip_keys,
            tied_params_map=tied_params_map,
        )
        add_hook_to_module(module, hook)

    for child_name, child in module.named_children():
        attach_align_device_hook_on_blocks(
            child,
            execution_device=execution_device,
            offload=offload,
            weights_map=weights_map,
            offload_buffers=offload_buffers,
            module_name=f"{module_name}.{child_name}" if module_name else child_name,
            skip_keys=skip_keys,
            preload_module_classes=preload_module_classes,
            tied_params_map=tied_params_map,
        )


_CASTABLE_LAYERS = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Linear,
)


def attach_layerwise_casting_hooks(
    module: nn.Module,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    skip_modules_pattern: str | tuple[str, ...] | None = None,
    skip_modules_classes: tuple[type[nn.Module], ...] | None = None,
    non_blocking: bool = False,
) -> None:
    """Store weights in ``storage_dtype`` and compute in ``compute_dtype``, per layer; return nothing.

    With neither skip argument, ``module`` itself gets one :class:`LayerwiseCastingHook`. Otherwise
    every Linear/Conv layer below it does, except those whose qualified name matches one of
    ``skip_modules_pattern`` (regular expressions) or whose class is in ``skip_modules_classes``.
    """
    if isinstance(skip_modules_pattern, str):
        skip_modules_pattern = (skip_modules_pattern,)
    if skip_modules_pattern is None and skip_modules_classes is None:
        add_hook_to_module(module, LayerwiseCastingHook(storage_dtype, compute_dtype, non_blocking))
        return
    patterns = [re.compile(p) for p in (skip_modules_pattern or ())]
    classes = tuple(skip_modules_classes or ())

    def visit(mod: nn.Module, name: str) -> None:
        skip = (classes and isinstance(mod, classes)) or any(p.search(name) for p in patterns)
        if skip:
            logger.debug("layerwise casting: skipping %r", name)
            return
        if isinstance(mod, _CASTABLE_LAYERS):
            add_hook_to_module(mod, LayerwiseCastingHook(storage_dtype, compute_dtype, non_blocking))
            return
        for child_name, child in mod.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)

    for child_name, child in module.named_children():
        visit(child, child_name)
