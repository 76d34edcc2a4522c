"""The big-model path stays light: it never loads the process state, the plugins or FSDP.

Big-model inference runs in one process: nothing on its path needs ``PartialState``. A top-level
import of ``utils.other`` (which reads the state) from a low module once pulled the state, the
plugins, ``torch.distributed.fsdp`` and sympy into every ``load_checkpoint_and_dispatch`` import
(~0.6 s on top of torch instead of ~0.02 s; benchmarks/bench_import.py measures it). Each check runs
in a fresh interpreter, since this test session has long imported everything.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# What the chain used to drag in; none of it belongs on the big-model path.
HEAVY = (
    "notebook_accel.state",
    "notebook_accel.utils.other",
    "notebook_accel.utils.plugins",
    "torch.distributed.fsdp",
    "sympy",
)

_REPORT = f"import json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"

# Import the whole big-model API, then use it: an empty model, a device map, CPU and disk offload,
# and a checkpoint loaded and dispatched with part of it on disk.
_USE_BIG_MODEL_API = """
import os, tempfile
import torch
from torch import nn
from safetensors.torch import save_file
from notebook_accel import (
    cpu_offload, disk_offload, dispatch_model, infer_auto_device_map, init_empty_weights,
    load_checkpoint_and_dispatch,
)

def net():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))

reference = net()
x = torch.randn(2, 4)
expected = reference(x)
with tempfile.TemporaryDirectory() as folder:
    checkpoint = os.path.join(folder, "model.safetensors")
    save_file(reference.state_dict(), checkpoint)
    with init_empty_weights():
        empty = net()
    assert infer_auto_device_map(empty, max_memory={"cpu": "1GB"}) == {"": "cpu"}
    device_map = {"0": "cpu", "1": "cpu", "2": "disk"}
    loaded = load_checkpoint_and_dispatch(
        empty, checkpoint, device_map=device_map, offload_folder=os.path.join(folder, "off")
    )
    assert torch.allclose(loaded(x), expected)
    assert torch.allclose(cpu_offload(reference)(x), expected)
    on_disk = disk_offload(net(), os.path.join(folder, "disk"))
    dispatched = dispatch_model(net(), device_map={"": "cpu"})
    on_disk(x), dispatched(x)
"""


def _loaded_after(code: str) -> list[str]:
    """Return the HEAVY modules a fresh interpreter has loaded after running ``code``."""
    out = subprocess.run(
        [sys.executable, "-c", code + "\n" + _REPORT], capture_output=True, text=True, cwd="/", timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_using_the_big_model_api_loads_no_state_plugins_or_fsdp() -> None:
    assert _loaded_after(_USE_BIG_MODEL_API) == []


@pytest.mark.parametrize(
    "statement",
    [
        "import notebook_accel.hooks, notebook_accel.big_modeling",
        # The utils facade resolves each modeling name from its topic module, not the utils.modeling face.
        "from notebook_accel.utils import (compute_module_sizes, get_balanced_memory, check_device_map,"
        " load_checkpoint_in_model, find_tied_parameters, set_module_tensor_to_device, clean_device_map,"
        " offload_state_dict, has_offloaded_params)",
        # The structure helpers the hooks use are named at their state-free home, not utils.operations.
        "from notebook_accel.utils import send_to_device, find_device, recursively_apply, find_batch_size",
    ],
)
def test_importing_hooks_and_modeling_names_loads_no_state(statement: str) -> None:
    assert _loaded_after(statement) == []


def test_names_served_lazily_are_the_utils_objects() -> None:
    # hooks and big_modeling serve recursive_getattr (Accelerate does) without importing utils.other.
    from notebook_accel import big_modeling, hooks
    from notebook_accel.utils import other

    assert hooks.recursive_getattr is other.recursive_getattr is big_modeling.recursive_getattr
    assert "recursive_getattr" in hooks.__all__ and "recursive_getattr" in big_modeling.__all__
