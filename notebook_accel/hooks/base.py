"""The hook protocol (ModelHook, SequentialHook) and putting a hook on a module or taking it off.

A hooked module's ``forward`` is an instance attribute: a ``functools.partial`` of one of four
module-level functions with the module, the hook and the hook's bound ``pre_forward`` /
``post_forward``. Which function is decided once, when the hook is attached, from what the hook
overrides: a hook without ``pre_forward`` (or ``post_forward``) pays no call for it, and nothing
enters ``torch.no_grad()`` unless ``hook.no_grad``. The partial holds no closure and reads the
original forward from ``module._old_forward`` at each call, so ``copy.deepcopy`` / pickle of a
hooked model give a model that calls its own hook. The wrapper carries the original forward's
name, docstring and signature; taking the hook off restores the original forward exactly.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "ModelHook",
    "SequentialHook",
    "add_hook_to_module",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
]

# What add_hook_to_module needs from a hook (duck typing: a hook need not subclass ModelHook).
_PROTOCOL = ("init_hook", "pre_forward", "post_forward", "detach_hook", "no_grad")


class ModelHook:
    """Callbacks run just before and after a module's forward; unlike torch hooks they see the kwargs.

    Subclass it and override what you need: ``init_hook`` (attached), ``pre_forward`` (returns the
    ``(args, kwargs)`` the forward will get), ``post_forward`` (returns the output), ``detach_hook``
    (removed). Set the class attribute ``no_grad = True`` to run the forward under ``torch.no_grad()``.
    """

    no_grad = False
    _is_stateful = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Return the module, after whatever the hook does when attached to it."""
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """Return the ``(args, kwargs)`` to pass to the module's forward."""
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Return the (possibly processed) output of the module's forward."""
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Return the module, after whatever the hook undoes when detached from it."""
        return module


class SequentialHook(ModelHook):
    """A hook that runs several hooks in turn at each event (outputs of one feed the next)."""

    def __init__(self, *hooks: ModelHook) -> None:
        for hook in hooks:
            if not hasattr(hook, "pre_forward") or not hasattr(hook, "post_forward"):
                raise TypeError(f"SequentialHook takes ModelHook instances, got {type(hook).__name__}")
        self.hooks = hooks

    @property
    def no_grad(self) -> bool:  # type: ignore[override]
        return any(hook.no_grad for hook in self.hooks)

    def init_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module

    def __repr__(self) -> str:
        return f"SequentialHook({', '.join(map(repr, self.hooks))})"


# A hook's pre_forward(module, *args, **kwargs) -> (args, kwargs) and post_forward(module, output) -> output.
_PreForward = Callable[..., tuple[tuple, dict]]
_PostForward = Callable[[nn.Module, Any], Any]


# -- the four hooked forwards ---------------------------------------------------------------------
def _forward_full(
    module: nn.Module, hook: ModelHook, pre: _PreForward, post: _PostForward, *args: Any, **kwargs: Any
) -> Any:
    args, kwargs = pre(module, *args, **kwargs)
    if hook.no_grad:
        with torch.no_grad():
            output = module._old_forward(*args, **kwargs)
    else:
        output = module._old_forward(*args, **kwargs)
    return post(module, output)


def _forward_pre(
    module: nn.Module, hook: ModelHook, pre: _PreForward, post: _PostForward, *args: Any, **kwargs: Any
) -> Any:
    args, kwargs = pre(module, *args, **kwargs)
    if hook.no_grad:
        with torch.no_grad():
            return module._old_forward(*args, **kwargs)
    return module._old_forward(*args, **kwargs)


def _forward_post(
    module: nn.Module, hook: ModelHook, pre: _PreForward, post: _PostForward, *args: Any, **kwargs: Any
) -> Any:
    if hook.no_grad:
        with torch.no_grad():
            return post(module, module._old_forward(*args, **kwargs))
    return post(module, module._old_forward(*args, **kwargs))


def _forward_none(
    module: nn.Module, hook: ModelHook, pre: _PreForward, post: _PostForward, *args: Any, **kwargs: Any
) -> Any:
    if hook.no_grad:
        with torch.no_grad():
            return module._old_forward(*args, **kwargs)
    return module._old_forward(*args, **kwargs)


# (overrides pre_forward, overrides post_forward) -> the forward that calls exactly those.
_FORWARDS = {
    (True, True): _forward_full,
    (True, False): _forward_pre,
    (False, True): _forward_post,
    (False, False): _forward_none,
}


def _overrides(hook: ModelHook, name: str) -> bool:
    """Return whether ``hook`` brings its own ``name`` callback (class or instance attribute)."""
    if name in getattr(hook, "__dict__", {}):
        return True
    return getattr(type(hook), name, None) is not getattr(ModelHook, name)


def _forward_for(hook: ModelHook) -> Callable[..., Any]:
    """Return the hooked-forward function calling only the callbacks ``hook`` overrides."""
    if isinstance(hook, SequentialHook):  # its members decide at each call
        return _forward_full
    return _FORWARDS[_overrides(hook, "pre_forward"), _overrides(hook, "post_forward")]


def _wrap_forward(module: nn.Module, hook: ModelHook, original: Callable[..., Any]) -> functools.partial:
    """Return the forward of ``module`` hooked by ``hook``, looking like ``original`` (name, doc, signature)."""
    wrapper = functools.partial(_forward_for(hook), module, hook, hook.pre_forward, hook.post_forward)
    functools.update_wrapper(wrapper, original)
    try:
        wrapper.__signature__ = inspect.signature(original)
    except (TypeError, ValueError):  # builtins and C functions may have no signature to show
        pass
    return wrapper


def _check_attachable(module: Any, hook: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"add_hook_to_module needs a torch.nn.Module, got {type(module).__name__}")
    if not all(hasattr(hook, name) for name in _PROTOCOL):
        raise TypeError(
            "add_hook_to_module needs a ModelHook (init_hook/pre_forward/post_forward/detach_hook/no_grad): "
            f"subclass notebook_accel.hooks.ModelHook, got {type(hook).__name__}"
        )


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Return ``module`` with ``hook`` attached: its forward now runs the hook's callbacks around it.

    A hook already there is replaced (without being detached), unless ``append`` is True: then the
    current hook is detached and chained with the new one in a :class:`SequentialHook` (current
    first), whose ``init_hook`` runs both. Undo with :func:`remove_hook_from_module`.
    """
    _check_attachable(module, hook)
    current = module.__dict__.get("_hf_hook")
    if append and current is not None:
        remove_hook_from_module(module)
        hook = SequentialHook(current, hook)
    # The forward before any hook: a replaced hook's wrapper must never be wrapped again.
    original = module.__dict__.get("_old_forward", module.forward)
    module._old_forward = original
    module = hook.init_hook(module)
    module._hf_hook = hook
    module.forward = _wrap_forward(module, hook, original)
    return module


def _restore_forward(module: nn.Module) -> None:
    """Put back the forward saved by :func:`add_hook_to_module` (none at all if it was the class's own)."""
    original = module.__dict__.pop("_old_forward", None)
    if original is None:
        return
    is_class_forward = getattr(original, "__self__", None) is module and getattr(
        original, "__func__", None
    ) is getattr(type(module), "forward", None)
    if is_class_forward:
        module.__dict__.pop("forward", None)
    else:
        module.forward = original


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Return ``module`` with any hook attached by :func:`add_hook_to_module` detached (and its forward restored)."""
    hook = module.__dict__.pop("_hf_hook", None)
    if hook is not None:
        hook.detach_hook(module)
    _restore_forward(module)
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
