"""The same tracker calls, run under Accelerate 1.15 (scripts/record_tracker_goldens.py) and under us.

``run_program(lib, tracker, workdir)`` builds ``lib.Accelerator(log_with=tracker, project_dir=workdir)``,
calls ``init_trackers`` / ``log`` / ``end_training`` the same way, then ``read_<tracker>(workdir)``
turns what the tracker's real library wrote into plain JSON: file layout, scalars by tag and step,
texts, parameters. Only facts that do not depend on time or random ids are kept.
"""

from __future__ import annotations

import os
import re
from typing import Any

CONFIG = {"lr": 0.1, "layers": 2, "optimizer": "sgd", "use_bias": True}
LOGS = [
    ({"loss": 1.5, "accuracy": 0.25}, 0),
    ({"loss": 1.0, "note": "halfway"}, 1),
    ({"loss": 0.5, "per_class": {"a": 0.75, "b": 0.5}, "eval_loss": 0.75, "test_acc/top1": 0.5}, 2),
]


def tracker_env(workdir: str) -> dict[str, str]:
    """Return the environment both runs get: offline modes, MLflow's file store in ``workdir/mlruns``."""
    return {
        "HOME": workdir,
        "MLFLOW_TRACKING_URI": f"file://{os.path.join(workdir, 'mlruns')}",
        "WANDB_MODE": "offline",
        "COMET_MODE": "offline",
        "HF_HUB_OFFLINE": "1",
        "MLFLOW_ALLOW_FILE_STORE": "true",
        "COMET_START_ONLINE": "0",
        "CLEARML_OFFLINE_MODE": "1",
        "COMET_OFFLINE_DIRECTORY": os.path.join(workdir, "comet"),
        "DVC_NO_ANALYTICS": "1",
        "DVC_STUDIO_OFFLINE": "1",
        # Comet, even offline, reports its own errors to Sentry and asks the cloud metadata address
        # (169.254.169.254) which cloud it runs on, unless told not to.
        "COMET_ERROR_TRACKING_ENABLE": "false",
        "COMET_AUTO_LOG_ENV_DETAILS": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",  # else MLflow asks config.mlflow-telemetry.io
        "DO_NOT_TRACK": "1",
    }


ERRORS_FILE = "program_errors.json"
# Trackers whose 1.15 class has ``log_images``: the program logs one small image (with a caption) to them.
IMAGE_TRACKERS = {"aim"}


def _image() -> Any:
    import numpy as np

    return (np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3) * 2, "a gradient")


