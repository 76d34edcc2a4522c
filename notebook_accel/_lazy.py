"""Module-level lazy attribute loading (PEP 562) shared by the package facades.

The public facades (``notebook_accel`` and ``notebook_accel.utils``) list every name and the
submodule that defines it; a name is imported the first time it is looked up. That keeps
``import notebook_accel`` cheap (no torch.distributed, no safetensors until used) and keeps the
layering one-way: a low-level module never pays for importing a high-level one.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

# package -> its lazy table (name -> module), as each facade registered it; read by the tests that check
# every entry against its module's __all__ and by the API reference.
TABLES: dict[str, Mapping[str, str]] = {}
# face -> the modules whose __all__ it serves (forward()).
FORWARDS: dict[str, tuple[str, ...]] = {}


class ReferencedModule(types.ModuleType):
    """A module subclass that pickles, as a plain module does, by reference to its name.

    Pickle's and cloudpickle's module reducers match ``types.ModuleType`` exactly; without this, a
    function using such a module (``accelerate.PartialState()``) could not be sent to a spawned worker.
    """

    def __reduce__(self) -> tuple[Callable[[str], Any], tuple[str]]:
        return importlib.import_module, (self.__name__,)


class _Facade(ReferencedModule):
    """A facade package with a public name that is also one of its submodules (``utils.tqdm``).

    Importing a submodule binds it on its package, which would hide the public name of the same
    name for good (``from notebook_accel.utils import tqdm`` gave the module once any code had run
    ``from .tqdm import tqdm``). As in Accelerate, whose ``utils/__init__`` rebinds the name after
    the import, the package attribute stays the public object; the submodule is in sys.modules.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            isinstance(value, types.ModuleType)
            and name in self.__dict__.get("_shadowed_by_submodule", ())
            and value.__name__ == f"{self.__name__}.{name}"
        ):
            return
        super().__setattr__(name, value)


def attach(
    package: str, table: Mapping[str, str], submodules: tuple[str, ...] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return ``(__getattr__, __dir__)`` for ``package`` resolving names through ``table``.

    ``table`` maps a public name to the module (absolute, or relative to ``package`` when it starts
    with a dot) that defines it. ``submodules`` names submodules of ``package`` that are attributes of
    it from the start, as those an eagerly importing package binds (``accelerate.utils`` after ``import
    accelerate``): each is imported the first time it is read.
    """

    TABLES[package] = table
    shadowed = frozenset(n for n, m in table.items() if m in (f".{n}", f"{package}.{n}"))
    module = sys.modules.get(package)
    if shadowed and module is not None and type(module) is types.ModuleType:
        module._shadowed_by_submodule = shadowed
        module.__class__ = _Facade

    def __getattr__(name: str) -> Any:
        if name in submodules:
            # Importing binds the submodule on the package; later reads skip this function.
            return importlib.import_module(f"{package}.{name}")
        try:
            module_name = table[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        module = importlib.import_module(module_name, package)
        value = getattr(module, name)
        # Cache on the package so later look-ups skip this function.
        importlib.import_module(package).__dict__[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(table) | set(submodules) | set(importlib.import_module(package).__dict__))

    return __getattr__, __dir__


def forward(package: str, *targets: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return ``(__getattr__, __dir__)`` for a face that serves every public name of ``targets``.

    ``package`` (an Accelerate path such as ``notebook_accel.utils.deepspeed``) then offers the names in
    each target's ``__all__`` (the first target that lists a name serves it); a target is imported the
    first time a name is looked up there, so the face imports nothing at import and writes no name down.
    Targets may be relative to ``package``'s parent package (``".kwargs"``).
    """
    FORWARDS[package] = targets
    parent = package.rpartition(".")[0]

    def _public(module_name: str) -> tuple[Any, list[str]]:
        module = importlib.import_module(module_name, parent)
        return module, list(getattr(module, "__all__", ()))

    def __getattr__(name: str) -> Any:
        if name.startswith("__") and name != "__all__":
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if name == "__all__":
            return sorted({n for target in targets for n in _public(target)[1]})
        for target in targets:
            module, public = _public(target)
            if name in public:
                value = getattr(module, name)
                sys.modules[package].__dict__[name] = value
                return value
        raise AttributeError(f"module {package!r} has no attribute {name!r} (its names live in {targets})")

    def __dir__() -> list[str]:
        return sorted(set(__getattr__("__all__")) | set(sys.modules[package].__dict__))

    return __getattr__, __dir__


class LazyModule(types.ModuleType):
    """A stand-in for a module that is imported the first time one of its attributes is read.

    For a costly module used only on some paths (``torch.distributed.fsdp`` when an FSDP plugin is
    built, an engine's wrapping code when a model is prepared for it): the holder's own import stays cheap.
    """

    def __init__(self, name: str) -> None:
        super().__init__(name)

    def __getattr__(self, attribute: str) -> Any:
        module = importlib.import_module(self.__name__)
        return getattr(module, attribute)

    def __reduce__(self) -> tuple[Callable[[str], Any], tuple[str]]:
        return importlib.import_module, (self.__name__,)
