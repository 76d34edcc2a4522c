"""The process state stays light: importing it loads no engine integration and not FSDP.

``notebook_accel.state`` is imported by every launched worker and by ``Accelerator``; the engines
(DeepSpeed, Megatron-LM, FSDP, bitsandbytes, fp8, XLA) live in ``notebook_accel.integrations`` and
load when a plugin asks for them. The plugins module the state reads once imported the DeepSpeed and
FSDP plugins, and with them ``torch.distributed.fsdp``, DTensor and sympy (seconds of import; see
benchmarks/bench_import.py). Each check runs in a fresh interpreter: this session imported them all.
"""

from __future__ import annotations

import pytest

from tests.import_probe import modules_after

FORBIDDEN_PREFIXES = (
    "notebook_accel.integrations",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "sympy",
)


def _loaded_after(code: str) -> list[str]:
    return sorted(m for m in modules_after(code) if m.startswith(FORBIDDEN_PREFIXES))


@pytest.mark.parametrize(
    "code",
    [
        "import notebook_accel.state",
        "from notebook_accel.state import AcceleratorState, PartialState; PartialState()",
        "from notebook_accel import Accelerator; Accelerator(cpu=True)",
    ],
)
def test_state_and_accelerator_load_no_engine(code: str) -> None:
    assert _loaded_after(code) == []


def test_an_fsdp_plugin_loads_its_engine() -> None:
    # The other side of the same fact: the engine does load when a plugin asks for it.
    loaded = _loaded_after(
        "from notebook_accel.utils import FullyShardedDataParallelPlugin; FullyShardedDataParallelPlugin()"
    )
    assert "notebook_accel.integrations.fsdp.plugin" in loaded
    assert "torch.distributed.fsdp" in loaded
