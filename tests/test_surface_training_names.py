"""Accelerate 1.15's smaller training-side names: tracker registry, state helpers, optimizer and loader pieces."""

from __future__ import annotations

import sys
import threading
import types

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

from notebook_accel.data_loader import DataLoaderAdapter, DataLoaderShard, DataLoaderStateMixin, get_sampler
from notebook_accel.optimizer import AcceleratedOptimizer, move_to_device, patch_optimizer_step
from notebook_accel.state import (
    AcceleratorState,
    GradientState,
    PartialState,
    ThreadLocalSharedDict,
    do_nothing,
    is_initialized,
)
from notebook_accel.tracking import (
    GeneralTracker,
    MLflowTracker,
    filter_trackers,
    get_available_trackers,
    on_main_process,
    register_tracker_class,
)
from notebook_accel.utils.dataclasses import get_module_class_from_name
from notebook_accel.utils.enums import LoggerType


class _MyTracker(GeneralTracker):
    name = "my_tracker_for_tests"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs) -> None:
        super().__init__()
        self.run_name, self.logged = run_name, []

    @property
    def tracker(self):
        return self

    def log(self, values, step=None, **kwargs) -> None:
        self.logged.append((values, step))


def test_register_tracker_class_makes_the_name_usable(monkeypatch) -> None:
    import notebook_accel.tracking as tracking

    monkeypatch.setattr(tracking, "LOGGER_TYPE_TO_CLASS", dict(tracking.LOGGER_TYPE_TO_CLASS))  # no leak
    with pytest.raises(ValueError, match="not a known tracker"):
        filter_trackers("my_tracker_for_tests")
    register_tracker_class(_MyTracker)
    assert filter_trackers("my_tracker_for_tests") == ["my_tracker_for_tests"]

    class Nameless(GeneralTracker):
        name = ""
        requires_logging_directory = False

    with pytest.raises(ValueError, match="Nameless needs a non-empty `name`"):
        register_tracker_class(Nameless)
    with pytest.raises(ValueError, match="takes a subclass of GeneralTracker, got <class 'int'>"):
        register_tracker_class(int)


def test_available_trackers_follow_installed_packages(monkeypatch) -> None:
    import notebook_accel.tracking as tracking

    monkeypatch.setattr(tracking, "is_package_available", lambda name: name in ("wandb", "mlflow"))
    assert tracking.get_available_trackers() == [LoggerType.WANDB, LoggerType.MLFLOW]
    assert all(isinstance(t, LoggerType) for t in get_available_trackers())


def test_on_main_process_skips_other_processes(monkeypatch) -> None:
    class Tracker:
        main_process_only = True

        @on_main_process
        def log(self, value):
            return value * 2

    PartialState()
    assert Tracker().log(2) == 4
    monkeypatch.setitem(PartialState._shared_state, "process_index", 1)
    assert Tracker().log(2) is None
    everywhere = Tracker()
    everywhere.main_process_only = False
    assert everywhere.log(2) == 4


def test_mlflow_tracker_takes_the_1_15_arguments(monkeypatch) -> None:
    calls = {}
    fake = types.ModuleType("mlflow")
    fake.set_tracking_uri = lambda uri: calls.setdefault("uri", uri)
    fake.get_experiment_by_name = lambda name: None
    fake.create_experiment = lambda name: calls.setdefault("created", name) and "exp-1"
    fake.start_run = lambda **kwargs: calls.setdefault("run", kwargs)
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    monkeypatch.setenv("MLFLOW_TAGS", '{"team": "a"}')
    tracker = MLflowTracker("proj", logging_dir="/tmp/ml", run_name="r1", nested_run=True, description="d")
    assert calls == {}  # built, not started: MLflow is not touched before start() (as 1.15)
    tracker.start()
    assert calls["uri"] == "/tmp/ml" and calls["created"] == "proj" and tracker.run_name == "r1"
    assert calls["run"] == {
        "run_id": None,
        "experiment_id": "exp-1",
        "run_name": "r1",
        "nested": True,
        "tags": {"team": "a"},
        "description": "d",
    }
    monkeypatch.setenv("MLFLOW_TAGS", "not json")
    with pytest.raises(ValueError, match="tags must be a dict or its JSON text, got 'not json'"):
        MLflowTracker("proj")


