"""Experiment trackers for ``Accelerator(log_with=...)``.

One small class per service (TensorBoard, Weights & Biases, Comet ML, Aim, MLflow, ClearML,
DVCLive, SwanLab, Trackio) over the same :class:`GeneralTracker` interface, plus
:class:`JSONLinesTracker`, a dependency-free tracker writing one JSON object per ``log`` call, and
:class:`NotebookTracker` (``log_with="notebook"``), which sends the values of a launched run to the
notebook that launched it (live charts in the launch panel, ``handle.metrics``).
A tracker whose package is missing raises ImportError naming it; ``"all"`` selects the services
whose package is installed.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .logging import get_logger
from .state import PartialState
from .utils._worker_channel import send_event
from .utils.atomic_files import atomic_write
from .utils.enums import LoggerType
from .utils.environment import str_to_bool
from .utils.operations import listify
from .utils.package_checks import (
    is_aim_available,
    is_clearml_available,
    is_comet_ml_available,
    is_dvclive_available,
    is_mlflow_available,
    is_package_available,
    is_swanlab_available,
    is_tensorboard_available,
    is_trackio_available,
    is_wandb_available,
)
from .utils.versions import compare_versions

__all__ = [
    "AimTracker",
    "ClearMLTracker",
    "CometMLTracker",
    "DVCLiveTracker",
    "GeneralTracker",
    "JSONLinesTracker",
    "MLflowTracker",
    "NotebookTracker",
    "SwanLabTracker",
    "TensorBoardTracker",
    "TrackioTracker",
    "WandBTracker",
    "filter_trackers",
    "get_available_trackers",
    "on_main_process",
    "register_tracker_class",
]
# Accelerate 1.15 serves these names at this path too (defined elsewhere).
__all__ += [
    "LoggerType",
    "PartialState",
    "compare_versions",
    "get_logger",
    "is_aim_available",
    "is_clearml_available",
    "is_comet_ml_available",
    "is_dvclive_available",
    "is_mlflow_available",
    "is_swanlab_available",
    "is_tensorboard_available",
    "is_trackio_available",
    "is_wandb_available",
    "listify",
    "str_to_bool",
]

logger = logging.getLogger(__name__)


def _require(module: str, pip_name: str, tracker: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"log_with={tracker!r} requires `{pip_name}`: pip install {pip_name}") from exc


class GeneralTracker:
    """Base of the trackers: ``store_init_configuration``, ``log``, ``finish`` and ``tracker``.

    Subclasses set ``name``, ``requires_logging_directory`` and ``main_process_only`` (whether
    only the main process creates it). ``GeneralTracker(_blank=True)`` is a tracker that does
    nothing, handed out on processes where the real one does not run.
    """

    name: str = ""
    requires_logging_directory: bool = False
    main_process_only: bool = True

    def __init__(self, _blank: bool = False) -> None:
        # The base class supplies defaults for every attribute; an empty name means a subclass set none.
        if not _blank and not type(self).name:
            raise TypeError(
                f"{type(self).__name__} must define the class attributes name, requires_logging_directory "
                "and main_process_only"
            )
        self._blank = _blank

    @property
    def tracker(self) -> Any:
        """Return the underlying run object of the service (None for a blank tracker)."""
        return getattr(self, "run", None)

    def start(self) -> None:
        """Open the run (the constructors of the built-in trackers already do)."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the hyper-parameters of the run."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` (name -> number, string or object the service understands) at ``step``."""

    def finish(self) -> None:
        """Close the run and flush what is buffered."""


class JSONLinesTracker(GeneralTracker):
    """Append every ``log`` call as one JSON object to ``logging_dir/run_name/metrics.jsonl``.

    ``store_init_configuration`` writes ``config.json`` next to it. No package needed.
    """

    name = "jsonl"
    requires_logging_directory = True
    main_process_only = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__()
        if logging_dir is None:
            raise ValueError("JSONLinesTracker needs a logging directory: set Accelerator(project_dir=...)")
        self.run_name = run_name
        self.directory = Path(logging_dir) / run_name
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / "metrics.jsonl"
        self.run = self.path.open("a", encoding="utf-8")

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        text = json.dumps(values, indent=2, sort_keys=True, default=repr) + "\n"
        atomic_write(
            os.fspath(self.directory / "config.json"),
            lambda tmp: Path(tmp).write_text(text, encoding="utf-8"),
        )

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        record = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in values.items()}}
        self.run.write(json.dumps(record, default=repr) + "\n")
        self.run.flush()

    def finish(self) -> None:
        self.run.close()


class NotebookTracker(GeneralTracker):
    """Send ``accelerator.log(values, step=...)`` of a launched run to the launching notebook.

    Inside ``notebook_launcher``, each ``log`` call of the main process travels to the kernel as an
    event: the launch panel draws one chart per metric against ``step`` and the handle keeps every
    call in ``handle.metrics`` (a list of dicts, ``step`` first; ``handle.metrics_frame()`` for a
    DataFrame). The tracker keeps the same records in ``tracker.metrics``, which is all it does
    outside a launch. Chosen by ``log_with="notebook"`` (not a ``LoggerType`` member: that enum stays
    Accelerate's) or by passing an instance; other trackers work beside it.

    Values are numbers (tensors with one element become floats) or strings; other values are left
    out of the record. A ``log`` without ``step`` takes the step after the last one.
    """

    name = "notebook"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str = "notebook", **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.metrics: list[dict[str, Any]] = []
        self.config: dict[str, Any] = {}
        self.run = self.metrics

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.config = dict(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if step is None:
            step = self.metrics[-1]["step"] + 1 if self.metrics else 0
        record: dict[str, Any] = {"step": int(step)}
        for key, value in values.items():
            value = _plain(value)
            if isinstance(value, (bool, int, float, str)):
                record[key] = value
            else:
                logger.debug(
                    "NotebookTracker: %r is a %s, not a number or string; not logged", key, type(value)
                )
        self.metrics.append(record)
        send_event("metrics", record)


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    return value


class TensorBoardTracker(GeneralTracker):
    """Write scalars, text and dicts of scalars with ``torch.utils.tensorboard`` (needs ``tensorboard``)."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__()
        _require("tensorboard", "tensorboard", self.name)
        from torch.utils.tensorboard import SummaryWriter

        self.run_name = run_name
        self.logging_dir = os.path.join(logging_dir, run_name)
        self.writer = SummaryWriter(self.logging_dir, **kwargs)
        self.run = self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.writer.add_hparams(values, metric_dict={})
        self.writer.flush()

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            if isinstance(value, (int, float)) or (hasattr(value, "item") and getattr(value, "ndim", 1) == 0):
                self.writer.add_scalar(key, _plain(value), global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class WandBTracker(GeneralTracker):
    """Log to Weights & Biases (needs ``wandb``)."""

    name = "wandb"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        wandb = _require("wandb", "wandb", self.name)
        self.run_name = run_name
        self.run = wandb.init(project=run_name, **kwargs)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class CometMLTracker(GeneralTracker):
    """Log to Comet ML (needs ``comet_ml``)."""

    name = "comet_ml"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        comet_ml = _require("comet_ml", "comet_ml", self.name)
        self.run_name = run_name
        self.run = comet_ml.start(project_name=run_name, **kwargs)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run._set_parameters(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if step is not None:
            self.run.set_step(step)
        for key, value in values.items():
            if isinstance(value, (int, float)) or hasattr(value, "item"):
                self.run.log_metric(key, _plain(value), step=step, **kwargs)
            elif isinstance(value, str):
                self.run.log_other(key, value, **kwargs)
            elif isinstance(value, dict):
                self.run.log_metrics(value, step=step, **kwargs)

    def finish(self) -> None:
        self.run.end()


class AimTracker(GeneralTracker):
    """Log to Aim (needs ``aim``)."""

    name = "aim"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike = ".", **kwargs: Any) -> None:
        super().__init__()
        aim = _require("aim", "aim", self.name)
        self.run_name = run_name
        self.run = aim.Run(repo=str(logging_dir), **kwargs)
        self.run.name = run_name

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run["hparams"] = values

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            self.run.track(_plain(value), name=key, step=step, **kwargs)

    def finish(self) -> None:
        self.run.close()


class MLflowTracker(GeneralTracker):
    """Log to MLflow (needs ``mlflow``); ``logging_dir`` becomes the tracking URI when given."""

    name = "mlflow"
    requires_logging_directory = False

    def __init__(
        self,
        experiment_name: str | None = None,
        logging_dir: str | os.PathLike | None = None,
        run_id: str | None = None,
        tags: dict[str, Any] | str | None = None,
        nested_run: bool | None = False,
        run_name: str | None = None,
        description: str | None = None,
    ) -> None:
        super().__init__()
        mlflow = _require("mlflow", "mlflow", self.name)
        self._mlflow = mlflow
        # MLflow's own environment variables win over the arguments, as in MLflow's tools.
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        run_id = os.environ.get("MLFLOW_RUN_ID", run_id)
        tags = os.environ.get("MLFLOW_TAGS", tags)
        if isinstance(tags, str):
            try:
                tags = json.loads(tags)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"MLflowTracker: tags must be a dict or its JSON text, got {tags!r}"
                ) from error
        nested_run = (
            str_to_bool(os.environ["MLFLOW_NESTED_RUN"], to_bool=True)
            if "MLFLOW_NESTED_RUN" in os.environ
            else nested_run
        )
        if logging_dir is not None:
            mlflow.set_tracking_uri(str(logging_dir))
        experiment = mlflow.get_experiment_by_name(experiment_name) if experiment_name else None
        if experiment_name and experiment is None:
            experiment_id = mlflow.create_experiment(experiment_name)
        else:
            experiment_id = experiment.experiment_id if experiment else None
        self.run_name = run_name
        self.run = mlflow.start_run(
            run_id=run_id,
            experiment_id=experiment_id,
            run_name=run_name,
            nested=bool(nested_run),
            tags=tags,
            description=description,
        )

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        # MLflow caps parameter values at 500 characters; longer ones are dropped with a note.
        kept = {k: v for k, v in values.items() if len(str(v)) <= 500}
        for key in set(values) - set(kept):
            logger.warning("MLflow: parameter %r is longer than 500 characters and was not logged", key)
        self._mlflow.log_params(kept)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        metrics = {k: _plain(v) for k, v in values.items() if isinstance(_plain(v), (int, float))}
        self._mlflow.log_metrics(metrics, step=step)

    def finish(self) -> None:
        self._mlflow.end_run()


class ClearMLTracker(GeneralTracker):
    """Log to ClearML (needs ``clearml``)."""

    name = "clearml"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        clearml = _require("clearml", "clearml", self.name)
        self.run_name = run_name
        kwargs.setdefault("project_name", run_name)
        self.run = clearml.Task.init(**kwargs)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.connect_configuration(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        reporter = self.run.get_logger()
        for key, value in values.items():
            title, _, series = key.partition("/")
            value = _plain(value)
            if isinstance(value, (int, float)):
                if step is None:
                    reporter.report_single_value(name=key, value=value, **kwargs)
                else:
                    reporter.report_scalar(
                        title=title, series=series or title, value=value, iteration=step, **kwargs
                    )

    def finish(self) -> None:
        self.run.close()


class DVCLiveTracker(GeneralTracker):
    """Log with DVCLive (needs ``dvclive``)."""

    name = "dvclive"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, live: Any = None, **kwargs: Any) -> None:
        super().__init__()
        dvclive = _require("dvclive", "dvclive", self.name)
        self.run_name = run_name
        self.run = live if live is not None else dvclive.Live(**kwargs)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.log_params(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if step is not None:
            self.run.step = step
        for key, value in values.items():
            value = _plain(value)
            if isinstance(value, (int, float)):
                self.run.log_metric(key, value, **kwargs)
        self.run.next_step()

    def finish(self) -> None:
        self.run.end()


class SwanLabTracker(GeneralTracker):
    """Log to SwanLab (needs ``swanlab``)."""

    name = "swanlab"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        swanlab = _require("swanlab", "swanlab", self.name)
        self._swanlab = swanlab
        self.run_name = run_name
        self.run = swanlab.init(project=run_name, **kwargs)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._swanlab.config.update(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        self._swanlab.finish()


class TrackioTracker(GeneralTracker):
    """Log to Trackio (needs ``trackio``)."""

    name = "trackio"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        trackio = _require("trackio", "trackio", self.name)
        self._trackio = trackio
        self.run_name = run_name
        self.run = trackio.init(project=run_name, **kwargs)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._trackio.config.update(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


LOGGER_TYPE_TO_CLASS: dict[str, type[GeneralTracker]] = {
    cls.name: cls
    for cls in (
        TensorBoardTracker,
        WandBTracker,
        CometMLTracker,
        AimTracker,
        MLflowTracker,
        ClearMLTracker,
        DVCLiveTracker,
        SwanLabTracker,
        TrackioTracker,
        JSONLinesTracker,
    )
}

# Trackers chosen by name that are not LoggerType members (the enum keeps Accelerate 1.15's values).
_EXTRA_TRACKERS: dict[str, type[GeneralTracker]] = {NotebookTracker.name: NotebookTracker}


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Make ``log_with=tracker_class.name`` choose ``tracker_class``, like the built-in trackers.

    The class must subclass GeneralTracker with a non-empty ``name`` and a ``requires_logging_directory``
    attribute; it is built with the project name first (and the logging directory when it requires one).
    Register it before creating the Accelerator that uses it.
    """
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise TypeError(f"register_tracker_class takes a GeneralTracker subclass, got {tracker_class!r}")
    name = getattr(tracker_class, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"{tracker_class.__name__} needs a non-empty `name` class attribute to be registered"
        )
    if not isinstance(getattr(tracker_class, "requires_logging_directory", None), bool):
        raise ValueError(
            f"{tracker_class.__name__} needs a `requires_logging_directory` class attribute (True or False)"
        )
    _EXTRA_TRACKERS[name] = tracker_class


def get_available_trackers() -> list[LoggerType]:
    """Return the trackers (LoggerType members) whose package is installed here."""
    return [LoggerType(name) for name, package in _PACKAGES.items() if is_package_available(package)]


def on_main_process(function: Callable) -> Callable:
    """Return a tracker method that runs on the main process only when its tracker has ``main_process_only``.

    The process is asked at call time, so decorating does not build the process state.
    """

    @functools.wraps(function)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False) and not PartialState().is_main_process:
            return None
        return function(self, *args, **kwargs)

    return wrapper


def _tracker_class(name: str) -> type[GeneralTracker] | None:
    return LOGGER_TYPE_TO_CLASS.get(name) or _EXTRA_TRACKERS.get(name)


# package import name of each service, for "all"
_PACKAGES = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "comet_ml": "comet_ml",
    "aim": "aim",
    "mlflow": "mlflow",
    "clearml": "clearml",
    "dvclive": "dvclive",
    "swanlab": "swanlab",
    "trackio": "trackio",
}


def filter_trackers(log_with: Any, logging_dir: str | os.PathLike | None = None) -> list[Any]:
    """Return the trackers ``log_with`` asks for: names (validated, installed) and tracker objects.

    Raises ValueError for an unknown name (listing the valid ones) or for a tracker that needs
    a logging directory when none is set, ImportError for a named service that is not installed.
    """
    if log_with is None:
        return []
    items = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    chosen: list[Any] = []
    for item in items:
        if isinstance(item, GeneralTracker):
            chosen.append(item)
            continue
        name = str(getattr(item, "value", item)).lower()
        if name == "all":
            chosen.extend(n for n, pkg in _PACKAGES.items() if is_package_available(pkg) and n not in chosen)
            continue
        cls = _tracker_class(name)
        if cls is None:
            raise ValueError(
                f"log_with={item!r} is not a known tracker; choose from "
                f"{sorted([*LOGGER_TYPE_TO_CLASS, *_EXTRA_TRACKERS]) + ['all']} or pass a GeneralTracker instance"
            )
        if name in _PACKAGES and not is_package_available(_PACKAGES[name]):
            raise ImportError(
                f"log_with={name!r} requires `{_PACKAGES[name]}`: pip install {_PACKAGES[name]}"
            )
        if cls.requires_logging_directory and logging_dir is None:
            raise ValueError(
                f"log_with={name!r} writes to a logging directory: pass Accelerator(project_dir=...) "
                "or ProjectConfiguration(logging_dir=...)"
            )
        if name not in chosen:
            chosen.append(name)
    return chosen


def start_trackers(
    log_with: list[Any],
    project_name: str,
    logging_dir: str | os.PathLike | None,
    is_main_process: bool,
    config: dict[str, Any] | None = None,
    init_kwargs: dict[str, dict[str, Any]] | None = None,
) -> list[GeneralTracker]:
    """Create the trackers of ``log_with`` that run on this process and store ``config`` in each."""
    init_kwargs = init_kwargs or {}
    unknown = set(init_kwargs) - {str(getattr(t, "name", t)) for t in log_with}
    if unknown:
        raise ValueError(
            f"init_kwargs names trackers {sorted(unknown)} that are not in log_with={log_with!r}"
        )
    trackers: list[GeneralTracker] = []
    for item in log_with:
        if isinstance(item, GeneralTracker):
            if item.main_process_only and not is_main_process:
                continue
            item.start()
            trackers.append(item)
            continue
        cls = _tracker_class(item)
        if cls.main_process_only and not is_main_process:
            continue
        kwargs = dict(init_kwargs.get(item, {}))
        if cls.requires_logging_directory:
            kwargs["logging_dir"] = logging_dir
        trackers.append(cls(project_name, **kwargs))
    if config is not None:
        for tracker in trackers:
            tracker.store_init_configuration(config)
    return trackers
