"""``accelerate config update``: rewrite an existing config file with the current fields and defaults."""

from __future__ import annotations

import argparse
import logging
import os

from .config_args import default_config_file, load_config_from_file
from .config_utils import SubcommandHelpFormatter

__all__ = ["update_command_parser", "update_config", "update_config_command"]

logger = logging.getLogger(__name__)

description = "Rewrite an existing config file in the current format, keeping every setting it holds."


def _config_to_update(given: str | None) -> str:
    """Return the file to rewrite: ``given``, or the default config file when none is given."""
    path = default_config_file if given is None else given
    if os.path.isfile(path):
        return path
    origin = "the default config file" if given is None else "--config_file"
    raise FileNotFoundError(
        f"accelerate config update: nothing to update at {path!r} ({origin}); write a config first with "
        "`accelerate config` or `accelerate config default`, or pass --config_file PATH of an existing one"
    )


def update_config(args: argparse.Namespace) -> str:
    """Return the path of the config file after re-writing it through ``load_config_from_file``."""
    path = _config_to_update(args.config_file)
    config = load_config_from_file(path)  # fills the fields the file lacks with today's defaults
    write = config.to_json_file if path.endswith(".json") else config.to_yaml_file
    write(path)
    return path


def update_config_command(args: argparse.Namespace) -> str:
    """Return the path re-written by ``update_config`` (logged at INFO)."""
    path = update_config(args)
    logger.info("accelerate config update: rewrote %s", path)
    return path


def update_command_parser(parser, parents):
    """Return the ``update`` subparser added to ``parser`` (its ``func`` runs ``update_config_command``)."""
    command = parser.add_parser(
        "update", parents=parents, help=description, formatter_class=SubcommandHelpFormatter
    )
    command.set_defaults(func=update_config_command)
    command.add_argument(
        "--config_file",
        default=None,
        help="Path of the config file to rewrite (the default config file if omitted).",
    )
    return command
