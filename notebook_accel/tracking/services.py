"""The trackers of the hosted services: TensorBoard, W&B, Comet ML, Aim, MLflow, ClearML, DVCLive, SwanLab, Trackio.

Each imports its package when built (ImportError naming it when missing) and logs through that
package's own API. As in Accelerate 1.15, building a tracker only records its arguments: the run
(a writer, a W&B/Comet/Aim/MLflow run, a ClearML task, a DVCLive ``Live``) opens in ``start()``,
which ``Accelerator.init_trackers`` calls on the processes that log, so a tracker built before the
Accelerator asks for no API key, writes no file and holds no task. Re-exported by ``notebook_accel.tracking`` (where Accelerate serves them).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from ..utils.environment import str_to_bool
from .base import GeneralTracker, _plain, _require, logging_dir_message, on_main_process

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


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _as_called_by_user(function: Any, **kwargs: Any) -> Any:
    """Return ``function(**kwargs)``, called from a frame named after the first caller outside notebook_accel.

    ``clearml.Task.init`` records the file of its caller as the task's script, and when Python runs
    ``-m module`` (pytest, say) it analyses that file's repository: the git diff and the imports of the
    whole checkout, which ``Task.close`` then waits for (up to 5 minutes). Called from our own module that
    is notebook_accel's checkout when it is installed from one, so the caller is the user's file instead.
    """
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR + os.sep):
        frame = frame.f_back
    if frame is None or not os.path.isfile(frame.f_code.co_filename):
        return function(**kwargs)
    namespace: dict[str, Any] = {}
    exec(compile("def call(f, k):\n    return f(**k)\n", frame.f_code.co_filename, "exec"), namespace)
    return namespace["call"](function, kwargs)


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

    def __init__(self, run_name: str, logging_dir: str | os.PathLike | None, **kwargs: Any) -> None:
        super().__init__()
        _require("tensorboard", "tensorboard", self.name)
        self.run_name = run_name
        self.logging_dir_param = logging_dir
        self.logging_dir = None if logging_dir is None else os.path.join(logging_dir, run_name)
        self.init_kwargs = kwargs

    @property
    def writer(self) -> Any:
        """Return the ``SummaryWriter`` ``start()`` opened (None before)."""
        return self.run

    def start(self) -> None:
        """Open the ``SummaryWriter`` in ``logging_dir/run_name``; ValueError (1.15's text) without a logging dir."""
        if self.run is not None:
            return
        if self.logging_dir is None:
            raise ValueError(logging_dir_message(self.name))
        from torch.utils.tensorboard import SummaryWriter

        self.run = SummaryWriter(self.logging_dir, **self.init_kwargs)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._active().add_hparams(values, metric_dict={})
        self.writer.flush()

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._active()
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
            self._active().add_images(key, images, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        self._active().close()


class _ProjectRunTracker(GeneralTracker):
    """A tracker whose library starts a run with ``init(project=run_name, **kwargs)`` (module = ``name``)."""

    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self._library = _require(self.name, self.name, self.name)
        self.run_name = run_name
        self.init_kwargs = kwargs

    def start(self) -> None:
        """Start the library's run: ``init(project=run_name, **kwargs)``."""
        if self.run is None:
            self.run = self._library.init(project=self.run_name, **self.init_kwargs)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._active()
        self._library.config.update(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._active().log(values, step=step, **kwargs)

    def finish(self) -> None:
        self._active().finish()


class _ImageRunTracker(_ProjectRunTracker):
    """A project-run tracker whose library wraps images in ``<library>.Image`` for ``run.log``."""

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """Return None; log each ``{name: image or list of images}`` as the library's ``Image`` objects with ``run.log``."""
        logged = {
            key: [self._library.Image(image) for image in _image_list(key, images)]
            for key, images in values.items()
        }
        self._active().log(logged, step=step, **kwargs)


class WandBTracker(_ImageRunTracker):
    """Log to Weights & Biases (needs ``wandb``)."""

    name = "wandb"

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._active().config.update(values, allow_val_change=True)

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
        self._active().log({table_name: table}, step=step, **kwargs)


class CometMLTracker(GeneralTracker):
    """Log to Comet ML (needs ``comet_ml``)."""

    name = "comet_ml"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self._comet_ml = _require("comet_ml", "comet_ml", self.name)
        self.run_name = run_name
        self.init_kwargs = kwargs

    @property
    def writer(self) -> Any:
        """Return the Comet experiment ``start()`` opened (None before), 1.15's attribute name."""
        return self.run

    def start(self) -> None:
        """Start the experiment: ``comet_ml.start(project_name=run_name, **kwargs)``."""
        if self.run is None:
            self.run = self._comet_ml.start(project_name=self.run_name, **self.init_kwargs)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._active().log_parameters(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._active()
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
        self._active().end()


class AimTracker(GeneralTracker):
    """Log to Aim (needs ``aim``)."""

    name = "aim"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike | None = ".", **kwargs: Any) -> None:
        super().__init__()
        _require("aim", "aim", self.name)
        self.run_name = run_name
        # A `repo` among the keyword arguments names the repository itself (1.15 passes both to
        # aim.Run, which raises "got multiple values for keyword argument 'repo'").
        self.aim_repo_path = str(kwargs.pop("repo", "." if logging_dir is None else logging_dir))
        self.init_kwargs = kwargs

    @property
    def writer(self) -> Any:
        """Return the ``aim.Run`` ``start()`` opened (None before), 1.15's attribute name."""
        return self.run

    def start(self) -> None:
        """Open an ``aim.Run`` in the repository ``logging_dir`` (or ``repo=``), named ``run_name``."""
        if self.run is not None:
            return
        import aim

        self.run = aim.Run(repo=self.aim_repo_path, **self.init_kwargs)
        self.run.name = self.run_name

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._active()["hparams"] = values

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        run = self._active()
        for key, value in values.items():
            run.track(_plain(value), name=key, step=step, **kwargs)

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
            self._active().track(aim_image, name=key, step=step, **kwargs.get("track", {}))

    def finish(self) -> None:
        self._active().close()


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
        self.experiment_name = experiment_name
        self.logging_dir = logging_dir
        self.run_id = run_id
        self.tags = tags
        self.nested_run = nested_run
        self.run_name = run_name
        self.description = description

    @property
    def active_run(self) -> Any:
        """Return the MLflow run ``start()`` opened (None before), 1.15's attribute name."""
        return self.run

    def start(self) -> None:
        """Point MLflow at ``logging_dir``, create the experiment if new, and start (or resume) the run."""
        if self.run is not None:
            return
        mlflow = self._mlflow
        if self.logging_dir is not None:
            mlflow.set_tracking_uri(str(self.logging_dir))
        name = self.experiment_name
        experiment = mlflow.get_experiment_by_name(name) if name else None
        if name and experiment is None:
            experiment_id = mlflow.create_experiment(name)
        else:
            experiment_id = experiment.experiment_id if experiment else None
        self.run = mlflow.start_run(
            run_id=self.run_id,
            experiment_id=experiment_id,
            run_name=self.run_name,
            nested=bool(self.nested_run),
            tags=self.tags,
            description=self.description,
        )

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        # MLflow caps parameter values at 500 characters; longer ones are dropped with a note.
        kept = {k: v for k, v in values.items() if len(str(v)) <= 500}
        for key in set(values) - set(kept):
            logger.warning("MLflow: parameter %r is longer than 500 characters and was not logged", key)
        self._active()
        self._mlflow.log_params(kept)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._active()
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
        self._active()
        self._mlflow.end_run()


class ClearMLTracker(GeneralTracker):
    """Log to ClearML (needs ``clearml``)."""

    name = "clearml"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        self._clearml = _require("clearml", "clearml", self.name)
        self.run_name = run_name
        self.init_kwargs = kwargs
        self._initialized_externally = False

    @property
    def task(self) -> Any:
        """Return the ClearML task ``start()`` opened or joined (None before), 1.15's attribute name."""
        return self.run

    def start(self) -> None:
        """Join the task already running in this process, or ``Task.init`` one named by ``run_name``.

        A task this tracker opened is closed by ``finish()`` (``Accelerator.end_training``), so the next
        run may open another (another project name included); a task opened before is left open.
        """
        if self.run is not None:
            return
        current = self._clearml.Task.current_task()
        self._initialized_externally = current is not None
        if current is not None:
            self.run = current
            return
        kwargs = dict(self.init_kwargs)
        kwargs.setdefault("project_name", self.run_name)
        kwargs.setdefault("task_name", self.run_name)
        self.run = _as_called_by_user(self._clearml.Task.init, **kwargs)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._active().connect_configuration(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        reporter = self._active().get_logger()
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
        reporter = self._active().get_logger()
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
        self._active().get_logger().report_table(
            title=title, series=series, iteration=step, table_plot=table, **kwargs
        )

    def finish(self) -> None:
        task = self._active()
        if not self._initialized_externally:
            task.close()
        self.run = None  # a later start() opens (or joins) a task again


class DVCLiveTracker(GeneralTracker):
    """Log with DVCLive (needs ``dvclive``)."""

    name = "dvclive"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, live: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self._dvclive = _require("dvclive", "dvclive", self.name)
        from dvclive.error import InvalidDataTypeError

        self._refused = InvalidDataTypeError
        self.run_name = run_name
        self._given_live = live
        self.init_kwargs = kwargs

    @property
    def live(self) -> Any:
        """Return the ``dvclive.Live`` in use: the one given, or the one ``start()`` made (1.15's attribute)."""
        return self.run if self.run is not None else self._given_live

    def start(self) -> None:
        """Use the ``live`` given, or open ``dvclive.Live(**kwargs)`` (which writes ``dvclive/``)."""
        if self.run is None:
            self.run = (
                self._given_live if self._given_live is not None else self._dvclive.Live(**self.init_kwargs)
            )

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._active().log_params(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log each value DVCLive takes as a metric (a number, a bool, a string); warn about and skip the rest.

        A 0-d tensor or numpy scalar is logged as its number (1.15 drops a tensor). Each call ends
        DVCLive's step (``Live.next_step``: the summary in ``metrics.json``); ``step`` sets it first.
        """
        live = self._active()
        if step is not None:
            live.step = step
        for key, value in values.items():
            value = _plain(value)
            try:
                live.log_metric(key, value, **kwargs)
            except self._refused:
                logger.warning(
                    "DVCLiveTracker: %r is a %s, which DVCLive cannot log as a metric (a number or a string): "
                    "not logged",
                    key,
                    type(value).__name__,
                )
        live.next_step()

    def finish(self) -> None:
        self._active().end()


class SwanLabTracker(_ImageRunTracker):
    """Log to SwanLab (needs ``swanlab``)."""

    name = "swanlab"

    def finish(self) -> None:
        self._library.finish()


class TrackioTracker(_ProjectRunTracker):
    """Log to Trackio (needs ``trackio``)."""

    name = "trackio"
