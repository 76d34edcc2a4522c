"""Record what Accelerate 1.15's ``accelerate launch`` builders produce, as goldens for our ``utils.launch``.

For each command line of ``CASES`` this parses it with 1.15's ``launch_command_parser``, validates it
(``_validate_launch_command``, the defaults a launch without a config file gets) and calls each
``prepare_*`` builder on a copy of the namespace. What is recorded: the namespace the builders got (so
our test hands our builders the same one), the command list, the environment variables each builder
adds or changes (the inherited environment is a fixed clean one), and the attributes it adds to or
changes on the namespace (torchrun reads those). Run with the real Accelerate installed:

    python scripts/record_cli_goldens.py --python .venv/bin/python   # writes tests/data/goldens/cli_prepare.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from _recorder import CLEAN_ENV

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "goldens" / "cli_prepare.json"
OUT_COMMANDS = ROOT / "tests" / "data" / "goldens" / "cli_commands.json"
# A tiny GPT-2 built from its config alone (nothing downloaded) for ``estimate-memory``.
TINY_GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000, "n_positions": 128}
FSDP1_CONFIG = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "FSDP",
    "fsdp_config": {
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_backward_prefetch": "BACKWARD_PRE",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_forward_prefetch": False,
        "fsdp_offload_params": False,
        "fsdp_sharding_strategy": "FULL_SHARD",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_sync_module_states": True,
        "fsdp_transformer_layer_cls_to_wrap": "GPT2Block",
        "fsdp_use_orig_params": True,
        "fsdp_version": 1,
    },
    "machine_rank": 0,
    "main_training_function": "main",
    "mixed_precision": "bf16",
    "num_machines": 1,
    "num_processes": 2,
    "use_cpu": False,
}
TO_FSDP2_CASES = {
    "full_shard": FSDP1_CONFIG,
    "shard_grad_op": {
        **FSDP1_CONFIG,
        "fsdp_config": {**FSDP1_CONFIG["fsdp_config"], "fsdp_sharding_strategy": "SHARD_GRAD_OP"},
    },
    "no_shard_fsdp2_keys": {
        **FSDP1_CONFIG,
        "fsdp_config": {
            "fsdp_sharding_strategy": "NO_SHARD",
            "fsdp_activation_checkpointing": True,
            "fsdp_version": 1,
        },
    },
    "already_fsdp2": {
        **FSDP1_CONFIG,
        "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": False},
    },
}

CASES = {
    "cpu_two": ["--cpu", "--num_processes", "2", "--main_process_port", "29555", "s.py", "--x", "1"],
    "bf16_one": ["--num_processes", "1", "--mixed_precision", "bf16", "s.py"],
    "two_machines_c10d": [
        "--multi_gpu",
        "--num_processes",
        "4",
        "--num_machines",
        "2",
        "--machine_rank",
        "1",
        "--main_process_ip",
        "10.0.0.1",
        "--main_process_port",
        "29555",
        "--rdzv_backend",
        "c10d",
        "s.py",
    ],
    "fsdp2": [
        "--num_processes",
        "2",
        "--use_fsdp",
        "--fsdp_version",
        "2",
        "--fsdp_offload_params",
        "true",
        "--main_process_port",
        "29555",
        "s.py",
    ],
    "module_dynamo": [
        "-m",
        "--num_processes",
        "1",
        "--dynamo_backend",
        "inductor",
        "--dynamo_use_fullgraph",
        "pkg.mod",
        "--lr",
        "3",
    ],
    "deepspeed_z2": [
        "--use_deepspeed",
        "--num_processes",
        "2",
        "--zero_stage",
        "2",
        "--gradient_accumulation_steps",
        "4",
        "--main_process_port",
        "29555",
        "s.py",
    ],
    "debug_fp8": [
        "--cpu",
        "--debug",
        "--mixed_precision",
        "fp8",
        "--fp8_backend",
        "te",
        "--num_processes",
        "1",
        "s.py",
    ],
    "cpu_one_debug": [
        "--cpu",
        "--debug",
        "--num_processes",
        "1",
        "--num_cpu_threads_per_process",
        "3",
        "s.py",
    ],
    "gpu_ids_fp16": [
        "--multi_gpu",
        "--gpu_ids",
        "0,1",
        "--num_processes",
        "2",
        "--mixed_precision",
        "fp16",
        "--main_process_port",
        "29555",
        "s.py",
    ],
    "cpu_two_default_port": ["--cpu", "--num_processes", "2", "s.py"],
    "one_with_port": ["--num_processes", "1", "--main_process_port", "29555", "s.py"],
    "parallelism_cp_sp": [
        "--use_parallelism_config",
        "--use_fsdp",
        "--fsdp_version",
        "2",
        "--parallelism_config_cp_size",
        "2",
        "--parallelism_config_sp_size",
        "2",
        "--num_processes",
        "4",
        "--main_process_port",
        "29555",
        "s.py",
    ],
    "deepspeed_full": [
        "--use_deepspeed",
        "--num_processes",
        "2",
        "--zero_stage",
        "3",
        "--offload_optimizer_device",
        "cpu",
        "--offload_param_device",
        "cpu",
        "--gradient_clipping",
        "1.0",
        "--zero3_init_flag",
        "true",
        "--zero3_save_16bit_model",
        "true",
        "--deepspeed_config_file",
        "ds.json",
        "--deepspeed_moe_layer_cls_names",
        "Block",
        "--mixed_precision",
        "bf16",
        "--main_process_port",
        "29555",
        "s.py",
    ],
    "deepspeed_nodes": [
        "--use_deepspeed",
        "--num_processes",
        "4",
        "--num_machines",
        "2",
        "--machine_rank",
        "0",
        "--main_process_ip",
        "10.0.0.2",
        "--main_process_port",
        "29555",
        "--deepspeed_hostfile",
        "hosts",
        "--deepspeed_inclusion_filter",
        "w1",
        "--deepspeed_multinode_launcher",
        "openmpi",
        "-m",
        "pkg.train",
        "--lr",
        "1",
    ],
    "tpu": ["--tpu", "--main_training_function", "train", "s.py"],
    "no_python": [
        "--no_python",
        "--num_processes",
        "2",
        "--cpu",
        "--main_process_port",
        "29555",
        "./run.sh",
        "a",
    ],
    "megatron": [
        "--use_megatron_lm",
        "--num_processes",
        "2",
        "--megatron_lm_tp_degree",
        "2",
        "--main_process_port",
        "29555",
        "s.py",
    ],
    "parallelism": [
        "--use_parallelism_config",
        "--use_fsdp",
        "--fsdp_version",
        "2",
        "--parallelism_config_dp_shard_size",
        "2",
        "--num_processes",
        "2",
        "--main_process_port",
        "29555",
        "s.py",
    ],
}

# ``--mpirun_hostfile`` launches through MPI: the launcher looks for mpirun/mpiexec (``which``) and asks
# ``<it> --version`` which MPI it is. Recorded with both patched where 1.15's own tests patch them
# (``accelerate.utils.launch.which`` / ``.subprocess.check_output``), for each MPI and each PATH.
MPI_CASES = {
    "one_machine": ["--cpu", "--num_processes", "4", "--mpirun_hostfile", "/h/hostfile", "s.py"],
    "four_machines": ["--cpu", "--num_machines", "4", "--num_processes", "16", "--main_process_ip", "10.0.0.1",
                      "--main_process_port", "29555", "--mpirun_hostfile", "/h/hostfile", "s.py", "--x", "1"],
    "module": ["--cpu", "-m", "--num_machines", "2", "--num_processes", "4", "--main_process_ip", "10.0.0.1",
               "--main_process_port", "29555", "--machine_rank", "1", "--mpirun_hostfile", "/h/hostfile", "pkg.mod"],
    "no_python": ["--cpu", "--no_python", "--num_processes", "2", "--mpirun_hostfile", "/h/hostfile", "./run.sh"],
    "without_cpu_flag": ["--num_processes", "2", "--mpirun_hostfile", "/h/hostfile", "s.py"],
}  # fmt: skip
MPI_VERSIONS = {
    "intel": "Intel(R) MPI Library for Linux* OS, Version 2021.13",
    "open_mpi": "mpirun (Open MPI) 4.1.2",
    "mpich": "HYDRA build details:\n    Version: 4.0",
    "open_rte": "mpirun (OpenRTE) 2.1.1",
    "version_fails": None,
}
MPI_PATHS = {"both": ["mpirun", "mpiexec"], "mpiexec_only": ["mpiexec"], "neither": []}


def jsonable(value):
    """Return ``value`` as JSON: sets become sorted lists, tuples lists."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def _record_one(argv: list[str]) -> dict:
    import copy
    import os

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as L

    base = dict(os.environ)
    args = launch_command_parser().parse_args(argv)
    args = _validate_launch_command(args)[0]
    if not hasattr(args, "deepspeed_fields_from_accelerate_config"):
        args.deepspeed_fields_from_accelerate_config = ["zero_stage", "gradient_clipping"]
    namespace = {k: jsonable(v) for k, v in vars(args).items()}

    def env_diff(env):
        cwd = os.getcwd()
        return {k: str(v).replace(cwd, "<cwd>") for k, v in env.items() if base.get(k) != v}

    def ns_diff(after):
        return {
            k: jsonable(v)
            for k, v in vars(after).items()
            if k not in namespace or namespace[k] != jsonable(v)
        }

    out = {"argv": argv, "namespace": namespace}
    calls = {
        "prepare_simple_launcher_cmd_env": lambda a: L.prepare_simple_launcher_cmd_env(a),
        "prepare_multi_gpu_env": lambda a: L.prepare_multi_gpu_env(a),
        "prepare_deepspeed_cmd_env": lambda a: L.prepare_deepspeed_cmd_env(a),
        "prepare_tpu": lambda a: L.prepare_tpu(a, {}, False),
    }
    for name, call in calls.items():
        a = copy.deepcopy(args)
        try:
            result = call(a)
        except Exception as exc:  # recorded as a fact: the builder refuses this namespace
            out[name] = {"error": type(exc).__name__, "message_start": str(exc)[:60]}
            continue
        rec = {"namespace_changes": ns_diff(a)}
        if name == "prepare_tpu":
            rec["env"] = env_diff(result[1])
        elif isinstance(result, tuple):
            rec["cmd"] = (
                None if result[0] is None else ["<python>" if c == sys.executable else c for c in result[0]]
            )
            rec["env"] = env_diff(result[1])
        else:
            rec["env"] = env_diff(result)
        out[name] = rec
    return out


