"""register_tracker_class as Accelerate 1.15 has it: the class joins LOGGER_TYPE_TO_CLASS, log_with= chooses it
by name, a class that is no tracker or has no name is refused with ValueError, and replacing a name warns."""

from __future__ import annotations

import warnings

import pytest

import notebook_accel.tracking as tracking
from notebook_accel import Accelerator
from notebook_accel.tracking import GeneralTracker, register_tracker_class


@pytest.fixture(autouse=True)
def _own_registry(monkeypatch):
    """Each test registers into a copy of the table, so no name leaks into other tests."""
    monkeypatch.setattr(tracking, "LOGGER_TYPE_TO_CLASS", dict(tracking.LOGGER_TYPE_TO_CLASS))


class ListTracker(GeneralTracker):
    name = "list_tracker"
    requires_logging_directory = False
    runs: list[ListTracker] = []

    def __init__(self, run_name: str, **kwargs) -> None:
        super().__init__()
        self.run_name, self.kwargs, self.config, self.logged = run_name, kwargs, None, []
        ListTracker.runs.append(self)

    @property
    def tracker(self):
        return self.logged

    def store_init_configuration(self, values) -> None:
        self.config = dict(values)

    def log(self, values, step=None, **kwargs) -> None:
        self.logged.append((dict(values), step))


def test_a_registered_tracker_is_listed_and_chosen_by_name_in_log_with() -> None:
    assert "list_tracker" not in tracking.LOGGER_TYPE_TO_CLASS
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a new name warns nothing
        register_tracker_class(ListTracker)
    assert tracking.LOGGER_TYPE_TO_CLASS["list_tracker"] is ListTracker

    ListTracker.runs.clear()
    accelerator = Accelerator(cpu=True, log_with="list_tracker")
    accelerator.init_trackers("proj", config={"lr": 0.5}, init_kwargs={"list_tracker": {"tag": "a"}})
    accelerator.log({"loss": 1.25}, step=3)
    (run,) = ListTracker.runs
    assert (run.run_name, run.kwargs, run.config) == ("proj", {"tag": "a"}, {"lr": 0.5})
    assert run.logged == [({"loss": 1.25}, 3)]
    assert accelerator.get_tracker("list_tracker", unwrap=True) is run.logged
    accelerator.end_training()


def test_a_registered_class_replaces_a_built_in_name_without_its_package(monkeypatch) -> None:
    monkeypatch.setattr(tracking, "is_package_available", lambda name: False)

    class NotMlflow(ListTracker):
        name = "mlflow"

    with pytest.warns(
        UserWarning, match="tracker name 'mlflow' was MLflowTracker; .*now chooses .*NotMlflow"
    ):
        register_tracker_class(NotMlflow)
    ListTracker.runs.clear()
    accelerator = Accelerator(cpu=True, log_with="mlflow")
    accelerator.init_trackers("p")
    assert [type(run) for run in ListTracker.runs] == [NotMlflow]


def test_overwriting_a_registered_name_warns_and_the_last_class_wins() -> None:
    class Second(ListTracker):
        pass

    register_tracker_class(ListTracker)
    with pytest.warns(UserWarning, match="'list_tracker' was ListTracker; .*now chooses .*Second"):
        register_tracker_class(Second)
    assert tracking.LOGGER_TYPE_TO_CLASS["list_tracker"] is Second


class _NoName(GeneralTracker):
    requires_logging_directory = False


class _EmptyName(ListTracker):
    name = ""


class _NoDirFlag(GeneralTracker):
    name = "no_dir_flag"


@pytest.mark.parametrize(
    "bad, match",
    [
        (int, "takes a subclass of GeneralTracker, got <class 'int'>"),
        (object(), "takes a subclass of GeneralTracker, got <object object"),
        (ListTracker.__new__(ListTracker), "takes a subclass of GeneralTracker, got <.*ListTracker object"),
        (_NoName, "_NoName needs a non-empty `name` class attribute"),
        (_EmptyName, "_EmptyName needs a non-empty `name` class attribute .*got ''"),
        (_NoDirFlag, "_NoDirFlag needs a `requires_logging_directory` class attribute"),
    ],
)
def test_a_non_tracker_or_nameless_class_is_refused_with_value_error(bad, match) -> None:
    before = dict(tracking.LOGGER_TYPE_TO_CLASS)
    with pytest.raises(ValueError, match=match):
        register_tracker_class(bad)
    assert tracking.LOGGER_TYPE_TO_CLASS == before


def test_the_trackers_stay_listed_after_end_training() -> None:
    """As 1.15: ``end_training`` finishes each tracker and ``accelerator.trackers`` still holds them (its DVCLive
    tests read ``accelerator.trackers[0].live`` after it)."""
    register_tracker_class(ListTracker)
    ListTracker.runs.clear()
    accelerator = Accelerator(cpu=True, log_with="list_tracker")
    accelerator.init_trackers("proj")
    finished = []
    ListTracker.runs[0].finish = lambda: finished.append(True)
    accelerator.end_training()
    assert accelerator.trackers == ListTracker.runs and finished == [True]
