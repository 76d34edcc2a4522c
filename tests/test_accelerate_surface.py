"""Accelerate 1.15's public surface, recorded as facts, is offered at the same paths under notebook_accel.

tests/data/accelerate_surface.json comes from scripts/record_accelerate_surface.py (run in the separate
accelerate environment). For every recorded module ``accelerate.X.Y`` this checks ``notebook_accel.X.Y``:
each name importable, the same kind (exception classes stay exceptions, enums keep their members,
constants their values), and callables with the same parameters in the same order with the same
defaults (extra keyword-only parameters are allowed). tests/data/accelerate_surface_exclusions.toml
lists what is deliberately left out (with the reason) and, while engineers are still adding names,
what is pending and who owns it.
"""

from __future__ import annotations

import enum
import fnmatch
import importlib
import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import tomllib

from tests.script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
SURFACE = json.loads((DATA / "accelerate_surface.json").read_text(encoding="utf-8"))
EXCLUSIONS = tomllib.loads((DATA / "accelerate_surface_exclusions.toml").read_text(encoding="utf-8"))


# The recorder's signature reading and value normalisation are reused so both sides are compared in one
# form; loading it does not import accelerate (it only does so inside its functions).
RECORDER = load_script("record_accelerate_surface.py")
EXCLUDED: dict[str, str] = EXCLUSIONS.get("excluded", {})
PENDING: dict[str, list[str]] = EXCLUSIONS.get("pending", {})
MODULES = sorted(SURFACE["modules"])


def our_module_name(accelerate_module: str) -> str:
    """Return the notebook_accel path for ``accelerate.X.Y``."""
    return "notebook_accel" + accelerate_module[len("accelerate") :]


def _classify(qualified: str) -> tuple[str, str | None]:
    """Return ``("excluded", reason)``, ``("pending", owner)`` or ``("checked", None)``."""
    for pattern, reason in EXCLUDED.items():
        if fnmatch.fnmatchcase(qualified, pattern):
            return "excluded", reason
    for owner, patterns in PENDING.items():
        if any(fnmatch.fnmatchcase(qualified, p) for p in patterns):
            return "pending", owner
    return "checked", None


def compare_parameters(recorded: list[dict[str, Any]], ours: list[dict[str, Any]] | None) -> list[str]:
    """Return the differences between a recorded parameter list and ours (empty when they match)."""
    if ours is None:
        return ["our signature cannot be read"]
    fmt = lambda ps: ", ".join(  # noqa: E731
        ("*" if p["kind"] == "var_positional" else "**" if p["kind"] == "var_keyword" else "")
        + p["name"]
        + (f"={p['default']}" if "default" in p else "")
        for p in ps
    )
    recorded_names = {p["name"] for p in recorded}
    extra = [p for p in ours if p["name"] not in recorded_names]
    if any(p["kind"] != "keyword_only" for p in extra):
        return [f"parameters ({fmt(ours)}) != recorded ({fmt(recorded)})"]
    trimmed = [p for p in ours if p["name"] in recorded_names]
    if len(trimmed) != len(recorded) or not all(map(_same_parameter, recorded, trimmed)):
        return [f"parameters ({fmt(ours)}) != recorded ({fmt(recorded)})"]
    return []


def _same_parameter(recorded: dict[str, Any], ours: dict[str, Any]) -> bool:
    if recorded == ours:
        return True
    # A private sentinel (``object()``) default has no stable text; any sentinel of ours matches it.
    sentinel = recorded.get("default", "").startswith("<instance of") and ours.get("default", "").startswith(
        "<"
    )
    return sentinel and {**recorded, "default": None} == {**ours, "default": None}


def check_name(entry: dict[str, Any], obj: Any) -> list[str]:
    """Return what differs between a recorded entry and our object."""
    kind = entry["kind"]
    problems: list[str] = []
    if kind == "enum":
        if not (inspect.isclass(obj) and issubclass(obj, enum.Enum)):
            return [f"is {type(obj).__name__}, recorded an Enum"]
        ours = {m.name: RECORDER._json_value(m.value)[1] for m in obj}
        missing = sorted(set(entry["members"]) - set(ours))
        if missing:
            problems.append(f"enum members missing: {missing}")
        wrong = {k: (ours[k], v) for k, v in entry["members"].items() if k in ours and ours[k] != v}
        if wrong:
            problems.append(f"enum values differ (ours, recorded): {wrong}")
        return problems
    if kind in ("exception", "warning"):
        base = BaseException if kind == "exception" else Warning
        if not (inspect.isclass(obj) and issubclass(obj, base)):
            return [f"is {obj!r}, recorded a subclass of {base.__name__}"]
    elif kind in ("class", "dataclass"):
        if not inspect.isclass(obj):
            return [f"is {type(obj).__name__}, recorded a class"]
    elif kind == "function":
        if not callable(obj):
            return [f"is {type(obj).__name__}, recorded a function"]
    elif kind == "constant":
        ok, value = RECORDER._json_value(obj)
        if not ok or value != entry["value"]:
            return [f"value {obj!r} != recorded {entry['value']!r}"]
        return []
    elif kind == "instance" and "keys" in entry:
        missing_keys = sorted(set(entry["keys"]) - set(obj)) if isinstance(obj, dict) else entry["keys"]
        if missing_keys:
            return [f"keys missing: {missing_keys}"]
    elif kind == "instance" and "classes" in entry:
        ours_classes = (
            [f"{c.__module__}.{c.__qualname__}" for c in obj] if isinstance(obj, (list, tuple)) else obj
        )
        if ours_classes != entry["classes"]:
            return [f"classes {ours_classes} != recorded {entry['classes']}"]
    if entry.get("parameters") is not None and kind != "instance":
        problems += compare_parameters(entry["parameters"], RECORDER._signature(obj))
    return problems


