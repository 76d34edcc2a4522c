"""Load one of ``scripts/`` as a module, for tests that reuse a recorder's or checker's functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(filename: str) -> ModuleType:
    """Return ``scripts/<filename>`` executed as a module (named after the file, prefixed with ``_``)."""
    spec = importlib.util.spec_from_file_location(f"_{Path(filename).stem}", SCRIPTS / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