def test_state_helpers() -> None:
    class Shared:
        _shared_state = ThreadLocalSharedDict()

    class PerThread:
        _shared_state = ThreadLocalSharedDict(thread_local=True)

    Shared()._shared_state["a"] = 1
    PerThread()._shared_state["b"] = 2
    seen = []
    thread = threading.Thread(
        target=lambda: seen.append((dict(Shared._shared_state), dict(PerThread._shared_state)))
    )
    thread.start()
    thread.join()
    assert seen == [({"a": 1}, {})] and PerThread._shared_state == {"b": 2}
    replaced = Shared()
    replaced._shared_state = {"c": 3}
    assert Shared._shared_state == {"c": 3}
    assert do_nothing(1, k=2) is None
    assert not is_initialized()
    AcceleratorState(cpu=True)
    assert is_initialized()


def test_optimizer_helpers() -> None:
    state = {"state": {0: {"exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 0.1}]}
    moved = move_to_device(state, "meta")
    assert moved["state"][0]["exp_avg"].device.type == "meta" and moved["param_groups"] == [{"lr": 0.1}]
    AcceleratorState(cpu=True)
    model = torch.nn.Linear(1, 1)
    wrapped = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    wrapped._accelerate_step_called = False
    step = patch_optimizer_step(wrapped, wrapped.optimizer.step)
    model(torch.ones(1)).sum().backward()
    assert step(lambda: 3.0) == 3.0  # what the real step returns (SGD: the closure's loss)
    assert wrapped._accelerate_step_called and step.__name__ == "step"


def test_loader_pieces() -> None:
    data = list(range(10))
    adapter = DataLoaderAdapter(data, batch_size=4)
    assert isinstance(adapter, DataLoader) and [len(b) for b in adapter] == [4, 4, 2] and len(adapter) == 3
    with pytest.raises(ValueError, match="use_stateful_dataloader=True"):
        adapter.state_dict()
    sampler = RandomSampler(data)
    assert get_sampler(DataLoader(data, sampler=sampler, batch_size=2)) is sampler
    assert issubclass(DataLoaderShard, DataLoaderStateMixin)

    class Custom(DataLoaderStateMixin):
        _drop_last = True

        def __init__(self) -> None:
            self.gradient_state = GradientState()

    loader = Custom()
    loader.begin()
    assert loader.gradient_state.active_dataloader is loader and loader.remainder == -1
    loader.end_of_dataloader = True
    loader.reset()
    assert loader.end_of_dataloader is False
    loader.end()
    assert loader.gradient_state.active_dataloader is None


def test_stateful_adapter_names_torchdata_when_missing() -> None:
    pytest.importorskip("torch")
    try:
        import torchdata.stateful_dataloader  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install 'torchdata>=0.8.0'"):
            DataLoaderAdapter(list(range(4)), use_stateful_dataloader=True, batch_size=2)
        return
    adapter = DataLoaderAdapter(list(range(8)), use_stateful_dataloader=True, batch_size=2)
    iterator = iter(adapter)
    next(iterator)
    resumed = DataLoaderAdapter(list(range(8)), use_stateful_dataloader=True, batch_size=2)
    resumed.load_state_dict(adapter.state_dict())
    assert [b.tolist() for b in resumed] == [[2, 3], [4, 5], [6, 7]]


def test_get_module_class_from_name() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Sequential(torch.nn.GELU()))
    assert get_module_class_from_name(model, "GELU") is torch.nn.GELU
    assert get_module_class_from_name(model, "Sequential") is torch.nn.Sequential
    assert get_module_class_from_name(model, "Conv2d") is None


def test_load_accelerator_state_passes_load_kwargs(tmp_path, monkeypatch) -> None:
    import notebook_accel.checkpointing as checkpointing
    from notebook_accel.checkpointing import load_accelerator_state, save_accelerator_state

    PartialState()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_accelerator_state(tmp_path, [model], [optimizer], [], [], 0, step=3)
    seen = []
    original = checkpointing.load

    def spy(path, map_location=None, **kwargs):
        seen.append(kwargs)
        return original(path, map_location=map_location, **kwargs)

    monkeypatch.setattr(checkpointing, "load", spy)
    out = load_accelerator_state(tmp_path, [model], [optimizer], [], [], 0, load_kwargs={"mmap": True})
    assert out["step"] == 3 and seen and all(kwargs == {"mmap": True} for kwargs in seen)
    with pytest.raises(ValueError, match="weights_only=True only"):
        load_accelerator_state(tmp_path, [model], [optimizer], [], [], 0, load_kwargs={"weights_only": False})
