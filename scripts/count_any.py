"""Report how many annotated parameters in a package are annotated with a bare ``Any``.

Usage: python scripts/count_any.py [PACKAGE_DIR] [--max-ratio R] [--list]

Counts every annotated parameter of every function (positional, keyword-only, ``*args`` and
``**kwargs``; ``self``/``cls`` carry no annotation and are not counted) in the ``.py`` files under
PACKAGE_DIR (default: notebook_accel). "Bare" means the whole annotation is ``Any`` (or
``typing.Any``); ``Any | None``, ``list[Any]`` and the like are not bare. Prints the totals and the
ratio; with ``--max-ratio`` exits 1 when the ratio is above it; ``--list`` prints each bare one.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys


def _is_bare_any(annotation: ast.expr) -> bool:
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a string annotation
        return annotation.value.strip() in ("Any", "typing.Any")
    if isinstance(annotation, ast.Name):
        return annotation.id == "Any"
    return isinstance(annotation, ast.Attribute) and annotation.attr == "Any" and (
        isinstance(annotation.value, ast.Name) and annotation.value.id == "typing"
    )


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    args = function.args
    found = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    found += [a for a in (args.vararg, args.kwarg) if a is not None]
    return found


def count(package: pathlib.Path) -> tuple[int, list[str]]:
    """Return the number of annotated parameters under ``package`` and a 'file:line function(param)' per bare Any."""
    annotated = 0
    bare: list[str] = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for parameter in _parameters(node):
                if parameter.annotation is None:
                    continue
                annotated += 1
                if _is_bare_any(parameter.annotation):
                    bare.append(f"{path}:{parameter.lineno} {node.name}({parameter.arg})")
    return annotated, bare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default="notebook_accel")
    parser.add_argument("--max-ratio", type=float, default=None)
    parser.add_argument("--list", action="store_true")
    options = parser.parse_args(argv)
    package = pathlib.Path(options.package)
    if not package.is_dir():
        parser.error(f"{package} is not a directory: pass the package folder, e.g. notebook_accel")
    annotated, bare = count(package)
    if options.list:
        print("\n".join(bare))
    ratio = len(bare) / annotated if annotated else 0.0
    print(f"bare Any: {len(bare)} of {annotated} annotated parameters ({ratio:.1%}) in {package}")
    return 1 if options.max_ratio is not None and ratio > options.max_ratio else 0


if __name__ == "__main__":
    sys.exit(main())
