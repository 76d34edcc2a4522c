"""The trackers of the hosted services: TensorBoard, W&B, Comet ML, Aim, MLflow, ClearML, DVCLive, SwanLab, Trackio.

Each imports its package when built (ImportError naming it when missing) and logs through that
package's own API. Re-exported by ``notebook_accel.tracking`` (where Accelerate serves them).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from ..utils.environment import str_to_bool
from .base import GeneralTracker, _plain, _require, on_main_process

__all__ = [
    "AimTracker",
    "ClearMLTracker",
    "CometMLTracker",
    "DVCLiveTracker",
    "MLflowTracker",
    "SwanLabTracker",
    "TensorBoardTracker",
    "TrackioTracker",
    "WandBTracker",
]

logger = logging.getLogger(__name__)


def _image_list(key: str, images: Any) -> list[Any]:
    """Return ``images`` (one image or a list/tuple of them) as a list; a dict or string raises TypeError."""
    if isinstance(images, (dict, str, bytes)):
        raise TypeError(
            f"log_images: {key!r} must map to an image (numpy array, PIL image, tensor) or a list of them, "
            f"got {type(images).__name__}"
        )
    return list(images) if isinstance(images, (list, tuple)) else [images]


def _title_series(key: str) -> tuple[str, str]:
    """Return ClearML's (title, series) for ``key``: "title/series", or the key twice."""
    title, _, series = key.partition("/")
    return title, series or title


