"""A prepared stateful loader's ``state_dict()`` is torchdata's, as 1.15's is: checkpoints resume both ways.

tests/data/loader_state_1_15.json (scripts/record_loader_state.py, run under the real 1.15 with
torchdata) holds, for 0 and 2 workers with and without dispatching, the ``state_dict()`` 1.15 returned
after 3 batches and the batches a fresh loader yielded after loading it. Ours returns the same keys and
values and nothing else (what we keep for exact resumption goes in ``resume_state()``), resumes 1.15's state
on the same batches, and (where the Accelerate interpreter is here) 1.15 resumes ours on them too.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.script_loader import load_script

pytest.importorskip("torchdata")

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "tests" / "data" / "loader_state_1_15.json").read_text(encoding="utf-8"))
RECORDER = load_script("record_loader_state.py")
ACCELERATE_PYTHON = os.environ.get("ACCELERATE_PYTHON") or str(ROOT / ".venv-accelerate" / "bin" / "python")
# Drawn afresh by every run (torch's worker base seed): compared as present, not as equal.
_RANDOM = "_base_seed"


def _without_random(value):
    if isinstance(value, dict):
        return {k: ("<random>" if k == _RANDOM else _without_random(v)) for k, v in value.items()}
    return value


def test_record_is_1_15s():
    assert RECORD["accelerate_version"].startswith("1.15") and len(RECORD["cases"]) == 4


@pytest.fixture(scope="module")
def ours() -> dict:
    return RECORDER.run(sys.executable, "notebook_accel", env={"PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("case", sorted(RECORD["cases"]))
def test_state_dict_is_torchdatas_as_1_15s(case, ours):
    assert _without_random(ours[case]["state"]) == _without_random(RECORD["cases"][case]["state"])
    assert ours[case]["resumed"] == RECORD["cases"][case]["resumed"]


def test_a_state_saved_by_1_15_resumes_here(tmp_path):
    states = tmp_path / "states.json"
    states.write_text(json.dumps({name: case["state"] for name, case in RECORD["cases"].items()}))
    got = RECORDER.run(sys.executable, "notebook_accel", str(states), env={"PYTHONPATH": str(ROOT)})
    assert got == {name: case["resumed"] for name, case in RECORD["cases"].items()}


@pytest.mark.skipif(not os.path.exists(ACCELERATE_PYTHON), reason="no Accelerate 1.15 interpreter here")
def test_a_state_saved_here_resumes_on_1_15(tmp_path, ours):
    states = tmp_path / "states.json"
    states.write_text(json.dumps({name: case["state"] for name, case in ours.items()}))
    got = RECORDER.run(ACCELERATE_PYTHON, "accelerate", str(states))
    assert got == {name: case["resumed"] for name, case in RECORD["cases"].items()}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("with_accelerator", [True, False], ids=["accelerator", "partial_state"])
def test_adapters_state_dict_equals_torchdatas_exactly(workers: int, with_accelerator: bool) -> None:
    """1.15's tests compare each adapter's state_dict() with torchdata's by ``==`` (0 and 2 workers, with an
    Accelerator and with the decoupled PartialState), then resume each from torchdata's state."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    from notebook_accel import Accelerator
    from notebook_accel.data_loader import DataLoaderDispatcher, DataLoaderShard, SkipDataLoader
    from notebook_accel.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    Accelerator(cpu=True) if with_accelerator else PartialState(cpu=True)
    data = list(range(40))

    def build(cls, **extra):
        kwargs = dict(batch_size=4, num_workers=workers, generator=torch.Generator().manual_seed(3))
        if cls is StatefulDataLoader:
            return cls(data, **kwargs)
        return cls(data, use_stateful_dataloader=True, **kwargs, **extra)

    def first(loader, n=5):
        got = []
        for batch in loader:
            got.append(batch.tolist())
            if len(got) == n:
                break
        return got

    reference = build(StatefulDataLoader)
    expected_batches = first(reference)
    expected = reference.state_dict()
    for cls in (SkipDataLoader, DataLoaderShard, DataLoaderDispatcher):
        loader = build(cls)
        assert first(loader) == expected_batches, cls.__name__
        assert loader.state_dict() == expected, cls.__name__
    rest = [batch.tolist() for batch in _loaded(build(StatefulDataLoader), expected)]
    assert rest == [list(range(i, i + 4)) for i in range(20, 40, 4)]
    for cls in (SkipDataLoader, DataLoaderShard, DataLoaderDispatcher):
        assert [batch.tolist() for batch in _loaded(build(cls), expected)] == rest, cls.__name__
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _loaded(loader, state):
    loader.load_state_dict(state)
    return loader


def test_base_dataloader_is_an_attribute_of_instances_only() -> None:
    from torch.utils.data import DataLoader

    from notebook_accel.data_loader import DataLoaderDispatcher, DataLoaderShard, SkipDataLoader

    for cls in (DataLoaderShard, DataLoaderDispatcher, SkipDataLoader):
        with pytest.raises(AttributeError, match=f"'{cls.__name__}' has no attribute 'base_dataloader'"):
            cls.base_dataloader  # noqa: B018
        assert not hasattr(cls, "base_dataloader")
    shard = DataLoaderShard(list(range(4)), batch_size=2)
    assert shard.base_dataloader is shard and isinstance(shard.base_dataloader, DataLoader)
    stateful = DataLoaderShard(list(range(4)), batch_size=2, use_stateful_dataloader=True)
    assert type(stateful.base_dataloader).__name__ == "StatefulDataLoader"
