"""Building a tracker starts nothing; ``start()`` (called by ``init_trackers``) opens the run, as in Accelerate 1.15.

The service libraries are faked in ``sys.modules`` (the main suite has none of them; the real ones run in
tests/test_trackers_real.py): each fake records the calls that would open a run.
"""

from __future__ import annotations

import sys
import types

import pytest

from notebook_accel import Accelerator
from notebook_accel.tracking import (
    AimTracker,
    ClearMLTracker,
    CometMLTracker,
    DVCLiveTracker,
    MLflowTracker,
    TensorBoardTracker,
    WandBTracker,
)


def _fake_libraries(monkeypatch, calls: list) -> None:
    """Put fakes of the seven trackers' libraries in ``sys.modules``; each run-opening call lands in ``calls``."""

    def opener(name: str):
        def open_run(*args, **kwargs):
            calls.append(name)
            return types.SimpleNamespace(
                name=None, experiment_id="e", log=lambda *a, **k: None, close=lambda: None
            )

        return open_run

    modules = {
        "tensorboard": {},
        "torch.utils.tensorboard": {"SummaryWriter": opener("SummaryWriter")},
        "wandb": {"init": opener("wandb.init")},
        "comet_ml": {"start": opener("comet_ml.start")},
        "aim": {"Run": opener("aim.Run")},
        "mlflow": {
            "start_run": opener("mlflow.start_run"),
            "set_tracking_uri": opener("mlflow.set_tracking_uri"),
            "get_experiment_by_name": opener("mlflow.get_experiment_by_name"),
        },
        "clearml": {"Task": types.SimpleNamespace(init=opener("Task.init"), current_task=lambda: None)},
        "dvclive": {"Live": opener("dvclive.Live")},
        "dvclive.error": {"InvalidDataTypeError": type("InvalidDataTypeError", (Exception,), {})},
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        for key, value in attrs.items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize(
    ("build", "opens"),
    [
        (lambda: TensorBoardTracker("run", "logs"), ["SummaryWriter"]),
        (lambda: WandBTracker("run"), ["wandb.init"]),
        (lambda: CometMLTracker("run"), ["comet_ml.start"]),
        (lambda: AimTracker("run", "repo"), ["aim.Run"]),
        (
            lambda: MLflowTracker("run", logging_dir="uri"),
            ["mlflow.set_tracking_uri", "mlflow.get_experiment_by_name", "mlflow.start_run"],
        ),  # fmt: skip
        (lambda: ClearMLTracker("run"), ["Task.init"]),
        (lambda: DVCLiveTracker("run"), ["dvclive.Live"]),
    ],
    ids=["tensorboard", "wandb", "comet_ml", "aim", "mlflow", "clearml", "dvclive"],
)
def test_building_a_tracker_opens_no_run_until_init_trackers_starts_it(monkeypatch, build, opens) -> None:
    calls: list = []
    _fake_libraries(monkeypatch, calls)
    tracker = build()
    assert calls == [] and tracker.tracker is None  # no API key asked, no file, no task
    with pytest.raises(
        RuntimeError, match=rf"{type(tracker).__name__} has no run yet: call tracker.start\(\) first"
    ):
        tracker.log({"loss": 1.0}, step=0)
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    assert calls == []
    accelerator.init_trackers("project")
    assert calls == opens and tracker.tracker is not None
    tracker.start()  # a second start opens nothing more
    assert calls == opens


def test_tensorboard_without_a_logging_dir_raises_1_15s_message(monkeypatch) -> None:
    import notebook_accel.tracking as tracking

    _fake_libraries(monkeypatch, [])
    monkeypatch.setattr(
        tracking, "is_package_available", lambda package: True
    )  # the fake counts as installed
    with pytest.raises(
        ValueError, match=r"^Logging with `tensorboard` requires a `logging_dir` to be passed in\.\n"
    ):
        Accelerator(cpu=True, log_with="tensorboard")
    tracker = TensorBoardTracker("run", None)  # built as in 1.15; the error comes when it starts
    with pytest.raises(
        ValueError, match=r"^Logging with `tensorboard` requires a `logging_dir`.*\n.*project_dir"
    ):
        tracker.start()
