"""Programs about when a tracker starts, run under Accelerate 1.15 (scripts/record_tracker_start_goldens.py) and us.

``PROGRAMS[name](lib, workdir)`` runs offline in ``workdir`` (the caller sets ``tracker_env`` and the
network guards of ``tests/tracker_programs.py`` first) and returns plain JSON: what building the seven
trackers wrote (nothing, in 1.15), the error of TensorBoard/Aim without a logging directory, DVCLive's
stored steps for ``log`` calls with and without ``step``, and two ClearML runs with other project names
in one process. ``tests/test_trackers_real.py`` compares ours with ``tests/data/goldens/tracker_start.json``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

from tests.tracker_programs import read_dvclive

# The seven trackers of Accelerate 1.15 and the arguments each is built with.
BUILT = {
    "TensorBoardTracker": ("run", "tb_logs"),
    "WandBTracker": ("run",),
    "CometMLTracker": ("run",),
    "AimTracker": ("run", "aim_repo"),
    "MLflowTracker": ("run",),
    "ClearMLTracker": ("run",),
    "DVCLiveTracker": ("run",),
}
PACKAGES = {
    "TensorBoardTracker": "tensorboard",
    "WandBTracker": "wandb",
    "CometMLTracker": "comet_ml",
    "AimTracker": "aim",
    "MLflowTracker": "mlflow",
    "ClearMLTracker": "clearml",
    "DVCLiveTracker": "dvclive",
}


def _files(workdir: str) -> list[str]:
    out = []
    for folder, _, files in os.walk(workdir):
        out += [os.path.relpath(os.path.join(folder, f), workdir) for f in files]
    return sorted(out)


def build_without_start(lib: Any, workdir: str) -> dict:
    """Return, per tracker whose library is installed, the files written and the error raised by building it."""
    tracking = importlib.import_module(lib.__name__ + ".tracking")
    out = {}
    for cls, args in BUILT.items():
        if importlib.util.find_spec(PACKAGES[cls]) is None:
            continue
        before = set(_files(workdir))
        try:
            getattr(tracking, cls)(*args)
            error = None
        except Exception as exc:  # noqa: BLE001 - the error is the fact compared
            error = [type(exc).__name__, str(exc)]
        out[cls] = {"new_files": sorted(set(_files(workdir)) - before), "error": error}
    return out


def no_logging_dir(lib: Any, workdir: str) -> dict:
    """Return the error of ``Accelerator(log_with=name)`` without a project dir, for TensorBoard and Aim."""
    out = {}
    for name in ("tensorboard", "aim"):
        try:
            lib.Accelerator(log_with=name)
            out[name] = None
        except Exception as exc:  # noqa: BLE001
            out[name] = [type(exc).__name__, str(exc).splitlines()[0]]
    return out


def dvclive_steps(lib: Any, workdir: str) -> dict:
    """Return what DVCLive stored for a tracker built before the Accelerator and logs with and without steps."""
    tracking = importlib.import_module(lib.__name__ + ".tracking")
    tracker = tracking.DVCLiveTracker("ignored", dir="custom")
    built = _files(workdir)
    accelerator = lib.Accelerator(log_with=[tracker])
    accelerator.init_trackers("project", config={"lr": 0.5})
    for values, step in (({"loss": 1.0}, None), ({"loss": 0.5}, None), ({"loss": 0.25}, 5),
                         ({"loss": 0.2, "acc": 0.1}, 5), ({"loss": 0.1}, 3), ({"acc": 0.3}, None)):  # fmt: skip
        accelerator.log(values, step=step)
    accelerator.end_training()
    return {"files_after_build": built, "written": read_dvclive(workdir)}


def clearml_two_projects(lib: Any, workdir: str) -> dict:
    """Return the project of each of two runs with other project names in one process, and the open task after."""
    import clearml

    projects = []
    for project in ("first_project", "second_project"):
        accelerator = lib.Accelerator(log_with="clearml")
        accelerator.init_trackers(
            project, init_kwargs={"clearml": {"auto_connect_frameworks": {"detect_repository": False}}}
        )
        accelerator.log({"loss": 1.0}, step=1)
        task = accelerator.get_tracker("clearml", unwrap=True)
        projects.append([task.get_project_name(), task.name])
        accelerator.end_training()
    return {"projects": projects, "task_open_after": clearml.Task.current_task() is not None}


PROGRAMS: dict[str, Callable[[Any, str], dict]] = {
    "build_without_start": build_without_start,
    "no_logging_dir": no_logging_dir,
    "dvclive_steps": dvclive_steps,
    "clearml_two_projects": clearml_two_projects,
}
# The libraries each program needs (build_without_start builds those installed).
NEEDS: dict[str, tuple[str, ...]] = {
    "build_without_start": (),
    "no_logging_dir": ("tensorboard", "aim"),
    "dvclive_steps": ("dvclive",),
    "clearml_two_projects": ("clearml",),
}


def run_in_child(python: str, lib: str, program: str, workdir: str, root: str) -> dict:
    """Return ``PROGRAMS[program]``'s JSON, run with ``lib`` by ``python`` in a child, offline, in ``workdir``.

    The child gets ``tracker_env`` and the network guards; a refused connection fails the run.
    """
    import json
    import subprocess

    from tests.tracker_programs import tracker_env

    code = (
        f"import json, sys; sys.path.insert(0, {root!r}); import {lib} as lib; "
        "from tests.tracker_programs import network_guards; refused = []; "
        "[setattr(o, n, v) for o, n, v in network_guards(refused)]; "
        f"from tests.tracker_start_programs import PROGRAMS; out = PROGRAMS[{program!r}](lib, {workdir!r}); "
        "print('RESULT ' + json.dumps({'out': out, 'refused': refused}))"
    )
    env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}, **tracker_env(workdir)}
    proc = subprocess.run(
        [python, "-c", code], cwd=workdir, env=env, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{program} under {lib} failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    if result["refused"]:
        raise RuntimeError(f"{program} under {lib} went to the network: {result['refused']}")
    return result["out"]
