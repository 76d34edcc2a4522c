"""Report which recorded Accelerate 1.15 class methods differ from ours (the surface test does not check them).

tests/data/accelerate_surface.json records, for every class Accelerate defines, its public methods and
properties (``methods``). This compares them with our classes at the same paths, for the names the
surface test checks (not excluded, not pending), each class once (where Accelerate defines it):

    python scripts/report_method_signatures.py        # counts and a few examples
    python scripts/report_method_signatures.py -v     # every difference

"missing" means no class attribute of that name: a name we set per instance in ``__init__`` (e.g.
``GradientState.active_dataloader``) is counted as missing although instances have it.
"""

from __future__ import annotations

import collections
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tests.test_accelerate_surface as surface  # noqa: E402


def _class_attr(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return None


def _difference(recorded: dict[str, Any], attr: Any) -> str | None:
    """Return what differs between a recorded method entry and our class attribute (None if nothing)."""
    if attr is None:
        return "missing"
    if recorded["kind"] == "property":
        return (
            "property recorded, ours is a method"
            if callable(attr) and not isinstance(attr, property)
            else None
        )
    if isinstance(attr, property):
        return f"{recorded['kind']} recorded, ours is a property"
    func = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
    ours = surface._params(func)
    if ours and recorded["kind"] == "method" and not isinstance(attr, staticmethod):
        ours = ours[1:]  # the recorder drops self
    found = surface.compare_parameters(recorded["parameters"], ours)
    return found[0] if found else None


def _checked_classes() -> list[tuple[str, str, dict[str, Any], type]]:
    out = []
    for module in surface.MODULES:
        for name, entry in surface.SURFACE["modules"][module]["names"].items():
            if not entry.get("methods") or not entry.get("defined_here", True):
                continue
            if surface._classify(f"{module}.{name}")[0] != "checked":
                continue
            cls = getattr(importlib.import_module(surface.our_module_name(module)), name, None)
            if inspect.isclass(cls):
                out.append((module, name, entry, cls))
    return out


def main(verbose: bool) -> None:
    counts: collections.Counter = collections.Counter()
    per_class: collections.Counter = collections.Counter()
    lines = []
    classes = _checked_classes()
    for module, name, entry, cls in classes:
        for method, recorded in entry["methods"].items():
            counts["recorded"] += 1
            problem = _difference(recorded, _class_attr(cls, method))
            if problem is None:
                counts["same"] += 1
                continue
            counts["missing" if problem == "missing" else "different"] += 1
            per_class[f"{module}.{name}"] += 1
            lines.append(f"  {module}.{name}.{method}: {problem}")
    print(
        f"methods and properties recorded on {len(classes)} checked classes: "
        + ", ".join(f"{k} {v}" for k, v in counts.items())
    )
    print(f"classes with at least one difference: {len(per_class)}; most: {per_class.most_common(6)}")
    print(
        "\n".join(
            lines
            if verbose
            else lines[:10] + ([f"  ... ({len(lines) - 10} more, -v)"] if len(lines) > 10 else [])
        )
    )


if __name__ == "__main__":
    main("-v" in sys.argv)
