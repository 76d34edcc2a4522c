"""A tqdm progress bar shown by the local main process only, so N processes draw one bar per machine."""

from __future__ import annotations

import sys
from typing import Any

from .._lazy import ReferencedModule, attach
from .other import _state
from .package_checks import is_tqdm_available

__all__ = ["is_tqdm_available", "tqdm"]
# Accelerate serves PartialState here too; state sits above utils, so it resolves at first use.
_REEXPORTED_LAZILY = {"PartialState": "notebook_accel.state"}
__all__ += sorted(_REEXPORTED_LAZILY)
__getattr__, __dir__ = attach(__name__, _REEXPORTED_LAZILY)


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """Return a ``tqdm.auto.tqdm`` bar, disabled on every process but the local main one when ``main_process_only``.

    Arguments are tqdm's; an explicit ``disable=True`` is kept on every process.

    Args:
        *args: tqdm's positional arguments (the iterable first).
        main_process_only: Show the bar on the local main process only (default True).
        **kwargs: tqdm's keyword arguments.
    """
    if not is_tqdm_available():
        raise ImportError("notebook_accel.utils.tqdm needs tqdm: pip install tqdm")
    from tqdm.auto import tqdm as _tqdm

    if main_process_only and not _state().is_local_main_process:
        kwargs["disable"] = True
    return _tqdm(*args, **kwargs)


class _CallableModule(ReferencedModule):
    """This module, callable as its ``tqdm`` function.

    ``notebook_accel.utils.tqdm`` names both this module and the function (as in Accelerate). Importing
    the module binds the package attribute to the module; calling it still makes a progress bar.
    """

    def __call__(self, *args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
        return tqdm(*args, main_process_only=main_process_only, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
