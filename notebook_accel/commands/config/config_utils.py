"""Argument-parser helpers shared by the ``accelerate config`` subcommands."""

from __future__ import annotations

import argparse

__all__ = ["SubcommandHelpFormatter"]


class SubcommandHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help formatter that lists subcommands without the ``{a,b,c}`` choices line above them."""

    def _format_action(self, action):
        parts = super()._format_action(action)
        if action.nargs == argparse.PARSER:
            # The first line only repeats the choices that the indented lines below list one by one.
            parts = "\n".join(parts.split("\n")[1:])
        return parts
