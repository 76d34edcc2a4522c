"""Report which recorded Accelerate 1.15 class methods differ from ours (tests/test_accelerate_methods.py checks them).

tests/data/accelerate_surface.json records, for every class Accelerate defines, its public methods and
properties (``methods``). This compares them with our classes at the same paths, for the names the
surface test checks (not excluded, not pending), each class once (where Accelerate defines it):

    python scripts/report_method_signatures.py        # counts and a few examples
    python scripts/report_method_signatures.py -v     # every difference

"missing" means no class attribute of that name: a name we set per instance in ``__init__`` (e.g.
``GradientState.active_dataloader``) is counted as missing although instances have it.
"""

from __future__ import annotations

import collections
import fnmatch
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_accelerate_methods import (  # noqa: E402
    METHODS_EXCLUDED,
    checked_classes,
    class_attr,
    member_difference,
)


def main(verbose: bool) -> None:
    counts: collections.Counter = collections.Counter()
    per_class: collections.Counter = collections.Counter()
    lines = []
    classes = checked_classes()
    for module, name, entry, cls in classes:
        for method, recorded in entry["methods"].items():
            counts["recorded"] += 1
            problem = member_difference(recorded, class_attr(cls, method))
            if problem is not None and any(
                fnmatch.fnmatchcase(f"{module}.{name}.{method}", p) for p in METHODS_EXCLUDED
            ):
                counts["excluded"] += 1
                continue
            if problem is None:
                counts["same"] += 1
                continue
            counts["missing" if problem == "missing" else "different"] += 1
            per_class[f"{module}.{name}"] += 1
            lines.append(f"  {module}.{name}.{method}: {problem}")
    print(
        f"methods and properties recorded on {len(classes)} checked classes: "
        + ", ".join(f"{k} {v}" for k, v in counts.items())
    )
    print(f"classes with at least one difference: {len(per_class)}; most: {per_class.most_common(6)}")
    print(
        "\n".join(
            lines
            if verbose
            else lines[:10] + ([f"  ... ({len(lines) - 10} more, -v)"] if len(lines) > 10 else [])
        )
    )


if __name__ == "__main__":
    main("-v" in sys.argv)
