"""The quick lane (``pytest -m quick``, tests/quick_lane.py) covers every package and holds a real launch."""

from __future__ import annotations

import ast
import pathlib

import pytest

import notebook_accel
from tests import quick_lane

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs tomllib (3.11) or tomli")

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def _packages() -> set[str]:
    """The source tree's packages: notebook_accel's subpackages and public top-level modules, and the
    packages pyproject maps from folders of their own (``widgets``)."""
    source = ROOT / "notebook_accel"
    names = {p.name for p in source.iterdir() if (p / "__init__.py").is_file()}
    names |= {p.stem for p in source.glob("*.py") if not p.stem.startswith("_")}
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    names |= {name.split(".", 1)[1] for name in package_dir if name != "notebook_accel"}
    return names


def _imported_packages(tree: ast.AST) -> set[str]:
    """The packages of notebook_accel a test module imports anywhere (a top-level name counts for the
    package the lazy table loads it from)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            if node.module == "notebook_accel":
                for alias in node.names:
                    lazy = notebook_accel._TABLE.get(alias.name, "." + alias.name)
                    found.add(lazy.lstrip(".").split(".")[0])
        else:
            continue
        found |= {m.split(".")[1] for m in modules if m.startswith("notebook_accel.")}
    return found


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def _parse(module: str) -> ast.Module:
    path = TESTS / f"{module}.py"
    assert path.is_file(), f"tests/quick_lane.py names {module!r}, but there is no {path}"
    return ast.parse(path.read_text())


def test_every_package_of_the_source_tree_has_quick_tests() -> None:
    packages = _packages()
    assert {"utils", "launch", "nodes", "interactive", "widgets", "launchers", "commands"} <= packages
    missing = sorted(packages - set(quick_lane.QUICK))
    assert not missing, (
        f"packages with no quick test (add their unit tests to tests/quick_lane.py): {missing}"
    )
    stale = sorted(set(quick_lane.QUICK) - packages)
    assert not stale, f"tests/quick_lane.py names packages the source tree lacks: {stale}"


def test_each_entry_exists_and_imports_its_package() -> None:
    for package, entries in quick_lane.QUICK.items():
        assert entries, f"{package}: no quick entry"
        for entry in entries:
            module, _, function = entry.partition("::")
            tree = _parse(module)
            if function:
                assert function in _functions(tree), f"{entry}: no such test function"
                assert quick_lane.is_quick(module, function)
            else:
                assert any(name.startswith("test_") for name in _functions(tree)), f"{entry}: no test"
            assert package in _imported_packages(tree), f"{entry} does not import notebook_accel's {package}"


def _launches_two_ranks(function: ast.FunctionDef) -> bool:
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "notebook_launcher":
            counts = [k.value for k in node.keywords if k.arg == "num_processes"]
            if counts and isinstance(counts[0], ast.Constant) and counts[0].value >= 2:
                return True
    return False


def test_the_lane_holds_a_real_multi_process_launch() -> None:
    module, _, function = quick_lane.QUICK_LAUNCH.partition("::")
    test = _functions(_parse(module)).get(function)
    assert test is not None, f"QUICK_LAUNCH names no test: {quick_lane.QUICK_LAUNCH}"
    assert _launches_two_ranks(test), (
        f"{quick_lane.QUICK_LAUNCH} calls no notebook_launcher(num_processes>=2)"
    )
    assert quick_lane.is_quick(module, function)


class _Item:
    def __init__(self, nodeid: str, slow: bool = False) -> None:
        self.nodeid, self.slow, self.markers = nodeid, slow, []

    def get_closest_marker(self, name: str):
        return object() if name == "slow" and self.slow else None

    def add_marker(self, marker) -> None:
        self.markers.append(marker.name)


def test_conftest_marks_the_lane_by_the_rule(request) -> None:
    from tests.conftest import _mark_quick

    module, _, function = quick_lane.QUICK_LAUNCH.partition("::")
    items = [
        _Item(f"tests/{module}.py::{function}"),
        _Item(f"tests/{module}.py::test_not_in_the_table"),
        _Item("tests/test_state.py::test_anything[param]"),
        _Item("tests/test_state.py::test_anything", slow=True),
        _Item("notebooks/quickstart.ipynb::Cell 0"),
    ]
    _mark_quick(items)
    assert [item.markers for item in items] == [["quick"], [], ["quick"], [], []]
    # In a session that collected the launch (the whole suite, `-m quick`), conftest marked it.
    for item in request.session.items:
        if item.nodeid == f"tests/{module}.py::{function}":
            assert item.get_closest_marker("quick") is not None
