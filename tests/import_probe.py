"""What a fresh interpreter has imported after running a snippet (the import-laziness tests share it)."""

from __future__ import annotations

import json
import subprocess
import sys


def modules_after(code: str) -> set[str]:
    """Run ``code`` in a fresh interpreter and return the names in its ``sys.modules`` afterwards."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))
