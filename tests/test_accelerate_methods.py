"""The methods and properties of Accelerate 1.15's classes, as recorded, on ours (issue 12).

tests/data/accelerate_surface.json records, for every class Accelerate defines, its public methods and
properties. For each class the surface test checks (defined at that path, neither excluded nor pending),
every recorded member must exist on our class with the same kind and, for a method, the same parameters
in the same order with the same defaults (extra keyword-only ones allowed). Exceptions are listed in
``[methods_excluded]`` of tests/data/accelerate_surface_exclusions.toml, each with its reason.
"""

from __future__ import annotations

import fnmatch
import importlib
import inspect
from typing import Any

import pytest

import tests.test_accelerate_surface as surface

METHODS_EXCLUDED: dict[str, str] = surface.EXCLUSIONS.get("methods_excluded", {})


def class_attr(cls: type, name: str) -> Any:
    """Return ``name`` as found on ``cls`` or a base (the raw descriptor), or None."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return None


def member_difference(recorded: dict[str, Any], attr: Any) -> str | None:
    """Return what differs between a recorded member and our class attribute (None if nothing)."""
    if attr is None:
        return "missing"
    if recorded["kind"] == "property":
        if callable(attr) and not isinstance(attr, property):
            return "property recorded, ours is a method"
        return None
    if isinstance(attr, property):
        return f"{recorded['kind']} recorded, ours is a property"
    func = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
    ours = surface.RECORDER._signature(func)
    if ours and recorded["kind"] == "method" and not isinstance(attr, staticmethod):
        ours = ours[1:]  # the recorder drops self
    found = surface.compare_parameters(recorded["parameters"], ours)
    return found[0] if found else None


def checked_classes() -> list[tuple[str, str, dict[str, Any], type]]:
    """Return (accelerate module, class name, recorded entry, our class) for every checked class."""
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


def class_differences(module: str, name: str, entry: dict[str, Any], cls: type) -> list[str]:
    """Return ``"<qualified member>: <difference>"`` for each recorded member not excluded."""
    out = []
    for member, recorded in entry["methods"].items():
        qualified = f"{module}.{name}.{member}"
        if any(fnmatch.fnmatchcase(qualified, pattern) for pattern in METHODS_EXCLUDED):
            continue
        problem = member_difference(recorded, class_attr(cls, member))
        if problem is not None:
            out.append(f"{qualified}: {problem}")
    return out


CLASSES = checked_classes()


@pytest.mark.parametrize(
    ("module", "name", "entry", "cls"), CLASSES, ids=[f"{m}.{n}" for m, n, _, _ in CLASSES]
)
def test_class_members_match(module: str, name: str, entry: dict[str, Any], cls: type) -> None:
    problems = class_differences(module, name, entry, cls)
    assert not problems, "\n".join(problems)


def test_every_method_exclusion_has_a_reason_and_matches_a_recorded_member() -> None:
    recorded = [f"{m}.{n}.{k}" for m, n, e, _ in CLASSES for k in e["methods"]]
    for pattern, reason in METHODS_EXCLUDED.items():
        assert len(reason.strip()) > 20, f"method exclusion {pattern!r} needs a real reason"
        assert fnmatch.filter(recorded, pattern), f"method exclusion {pattern!r} matches no recorded member"
    assert len(METHODS_EXCLUDED) <= 15, "the method exclusions are meant to stay short"


def test_member_difference_sees_missing_kind_and_parameters() -> None:
    class Ours:
        def step(self, closure=None):
            return closure

        @property
        def flag(self):
            return True

    method = {
        "kind": "method",
        "parameters": [{"name": "closure", "kind": "positional_or_keyword", "default": "None"}],
    }
    assert member_difference(method, class_attr(Ours, "step")) is None
    assert member_difference(method, class_attr(Ours, "absent")) == "missing"
    assert member_difference(method, class_attr(Ours, "flag")) == "method recorded, ours is a property"
    assert (
        member_difference({"kind": "property"}, class_attr(Ours, "step"))
        == "property recorded, ours is a method"
    )
    other = {"kind": "method", "parameters": [{"name": "closure", "kind": "positional_or_keyword"}]}
    assert member_difference(other, class_attr(Ours, "step"))
