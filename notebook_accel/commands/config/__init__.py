"""``accelerate.commands.config``: the ``accelerate config`` command and the config-file readers libraries import.

``accelerate config`` with no subcommand is Accelerate's interactive questionnaire, which needs a
terminal; here ``accelerate config default`` (or ``write_basic_config()`` from a notebook) writes the
file and ``accelerate config update`` refreshes it.
"""

from __future__ import annotations

import argparse

from .config_args import default_config_file, load_config_from_file
from .config_utils import SubcommandHelpFormatter
from .default import default_command_parser
from .update import update_command_parser

__all__ = [
    "config_command_parser",
    "default_command_parser",
    "default_config_file",
    "get_config_parser",
    "load_config_from_file",
    "main",
    "update_command_parser",
]

_DESCRIPTION = "Write or update the accelerate config file (default_config.yaml)."


def _questionnaire(args: argparse.Namespace):
    raise RuntimeError(
        "The interactive `accelerate config` questionnaire is not part of notebook_accel: run "
        "`accelerate config default [--mixed_precision fp16] [--config_file PATH]` (or "
        "notebook_accel.utils.write_basic_config() in a notebook) and edit the file it writes."
    )


def config_command_parser(subparsers=None):
    """Return the ``config`` parser (a subparser of ``subparsers`` when given) with its ``--config_file`` option."""
    if subparsers is not None:
        parser = subparsers.add_parser("config", description=_DESCRIPTION)
    else:
        parser = argparse.ArgumentParser("Accelerate config command", description=_DESCRIPTION)
    parser.add_argument(
        "--config_file", default=None, help="The config file to write (default: the default one)."
    )
    parser.set_defaults(func=_questionnaire)
    return parser


def get_config_parser(subparsers=None):
    """Return the ``config`` parser with its ``default`` and ``update`` subcommands."""
    parent = config_command_parser(subparsers)
    sub = parent.add_subparsers(title="subcommands", dest="subcommand")
    default_command_parser(sub, parents=[])
    update_command_parser(sub, parents=[])
    parent.formatter_class = SubcommandHelpFormatter
    return parent


def main(*, argv=None):
    """Return what the chosen subcommand returns, after parsing ``argv`` (default: ``sys.argv[1:]``)."""
    parser = get_config_parser()
    args = parser.parse_args(argv)
    return args.func(args)
