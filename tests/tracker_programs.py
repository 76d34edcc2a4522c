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
    }


def run_program(lib: Any, tracker: str, workdir: str) -> None:
    """Run the tracker calls with library ``lib`` (``accelerate`` or ``notebook_accel``) in ``workdir``."""
    accelerator = lib.Accelerator(log_with=tracker, project_dir=workdir)
    accelerator.init_trackers("golden_run", config=dict(CONFIG))
    for values, step in LOGS:
        accelerator.log(values, step=step)
    accelerator.end_training()


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


READERS = {
    "clearml": read_clearml,
    "tensorboard": read_tensorboard,
    "mlflow": read_mlflow,
    "wandb": read_wandb,
    "comet_ml": read_comet_ml,
}
# The package each tracker needs, for the skip reason when it is missing.
PACKAGES = {
    "tensorboard": "tensorboard",
    "mlflow": "mlflow",
    "wandb": "wandb",
    "comet_ml": "comet_ml",
    "clearml": "clearml",
}
