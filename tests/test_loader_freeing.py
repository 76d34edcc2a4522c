"""A prepared loader with a live iterator is freed with its owner, by reference counting alone.

After ``del`` of an object holding the Accelerator, a prepared loader and an iterator over it, weak
references to the Accelerator, the loader and its ``GradientState`` are dead with the garbage collector
disabled (no cycle or registry keeps them), as under Accelerate 1.15. Runs in a fresh interpreter so
the collector can stay off and nothing of this test process holds on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = """
import gc, json, sys, weakref
gc.disable()
from torch.utils.data import DataLoader
import notebook_accel as na

class Holder:
    def __init__(self, dispatch, stateful):
        config = na.DataLoaderConfiguration(dispatch_batches=dispatch, use_stateful_dataloader=stateful)
        self.acc = na.Accelerator(cpu=True, dataloader_config=config)
        self.loader = self.acc.prepare(DataLoader(list(range(8)), batch_size=2))
        self.it = iter(self.loader)
        next(self.it)

holder = Holder(sys.argv[1] == "dispatch", sys.argv[2] == "stateful")
refs = {"accelerator": weakref.ref(holder.acc), "loader": weakref.ref(holder.loader),
        "gradient_state": weakref.ref(holder.loader.gradient_state)}
del holder
print(json.dumps({name: ref() is None for name, ref in refs.items()}))
"""


@pytest.mark.parametrize("stateful", ["plain", "stateful"])
@pytest.mark.parametrize("dispatch", ["shard", "dispatch"])
def test_the_owner_takes_the_loader_its_iterator_and_state_with_it(dispatch, stateful):
    if stateful == "stateful":
        pytest.importorskip("torchdata")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, dispatch, stateful], capture_output=True, text=True,
                          timeout=240, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    freed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert freed == {"accelerator": True, "loader": True, "gradient_state": True}
