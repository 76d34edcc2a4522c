"""Record Accelerate's public surface (names, kinds, signatures, enum members, constant values) as JSON.

The facts land in ``tests/data/accelerate_surface.json``; ``tests/test_accelerate_surface.py`` checks
that every recorded name exists at the same path under ``notebook_accel`` with the same parameters.
Only introspection is used (importlib, inspect.signature, enum members, values); no code is copied.

Refresh (the real accelerate lives in its own virtual environment, never in ours):

    /work/.venv-accelerate/bin/python scripts/record_accelerate_surface.py

Options: ``--out PATH`` writes elsewhere. The script refuses to run without ``accelerate`` importable,
and records ``accelerate.__version__`` so the test can name the reference it compares against.

Which names count as public in a module ``M``:

* every name without a leading underscore, minus submodules and the objects whose origin is outside
  accelerate (``torch``, ``os``, ``typing`` names, third-party classes and functions);
* classes and functions count when their ``__module__`` starts with ``accelerate``;
* other values (constants, singletons) count when some accelerate module assigns that name at its top
  level (read from the module's syntax tree) and holds the same object -- so a re-exported
  ``utils.WEIGHTS_NAME`` counts, ``torch.float16`` or a ``logger`` from ``logging.getLogger`` do not.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import importlib
import inspect
import json
import pkgutil
import sys
import types
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "data" / "accelerate_surface.json"

# The CLI package is a program, not a library; these are the modules of it that libraries and user
# scripts import (transformers, trl and training scripts import them by name).
COMMANDS_MODULES = (
    "accelerate.commands.config",
    "accelerate.commands.config.config_args",
    "accelerate.commands.config.default",
    "accelerate.commands.launch",
)
SKIPPED_PREFIXES = ("accelerate.test_utils", "accelerate.commands")
# Names that are module-level plumbing, not API, wherever they appear.
SKIPPED_NAMES = {"logger", "annotations"}

_PARAM_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional_only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional_or_keyword",
    inspect.Parameter.VAR_POSITIONAL: "var_positional",
    inspect.Parameter.KEYWORD_ONLY: "keyword_only",
    inspect.Parameter.VAR_KEYWORD: "var_keyword",
}


def _module_names() -> list[str]:
    import accelerate

    names = ["accelerate"]
    for info in pkgutil.walk_packages(accelerate.__path__, "accelerate."):
        if info.name.startswith(SKIPPED_PREFIXES):
            continue
        names.append(info.name)
    names.extend(COMMANDS_MODULES)
    return sorted(set(names))


def _json_value(value: Any) -> tuple[bool, Any]:
    """Return ``(ok, value)`` with ``value`` JSON-safe when ``ok``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        if isinstance(value, float) and value != value:  # NaN is not JSON
            return False, None
        return True, value
    if isinstance(value, enum.Enum):
        return True, {"enum": type(value).__name__, "member": value.name}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else list(value)
        out = []
        for item in items:
            ok, v = _json_value(item)
            if not ok:
                return False, None
            out.append(v)
        return True, out
    if isinstance(value, dict):
        out_d = {}
        for key, item in value.items():
            ok_k, k = _json_value(key)
            ok_v, v = _json_value(item)
            if not (ok_k and ok_v) or not isinstance(k, (str, int, float, bool)) and k is not None:
                return False, None
            out_d[str(k)] = v
        return True, out_d
    return False, None


def default_repr(value: Any) -> str:
    """Return a stable text for a parameter default (object addresses removed)."""
    if value is inspect.Parameter.empty:
        return "<empty>"
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if inspect.isclass(value) or inspect.isfunction(value) or inspect.isbuiltin(value):
        return f"<{getattr(value, '__qualname__', type(value).__name__)}>"
    text = repr(value)
    if " at 0x" in text:
        return f"<instance of {type(value).__qualname__}>"
    # A default built from the home folder (config paths) reads the same for every user.
    home = str(Path.home())
    return text.replace(home, "~") if home != "/" else text


def _signature(obj: Any) -> list[dict[str, Any]] | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = []
    for p in sig.parameters.values():
        entry: dict[str, Any] = {"name": p.name, "kind": _PARAM_KINDS[p.kind]}
        if p.default is not inspect.Parameter.empty:
            entry["default"] = default_repr(p.default)
        params.append(entry)
    return params


def _class_methods(cls: type) -> dict[str, Any]:
    """Return the public methods and properties a class defines itself (not inherited from outside)."""
    out: dict[str, Any] = {}
    for klass in cls.__mro__:
        if not getattr(klass, "__module__", "").startswith("accelerate"):
            continue
        for name, attr in vars(klass).items():
            if name.startswith("_") or name in out:
                continue
            if isinstance(attr, property):
                out[name] = {"kind": "property"}
            elif isinstance(attr, (staticmethod, classmethod)):
                out[name] = {"kind": type(attr).__name__, "parameters": _signature(attr.__func__)}
            elif inspect.isfunction(attr):
                params = _signature(attr)
                out[name] = {"kind": "method", "parameters": params[1:] if params else params}
    return dict(sorted(out.items()))


