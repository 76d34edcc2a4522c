"""scripts/count_any.py: the bare-Any ratio of annotated parameters, and the project's limit (12%)."""

from __future__ import annotations

import pathlib

from tests.script_loader import load_script

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _script():
    return load_script("count_any.py")


def test_counts_bare_any_only_and_keeps_variadic_apart(tmp_path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text(
        "import typing\n"
        "from typing import Any\n"
        "def f(a: Any, b: Any | None, c: list[Any], d: int, e, *args: Any, **kwargs: 'Any') -> Any: ...\n"
        "class C:\n"
        "    def m(self, x: typing.Any, y: 'Any') -> None: ...\n"
    )
    found = _script().count(package)
    named, named_bare = found["named"]
    variadic, variadic_bare = found["variadic"]
    assert (named, variadic) == (6, 2)  # e and self carry no annotation
    assert [entry.rsplit(" ", 1)[1] for entry in named_bare] == ["f(a)", "m(x)", "m(y)"]
    assert len(variadic_bare) == 2


def test_max_ratio_sets_the_exit_status(tmp_path, capsys) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text(
        "from typing import Any\ndef f(a: Any, b: int, c: int, d: int) -> None: ...\n"
    )
    script = _script()
    assert script.main([str(package), "--max-ratio", "0.25"]) == 0
    assert script.main([str(package), "--max-ratio", "0.2"]) == 1
    assert "bare Any 1 of 4 (25.0%)" in capsys.readouterr().out


def test_the_project_stays_at_or_under_twelve_percent(capsys) -> None:
    assert _script().main([str(ROOT / "notebook_accel"), "--max-ratio", "0.12"]) == 0, capsys.readouterr().out
