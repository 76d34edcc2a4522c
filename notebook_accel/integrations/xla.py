"""Install the torch_xla wheel matching the installed torch, in Google Colab."""

from __future__ import annotations

import importlib.metadata
import logging
import subprocess
import sys

from ..utils.environment import detect_platform

__all__ = ["install_xla"]

logger = logging.getLogger(__name__)

_LIBTPU_INDEX = "https://storage.googleapis.com/libtpu-releases/index.html"


def _pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", "install", *args]
    logger.info("running %s", " ".join(command))
    subprocess.run(command, check=True)


def install_xla(upgrade: bool = False) -> None:
    """Return nothing; in Google Colab, pip-install the torch_xla wheel that matches the installed torch.

    With ``upgrade`` torch itself is upgraded first. Outside Colab this raises RuntimeError: install
    torch_xla yourself there (it must match your torch version).
    """
    if detect_platform() != "colab":
        raise RuntimeError(
            "install_xla only installs in Google Colab. Elsewhere install the torch_xla release matching "
            "your torch yourself, e.g. `pip install 'torch_xla[tpu]~=<torch major.minor>.0' -f "
            f"{_LIBTPU_INDEX}` (see https://github.com/pytorch/xla#installation)"
        )
    if upgrade:
        _pip("--upgrade", "torch")
    # Read the version from the installed metadata: after an upgrade the imported torch is stale.
    version = importlib.metadata.version("torch").split("+")[0]
    major_minor = ".".join(version.split(".")[:2])
    _pip(f"torch_xla[tpu]~={major_minor}.0", "-f", _LIBTPU_INDEX)
