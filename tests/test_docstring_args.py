"""Every public function or class of ``notebook_accel`` and ``notebook_accel.utils`` taking 3 or more
parameters says what each one is: an ``Args:`` section in its docstring (rendered by napoleon in the
API reference), or, for a dataclass, a docstring under each of its fields (autodoc renders those;
an Args section would say each thing twice). Enums are left out: their call signature is the Enum
functional API, not ours.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import inspect
import textwrap

PACKAGES = ("notebook_accel", "notebook_accel.utils")


def _documented_fields(cls: type) -> set[str]:
    """Return the names of the fields that have a docstring under them, in ``cls`` or a base class."""
    names: set[str] = set()
    for klass in cls.__mro__:
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for statement, following in zip(body, body[1:]):
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                names.add(statement.target.id)
    return names


def _lacks_args(obj: object) -> bool:
    if "Args:" in (inspect.getdoc(obj) or ""):
        return False
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        fields = {f.name for f in dataclasses.fields(obj) if f.init}
        return not fields <= _documented_fields(obj)
    return True


def _public_callables() -> dict[str, object]:
    found: dict[str, object] = {}
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if inspect.isclass(obj) and issubclass(obj, enum.Enum):
                continue
            try:
                parameters = inspect.signature(obj).parameters
            except (TypeError, ValueError):
                continue
            if len([p for p in parameters if p not in ("self", "cls")]) >= 3:
                found[f"{package}.{name}"] = obj
    return found


def test_the_public_names_are_many_enough_to_mean_something() -> None:
    assert len(_public_callables()) >= 60  # the check below would pass vacuously on an empty surface


def test_every_public_callable_with_three_or_more_parameters_documents_them() -> None:
    lacking = sorted(name for name, obj in _public_callables().items() if _lacks_args(obj))
    assert not lacking, f"add an Args: section (or field docstrings) to: {lacking}"


def test_the_check_notices_a_missing_section() -> None:
    def undocumented(a: int, b: int, c: int) -> None:
        """Do a thing."""

    @dataclasses.dataclass
    class HalfDocumented:
        first: int = 0
        """Documented."""
        second: int = 0

    assert _lacks_args(undocumented) and _lacks_args(HalfDocumented)
    undocumented.__doc__ += "\n\nArgs:\n    a: one.\n"
    assert not _lacks_args(undocumented)


def _listed_in_args(doc: str) -> list[str]:
    section = doc.split("Args:", 1)[1]
    entries = []
    for line in section.splitlines():
        if line.startswith("    ") and not line.startswith("     ") and ":" in line:
            head = line.strip().split(":", 1)[0].split(" (", 1)[0]  # "name (type)" or "a, b" (grouped)
            entries += [part.strip().lstrip("*\\") for part in head.split(",")]
        elif line.strip() and not line.startswith(" "):
            break  # the next section
    return entries


def test_args_sections_name_real_parameters() -> None:
    for name, obj in _public_callables().items():
        doc = inspect.getdoc(obj) or ""
        if "Args:" not in doc:
            continue
        parameters = [p for p in inspect.signature(obj).parameters if p not in ("self", "cls")]
        stray = [entry for entry in _listed_in_args(doc) if entry not in parameters]
        assert not stray, f"{name}'s Args: lists {stray}, which are not among its parameters {parameters}"
