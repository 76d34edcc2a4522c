"""The ``notebook-accel`` command (``python -m notebook_accel.commands``): Accelerate's CLI commands.

``notebook-accel config|env|estimate-memory|launch|merge-weights|test|to-fsdp2|tpu-config ...`` takes the
arguments of ``accelerate <command>`` (1.15) and prints the same outputs. (The real ``accelerate``
script may be installed beside this package; ours has its own name.)
"""

from __future__ import annotations

import argparse

from .config import get_config_parser
from .env import env_command_parser
from .estimate import estimate_command_parser
from .launch import launch_command_parser
from .merge import merge_command_parser
from .test import test_command_parser
from .to_fsdp2 import to_fsdp2_command_parser
from .tpu import tpu_command_parser

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    """Return the top-level parser with one subcommand per command."""
    top = argparse.ArgumentParser(
        "notebook-accel", usage="notebook-accel <command> [<args>]", allow_abbrev=False
    )
    commands = top.add_subparsers(help="accelerate command helpers", dest="command")
    get_config_parser(subparsers=commands)
    estimate_command_parser(subparsers=commands)
    env_command_parser(subparsers=commands)
    launch_command_parser(subparsers=commands)
    merge_command_parser(subparsers=commands)
    test_command_parser(subparsers=commands)
    to_fsdp2_command_parser(subparsers=commands)
    tpu_command_parser(subparsers=commands)
    return top


def main(argv: list[str] | None = None) -> int:
    """Return 0 after running the command of ``argv`` (default ``sys.argv[1:]``); 1 and the help without one."""
    top = parser()
    args = top.parse_args(argv)
    if not hasattr(args, "func"):
        top.print_help()
        return 1
    args.func(args)
    return 0
