"""Experiment trackers for ``Accelerator(log_with=...)``.

One small class per service (TensorBoard, Weights & Biases, Comet ML, Aim, MLflow, ClearML,
DVCLive, SwanLab, Trackio) over the same :class:`GeneralTracker` interface, plus
:class:`JSONLinesTracker`, a dependency-free tracker writing one JSON object per ``log`` call, and
:class:`NotebookTracker` (``log_with="notebook"``), which sends the values of a launched run to the
notebook that launched it (live charts in the launch panel, ``handle.metrics``).
A tracker whose package is missing raises ImportError naming it; ``"all"`` selects the services
whose package is installed. The base class lives in ``tracking.base``, the service trackers in
``tracking.services``; this module serves them all and keeps the registry (``log_with`` names).
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

from ..logging import get_logger
from ..state import PartialState
from ..utils._worker_channel import send_event
from ..utils.atomic_files import atomic_write
from ..utils.enums import LoggerType
from ..utils.environment import str_to_bool
from ..utils.operations import listify
from ..utils.package_checks import (
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
from ..utils.versions import compare_versions
from .base import GeneralTracker, _plain, logging_dir_message, on_main_process
from .services import (
    AimTracker,
    ClearMLTracker,
    CometMLTracker,
    DVCLiveTracker,
    MLflowTracker,
    SwanLabTracker,
    TensorBoardTracker,
    TrackioTracker,
    WandBTracker,
)

__all__ = [
    "AimTracker",
    "ClearMLTracker",
    "CometMLTracker",
    "DVCLiveTracker",
    "GeneralTracker",
    "JSONLinesTracker",
    "LOGGER_TYPE_TO_CLASS",
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

# The classes that ship with us, by name: only these need their service's package installed.
_BUILT_IN: dict[str, type[GeneralTracker]] = dict(LOGGER_TYPE_TO_CLASS)

# Trackers chosen by name that are not LoggerType members (the enum keeps Accelerate 1.15's values).
_EXTRA_TRACKERS: dict[str, type[GeneralTracker]] = {NotebookTracker.name: NotebookTracker}


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Make ``log_with=tracker_class.name`` choose ``tracker_class``, like the built-in trackers.

    The class must subclass GeneralTracker with a non-empty ``name`` and a ``requires_logging_directory``
    attribute; it is built with the project name first (and the logging directory when it requires one).
    It joins ``LOGGER_TYPE_TO_CLASS``; a name already there (a built-in tracker included) is replaced,
    with a UserWarning. Register it before creating the Accelerator that uses it.
    """
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(
            f"register_tracker_class takes a subclass of GeneralTracker, got {tracker_class!r}; "
            "derive your tracker class from notebook_accel.tracking.GeneralTracker"
        )
    name = getattr(tracker_class, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"{tracker_class.__name__} needs a non-empty `name` class attribute to be registered "
            f"(got {name!r}); it is the string log_with= chooses it by"
        )
    own = [vars(klass) for klass in tracker_class.__mro__ if klass is not GeneralTracker]
    if not any(isinstance(attrs.get("requires_logging_directory"), bool) for attrs in own):
        raise ValueError(
            f"{tracker_class.__name__} needs a `requires_logging_directory` class attribute (True or False)"
        )
    previous = _tracker_class(name)
    if previous is not None:
        warnings.warn(
            f"register_tracker_class: tracker name {name!r} was {previous.__qualname__}; "
            f"log_with={name!r} now chooses {tracker_class.__qualname__}",
            UserWarning,
            stacklevel=2,
        )
    LOGGER_TYPE_TO_CLASS[name] = tracker_class


def get_available_trackers() -> list[LoggerType]:
    """Return the trackers (LoggerType members) whose package is installed here."""
    return [LoggerType(name) for name, package in _PACKAGES.items() if is_package_available(package)]


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
        if cls is _BUILT_IN.get(name) and name in _PACKAGES and not is_package_available(_PACKAGES[name]):
            raise ImportError(
                f"log_with={name!r} requires `{_PACKAGES[name]}`: pip install {_PACKAGES[name]}"
            )
        if cls.requires_logging_directory and logging_dir is None:
            raise ValueError(logging_dir_message(name))
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
        tracker = cls(project_name, **kwargs)
        tracker.start()  # as 1.15: built, then started, on the processes that log
        trackers.append(tracker)
    if config is not None:
        for tracker in trackers:
            tracker.store_init_configuration(config)
    return trackers