def _describe(obj: Any) -> dict[str, Any]:
    if inspect.isclass(obj):
        entry: dict[str, Any] = {"origin": f"{obj.__module__}.{obj.__qualname__}"}
        if issubclass(obj, enum.Enum):
            entry["kind"] = "enum"
            entry["members"] = {m.name: _json_value(m.value)[1] for m in obj}
            entry["bases"] = [b.__name__ for b in obj.__mro__[1:] if b not in (object,)]
            return entry
        if issubclass(obj, BaseException):
            entry["kind"] = "exception"
            entry["bases"] = [b.__name__ for b in obj.__mro__[1:]]
        elif issubclass(obj, Warning):
            entry["kind"] = "warning"
        else:
            entry["kind"] = "dataclass" if dataclasses.is_dataclass(obj) else "class"
        entry["parameters"] = _signature(obj)
        if dataclasses.is_dataclass(obj):
            entry["fields"] = [f.name for f in dataclasses.fields(obj)]
        entry["methods"] = _class_methods(obj)
        return entry
    if callable(obj) and _is_function(obj):
        return {
            "kind": "function",
            "origin": f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}",
            "parameters": _signature(obj),
        }
    ok, value = _json_value(obj)
    if ok:
        return {"kind": "constant", "value": value}
    entry = {"kind": "instance", "type": f"{type(obj).__module__}.{type(obj).__qualname__}"}
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        entry["keys"] = sorted(obj)
    if isinstance(obj, (list, tuple)) and obj and all(inspect.isclass(c) for c in obj):
        entry["classes"] = [f"{c.__module__}.{c.__qualname__}" for c in obj]
    if callable(obj):
        entry["parameters"] = _signature(obj)
    return entry


def _top_level_assignments(module: types.ModuleType) -> set[str]:
    """Return the names ``module`` binds by assignment at its top level (from its syntax tree)."""
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return set()
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        names.add(sub.id)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _is_value(obj: Any) -> bool:
    """Return True for a constant, a container, or an instance of an accelerate class (not a type alias)."""
    if inspect.isclass(obj) or _is_function(obj):
        return True  # judged by origin elsewhere
    if _json_value(obj)[0] or isinstance(obj, (dict, list, tuple, set, frozenset)):
        return True
    return str(type(obj).__module__).startswith("accelerate")


def _is_function(obj: Any) -> bool:
    """Return True for a function, including one wrapped by a decorator (``functools.cache``)."""
    return inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isfunction(inspect.unwrap(obj))


def _is_accelerate_object(obj: Any) -> bool:
    if inspect.ismodule(obj):
        return False
    if inspect.isclass(obj) or _is_function(obj):
        return str(getattr(obj, "__module__", "") or "").startswith("accelerate")
    return False


def record() -> dict[str, Any]:
    """Return the surface of the installed accelerate as a JSON-safe dict."""
    import accelerate

    modules: dict[str, types.ModuleType] = {}
    failed: dict[str, str] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in _module_names():
            try:
                modules[name] = importlib.import_module(name)
            except Exception as exc:  # an optional dependency missing: record it, do not guess
                failed[name] = f"{type(exc).__name__}: {exc}"
    # (name, id(value)) pairs that some accelerate module assigns itself.
    assigned: set[tuple[str, int]] = set()
    for module in modules.values():
        for name in _top_level_assignments(module):
            if hasattr(module, name):
                assigned.add((name, id(getattr(module, name))))
    out_modules: dict[str, Any] = {}
    for mod_name, module in sorted(modules.items()):
        names: dict[str, Any] = {}
        for name in sorted(vars(module)):
            if name.startswith("_") or name in SKIPPED_NAMES:
                continue
            obj = getattr(module, name)
            if inspect.ismodule(obj):
                continue
            if not (_is_accelerate_object(obj) or ((name, id(obj)) in assigned and _is_value(obj))):
                continue
            if (inspect.isclass(obj) or _is_function(obj)) and not _is_accelerate_object(obj):
                continue  # a type alias or a third-party class bound to a new name
            names[name] = _describe(obj)
            defined = getattr(obj, "__module__", None) == mod_name and not isinstance(obj, enum.Enum)
            names[name]["defined_here"] = bool(defined)
        out_modules[mod_name] = {"names": names}
    return {
        "accelerate_version": accelerate.__version__,
        "python": sys.version.split()[0],
        "note": "Generated by scripts/record_accelerate_surface.py; do not edit by hand.",
        "modules": out_modules,
        "modules_not_importable": failed,
        "public_names": {m: sorted(d["names"]) for m, d in out_modules.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    try:
        import accelerate  # noqa: F401
    except ImportError:
        parser.error("accelerate is not importable here; run with /work/.venv-accelerate/bin/python")
    data = record()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    total = sum(len(m["names"]) for m in data["modules"].values())
    sys.stderr.write(f"recorded {total} names in {len(data['modules'])} modules -> {args.out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
