"""Trackers' media and artifact methods from Accelerate 1.15: log_images, log_table, MLflow artifacts and figures.

None of the services' packages is installed in the test environment, so each test injects a fake
module in ``sys.modules`` that records how the tracker called the library.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from notebook_accel.state import PartialState
from notebook_accel.tracking import (
    AimTracker,
    ClearMLTracker,
    MLflowTracker,
    SwanLabTracker,
    TensorBoardTracker,
    TrackioTracker,
    WandBTracker,
)


class _Recorder:
    """Records every method call as (name, args, kwargs) in ``calls``; attributes are recorders too."""

    def __init__(self, calls: list, prefix: str = "") -> None:
        self._calls, self._prefix = calls, prefix

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Recorder(self._calls, f"{self._prefix}{name}")

    def __call__(self, *args, **kwargs):
        self._calls.append((self._prefix, args, kwargs))
        return _Recorder(self._calls, f"{self._prefix}()")


class _Wrapped:
    """What a fake library's Image/Table constructor returns: its arguments, comparable."""

    def __init__(self, kind: str, *args, **kwargs) -> None:
        self.kind, self.args, self.kwargs = kind, args, kwargs


def _module(monkeypatch, name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


IMAGE = np.zeros((3, 4, 4), dtype=np.uint8)


def _not_main(monkeypatch) -> None:
    PartialState()
    monkeypatch.setitem(PartialState._shared_state, "process_index", 1)


def test_tensorboard_log_images_adds_each_batch(monkeypatch) -> None:
    calls: list = []
    _module(monkeypatch, "tensorboard")
    _module(monkeypatch, "torch.utils.tensorboard", SummaryWriter=lambda *a, **k: _Recorder(calls, "writer."))
    tracker = TensorBoardTracker("run", "logs")
    tracker.start()
    batch = np.stack([IMAGE, IMAGE])
    tracker.log_images({"samples": batch}, step=3, dataformats="NCHW")
    (name, args, kwargs), flush = calls
    assert name == "writer.add_images" and args[0] == "samples" and args[1] is batch
    assert kwargs == {"global_step": 3, "dataformats": "NCHW"} and flush[0] == "writer.flush"
    _not_main(monkeypatch)
    tracker.log_images({"samples": batch})
    assert len(calls) == 2  # other processes log nothing


def _started_run_tracker(monkeypatch, cls: type, module: str) -> tuple:
    """Return (tracker, calls): ``cls`` started over a fake ``module`` whose run records every call."""
    calls: list = []
    _module(
        monkeypatch,
        module,
        init=lambda **kwargs: _Recorder(calls, "run."),
        Image=lambda image: _Wrapped("Image", image),
        Table=lambda **kwargs: _Wrapped("Table", **kwargs),
    )
    tracker = cls("project")
    tracker.start()
    return tracker, calls


@pytest.fixture
def wandb_run(monkeypatch):
    return _started_run_tracker(monkeypatch, WandBTracker, "wandb")


def test_wandb_log_images_wraps_every_image(wandb_run) -> None:
    tracker, calls = wandb_run
    tracker.log_images({"grid": [IMAGE, IMAGE], "one": IMAGE}, step=5, commit=False)
    ((name, (logged,), kwargs),) = calls
    assert name == "run.log" and kwargs == {"step": 5, "commit": False}
    assert [w.kind for w in logged["grid"]] == ["Image", "Image"] and logged["grid"][0].args[0] is IMAGE
    assert len(logged["one"]) == 1
    with pytest.raises(TypeError, match=r"'bad' must map to an image .* got str"):
        tracker.log_images({"bad": "picture.png"})


def test_wandb_log_table_builds_a_table(wandb_run) -> None:
    tracker, calls = wandb_run
    tracker.log_table("preds", columns=["x", "y"], data=[[1, 2]], step=2)
    ((name, (logged,), kwargs),) = calls
    table = logged["preds"]
    assert table.kind == "Table" and kwargs == {"step": 2}
    assert table.kwargs == {"columns": ["x", "y"], "data": [[1, 2]], "dataframe": None}
    frame = object()
    tracker.log_table("frame", dataframe=frame)
    assert calls[1][1][0]["frame"].kwargs == {"columns": None, "data": None, "dataframe": frame}
    with pytest.raises(ValueError, match=r"either `data` .* or `dataframe`, not neither"):
        tracker.log_table("empty")
    with pytest.raises(ValueError, match=r"not both"):
        tracker.log_table("both", data=[[1]], dataframe=object())


def test_aim_log_images_with_captions_and_split_kwargs(monkeypatch) -> None:
    calls: list = []
    _module(
        monkeypatch,
        "aim",
        Run=lambda **kwargs: _Recorder(calls, "run."),
        Image=lambda *a, **k: _Wrapped("Image", *a, **k),
    )
    tracker = AimTracker("run", "repo")
    tracker.start()
    tracker.log_images(
        {"a": (IMAGE, "first"), "b": IMAGE},
        step=1,
        kwargs={"aim_image": {"format": "png"}, "track": {"epoch": 2}},
    )
    (name_a, (image_a,), kwargs_a), (_, (image_b,), kwargs_b) = calls
    assert name_a == "run.track" and kwargs_a == {"name": "a", "step": 1, "epoch": 2}
    assert image_a.args[0] is IMAGE and image_a.kwargs == {"caption": "first", "format": "png"}
    assert image_b.kwargs["caption"] == "" and kwargs_b["name"] == "b"
    with pytest.raises(ValueError, match=r"kwargs keys must be 'aim_image' and/or 'track', got \['image'\]"):
        tracker.log_images({"a": IMAGE}, kwargs={"image": {}})


@pytest.fixture
def clearml_logger(monkeypatch):
    calls: list = []
    task = types.SimpleNamespace(get_logger=lambda: _Recorder(calls, "logger."))
    _module(
        monkeypatch,
        "clearml",
        Task=types.SimpleNamespace(init=lambda **kwargs: task, current_task=lambda: None),
    )
    tracker = ClearMLTracker("project")
    tracker.start()
    return tracker, calls


def test_clearml_log_images_reports_each_image(clearml_logger) -> None:
    tracker, calls = clearml_logger
    tracker.log_images({"val/samples": [IMAGE, IMAGE]}, step=4, max_image_history=2)
    assert [c[0] for c in calls] == ["logger.report_image"] * 2
    assert calls[0][2] == {
        "title": "val",
        "series": "samples",
        "iteration": 4,
        "image": IMAGE,
        "max_image_history": 2,
    }


def test_clearml_log_table_puts_the_columns_first(clearml_logger) -> None:
    tracker, calls = clearml_logger
    tracker.log_table("scores", columns=["name", "acc"], data=[["a", 0.5]], step=1)
    tracker.log_table("raw", data=[["h1"], ["v"]])
    frame = object()
    tracker.log_table("frame/s", dataframe=frame)
    (first, second, third) = (c[2] for c in calls)
    assert first == {
        "title": "scores",
        "series": "scores",
        "iteration": 1,
        "table_plot": [["name", "acc"], ["a", 0.5]],
    }
    assert second["table_plot"] == [["h1"], ["v"]]
    assert third["table_plot"] is frame and (third["title"], third["series"]) == ("frame", "s")
    with pytest.raises(ValueError, match=r"ClearMLTracker.log_table: give either"):
        tracker.log_table("nothing")


def test_mlflow_artifacts_and_figures(monkeypatch, tmp_path) -> None:
    calls: list = []
    fake = _Recorder(calls, "mlflow.")
    _module(
        monkeypatch,
        "mlflow",
        start_run=lambda **kwargs: "run",
        log_artifact=fake.log_artifact,
        log_artifacts=fake.log_artifacts,
        log_figure=fake.log_figure,
    )
    tracker = MLflowTracker()
    tracker.start()
    (tmp_path / "weights.bin").write_bytes(b"x")
    tracker.log_artifact(str(tmp_path / "weights.bin"), artifact_path="ckpt")
    tracker.log_artifacts(str(tmp_path))
    figure = object()
    tracker.log_figure(figure, "plots/loss.png", save_kwargs={"dpi": 50})
    assert calls == [
        ("mlflow.log_artifact", (), {"local_path": str(tmp_path / "weights.bin"), "artifact_path": "ckpt"}),
        ("mlflow.log_artifacts", (), {"local_dir": str(tmp_path), "artifact_path": None}),
        (
            "mlflow.log_figure",
            (),
            {"figure": figure, "artifact_file": "plots/loss.png", "save_kwargs": {"dpi": 50}},
        ),
    ]
    with pytest.raises(FileNotFoundError, match=r"log_artifact: '.*missing.bin' is not a file"):
        tracker.log_artifact(str(tmp_path / "missing.bin"))
    with pytest.raises(NotADirectoryError, match=r"log_artifacts: '.*weights.bin' is not a directory"):
        tracker.log_artifacts(str(tmp_path / "weights.bin"))
    _not_main(monkeypatch)
    tracker.log_figure(figure, "again.png")
    assert len(calls) == 3


def test_swanlab_log_images_wraps_every_image(monkeypatch) -> None:
    tracker, calls = _started_run_tracker(monkeypatch, SwanLabTracker, "swanlab")
    tracker.log_images({"gen": [IMAGE]}, step=7, print_to_console=True)
    ((name, (logged,), kwargs),) = calls
    assert name == "run.log" and kwargs == {"step": 7, "print_to_console": True}
    assert logged["gen"][0].kind == "Image" and logged["gen"][0].args[0] is IMAGE


@pytest.mark.parametrize(
    ("cls", "module", "config_call", "finish_call"),
    [
        (SwanLabTracker, "swanlab", "config.update", "finish"),
        (TrackioTracker, "trackio", "config.update", "run.finish"),
        (WandBTracker, "wandb", "run.configupdate", "run.finish"),  # the recorder joins nested names
    ],
)
def test_project_run_trackers_start_log_configure_and_finish(
    monkeypatch, cls, module, config_call, finish_call
) -> None:
    calls: list = []
    _module(
        monkeypatch,
        module,
        init=lambda **kwargs: calls.append(("init", (), kwargs)) or _Recorder(calls, "run."),
        config=_Recorder(calls, "config."),
        finish=lambda: calls.append(("finish", (), {})),
    )
    tracker = cls("my-project", mode="offline")
    assert calls == []  # built, not started: no run yet (as 1.15)
    tracker.start()
    tracker.store_init_configuration({"lr": 0.1})
    tracker.log({"loss": 1.5}, step=3)
    tracker.finish()
    assert [c[0] for c in calls] == ["init", config_call, "run.log", finish_call]
    assert calls[0][2] == {"project": "my-project", "mode": "offline"} and tracker.run_name == "my-project"
    assert calls[1][1] == ({"lr": 0.1},) and calls[2][1:] == (({"loss": 1.5},), {"step": 3})


def test_project_run_tracker_without_its_library_names_the_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "trackio", None)
    with pytest.raises(ImportError, match=r"log_with='trackio' requires `trackio`: pip install trackio"):
        TrackioTracker("p")
