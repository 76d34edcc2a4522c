"""Version comparisons: an installed library (or a version) against a requirement."""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch
from torch.torch_version import TorchVersion

from .constants import STR_OPERATION_TO_FUNC

__all__ = ["STR_OPERATION_TO_FUNC", "compare_versions", "is_torch_version", "torch_version"]

# The installed torch version; TorchVersion compares PEP 440 style against plain strings.
torch_version = TorchVersion(torch.__version__)


def _operation(operation: str) -> Any:
    try:
        return STR_OPERATION_TO_FUNC[operation]
    except (KeyError, TypeError):
        raise ValueError(
            f"operation {operation!r} is not a comparison: use one of {list(STR_OPERATION_TO_FUNC)}"
        ) from None


def compare_versions(library_or_version: Any, operation: str, requirement_version: str) -> bool:
    """Return whether ``library_or_version`` compares to ``requirement_version`` with ``operation``.

    A string names an installed distribution (``"torch"``) whose version is read from its metadata;
    any other object (a ``packaging`` ``Version``, a ``TorchVersion``) is the version itself.
    Raises ``importlib.metadata.PackageNotFoundError`` when the named library is not installed.

    Args:
        library_or_version: A distribution name (its installed version is read) or a version object.
        operation: One of "<", "<=", "==", "!=", ">=", ">".
        requirement_version: The version to compare with.
    """
    compare = _operation(operation)
    # TorchVersion subclasses str: only a plain str names a library.
    if type(library_or_version) is str:
        try:
            version = importlib.metadata.version(library_or_version)
        except importlib.metadata.PackageNotFoundError:
            raise importlib.metadata.PackageNotFoundError(
                f"{library_or_version!r} (install it, or pass a packaging.version.Version to compare "
                "a version number)"
            ) from None
    else:
        version = str(library_or_version)
    return compare(TorchVersion(version), str(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    """Return whether the installed torch version compares to ``version`` with ``operation``.

    ``operation`` is one of ``>``, ``>=``, ``==``, ``!=``, ``<=``, ``<``; ``version`` like ``"2.1.0"``.
    """
    return _operation(operation)(torch_version, version)