def _is_local(host: Any) -> bool:
    import ipaddress

    name = host.decode() if isinstance(host, bytes) else host
    if name in (None, "", "localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def network_guards(refused: list) -> list[tuple[Any, str, Any]]:
    """Return ``(owner, attribute, replacement)`` triples that keep this process off the network.

    The replacements of ``socket.socket.connect`` / ``connect_ex`` and ``socket.getaddrinfo`` refuse
    (``OSError`` / ``socket.gaierror``) any address or name beyond the loopback and record it in
    ``refused``; a Unix socket (W&B's service) passes. ClearML asks updates.clear.ml for a newer
    release at ``Task.init``, offline or not, with no switch to turn that off: its check is marked done.
    """
    import importlib.util
    import socket

    def guard(method: Any) -> Any:
        def connect(sock: socket.socket, address: Any) -> Any:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and not _is_local(address[0]):
                refused.append(list(address[:2]))
                raise OSError(f"tracker tests: connection to {address[:2]} refused (the tests run offline)")
            return method(sock, address)

        return connect

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_local(host):
            refused.append([host, args[0] if args else None])
            raise socket.gaierror(socket.EAI_NONAME, f"tracker tests: no lookup of {host!r} (offline)")
        return real_getaddrinfo(host, *args, **kwargs)

    real_getaddrinfo = socket.getaddrinfo
    guards = [
        (socket.socket, "connect", guard(socket.socket.connect)),
        (socket.socket, "connect_ex", guard(socket.socket.connect_ex)),
        (socket, "getaddrinfo", getaddrinfo),
    ]
    if importlib.util.find_spec("clearml") is not None:
        from clearml.utilities.check_updates import CheckPackageUpdates

        guards.append((CheckPackageUpdates, "_package_version_checked", True))
    return guards


def go_offline(monkeypatch: Any, workdir: str) -> list:
    """Return the list of refused connections; keep this test's tracker libraries on this machine.

    Sets every tracker library's offline switch (``tracker_env``: W&B, Comet and ClearML offline, MLflow's
    file store, DVC without analytics, ``HOME`` in ``workdir``), runs in ``workdir`` (DVCLive and MLflow
    write to the current folder) and puts ``network_guards`` in place, so a library that goes out anyway
    is refused and shows up in the list (the test asserts it empty) instead of reaching the network.
    """
    for key, value in tracker_env(workdir).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(workdir)
    refused: list = []
    for owner, attribute, replacement in network_guards(refused):
        monkeypatch.setattr(owner, attribute, replacement)
    return refused


def jsonl_beside_all(workdir: str) -> dict:
    """Run ``log_with=["jsonl", "all"]`` offline in ``workdir`` (in a child: the libraries patch the process).

    Return the started trackers' names, whether ``get_tracker("jsonl", unwrap=True)`` is the jsonl run,
    and the connections refused. Two library settings differ from their defaults: ClearML's repository
    detection (git in a thread) is off, and so is Aim's terminal capture: with Comet's beside it, the two
    stdout wrappers end up calling each other and ``end_training`` dies of a RecursionError (1.15 too).
    """
    import torch

    import notebook_accel
    from notebook_accel.utils.package_checks import is_aim_available, is_clearml_available

    for key, value in tracker_env(workdir).items():
        os.environ[key] = value
    os.chdir(workdir)
    refused: list = []
    for owner, attribute, replacement in network_guards(refused):
        setattr(owner, attribute, replacement)
    init_kwargs: dict = {}
    if is_clearml_available():
        init_kwargs["clearml"] = {"auto_connect_frameworks": {"detect_repository": False}}
    if is_aim_available():
        init_kwargs["aim"] = {"capture_terminal_logs": False}
    accelerator = notebook_accel.Accelerator(cpu=True, project_dir=workdir, log_with=["jsonl", "all"])
    accelerator.init_trackers("run1", config={"lr": 0.1}, init_kwargs=init_kwargs)
    accelerator.log({"loss": torch.tensor(0.5), "acc": 1}, step=3)
    unwrapped = accelerator.get_tracker("jsonl", unwrap=True) is accelerator.get_tracker("jsonl").run
    names = [tracker.name for tracker in accelerator.trackers]
    accelerator.end_training()
    return {"trackers": names, "unwrapped_is_run": unwrapped, "refused": refused}


def run_program(lib: Any, tracker: str, workdir: str) -> None:
    """Run the tracker calls with library ``lib`` (``accelerate`` or ``notebook_accel``) in ``workdir``.

    A ``log`` call that raises (Aim refuses a string, as its library does under 1.15) is written to
    ``workdir/program_errors.json`` as ``[step, exception type, message]`` and the program goes on.
    """
    import json

    accelerator = lib.Accelerator(log_with=tracker, project_dir=workdir)
    accelerator.init_trackers("golden_run", config=dict(CONFIG))
    errors = []
    for values, step in LOGS:
        try:
            accelerator.log(values, step=step)
        except Exception as error:  # noqa: BLE001 - the error is the fact compared
            errors.append([step, type(error).__name__, str(error)])
    if tracker in IMAGE_TRACKERS:
        accelerator.get_tracker(tracker).log_images({"sample": _image()}, step=3)
    accelerator.end_training()
    if errors:
        with open(os.path.join(workdir, ERRORS_FILE), "w", encoding="utf-8") as handle:
            json.dump(errors, handle)


def read_errors(workdir: str) -> list:
    """Return the ``[step, exception type, message]`` of each ``log`` call that raised ([] if none did)."""
    import json

    path = os.path.join(workdir, ERRORS_FILE)
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _round(value: float) -> float:
    return round(float(value), 6)


def read_tensorboard(workdir: str) -> dict:
    """Return the runs' folders (relative), and per folder the scalars, texts and plugin tags written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict = {}
    for folder, _, files in sorted(os.walk(workdir)):
        if not any(f.startswith("events.out.tfevents") for f in files):
            continue
        acc = EventAccumulator(folder, size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        tags = acc.Tags()
        scalars = {
            t: [[e.step, _round(e.value)] for e in acc.Scalars(t)] for t in sorted(tags.get("scalars", []))
        }
        texts = {}
        for tag in sorted(tags.get("tensors", [])):
            events = acc.Tensors(tag)
            texts[tag] = [[e.step, [s.decode() for s in e.tensor_proto.string_val]] for e in events]
        try:
            plugins = sorted(acc.PluginTagToContent("hparams"))
        except KeyError:  # no hparams written in this folder
            plugins = []
        # add_hparams writes into a sub-folder named by the time: that name is not a fact
        parts = [
            "<time>" if re.fullmatch(r"\d+\.\d+", p) else p
            for p in os.path.relpath(folder, workdir).split(os.sep)
        ]
        out["/".join(parts)] = {
            "event_files": sum(f.startswith("events.out.tfevents") for f in files),
            "scalars": scalars,
            "texts": texts,
            "hparams_tags": plugins,
        }
    return out


def read_mlflow(workdir: str) -> dict:
    """Return every experiment of the file store under ``workdir``: its runs' params, metrics and status."""
    import mlflow

    stores = [os.path.join(workdir, d) for d in ("", "mlruns")]
    out: dict = {}
    for store in stores:
        if not os.path.isdir(store) or not any(os.path.isfile(os.path.join(store, d, "meta.yaml"))
                                               for d in os.listdir(store)):  # fmt: skip
            continue
        client = mlflow.tracking.MlflowClient(tracking_uri=f"file://{os.path.abspath(store)}")
        for experiment in client.search_experiments():
            runs = []
            for run in client.search_runs([experiment.experiment_id]):
                metrics = {
                    key: [[m.step, _round(m.value)] for m in client.get_metric_history(run.info.run_id, key)]
                    for key in sorted(run.data.metrics)
                }
                runs.append({"params": dict(sorted(run.data.params.items())), "metrics": metrics,
                             "status": run.info.status, "run_name_given": run.info.run_name == "golden_run"})  # fmt: skip
            out[experiment.name] = {"store": os.path.relpath(store, workdir), "runs": runs}
    return out


def _wandb_records(path: str) -> list[bytes]:
    """Return the records of a W&B ``.wandb`` file (a 7-byte header, then a LevelDB-style log of 32 KiB blocks)."""
    import struct

    raw = open(path, "rb").read()
    block, pos, records, pending = 32768, 7, [], b""
    while pos + 7 <= len(raw):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):
            pos += left  # block trailer / padding
            continue
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = data if kind in (1, 2) else pending + data
        if kind in (1, 4):  # full record, or the last piece of one
            records.append(pending)
            pending = b""
    return records


