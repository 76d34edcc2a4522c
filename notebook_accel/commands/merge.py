"""``accelerate merge-weights``: one safetensors file from an FSDP sharded checkpoint folder."""

from __future__ import annotations

import logging

from ..utils import fsdp_utils
from .utils import build_command_parser

__all__ = ["merge_command", "merge_command_parser"]

logger = logging.getLogger(__name__)


_OPTIONS = (
    (["checkpoint_directory"], {"type": str, "help": "A directory of sharded weights saved by FSDP."}),
    (["output_path"], {"type": str, "help": "Where to save the merged weights."}),
    (["--unsafe_serialization"], {"action": "store_true",
                                  "help": "Save `pytorch_model.bin` rather than `model.safetensors` (not recommended)."}),
    (["--remove_checkpoint_dir"], {"action": "store_true", "help": "Remove the checkpoint directory after merging."}),
)  # fmt: skip
_DESCRIPTION = (
    "Merge the weights of an FSDP sharded checkpoint into a single file (`model.safetensors`) in "
    "`output_path`. Runs on the CPU and needs the RAM for the whole state dict."
)


def merge_command_parser(subparsers=None):
    """Return the ``merge-weights`` parser (a subparser of ``subparsers`` when given)."""
    return build_command_parser(subparsers, "merge-weights", _DESCRIPTION, _OPTIONS, merge_command)


def merge_command(args):
    """Return the path of the merged weights file written from ``args.checkpoint_directory``."""
    options = vars(args)
    target = fsdp_utils.merge_fsdp_weights(
        options["checkpoint_directory"], options["output_path"],
        safe_serialization=not options.get("unsafe_serialization", False),
        remove_checkpoint_dir=bool(options.get("remove_checkpoint_dir", False)),
    )  # fmt: skip
    logger.info("Merged weights written to %s", target)
    return target


def main():
    """Return the merged file for the command line in ``sys.argv``."""
    return merge_command(merge_command_parser().parse_args())
