"""The hook protocol: ModelHook and SequentialHook (re-exported by ``notebook_accel.hooks``)."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["ModelHook", "SequentialHook"]


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
