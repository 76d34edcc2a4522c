"""Record what Accelerate 1.15's ``accelerate launch`` does with a command line before it launches.

Facts only, for a spread of command lines and config files: the namespace ``_validate_launch_command``
returns (and the other two items of its tuple), the warnings it logs, or the exception it raises; for a
spread of script argument lists, what ``_convert_nargs_to_dict`` returns or raises; and what
``prepare_multi_gpu_env`` does with ``--main_process_port 0``. Our commands are held to these by
tests/test_launch_validation.py. Run with the real Accelerate installed:

    .venv/bin/python scripts/record_launch_validation.py --python /work/.venv-accelerate/bin/python
    # writes tests/data/launch_validation_1_15.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from _recorder import command_line, run_worker

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "launch_validation_1_15.json"
# The namespace fields that depend on the machine the recorder ran on (none on a CPU-only machine today,
# but kept out so a GPU machine's record would compare the same).
MACHINE_FIELDS = ("num_cpu_threads_per_process",)

# name -> argv after ``launch``: no config file (HF_HOME is an empty folder).
ARGV_CASES = {
    "script_only": ["s.py"],
    "two_processes": ["--num_processes", "2", "s.py"],
    "cpu_two_processes": ["--cpu", "--num_processes", "2", "s.py"],
    "multi_gpu_flag": ["--multi_gpu", "s.py"],
    "multi_gpu_two": ["--multi_gpu", "--num_processes", "2", "s.py"],
    "bf16_cpu": ["--mixed_precision", "bf16", "--cpu", "s.py"],
    "fp16_cpu": ["--mixed_precision", "fp16", "--cpu", "s.py"],
    "fp8": ["--mixed_precision", "fp8", "s.py"],
    "dynamo_inductor": ["--dynamo_backend", "inductor", "--dynamo_mode", "max-autotune", "s.py"],
    "fsdp_two": ["--use_fsdp", "--num_processes", "2", "s.py"],
    "deepspeed": ["--use_deepspeed", "s.py"],
    "megatron": ["--use_megatron_lm", "s.py"],
    "tpu": ["--tpu", "s.py"],
    "two_machines_no_rank": ["--num_machines", "2", "s.py"],
    "two_machines": ["--num_machines", "2", "--machine_rank", "1", "--num_processes", "4",
                     "--main_process_ip", "10.0.0.1", "--main_process_port", "29600", "s.py"],
    "threads_given": ["--num_processes", "2", "--num_cpu_threads_per_process", "3", "s.py"],
    "debug_module": ["--debug", "-m", "pkg.mod", "--x", "1"],
    "gpu_ids": ["--gpu_ids", "0,1", "--num_processes", "2", "s.py"],
    "uneven_processes": ["--num_machines", "2", "--machine_rank", "0", "--num_processes", "3", "s.py"],
    "multi_gpu_and_cpu": ["--multi_gpu", "--cpu", "--num_processes", "2", "s.py"],
    "negative_processes": ["--num_processes", "-1", "s.py"],
    "machine_rank_too_high": ["--num_machines", "2", "--machine_rank", "2", "--num_processes", "2", "s.py"],
    "fp8_backend_no_fp8": ["--fp8_backend", "te", "--mixed_precision", "bf16", "s.py"],
    "fsdp_and_deepspeed": ["--use_fsdp", "--use_deepspeed", "s.py"],
    "everything_given": ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
                         "--dynamo_backend", "no", "s.py"],
}  # fmt: skip

_LOCAL = {"compute_environment": "LOCAL_MACHINE", "machine_rank": 0, "num_machines": 1, "use_cpu": False}
# name -> (config file contents, argv after ``launch --config_file <file>``).
CONFIG_CASES = {
    "multi_cpu": ({**_LOCAL, "distributed_type": "MULTI_CPU", "mixed_precision": "no", "num_processes": 4,
                   "use_cpu": True}, ["s.py"]),
    "no_distribution": ({**_LOCAL, "distributed_type": "NO", "mixed_precision": "no", "num_processes": 1},
                        ["s.py"]),
    "bf16_from_config": ({**_LOCAL, "distributed_type": "NO", "mixed_precision": "bf16", "num_processes": 1},
                         ["s.py"]),
    "bf16_config_fp16_argv": ({**_LOCAL, "distributed_type": "NO", "mixed_precision": "bf16",
                               "num_processes": 1}, ["--mixed_precision", "fp16", "s.py"]),
    "dynamo_from_config": ({**_LOCAL, "distributed_type": "NO", "mixed_precision": "no", "num_processes": 1,
                            "dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_mode": "default",
                                              "dynamo_use_fullgraph": True, "dynamo_use_dynamic": False}},
                           ["s.py"]),
    "multi_gpu_config": ({**_LOCAL, "distributed_type": "MULTI_GPU", "mixed_precision": "fp16",
                          "num_processes": 2, "gpu_ids": "all", "main_process_port": 29700}, ["s.py"]),
    "fsdp_config": ({**_LOCAL, "distributed_type": "FSDP", "mixed_precision": "no", "num_processes": 2,
                     "fsdp_config": {"fsdp_version": 2, "fsdp_offload_params": False,
                                     "fsdp_state_dict_type": "SHARDED_STATE_DICT"}},
                    ["--num_processes", "4", "s.py"]),
    "deepspeed_config": ({**_LOCAL, "distributed_type": "DEEPSPEED", "mixed_precision": "no",
                          "num_processes": 1, "deepspeed_config": {"zero_stage": 2,
                                                                   "gradient_accumulation_steps": 4}},
                         ["s.py"]),
    "cpu_affinity_and_extra_keys": ({**_LOCAL, "distributed_type": "NO", "mixed_precision": "no",
                                     "num_processes": 1, "enable_cpu_affinity": True, "tpu_name": "t",
                                     "downcast_bf16": "no"}, ["--debug", "s.py"]),
    "two_machines_config": ({**_LOCAL, "distributed_type": "MULTI_CPU", "mixed_precision": "no",
                             "num_processes": 4, "num_machines": 2, "machine_rank": 1, "use_cpu": True,
                             "main_process_ip": "10.0.0.2", "main_process_port": 29800,
                             "rdzv_backend": "static", "same_network": True}, ["s.py"]),
    "fsdp_config_multi_gpu_argv": ({**_LOCAL, "distributed_type": "FSDP", "mixed_precision": "no",
                                    "num_processes": 2}, ["--multi_gpu", "s.py"]),
    "multi_cpu_config_multi_gpu_argv": ({**_LOCAL, "distributed_type": "MULTI_CPU", "mixed_precision": "no",
                                         "num_processes": 2, "use_cpu": True}, ["--multi_gpu", "s.py"]),
    "tpu_pod_config": ({**_LOCAL, "distributed_type": "XLA", "mixed_precision": "no", "debug": True,
                        "num_processes": 8, "tpu_use_cluster": True, "tpu_name": "pod", "tpu_vm": ["w0", "w1"]},
                       ["s.py", "--x"]),
    "tpu_keys_in_a_cpu_config": ({**_LOCAL, "distributed_type": "MULTI_CPU", "mixed_precision": "no",
                                  "num_processes": 2, "use_cpu": True, "tpu_use_cluster": True,
                                  "enable_cpu_affinity": True}, ["s.py"]),
    "xla_config_downcast": ({**_LOCAL, "distributed_type": "XLA", "mixed_precision": "bf16", "num_processes": 8,
                             "downcast_bf16": True, "same_network": True, "enable_cpu_affinity": True}, ["s.py"]),
    "tpu_config_no_processes": ({**_LOCAL, "distributed_type": "XLA", "mixed_precision": "no"}, ["s.py"]),
    "multi_cpu_config_no_processes": ({**_LOCAL, "distributed_type": "MULTI_CPU", "mixed_precision": "no",
                                       "use_cpu": True}, ["s.py"]),
    "no_processes_given_on_argv": ({**_LOCAL, "distributed_type": "MULTI_CPU", "mixed_precision": "no",
                                    "use_cpu": True}, ["--num_processes", "2", "s.py"]),
    "sagemaker": ({"compute_environment": "AMAZON_SAGEMAKER", "distributed_type": "DATA_PARALLEL",
                   "mixed_precision": "bf16", "use_cpu": False, "debug": False,
                   "ec2_instance_type": "ml.p3.2xlarge", "iam_role_name": "role"}, ["train.py", "--lr", "3"]),
}  # fmt: skip

# script argument lists for ``_convert_nargs_to_dict``
NARGS_CASES = [
    [], ["--lr", "1e-3", "--n", "5", "--b", "true", "--s", "hi"], ["-a", "1"], ["--a"], ["--a", "--b"],
    ["--a=1", "--b", "2"], ["--a=1"], ["--flag", "--x", "3"], ["--a", "1", "b"], ["x", "y"], ["a=1"],
    ["--a", "1", "2"], ["--a", "1", "--a", "2"], ["--x-y", "3"], ["--f", "2.5", "--neg", "-1"],
]  # fmt: skip
# Single values after a key: what type and value ``_convert_nargs_to_dict`` gives each (1.15 turns exactly
# "True"/"False" into bools and a number with no fraction into an int, "1e3" and "7." included).
NARGS_VALUES = ["False", "True", "false", "true", "TRUE", "yes", "0", "1", "3", "+4", "1_000", "0x10", "5e-5",
                "50.5", "1e3", "1E3", "1.5e3", "7.", "2.0", "0.0", "1e30", "1e400", "inf", "Infinity", "nan",
                "12345678901234567891", " 7 ", "bert", "", "None", "1/2", " True"]  # fmt: skip


def _jsonable(value):
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _outcome(call) -> dict:
    """Return ``{"result": ...}``, or ``{"error": type name, "message": text}`` (SystemExit: its code)."""
    import contextlib
    import io

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return {"result": call()}
    except SystemExit as exc:
        return {"error": "SystemExit", "message": str(exc.code)}
    except Exception as exc:  # noqa: BLE001 - any exception is a fact to record
        return {"error": type(exc).__name__, "message": str(exc)}


def _validate(parser_argv: list[str]) -> dict:
    """Return what ``_validate_launch_command`` gives for ``parser_argv``, with the records it logged."""
    import logging
    import warnings

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(f"{record.levelname}: {record.getMessage()}")
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.DEBUG)

    def call():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            args, defaults, mp_from_config = _validate_launch_command(
                launch_command_parser().parse_args(parser_argv)
            )
        records.extend(f"{w.category.__name__}: {w.message}" for w in caught)
        namespace = {
            k: _jsonable(v)
            for k, v in vars(args).items()
            if k not in ("config_file", "func", *MACHINE_FIELDS)
        }
        return {
            "namespace": namespace,
            "defaults": type(defaults).__name__,
            "mp_from_config_flag": mp_from_config,
        }

    try:
        out = _outcome(call)
    finally:
        logging.getLogger().removeHandler(handler)
    out["logged"] = records
    return out


def _free_port_fact() -> dict:
    """Return what ``prepare_multi_gpu_env`` sets for ``--main_process_port 0`` (a port, not 0)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = _validate_launch_command(
        launch_command_parser().parse_args(["--num_processes", "2", "--main_process_port", "0", "s.py"])
    )[0]
    env = prepare_multi_gpu_env(args)
    port = int(args.master_port)
    return {"master_port_is_int_string": str(port) == args.master_port, "port_is_not_zero": port != 0,
            "main_process_port_after": _jsonable(args.main_process_port),
            "env_master_port": env.get("MASTER_PORT"), "standalone": getattr(args, "standalone", None)}  # fmt: skip