def _check_table(tracker: str, columns: Any, data: Any, dataframe: Any) -> None:
    # A table is columns + rows or a dataframe: both, or neither, is ambiguous.
    if (dataframe is None) == (data is None):
        raise ValueError(
            f"{tracker}.log_table: give either `data` (rows, with `columns`) or `dataframe`, "
            f"not {'both' if dataframe is not None else 'neither'}"
        )


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

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """Return None; write each ``{name: batch of images}`` with ``SummaryWriter.add_images`` (``kwargs`` passed on)."""
        for key, images in values.items():
            self.writer.add_images(key, images, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class _ProjectRunTracker(GeneralTracker):
    """A tracker whose library starts a run with ``init(project=run_name, **kwargs)`` (module = ``name``)."""

    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self._library = _require(self.name, self.name, self.name)
        self.run_name = run_name
        self.run = self._library.init(project=run_name, **kwargs)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._library.config.update(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class _ImageRunTracker(_ProjectRunTracker):
    """A project-run tracker whose library wraps images in ``<library>.Image`` for ``run.log``."""

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """Return None; log each ``{name: image or list of images}`` as the library's ``Image`` objects with ``run.log``."""
        logged = {
            key: [self._library.Image(image) for image in _image_list(key, images)]
            for key, images in values.items()
        }
        self.run.log(logged, step=step, **kwargs)


class WandBTracker(_ImageRunTracker):
    """Log to Weights & Biases (needs ``wandb``)."""

    name = "wandb"

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    @on_main_process
    def log_table(
        self,
        table_name: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Return None; log a ``wandb.Table`` (``columns`` + ``data`` rows, or a ``dataframe``) under ``table_name``."""
        _check_table("WandBTracker", columns, data, dataframe)
        table = self._library.Table(columns=columns, data=data, dataframe=dataframe)
        self.run.log({table_name: table}, step=step, **kwargs)


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
        self.run.log_parameters(values)

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

    @on_main_process
    def log_images(
        self, values: dict, step: int | None = None, kwargs: dict[str, dict] | None = None
    ) -> None:
        """Return None; track each ``{name: image or (image, caption)}`` as an ``aim.Image``.

        ``kwargs`` holds the keyword arguments of ``aim.Image`` under ``"aim_image"`` and of ``Run.track``
        under ``"track"``; another key raises ValueError.
        """
        kwargs = dict(kwargs or {})
        unknown = sorted(set(kwargs) - {"aim_image", "track"})
        if unknown:
            raise ValueError(
                f"AimTracker.log_images: kwargs keys must be 'aim_image' and/or 'track', got {unknown}"
            )
        aim = _require("aim", "aim", self.name)
        for key, value in values.items():
            image, caption = value if isinstance(value, tuple) else (value, "")
            aim_image = aim.Image(image, caption=caption, **kwargs.get("aim_image", {}))
            self.run.track(aim_image, name=key, step=step, **kwargs.get("track", {}))

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

    @on_main_process
    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """Return None; upload the file ``local_path`` to the run's artifacts (under ``artifact_path`` when given)."""
        if not os.path.isfile(local_path):
            raise FileNotFoundError(f"MLflowTracker.log_artifact: {local_path!r} is not a file")
        self._mlflow.log_artifact(local_path=local_path, artifact_path=artifact_path)

    @on_main_process
    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        """Return None; upload everything in the directory ``local_dir`` to the run's artifacts."""
        if not os.path.isdir(local_dir):
            raise NotADirectoryError(f"MLflowTracker.log_artifacts: {local_dir!r} is not a directory")
        self._mlflow.log_artifacts(local_dir=local_dir, artifact_path=artifact_path)

    @on_main_process
    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        """Return None; save a matplotlib/plotly ``figure`` as the run artifact ``artifact_file`` (``mlflow.log_figure``)."""
        self._mlflow.log_figure(figure=figure, artifact_file=artifact_file, **save_kwargs)

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
        kwargs.setdefault("task_name", run_name)
        self.run = clearml.Task.init(**kwargs)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.connect_configuration(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        reporter = self.run.get_logger()
        for key, value in values.items():
            value = _plain(value)
            if not isinstance(value, (int, float)):
                logger.warning("ClearML: %r is a %s, not a scalar: not reported", key, type(value).__name__)
            elif step is None:
                reporter.report_single_value(name=key, value=value, **kwargs)
            else:
                # As 1.15: an eval_/test_/train_ prefix names the series; any other key is a "train" series.
                split, _, rest = key.partition("_")
                title, series = (
                    (rest, split) if split in ("eval", "test", "train") and rest else (key, "train")
                )
                reporter.report_scalar(title=title, series=series, value=value, iteration=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """Return None; report each image of ``{"title/series": images}`` with ``Logger.report_image``."""
        reporter = self.run.get_logger()
        for key, images in values.items():
            title, series = _title_series(key)
            for image in _image_list(key, images):
                reporter.report_image(title=title, series=series, iteration=step, image=image, **kwargs)

    @on_main_process
    def log_table(
        self,
        table_name: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Return None; report a table (``columns`` + ``data`` rows, or a ``dataframe``) with ``Logger.report_table``.

        Without ``columns`` the first row of ``data`` is the header, as ClearML reads a list of lists.
        """
        _check_table("ClearMLTracker", columns, data, dataframe)
        table = (
            dataframe
            if dataframe is not None
            else ([list(columns)] if columns else []) + [list(row) for row in data]
        )
        title, series = _title_series(table_name)
        self.run.get_logger().report_table(
            title=title, series=series, iteration=step, table_plot=table, **kwargs
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
        from dvclive.error import InvalidDataTypeError

        self._refused = InvalidDataTypeError
        self.run_name = run_name
        self.run = live if live is not None else dvclive.Live(**kwargs)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.log_params(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log each value DVCLive takes as a metric (a number, a bool, a string); warn about and skip the rest.

        A 0-d tensor or numpy scalar is logged as its number (1.15 drops a tensor). Each call ends
        DVCLive's step (``Live.next_step``: the summary in ``metrics.json``); ``step`` sets it first.
        """
        if step is not None:
            self.run.step = step
        for key, value in values.items():
            value = _plain(value)
            try:
                self.run.log_metric(key, value, **kwargs)
            except self._refused:
                logger.warning(
                    "DVCLiveTracker: %r is a %s, which DVCLive cannot log as a metric (a number or a string): "
                    "not logged",
                    key,
                    type(value).__name__,
                )
        self.run.next_step()

    def finish(self) -> None:
        self.run.end()


class SwanLabTracker(_ImageRunTracker):
    """Log to SwanLab (needs ``swanlab``)."""

    name = "swanlab"

    def finish(self) -> None:
        self._library.finish()


class TrackioTracker(_ProjectRunTracker):
    """Log to Trackio (needs ``trackio``)."""

    name = "trackio"
