"""``install_as_accelerate()``: make ``import accelerate`` (and every ``accelerate.X`` path) give notebook_accel.

The pattern of PyMySQL's ``install_as_MySQLdb()``, extended to a whole package: a finder placed first
on ``sys.meta_path`` answers ``accelerate`` and ``accelerate.X.Y`` with the *same module objects* as
``notebook_accel`` and ``notebook_accel.X.Y`` (so ``accelerate.utils.modeling is
notebook_accel.utils.modeling``, and state singletons, hooks and enums are shared whichever name a
library used), and answers ``importlib.metadata`` look-ups of the "accelerate" distribution with a
small metadata record, so version gates in transformers and peft see the Accelerate version whose
surface we implement.

Workers of our launcher: forked ones inherit the finder; spawned ones (and forkserver ones) read
``NOTEBOOK_ACCEL_AS_ACCELERATE=1`` from their environment, which the launcher passes on, and install it
again before unpickling the user's function (which may name ``accelerate`` modules).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

__all__ = [
    "ACCELERATE_COMPAT_VERSION",
    "ALIAS_ENV_VAR",
    "AccelerateShadowedWarning",
    "alias_worker_env",
    "install_as_accelerate",
    "is_installed_as_accelerate",
    "reinstall_from_env",
    "uninstall_as_accelerate",
]

ALIAS = "accelerate"
TARGET = "notebook_accel"
ACCELERATE_COMPAT_VERSION = "1.15.0"  # == notebook_accel.__version__ (a test holds them equal)
"""The version ``importlib.metadata.version("accelerate")`` reports once installed.

Clients gate code paths on it (transformers checks ``accelerate >= 1.1.0``, and newer keyword
arguments by version); the surface we implement is 1.15's, so 1.15.0 selects the paths that match
what we offer. Who is really answering is in the record's ``Summary`` field and in
``accelerate.__name__`` (``"notebook_accel"``).
"""
ALIAS_ENV_VAR = "NOTEBOOK_ACCEL_AS_ACCELERATE"


class AccelerateShadowedWarning(UserWarning):
    """Warned when the real ``accelerate`` is installed and ``install_as_accelerate()`` hides it."""


def _target_name(fullname: str) -> str | None:
    if fullname == ALIAS:
        return TARGET
    if fullname.startswith(ALIAS + "."):
        return TARGET + fullname[len(ALIAS) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads ``accelerate.X`` by handing back the already-imported ``notebook_accel.X`` module itself."""

    def __init__(self, target: str) -> None:
        self._target = target
        self._own_spec = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self._target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the alias spec on the module; it stays notebook_accel.X for
        # pickling, reload and for code that asks which module it is.
        module.__spec__ = self._own_spec


class _AliasDistribution(importlib.metadata.Distribution):
    """The metadata record of the "accelerate" distribution while installed."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            ours = sys.modules[TARGET].__notebook_accel_version__
            return (
                "Metadata-Version: 2.1\n"
                f"Name: {ALIAS}\n"
                f"Version: {ACCELERATE_COMPAT_VERSION}\n"
                f"Summary: notebook_accel {ours} installed as accelerate by install_as_accelerate()\n"
            )
        if filename == "top_level.txt":
            return ALIAS + "\n"
        return None

    def locate_file(self, path) -> Path:
        return Path(sys.modules[TARGET].__file__).parent.parent / path


class _AliasFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: resolves ``accelerate[.X]`` to ``notebook_accel[.X]`` and its metadata."""

    def find_spec(self, fullname, path=None, target=None):
        name = _target_name(fullname)
        if name is None:
            return None
        try:
            found = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            found = None
        if found is None:
            return None  # accelerate.X that we do not have: the usual ModuleNotFoundError names it
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(name), is_package=found.submodule_search_locations is not None
        )

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()) -> Iterator:
        wanted = context.name
        if wanted is not None and wanted.lower().replace("_", "-") == ALIAS:
            return iter([_AliasDistribution()])
        return iter(())


