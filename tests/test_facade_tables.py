"""Every lazy facade's table is built from its modules' ``__all__``.

A facade (``notebook_accel``, ``notebook_accel.utils``, the Accelerate-path faces...) names a public
name once, pointing at the module that defines and exports it; that module's ``__all__`` is the other
place the name is written. The faces that serve a whole module (``_lazy.forward``: ``utils.deepspeed``,
``utils.dataclasses``...) write no name at all. These checks import every facade (registering its table in
``_lazy.TABLES`` / ``_lazy.FORWARDS``) and read the modules' ``__all__``.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path

import pytest

import notebook_accel
from notebook_accel import _lazy


def _import_everything() -> None:
    for info in pkgutil.walk_packages(notebook_accel.__path__, "notebook_accel."):
        importlib.import_module(info.name)
    importlib.import_module("notebook_accel.widgets")


_import_everything()
ENTRIES = sorted(
    (package, name, module) for package, table in _lazy.TABLES.items() for name, module in table.items()
)


def _public(module_name: str, package: str) -> list[str]:
    return list(getattr(importlib.import_module(module_name, package), "__all__", ()))


def test_every_facade_registered_a_table() -> None:
    for facade in (
        "notebook_accel",
        "notebook_accel.utils",
        "notebook_accel.accelerator",
        "notebook_accel.widgets",
    ):
        assert facade in _lazy.TABLES
    for face in (
        "notebook_accel.utils.deepspeed",
        "notebook_accel.utils.dataclasses",
        "notebook_accel.utils.bnb",
    ):
        assert face in _lazy.FORWARDS


@pytest.mark.parametrize(("package", "name", "module"), ENTRIES, ids=[f"{p}.{n}" for p, n, _ in ENTRIES])
def test_table_entry_is_in_its_modules_all(package: str, name: str, module: str) -> None:
    assert name in _public(module, package), f"{package} serves {name} from {module}, whose __all__ lacks it"


def test_forward_faces_serve_exactly_their_targets_all() -> None:
    for face, targets in _lazy.FORWARDS.items():
        served = set(importlib.import_module(face).__all__)
        parent = face.rpartition(".")[0]
        assert served == {name for target in targets for name in _public(target, parent)}, face


PUBLIC_FACADES = ("notebook_accel", "notebook_accel.utils")


def _recorded_paths() -> dict[str, set[str]]:
    """Return name -> the notebook_accel paths at which Accelerate 1.15 serves it (tests/data)."""
    surface = json.loads(
        (Path(__file__).parent / "data" / "accelerate_surface.json").read_text(encoding="utf-8")
    )
    paths: dict[str, set[str]] = {}
    for module, record in surface["modules"].items():
        for name in record.get("names", record):
            paths.setdefault(name, set()).add("notebook_accel" + module[len("accelerate") :])
    return paths


def test_a_name_is_written_in_one_table_per_accelerate_path() -> None:
    # A name served by two tables is only there because Accelerate serves it at both paths (our two public
    # facades, notebook_accel and notebook_accel.utils, list API.md's names, a few beyond Accelerate's).
    # A module is offered at its own path and, behind a forward() face, at the face's path too.
    paths_of: dict[str, set[str]] = {}
    for face, targets in _lazy.FORWARDS.items():
        for target in targets:
            module = importlib.import_module(target, face.rpartition(".")[0]).__name__
            paths_of.setdefault(module, {module}).add(face)
    tables: dict[tuple[str, str], list[str]] = {}
    for package, name, module in ENTRIES:
        tables.setdefault((name, importlib.import_module(module, package).__name__), []).append(package)
    recorded = _recorded_paths()
    extra = {
        key: packages
        for key, packages in tables.items()
        if len(packages) > 1
        and not all(
            p in PUBLIC_FACADES or paths_of.get(p, {p}) & recorded.get(key[0], set()) for p in packages
        )
    }
    assert extra == {}
