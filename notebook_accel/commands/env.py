"""``accelerate env``: the versions and settings to paste into a bug report, in 1.15's layout."""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version
from shutil import which  # a module attribute: 1.15's tests patch accelerate.commands.env.which

from .._alias import ACCELERATE_COMPAT_VERSION
from .config.config_args import default_config_file, load_config_from_file
from .utils import build_command_parser

__all__ = ["env_command", "env_command_parser"]

_DESCRIPTION = "Print the versions and the config file's settings for a bug report."


def env_command_parser(subparsers=None):
    """Return the ``env`` parser (a subparser of ``subparsers`` when given); its ``func`` is ``env_command``."""
    options = [
        (["--config_file"], {"default": None, "help": "The config file to show (default: the default one)."})
    ]
    return build_command_parser(subparsers, "env", _DESCRIPTION, options, env_command)


def _system_ram() -> str:
    try:
        import psutil

        total = psutil.virtual_memory().total
    except ImportError:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"{total / 1024**3:.2f} GB"


def _accelerator_line() -> tuple[str, str | None]:
    import torch

    if torch.cuda.is_available():
        return "CUDA", f"{torch.cuda.get_device_name()}"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "XPU", None
    if torch.backends.mps.is_available():
        return "MPS", None
    return "N/A", None


def env_info(config_file: str | None = None) -> tuple[dict[str, str], tuple[str, object]]:
    """Return ``(fields, (config label, config dict or "Not found"))`` as ``accelerate env`` prints them."""
    import numpy as np
    import torch

    accelerator, device = _accelerator_line()
    try:
        notebook_accel_version = version("notebook-accel")
    except PackageNotFoundError:  # run from a source tree that is not installed
        notebook_accel_version = "unknown"
    fields = {
        "`Accelerate` version": f"{ACCELERATE_COMPAT_VERSION} (notebook_accel {notebook_accel_version})",
        "Platform": platform.platform(),
        "`accelerate` bash location": which("accelerate") or "Not found",
        "Python version": platform.python_version(),
        "Numpy version": np.__version__,
        "PyTorch version": torch.__version__,
        "PyTorch accelerator": accelerator,
        "System RAM": _system_ram(),
    }
    if device is not None:
        fields["GPU type"] = device
    path = config_file if config_file is not None else default_config_file
    label = "`Accelerate` config passed" if config_file is not None else "`Accelerate` default config"
    if config_file is not None and not os.path.isfile(config_file):
        raise FileNotFoundError(
            f"--config_file {config_file!r} does not exist: pass an accelerate config file."
        )
    config = load_config_from_file(path).to_dict() if os.path.isfile(path) else "Not found"
    return fields, (label, config)


def env_command(args):
    """Return the info dict after printing it as ``accelerate env`` does."""
    fields, (label, config) = env_info(getattr(args, "config_file", None))
    lines = ["", "Copy-and-paste the text below in your GitHub issue", ""]
    lines += [f"- {key}: {value}" for key, value in fields.items()]
    lines.append(f"- {label}:")
    if isinstance(config, dict):
        lines += [f"\t- {key}: {value}" for key, value in config.items()]
    else:
        lines.append(f"\t{config}")
    print("\n".join(lines))
    return {**fields, label: config}


def main():
    """Return the info dict of ``env`` for the command line in ``sys.argv``."""
    args = env_command_parser().parse_args()
    return env_command(args)