def _record_mpi() -> dict:
    """Return what ``prepare_simple_launcher_cmd_env`` gives for each MPI case, MPI and PATH (1.15)."""
    import subprocess as sp
    from unittest import mock

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as L

    out = {}
    for name, argv in MPI_CASES.items():
        args = _validate_launch_command(launch_command_parser().parse_args(argv))[0]
        for mpi, version in MPI_VERSIONS.items():
            for path_name, on_path in MPI_PATHS.items():

                def check_output(cmd, *a, version=version, **k):
                    if version is None:
                        raise sp.CalledProcessError(1, cmd)
                    return version.encode()

                with mock.patch.object(L, "which", side_effect=lambda n, *a, p=on_path, **k: f"/usr/bin/{n}" if n in p else None), \
                        mock.patch.object(L.subprocess, "check_output", side_effect=check_output):  # fmt: skip
                    try:
                        cmd, _ = L.prepare_simple_launcher_cmd_env(copy.deepcopy(args))
                        rec = {"cmd": ["<python>" if c == sys.executable else c for c in cmd]}
                    except Exception as exc:  # recorded as a fact
                        rec = {"error": type(exc).__name__, "message": str(exc)}
                out[f"{name}/{mpi}/{path_name}"] = {
                    "argv": argv,
                    "version_text": version,
                    "on_path": on_path,
                    **rec,
                }
    return out


