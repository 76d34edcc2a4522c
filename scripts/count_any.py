"""Report how many annotated parameters in a package are annotated with a bare ``Any``.

Usage: python scripts/count_any.py [PACKAGE_DIR] [--max-ratio R] [--list]

Reads every function in the ``.py`` files under PACKAGE_DIR (default: notebook_accel) and counts its
annotated parameters (``self``/``cls`` carry no annotation and are not counted). "Bare" means the
whole annotation is ``Any`` (or ``typing.Any``); ``Any | None``, ``list[Any]`` and the like are not.

Two ratios are printed: over the named parameters (positional and keyword), the headline figure, and
over all parameters including ``*args``/``**kwargs``. A ``*args: Any`` / ``**kwargs: Any`` mostly
forwards whatever the caller passes to another callable (a hook's model inputs, a tracker's options),
where ``Any`` is the honest annotation; they are reported, but the limit ``--max-ratio`` applies to the
named ones (exit 1 when above it). ``--list`` prints each bare one as ``file:line function(param)``.
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
    return (
        isinstance(annotation, ast.Attribute)
        and annotation.attr == "Any"
        and isinstance(annotation.value, ast.Name)
        and annotation.value.id == "typing"
    )


def count(package: pathlib.Path) -> dict[str, tuple[int, list[str]]]:
    """Return, for "named" and "variadic" parameters, how many are annotated and which are bare ``Any``."""
    found: dict[str, tuple[int, list[str]]] = {"named": (0, []), "variadic": (0, [])}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = node.args
            groups = {
                "named": [*args.posonlyargs, *args.args, *args.kwonlyargs],
                "variadic": [a for a in (args.vararg, args.kwarg) if a is not None],
            }
            for kind, parameters in groups.items():
                annotated, bare = found[kind]
                for parameter in parameters:
                    if parameter.annotation is None:
                        continue
                    annotated += 1
                    if _is_bare_any(parameter.annotation):
                        bare.append(f"{path}:{parameter.lineno} {node.name}({parameter.arg})")
                found[kind] = (annotated, bare)
    return found


def _ratio(bare: int, annotated: int) -> float:
    return bare / annotated if annotated else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default="notebook_accel")
    parser.add_argument("--max-ratio", type=float, default=None, help="limit for the named-parameter ratio")
    parser.add_argument("--list", action="store_true", help="print every bare-Any parameter")
    options = parser.parse_args(argv)
    package = pathlib.Path(options.package)
    if not package.is_dir():
        parser.error(f"{package} is not a directory: pass the package folder, e.g. notebook_accel")
    found = count(package)
    (named, named_bare), (variadic, variadic_bare) = found["named"], found["variadic"]
    if options.list:
        print("\n".join(named_bare + variadic_bare))
    ratio = _ratio(len(named_bare), named)
    print(f"named parameters: bare Any {len(named_bare)} of {named} ({ratio:.1%}) in {package}")
    total, total_bare = named + variadic, len(named_bare) + len(variadic_bare)
    print(f"with *args/**kwargs: bare Any {total_bare} of {total} ({_ratio(total_bare, total):.1%})")
    return 1 if options.max_ratio is not None and ratio > options.max_ratio else 0


if __name__ == "__main__":
    sys.exit(main())