def worker() -> None:
    """Print the JSON of every case (runs under the real Accelerate)."""
    from accelerate.utils.launch import _convert_nargs_to_dict

    out = {"argv_cases": {}, "config_cases": {}, "nargs_cases": [], "nargs_values": []}
    for name, argv in ARGV_CASES.items():
        out["argv_cases"][name] = {"argv": argv, **_validate(argv)}
    for name, (config, argv) in CONFIG_CASES.items():
        with tempfile.TemporaryDirectory() as workdir:
            path = os.path.join(workdir, "config.json")
            with open(path, "w") as handle:
                json.dump(config, handle)
            out["config_cases"][name] = {"config": config, "argv": argv,
                                         **_validate(["--config_file", path, *argv])}  # fmt: skip
    for nargs in NARGS_CASES:
        out["nargs_cases"].append(
            {"nargs": nargs, **_outcome(lambda nargs=nargs: _jsonable(_convert_nargs_to_dict(nargs)))}
        )
    for text in NARGS_VALUES:
        value = _convert_nargs_to_dict(["--a", text])["a"]
        out["nargs_values"].append({"text": text, "type": type(value).__name__, "repr": repr(value)})
    out["free_port"] = _free_port_fact()
    print(json.dumps(out))


def main() -> None:
    ns = command_line(__doc__, lambda ns: worker())
    version, record = run_worker(ns.python, __file__)
    OUT.write_text(json.dumps({"accelerate_version": version, **record}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    sys.exit(main())
