"""Argument parsing shared by the ``accelerate`` commands: options accepted with dashes or underscores."""

from __future__ import annotations

import argparse

__all__ = ["CustomArgumentParser", "build_command_parser"]


class CustomArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` where ``--num_processes`` may also be written ``--num-processes``."""

    def add_argument(self, *args, **kwargs):
        """Return the action for ``args``, registered with both spellings of each long option."""
        return super().add_argument(*_with_dashed_twins(args), **kwargs)

    def add_argument_group(self, *args, **kwargs):
        """Return an argument group whose options also accept both spellings."""
        group = super().add_argument_group(*args, **kwargs)
        plain = group.add_argument
        group.add_argument = lambda *a, **k: plain(*_with_dashed_twins(a), **k)
        return group


def _with_dashed_twins(names: tuple) -> tuple:
    """Return ``names`` plus the dashed spelling of every ``--long_option`` (``--long-option``)."""
    out = list(names)
    for name in names:
        if isinstance(name, str) and name.startswith("--") and "_" in name[2:]:
            twin = "--" + name[2:].replace("_", "-")
            if twin not in out:
                out.append(twin)
    return tuple(out)


def build_command_parser(subparsers, name: str, description: str, options, func) -> argparse.ArgumentParser:
    """Return the parser of command ``name``: a subparser of ``subparsers`` when given, else a standalone one.

    ``options`` is a sequence of ``(flags, add_argument keyword arguments)``; long options accept
    dashes too (``--config-file``); the parser's default ``func`` is ``func``.
    """
    if subparsers is None:
        parser = CustomArgumentParser(f"Accelerate {name} command", description=description)
    else:
        parser = subparsers.add_parser(name, description=description)
    for flags, settings in options:
        parser.add_argument(*_with_dashed_twins(tuple(flags)), **settings)
    parser.set_defaults(func=func)
    return parser
