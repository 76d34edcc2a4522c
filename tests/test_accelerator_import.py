"""``Accelerator(cpu=True)`` loads the modules it does not use only when they are first used.

Creating an Accelerator is the first line of every training script (and of every launched worker);
``notebook_accel.data_loader`` (samplers, dispatch, stateful loaders), ``notebook_accel.tracking`` (nine
tracker services and their package probes), ``utils.operations`` (the collectives and the nested-structure
helpers), ``utils.other`` (the file writers) and ``utils.kwargs`` (the handlers) were over half of what
that line imported after torch (issue 21, benchmarks/bench_import.py). They now load when a DataLoader is
prepared (or skipped into), a tracker is named, a tensor is first gathered, reduced, moved or cast, at the
first save or unwrap, and when a kwargs handler is passed. Each check runs in a fresh interpreter: this
session has imported them all.
"""

from __future__ import annotations

import pytest

from tests.import_probe import modules_after

LOADERS, TRACKERS, OTHER = (
    "notebook_accel.data_loader",
    "notebook_accel.tracking",
    "notebook_accel.utils.other",
)
OPERATIONS = ("notebook_accel.utils._ops_structure", "notebook_accel.utils.operations")
KWARGS = "notebook_accel.utils.kwargs"
WATCHED = (LOADERS, TRACKERS, OTHER, KWARGS, *OPERATIONS)


def _loaded_after(code: str) -> list[str]:
    """Return which of WATCHED (a package with its submodules) a fresh interpreter running ``code`` loaded."""
    loaded = modules_after(code)
    return sorted({w for w in WATCHED for m in loaded if m == w or m.startswith(w + ".")})


@pytest.mark.parametrize(
    "code",
    [
        "import notebook_accel.accelerator",
        "from notebook_accel import Accelerator; Accelerator(cpu=True)",
        # a model and an optimizer need neither; no tracker is started when none was named
        "import torch\nfrom notebook_accel import Accelerator\na = Accelerator(cpu=True)\n"
        "m = torch.nn.Linear(2, 2)\na.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))\n"
        "a.init_trackers('p'); a.log({'x': 1.0}); a.end_training()",
    ],
)
def test_accelerator_loads_none_of_them(code: str) -> None:
    assert _loaded_after(code) == []


def test_preparing_a_data_loader_loads_the_data_loaders() -> None:
    code = (
        "import torch\nfrom notebook_accel import Accelerator\na = Accelerator(cpu=True)\n"
        "dl = a.prepare(torch.utils.data.DataLoader(list(range(6)), batch_size=2))\n"
        "assert type(dl).__name__ == 'DataLoaderShard', type(dl)\n"
        "assert [b.tolist() for b in dl] == [[0, 1], [2, 3], [4, 5]]\n"
        "assert [b.tolist() for b in a.skip_first_batches(dl, 2)] == [[4, 5]]"
    )
    assert _loaded_after(code) == sorted([LOADERS, *OPERATIONS])  # the loaders use the tensor operations


def test_naming_a_tracker_loads_the_trackers(tmp_path) -> None:
    code = (
        "from notebook_accel import Accelerator\n"
        f"a = Accelerator(cpu=True, log_with='jsonl', project_dir={str(tmp_path)!r})\n"
        "assert a.log_with == ['jsonl'], a.log_with"
    )
    assert "notebook_accel.tracking" in _loaded_after(code)


def test_the_accelerator_path_still_serves_the_moved_names() -> None:
    # accelerate.accelerator serves these names; here they resolve at first look-up, to the same objects.
    code = (
        "import notebook_accel.accelerator as acc\n"
        "import notebook_accel.data_loader as dl, notebook_accel.tracking as tr\n"
        "for name in ('skip_first_batches', 'DataLoaderDispatcher', 'prepare_data_loader'):\n"
        "    assert getattr(acc, name) is getattr(dl, name), name\n"
        "for name in ('GeneralTracker', 'filter_trackers', 'LOGGER_TYPE_TO_CLASS'):\n"
        "    assert getattr(acc, name) is getattr(tr, name), name"
    )
    assert _loaded_after(code) == sorted([LOADERS, TRACKERS, *OPERATIONS])


def test_a_collective_loads_the_tensor_operations() -> None:
    code = (
        "import torch\nfrom notebook_accel import Accelerator\na = Accelerator(cpu=True)\n"
        "assert a.gather(torch.arange(3)).tolist() == [0, 1, 2]\n"
        "assert a.reduce(torch.ones(2), reduction='sum').tolist() == [1.0, 1.0]"
    )
    assert _loaded_after(code) == sorted(OPERATIONS)


def test_saving_loads_the_file_writers(tmp_path) -> None:
    code = (
        "import torch\nfrom notebook_accel import Accelerator\na = Accelerator(cpu=True)\n"
        f"a.save({{'w': torch.ones(2)}}, {str(tmp_path / 'w.pt')!r})\n"
        f"assert torch.load({str(tmp_path / 'w.pt')!r})['w'].tolist() == [1.0, 1.0]\n"
        "assert a.unwrap_model(torch.nn.Linear(1, 1)).in_features == 1"
    )
    assert OTHER in _loaded_after(code)


def test_a_kwargs_handler_loads_the_handlers() -> None:
    # The plugins the state reads share only the handlers' base class (utils._kwargs_base).
    code = (
        "from notebook_accel import Accelerator\nfrom notebook_accel.utils import GradScalerKwargs\n"
        "a = Accelerator(cpu=True, kwargs_handlers=[GradScalerKwargs(init_scale=8.0)])\n"
        "assert a.scaler_handler.to_kwargs() == {'init_scale': 8.0}\n"
        "import notebook_accel.accelerator as acc, notebook_accel.utils.kwargs as kw\n"
        "assert acc.ProfileKwargs is kw.ProfileKwargs and acc.KwargsHandler is kw.KwargsHandler"
    )
    assert KWARGS in _loaded_after(code)


def test_init_kwargs_for_an_unnamed_tracker_still_fail() -> None:
    from notebook_accel import Accelerator

    accelerator = Accelerator(cpu=True)
    with pytest.raises(ValueError, match=r"init_kwargs names trackers \['wandb'\] that are not in log_with"):
        accelerator.init_trackers("p", init_kwargs={"wandb": {}})


def test_an_unknown_tracker_name_still_fails_at_construction() -> None:
    from notebook_accel import Accelerator

    with pytest.raises(ValueError, match="log_with='no-such-tracker' is not a known tracker"):
        Accelerator(cpu=True, log_with="no-such-tracker")
