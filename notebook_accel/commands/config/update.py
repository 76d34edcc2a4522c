"""``accelerate config update``: rewrite an existing config file with the current fields and defaults."""

from __future__ import annotations

import argparse
import logging
import os

from .config_args import default_config_file, load_config_from_file
from .config_utils import SubcommandHelpFormatter

__all__ = ["update_command_parser", "update_config", "update_config_command"]

logger = logging.getLogger(__name__)

description = "Update an existing config file with the latest defaults while keeping the old configuration."


def update_config(args: argparse.Namespace) -> str:
    """Return the path of the config file after re-writing it through ``load_config_from_file``."""
    config_file = args.config_file
    if config_file is None and os.path.isfile(default_config_file):
        config_file = default_config_file
    elif config_file is None or not os.path.isfile(config_file):
        raise FileNotFoundError(
            f"The passed config file {config_file!r} does not exist: pass an existing --config_file, or write "
            "one first with `accelerate config default`."
        )
    config = load_config_from_file(config_file)
    if config_file.endswith(".json"):
        config.to_json_file(config_file)
    else:
        config.to_yaml_file(config_file)
    return config_file


def update_config_command(args: argparse.Namespace) -> str:
    """Return the path re-written by ``update_config`` (logged at INFO)."""
    path = update_config(args)
    logger.info("Successfully updated the configuration file at %s.", path)
    return path


def update_command_parser(parser, parents):
    """Return the ``update`` subparser added to ``parser`` (its ``func`` runs ``update_config_command``)."""
    sub = parser.add_parser(
        "update", parents=parents, help=description, formatter_class=SubcommandHelpFormatter
    )
    sub.add_argument(
        "--config_file", default=None, help="The config file to update (default: the default one)."
    )
    sub.set_defaults(func=update_config_command)
    return sub