def _module_report(module: str) -> tuple[dict[str, int], list[str]]:
    counts = {"recorded": 0, "present": 0, "excluded": 0, "pending": 0}
    problems: list[str] = []
    ours_name = our_module_name(module)
    try:
        ours = importlib.import_module(ours_name)
    except ImportError as exc:
        ours, import_error = None, exc
    for name, entry in SURFACE["modules"][module]["names"].items():
        counts["recorded"] += 1
        status, _ = _classify(f"{module}.{name}")
        if status != "checked":
            counts[status] += 1
            continue
        if ours is None:
            problems.append(f"{ours_name}.{name}: module not importable ({import_error})")
            continue
        try:
            obj = getattr(ours, name)
        except AttributeError:
            problems.append(f"{ours_name}.{name}: missing")
            continue
        found = check_name(entry, obj)
        problems += [f"{ours_name}.{name}: {p}" for p in found]
        counts["present"] += not found
    return counts, problems


@pytest.mark.parametrize("module", MODULES)
def test_module_surface(module: str) -> None:
    counts, problems = _module_report(module)
    print(f"{module}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    assert not problems, (
        f"{len(problems)} differences from Accelerate {SURFACE['accelerate_version']}:\n"
        + "\n".join(problems)
    )


def _pending_name_now_matches(module: str, name: str) -> bool:
    try:
        obj = getattr(importlib.import_module(our_module_name(module)), name)
    except (ImportError, AttributeError):
        return False
    return not check_name(SURFACE["modules"][module]["names"][name], obj)


def test_surface_counts(capsys) -> None:
    """Print names recorded / present / excluded / pending (per owner); the exclusions stay short."""
    totals = {"recorded": 0, "present": 0, "excluded": 0, "pending": 0}
    by_owner: dict[str, int] = {owner: 0 for owner in PENDING}
    landed: list[str] = []
    for module in MODULES:
        counts, _ = _module_report(module)
        for key in totals:
            totals[key] += counts[key]
        for name in SURFACE["modules"][module]["names"]:
            status, owner = _classify(f"{module}.{name}")
            if status == "pending":
                by_owner[owner] += 1
                if _pending_name_now_matches(module, name):
                    landed.append(f"{module}.{name} ({owner})")
    with capsys.disabled():
        print(
            f"\naccelerate {SURFACE['accelerate_version']} surface: "
            + " / ".join(f"{k} {v}" for k, v in totals.items())
            + "; pending by owner: "
            + (", ".join(f"{o} {n}" for o, n in by_owner.items()) or "none")
        )
        if landed:
            print("pending but already matching (remove from [pending]): " + ", ".join(landed))
    assert len(EXCLUDED) <= 40, "the exclusions list is meant to stay short"


def test_every_exclusion_has_a_reason_and_matches_something() -> None:
    recorded = [f"{m}.{n}" for m in MODULES for n in SURFACE["modules"][m]["names"]]
    for pattern, reason in EXCLUDED.items():
        assert len(reason.strip()) > 20, f"exclusion {pattern!r} needs a real reason"
        assert fnmatch.filter(recorded, pattern), f"exclusion {pattern!r} matches no recorded name"
    for owner, patterns in PENDING.items():
        for pattern in patterns:
            assert fnmatch.filter(recorded, pattern), (
                f"pending {pattern!r} ({owner}) matches no recorded name"
            )


def test_compare_parameters_flags_order_defaults_and_extra_positionals() -> None:
    rec = [
        {"name": "a", "kind": "positional_or_keyword"},
        {"name": "b", "kind": "positional_or_keyword", "default": "None"},
    ]
    assert compare_parameters(rec, rec) == []
    assert compare_parameters(rec, rec + [{"name": "c", "kind": "keyword_only", "default": "1"}]) == []
    assert compare_parameters(rec, rec[::-1])
    assert compare_parameters(rec, [rec[0], {**rec[1], "default": "0"}])
    assert compare_parameters(rec, rec + [{"name": "c", "kind": "positional_or_keyword", "default": "1"}])
    assert compare_parameters(rec, rec[:1])