def read_wandb(workdir: str) -> dict:
    """Return the offline runs' project, config, history rows (step, values) and final summary values."""
    import glob
    import json

    from wandb.proto import wandb_internal_pb2

    runs = []
    for path in sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))):
        run: dict = {"config": {}, "history": [], "summary": {}, "kinds": []}
        for data in _wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind in ("run", "config", "history", "summary", "exit"):
                run["kinds"].append(kind) if kind not in run["kinds"] else None
            if kind == "run":
                run["project"] = record.run.project
            elif kind == "config":
                run["config"].update({"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                                      for i in record.config.update if not i.key.startswith("_")})  # fmt: skip
            elif kind == "history":
                items = {
                    "/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item
                }
                run["history"].append(
                    [record.history.step.num, {k: v for k, v in items.items() if k[0] != "_"}]
                )
            elif kind == "summary":
                run["summary"].update({"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                                       for i in record.summary.update if not (i.key or i.nested_key[0]).startswith("_")})  # fmt: skip
        runs.append(run)
    return {"offline_runs": runs}


def read_comet_ml(workdir: str) -> dict:
    """Return each offline experiment archive's project, parameters, metrics and other values (no system data)."""
    import glob
    import json
    import zipfile

    out = []
    for path in sorted(glob.glob(os.path.join(workdir, "comet", "*.zip"))):
        with zipfile.ZipFile(path) as archive:
            experiment = json.loads(archive.read("experiment.json"))
            messages = [
                json.loads(line) for line in archive.read("messages.json").decode().splitlines() if line
            ]
        params, metrics, others = [], [], {}
        for message in messages:
            payload = message["payload"]
            # left out: the command line (run_arg_*), system data (sys.*), the run's duration
            if message["type"] == "parameter_msg" and not payload["param"]["paramName"].startswith(
                "run_arg_"
            ):
                p = payload["param"]
                params.append([p["paramName"], p["paramValue"], p["step"]])
            elif message["type"] == "metric_msg" and not payload["metric"]["metricName"].startswith(
                ("sys.", "process duration")
            ):
                m = payload["metric"]
                metrics.append([m["metricName"], m["metricValue"], m["step"]])
            elif message["type"] == "log_other" and not payload["key"].startswith("sys."):
                others[payload["key"]] = payload["value"]
        out.append({"project_name": experiment["project_name"], "tags": experiment["tags"],
                    "parameters": params, "metrics": metrics, "others": others})  # fmt: skip
    return {"offline_experiments": out}


def read_clearml(workdir: str) -> dict:
    """Return each offline ClearML session's task name, project, configuration and reported scalars."""
    import glob
    import json

    sessions = []
    for folder in sorted(glob.glob(os.path.join(workdir, ".clearml", "cache", "offline", "offline-*"))):
        if not os.path.isdir(folder):
            continue
        with open(os.path.join(folder, "task.json"), encoding="utf-8") as handle:
            task = json.load(handle)
        events = []
        metrics_file = os.path.join(folder, "metrics.jsonl")
        if os.path.isfile(metrics_file):
            with open(metrics_file, encoding="utf-8") as handle:
                for line in handle:
                    events += [[e.get("type"), e.get("metric"), e.get("variant"), e.get("value"), e.get("iter")]
                               for e in json.loads(line)]  # fmt: skip
        sessions.append({"name": task.get("name"), "project_name": task.get("project_name"),
                         "configuration": task.get("configuration"), "events": events})  # fmt: skip
    return {"offline_sessions": sessions}


def _aim_image(image: Any) -> list:
    """Return an ``aim.Image``'s caption, format, size and a digest of its pixels."""
    import hashlib

    pixels = image.to_pil_image()
    return [image.caption, image.format, [image.width, image.height], pixels.mode,
            hashlib.sha256(pixels.tobytes()).hexdigest()[:16]]  # fmt: skip


def read_aim(workdir: str) -> dict:
    """Return the Aim repo's runs, read back through Aim's API: name, hparams, metrics and images by name.

    A closed run is read once Aim has indexed it (what ``aim up`` does in the background): the reader
    asks Aim's index manager for it. Aim's own system metrics (``__system__*``: CPU, memory) are left out.
    """
    import aim
    from aim.sdk.index_manager import RepoIndexManager

    repo = aim.Repo(workdir)
    runs = []
    for run_hash in repo.list_all_runs():
        RepoIndexManager.get_index_manager(repo).index(run_hash)
        run = aim.Run(run_hash, repo=workdir, read_only=True)
        metrics, images = {}, {}
        for metric in sorted(run.metrics(), key=lambda m: (m.name, str(m.context.to_dict()))):
            if metric.name.startswith("__system__"):
                continue
            steps, (values,) = metric.data.view("val").items_list()
            metrics[metric.name] = {"context": metric.context.to_dict(),
                                    "values": [[s, _round(v)] for s, v in zip(steps, values)]}  # fmt: skip
        for name, context, _ in run.iter_sequence_info_by_type(aim.Images.allowed_dtypes()):
            steps, (values,) = run.get_image_sequence(name, context).data.view("val").items_list()
            images[name] = {"context": context.to_dict(),
                            "values": [[s, _aim_image(v)] for s, v in zip(steps, values)]}  # fmt: skip
        runs.append({"name": run.name, "experiment": run.experiment, "active": run.active,
                     "hparams": run.get("hparams"), "metrics": metrics, "images": images})  # fmt: skip
    return {"runs": runs}


def read_dvclive(workdir: str) -> dict:
    """Return DVCLive's files under ``workdir`` (the program's cwd): dvc.yaml, metrics.json, params.yaml, plots."""
    import yaml

    out: dict = {"files": []}
    for folder, _, files in sorted(os.walk(workdir)):
        rel = os.path.relpath(folder, workdir)
        if rel.split(os.sep)[0] in (".cache", ".config", ".local"):  # HOME is workdir: other tools' caches
            continue
        out["files"] += sorted(os.path.normpath(os.path.join(rel, f)).replace(os.sep, "/") for f in files)
    out["files"] = sorted(f for f in out["files"] if f != ERRORS_FILE)
    for name in out["files"]:
        path = os.path.join(workdir, name)
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        if name.endswith((".yaml", ".json")):
            out[name] = yaml.safe_load(text)  # JSON is YAML; key order kept out of the comparison
        elif name.endswith(".tsv"):
            out[name] = [line.split("\t") for line in text.splitlines()]
    return out


READERS = {
    "aim": read_aim,
    "clearml": read_clearml,
    "dvclive": read_dvclive,
    "tensorboard": read_tensorboard,
    "mlflow": read_mlflow,
    "wandb": read_wandb,
    "comet_ml": read_comet_ml,
}
# The package each tracker needs, for the skip reason when it is missing.
PACKAGES = {
    "aim": "aim",
    "dvclive": "dvclive",
    "tensorboard": "tensorboard",
    "mlflow": "mlflow",
    "wandb": "wandb",
    "comet_ml": "comet_ml",
    "clearml": "clearml",
}
