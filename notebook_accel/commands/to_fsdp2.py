"""``accelerate to-fsdp2``: rewrite an FSDP1 config file for FSDP2 (``fsdp_version: 2``).

The sharding strategy becomes ``fsdp_reshard_after_forward``; the options FSDP2 dropped
(``fsdp_backward_prefetch``, ``fsdp_sync_module_states``, ``fsdp_use_orig_params``) and the one it
does not implement (``fsdp_forward_prefetch``) are removed with a warning each.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import yaml

from .utils import build_command_parser

__all__ = ["convert_config_to_fsdp2", "load_config", "to_fsdp2_command", "to_fsdp2_command_parser"]

logger = logging.getLogger(__name__)

# FSDP1 sharding strategies (name or 1-based number) -> FSDP2's reshard_after_forward.
_RESHARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "NO_SHARD": False, "HYBRID_SHARD": True,
            "_HYBRID_SHARD_ZERO2": False, "1": True, "2": False, "3": False, "4": True, "5": False}  # fmt: skip
_REMOVED = ("fsdp_backward_prefetch", "fsdp_sync_module_states", "fsdp_use_orig_params")
_NOT_IMPLEMENTED = ("fsdp_forward_prefetch",)


_OPTIONS = (
    (["--config_file"], {"type": str, "required": True, "help": "The config file to convert to FSDP2"}),
    (["--overwrite"], {"action": "store_true", "help": "Overwrite the config file if it exists"}),
    (["--output_file"], {"type": str, "default": None,
                         "help": "Where to write the converted config (default: over the input, with --overwrite)"}),
)  # fmt: skip


def to_fsdp2_command_parser(subparsers=None):
    """Return the ``to-fsdp2`` parser (a subparser of ``subparsers`` when given)."""
    return build_command_parser(
        subparsers, "to-fsdp2", "Convert an Accelerate config from FSDP1 to FSDP2", _OPTIONS, to_fsdp2_command
    )


def convert_config_to_fsdp2(config: dict) -> dict:
    """Return a copy of the config dict ``config`` with its ``fsdp_config`` converted to FSDP2."""
    fsdp = dict(config.get("fsdp_config") or {})
    if int(fsdp.get("fsdp_version", 1)) == 2:
        logger.warning("Config already specifies FSDP2, skipping conversion...")
        logger.warning(
            "If the config doesn't use new argument names, change `fsdp_version` to `1` and rerun the command."
        )
        return dict(config)
    out: dict = {}
    for key, value in fsdp.items():
        if key in _REMOVED:
            logger.warning("Argument %s has been removed in FSDP2, skipping this key...", key)
        elif key in _NOT_IMPLEMENTED:
            logger.warning("Argument %s is not yet implemented in FSDP2, skipping this key...", key)
        elif key == "fsdp_sharding_strategy":
            if str(value) not in _RESHARD:
                raise ValueError(
                    f"fsdp_sharding_strategy {value!r} is unknown: use one of {sorted(_RESHARD)[5:]}."
                )
            out["fsdp_reshard_after_forward"] = _RESHARD[str(value)]
        else:
            out[key] = value
    out["fsdp_version"] = 2
    return {**config, "fsdp_config": dict(sorted(out.items()))}


def load_config(config_file: str) -> dict:
    """Return the YAML config file ``config_file`` as a dict (empty for an empty file)."""
    with open(config_file, encoding="utf-8") as handle:
        return yaml.safe_load(handle) or {}


def to_fsdp2_command(args):
    """Return the path written: ``args.config_file`` converted to FSDP2 (see the module's docstring)."""
    if not os.path.isfile(args.config_file):
        raise FileNotFoundError(
            f"--config_file {args.config_file!r} does not exist: pass the FSDP1 config file."
        )
    if not args.overwrite and args.output_file is None:
        raise ValueError("If --overwrite is not set, --output_file must be provided")
    target = args.output_file or args.config_file
    if args.output_file is not None and Path(args.output_file).exists() and not args.overwrite:
        raise FileExistsError(f"Output file {args.output_file} already exists and --overwrite is not set")
    config = load_config(args.config_file)
    already = int((config.get("fsdp_config") or {}).get("fsdp_version", 1)) == 2
    if config.get("distributed_type") != "FSDP" and not already:
        raise ValueError(
            f"{args.config_file} has distributed_type {config.get('distributed_type')!r}, not FSDP: "
            "only FSDP configs convert to FSDP2."
        )
    with open(target, "w", encoding="utf-8") as handle:
        yaml.safe_dump(convert_config_to_fsdp2(config), handle)
    return target


def main():
    """Return the path ``to-fsdp2`` wrote for the command line in ``sys.argv``."""
    return to_fsdp2_command(to_fsdp2_command_parser().parse_args())
