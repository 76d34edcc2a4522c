"""Load one of ``scripts/`` as a module, for tests that reuse a recorder's or checker's functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(filename: str) -> ModuleType:
    """Return ``scripts/<filename>`` executed as a module (named after the file, prefixed with ``_``).

    As when the script runs, scripts/ is on ``sys.path`` meanwhile, so its ``import _recorder`` works.
    """
    spec = importlib.util.spec_from_file_location(f"_{Path(filename).stem}", SCRIPTS / filename)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module
