"""``accelerate config default``: write a basic config file describing this machine."""

from __future__ import annotations

import argparse
import logging

from ...utils import imports as _imports
from ...utils.config_file import write_basic_config
from .config_args import ClusterConfig, default_json_config_file
from .config_utils import SubcommandHelpFormatter

__all__ = [
    "ClusterConfig",
    "SubcommandHelpFormatter",
    "default_command_parser",
    "default_config_command",
    "default_json_config_file",
    "description",
    "write_basic_config",
]

logger = logging.getLogger(__name__)

description = "Create a default config file for Accelerate with only a few flags set."

# Accelerate's module re-exports the device probes it uses (is_xpu_available, is_npu_available, ...);
# they are served from utils.imports, the one home of those probes.
_PROBES = ("hpu", "mlu", "musa", "neuron", "npu", "sdaa", "xpu")


def __getattr__(name: str):
    if name.startswith("is_") and name.endswith("_available") and name[3:-10] in _PROBES:
        return getattr(_imports, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def default_command_parser(parser, parents):
    """Return the ``default`` subparser added to ``parser`` (its ``func`` runs ``default_config_command``)."""
    sub = parser.add_parser(
        "default", parents=parents, help=description, formatter_class=SubcommandHelpFormatter
    )
    sub.add_argument(
        "--config_file",
        default=default_json_config_file,
        dest="save_location",
        help="Where to write the file (default: the default config location); .json writes JSON.",
    )
    sub.add_argument(
        "--mixed_precision",
        choices=["no", "fp16", "bf16"],
        default="no",
        type=str,
        help="Mixed precision of the config: no, fp16 or bf16.",
    )
    sub.set_defaults(func=default_config_command)
    return sub


def default_config_command(args: argparse.Namespace):
    """Return the path written by ``write_basic_config`` for ``args`` (False when a file is already there)."""
    path = write_basic_config(args.mixed_precision, args.save_location)
    if path:
        logger.info("accelerate configuration saved at %s", path)
    return path