def _our_finder() -> _AliasFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, _AliasFinder)), None)


def is_installed_as_accelerate() -> bool:
    """Return whether ``import accelerate`` currently resolves to notebook_accel in this process."""
    return _our_finder() is not None


def _is_ours(module: object) -> bool:
    name = getattr(module, "__name__", "")
    return name == TARGET or name.startswith(TARGET + ".")


def _real_accelerate_imported() -> list[str]:
    return sorted(
        key
        for key, module in list(sys.modules.items())
        if (key == ALIAS or key.startswith(ALIAS + ".")) and not _is_ours(module)
    )


def _real_accelerate_installed() -> str | None:
    """Return where the real accelerate is installed (with its version), or None."""
    spec = importlib.machinery.PathFinder.find_spec(ALIAS)
    if spec is None:
        return None
    try:
        version = importlib.metadata.version(ALIAS)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown version"
    return f"accelerate {version} at {spec.origin}"


def install_as_accelerate(*, warn: bool = True) -> None:
    """Return None after making ``import accelerate`` and ``accelerate.X`` resolve to notebook_accel.

    Call it before anything imports accelerate (first cell, top of the script): libraries that
    import ``accelerate`` (transformers, peft, user scripts) then run on notebook_accel unchanged,
    and ``importlib.metadata.version("accelerate")`` reports ``ACCELERATE_COMPAT_VERSION``. Calling
    it again is harmless. Raises RuntimeError when the real accelerate is already imported here;
    warns (``AccelerateShadowedWarning``) when it is installed, since it is then hidden.
    """
    if is_installed_as_accelerate():
        return
    imported = _real_accelerate_imported()
    if imported:
        origin = getattr(sys.modules[imported[0]], "__file__", None)
        raise RuntimeError(
            f"The real accelerate is already imported in this process ({', '.join(imported[:3])}"
            f"{' ...' if len(imported) > 3 else ''} from {origin}); modules that hold it would keep "
            "using it. Call notebook_accel.install_as_accelerate() before anything imports accelerate "
            "or transformers (first cell of the notebook, top of the script), or restart the kernel."
        )
    importlib.import_module(TARGET)  # the alias hands out this module; it must exist first
    installed = _real_accelerate_installed() if warn else None
    if installed:
        warnings.warn(
            f"{installed} is installed; install_as_accelerate() hides it: `import accelerate` now gives "
            "notebook_accel. Call notebook_accel.uninstall_as_accelerate() to get the real one back "
            "(in a fresh process).",
            AccelerateShadowedWarning,
            stacklevel=2,
        )
    sys.meta_path.insert(0, _AliasFinder())
    os.environ[ALIAS_ENV_VAR] = "1"


def uninstall_as_accelerate() -> None:
    """Return None after undoing ``install_as_accelerate()``: ``import accelerate`` finds the real one again.

    The ``accelerate`` entries that point at notebook_accel leave ``sys.modules``; modules that
    already bound ``accelerate`` names keep what they bound (re-import them, or start a new process).
    """
    while (finder := _our_finder()) is not None:
        sys.meta_path.remove(finder)
    for key in [k for k in sys.modules if k == ALIAS or k.startswith(ALIAS + ".")]:
        if _is_ours(sys.modules[key]):
            del sys.modules[key]
    os.environ.pop(ALIAS_ENV_VAR, None)


def alias_worker_env() -> dict[str, str]:
    """Return the environment entries a worker needs to install the alias again (empty when not installed)."""
    return {ALIAS_ENV_VAR: "1"} if is_installed_as_accelerate() else {}


def reinstall_from_env() -> bool:
    """Return whether the alias was installed here because ``NOTEBOOK_ACCEL_AS_ACCELERATE=1`` is set.

    For spawned workers: the parent installed it, a fresh interpreter has to do it again. The parent
    already warned about a shadowed real accelerate, so this stays quiet.
    """
    if os.environ.get(ALIAS_ENV_VAR) != "1" or is_installed_as_accelerate():
        return False
    install_as_accelerate(warn=False)
    return True