def worker() -> None:
    """Print the JSON of every case (runs under the real Accelerate)."""
    import socket
    import warnings

    warnings.simplefilter("ignore")
    # 1.15 asks torchrun for a standalone rendezvous when the port is taken: hold the default port
    # 29500 busy (if nobody else does) and give the explicit-port cases a port known to be free.
    held = socket.socket()
    try:
        held.bind(("127.0.0.1", 29500))
        held.listen()
    except OSError:
        pass  # already taken by someone else: busy either way
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    free_port = str(probe.getsockname()[1])
    probe.close()
    cases = {name: [free_port if a == "29555" else a for a in argv] for name, argv in CASES.items()}
    out = {"busy_port": 29500, "free_port": int(free_port)}
    out["cases"] = {name: _record_one(argv) for name, argv in cases.items()}
    held.close()  # now the default port is free (in the namespace of its own)
    out["default_port_free"] = _record_one(["--num_processes", "2", "--cpu", "s.py"])
    out["mpi_cases"] = _record_mpi()
    print(json.dumps(out, sort_keys=True))


def commands_worker(workdir: str) -> None:
    """Print the JSON of what 1.15's ``estimate-memory`` prints and ``to-fsdp2`` writes (real Accelerate)."""
    import contextlib
    import io
    import warnings

    import accelerate.commands.estimate as estimate
    import transformers
    import yaml
    from accelerate import init_empty_weights
    from accelerate.commands.to_fsdp2 import to_fsdp2_command, to_fsdp2_command_parser

    warnings.simplefilter("ignore")
    model_dir = "tiny-gpt2"  # relative (run in workdir): the table's width follows the name
    transformers.GPT2Config(**TINY_GPT2).save_pretrained(model_dir)

    def local_empty_model(model_name, library_name, trust_remote_code=False, access_token=None):
        # 1.15 asks the Hub about every name; a local folder is built here from its config instead.
        with init_empty_weights():
            return transformers.AutoModel.from_config(transformers.AutoConfig.from_pretrained(model_name))

    estimate.create_empty_model = local_empty_model
    out = {"estimate_memory": {}, "to_fsdp2": {}}
    for name, extra in {"default": [], "float32_int4": ["--dtypes", "float32", "int4"]}.items():
        args = estimate.estimate_command_parser().parse_args(
            [model_dir, "--library_name", "transformers", *extra]
        )
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            estimate.estimate_command(args)
        out["estimate_memory"][name] = {
            "argv_after_model": extra,
            "stdout": buf.getvalue(),
            "data": [[row[0], float(row[1]), float(row[2]), row[3]] for row in estimate.gather_data(args)],
        }
    for name, config in TO_FSDP2_CASES.items():
        src, dst = os.path.join(workdir, f"{name}.yaml"), os.path.join(workdir, f"{name}_out.yaml")
        with open(src, "w") as handle:
            yaml.safe_dump(config, handle)
        to_fsdp2_command(to_fsdp2_command_parser().parse_args(["--config_file", src, "--output_file", dst]))
        with open(dst) as handle:
            out["to_fsdp2"][name] = {"input": config, "output": yaml.safe_load(handle)}
    cfg = os.path.join(workdir, "full_shard.yaml")
    for name, extra in {"with_config": ["--config_file", cfg], "without_config": []}.items():
        proc = subprocess.run(
            [sys.executable, "-m", "accelerate.commands.accelerate_cli", "env", *extra],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "HF_HOME": os.path.join(workdir, "hf")},
        )
        lines = proc.stdout.splitlines()
        out[f"env_{name}"] = {
            "argv": ["env", *(["--config_file", "<config>"] if extra else [])],
            "lines": lines,
        }
    default_path = os.path.join(workdir, "default.json")
    subprocess.run(
        [sys.executable, "-m", "accelerate.commands.accelerate_cli", "config", "default", "--config_file",
         default_path, "--mixed_precision", "fp16"],
        capture_output=True,
        check=True,
    )  # fmt: skip
    with open(default_path) as handle:
        out["config_default_fp16"] = json.load(handle)
    out["tiny_gpt2"] = TINY_GPT2
    print(json.dumps(out, sort_keys=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="interpreter with accelerate==1.15 installed")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--commands-worker", default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    ns.python = os.path.abspath(ns.python) if os.sep in ns.python else ns.python
    if ns.worker:
        worker()
        return
    if ns.commands_worker:
        commands_worker(ns.commands_worker)
        return
    # In a network namespace of its own (where possible) so no other program's use of port 29500 on
    # this machine changes what 1.15 decides (it checks whether the port is taken).
    isolate = []
    if shutil.which("unshare") and shutil.which("ip") and hasattr(os, "geteuid") and os.geteuid() == 0:
        isolate = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
    proc = subprocess.run(
        [*isolate, ns.python, __file__, "--python", ns.python, "--worker"],
        env=CLEAN_ENV,
        cwd="/tmp",
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    import importlib.metadata  # noqa: F401  (version recorded from the worker's interpreter below)

    version = subprocess.run(
        [ns.python, "-c", "import accelerate; print(accelerate.__version__)"],
        env=CLEAN_ENV,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    OUT.write_text(json.dumps({"accelerate_version": version, **data}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT} ({len(data['cases'])} cases)")
    import tempfile

    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.run(
            [ns.python, __file__, "--python", ns.python, "--commands-worker", workdir],
            env=CLEAN_ENV,
            cwd=workdir,
            capture_output=True,
            text=True,
            check=True,
        )
    commands = json.loads(proc.stdout.strip().splitlines()[-1])
    commands["accelerate_version"] = version
    OUT_COMMANDS.write_text(json.dumps(commands, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT_COMMANDS}")


if __name__ == "__main__":
    main()
