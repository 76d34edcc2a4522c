"""Record Accelerate 1.15's ``launch`` and ``tpu-config`` options, and what ``tpu-config --debug`` prints.

Facts only: for every option of each parser, its option strings, destination, default, type, nargs,
choices, action kind and help group (no help text); for the options whose type is a function, what it
returns on a few inputs; and for a few ``accelerate tpu-config --debug`` command lines, the line printed.
Our parsers are held to these by tests/test_cli_options.py. Run with the real Accelerate installed:

    .venv/bin/python scripts/record_cli_options.py --python .venv/bin/python
    # writes tests/data/cli_options_1_15.json and tests/data/goldens/cli_tpu_config.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _recorder import CLEAN_ENV, command_line, run_worker

ROOT = Path(__file__).resolve().parents[1]
OUT_OPTIONS = ROOT / "tests" / "data" / "cli_options_1_15.json"
OUT_TPU = ROOT / "tests" / "data" / "goldens" / "cli_tpu_config.json"
TYPE_PROBES = ("true", "no", "1", "0", "true,false,true", "1,0", "maybe")
TPU_CONFIG = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "XLA",
    "mixed_precision": "no",
    "num_machines": 1,
    "num_processes": 8,
    "tpu_name": "my-tpu",
    "tpu_zone": "us-central1-a",
    "commands": ["pip install datasets", "echo hi"],
}
# name -> argv after ``tpu-config``. "<config>": a file holding TPU_CONFIG; "<config_file_too>": the same with
# ``command_file`` set to "<commands>" as well; "<commands>": two commands; "<ragged>": blank line, spaces.
TPU_CASES = {
    "config_commands": ["--config_file", "<config>", "--debug"],
    "config_alpha_install_cli_commands": ["--config_file", "<config>", "--debug", "--install_accelerate",
                                          "--command", "ls -la", "--command", "echo 'a b'", "--use_alpha"],
    "config_name_overridden": ["--config_file", "<config>", "--tpu_name", "other", "--tpu_zone", "eu-w4",
                               "--debug"],
    "flags_dev_version": ["--tpu_name", "t", "--tpu_zone", "z", "--debug", "--command", "a", "b",
                          "--install_accelerate", "--accelerate_version", "dev"],
    "command_file_pinned_version": ["--tpu_name", "t", "--tpu_zone", "z", "--debug", "--command_file",
                                    "<commands>", "--install_accelerate", "--accelerate_version", "1.2.0"],
    "command_file_wins_over_command": ["--tpu_name", "t", "--tpu_zone", "z", "--debug", "--command_file",
                                       "<ragged>", "--command", "y"],
    "config_command_file_and_commands": ["--config_file", "<config_file_too>", "--debug"],
    "no_command": ["--tpu_name", "t", "--tpu_zone", "z", "--debug"],
    "no_tpu_name": ["--debug", "--command", "x"],
}  # fmt: skip


# name -> (config file contents, argv after ``launch --config_file <file>``): the namespace 1.15's launch
# command hands its builders when a config file fills the options left out.
CONFIG_CASES = {
    "fsdp2_from_config": (
        {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "mixed_precision": "bf16",
         "num_machines": 1, "num_processes": 2, "machine_rank": 0, "main_process_port": 29611, "use_cpu": False,
         "fsdp_config": {"fsdp_version": 2, "fsdp_offload_params": True, "fsdp_auto_wrap_policy":
                         "TRANSFORMER_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap": "GPT2Block",
                         "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_reshard_after_forward": False}},
        ["--fsdp_sharding_strategy", "SHARD_GRAD_OP", "--mixed_precision", "fp16", "s.py"],
    ),
    "multi_cpu_from_config": (
        {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "mixed_precision": "no",
         "num_machines": 1, "num_processes": 4, "use_cpu": True, "debug": True, "gpu_ids": "all"},
        ["--num_processes", "2", "s.py", "--x"],
    ),
}  # fmt: skip


def _type_name(kind) -> str | None:
    if kind is None:
        return None
    return "<function>" if kind.__name__ == "<lambda>" else kind.__name__


def _jsonable(value):
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _actions(parser) -> list[dict]:
    out = []
    for group in parser._action_groups:
        for action in group._group_actions:
            if action.dest == "help":
                continue
            entry = {
                "option_strings": list(action.option_strings),
                "dest": action.dest,
                "group": group.title,
                "action": type(action).__name__,
                "default": _jsonable(action.default),
                "type": _type_name(action.type),
                "nargs": _jsonable(action.nargs),
                "choices": _jsonable(action.choices),
                "const": _jsonable(action.const),
                "required": action.required,
            }
            if callable(action.type) and action.type not in (str, int, float, bool):
                probes = {}
                for text in TYPE_PROBES:
                    try:
                        probes[text] = _jsonable(action.type(text))
                    except ValueError:
                        probes[text] = "ValueError"
                entry["type_probes"] = probes
            out.append(entry)
    return out


def options_worker() -> None:
    """Print the JSON of both parsers' options (runs under the real Accelerate)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.commands.tpu import tpu_command_parser

    out = {"launch": _actions(launch_command_parser()), "tpu_config": _actions(tpu_command_parser())}
    out["config_namespaces"] = {}
    for name, (config, argv) in CONFIG_CASES.items():
        with tempfile.TemporaryDirectory() as workdir:
            path = os.path.join(workdir, "config.json")
            with open(path, "w") as handle:
                json.dump(config, handle)
            args = _validate_launch_command(
                launch_command_parser().parse_args(["--config_file", path, *argv])
            )[0]
        namespace = {k: _jsonable(v) for k, v in vars(args).items() if k not in ("nondefault", "config_file")}
        out["config_namespaces"][name] = {"config": config, "argv": argv, "namespace": namespace}
    print(json.dumps(out))


def _tpu_cases(python: str, workdir: str) -> dict:
    import yaml

    files = {name: os.path.join(workdir, name.strip("<>")) for name in ("<config>", "<config_file_too>",
                                                                        "<commands>", "<ragged>")}  # fmt: skip
    with open(files["<config>"], "w") as handle:
        yaml.safe_dump(TPU_CONFIG, handle)
    with open(files["<config_file_too>"], "w") as handle:
        yaml.safe_dump({**TPU_CONFIG, "command_file": files["<commands>"]}, handle)
    with open(files["<commands>"], "w") as handle:
        handle.write("echo one\necho two\n")
    with open(files["<ragged>"], "w") as handle:
        handle.write("echo one\n\n  echo two  \n")
    out = {}
    for name, argv in TPU_CASES.items():
        real = [files.get(a, a) for a in argv]
        proc = subprocess.run([python, "-m", "accelerate.commands.accelerate_cli", "tpu-config", *real],
                              env={**CLEAN_ENV, "HF_HOME": os.path.join(workdir, "hf")}, cwd=workdir,
                              capture_output=True, text=True)  # fmt: skip
        record = {"argv": argv, "returncode": proc.returncode, "stdout": proc.stdout}
        if proc.returncode:
            last = proc.stderr.strip().splitlines()[-1]
            record["error"], _, message = last.partition(": ")
            record["message_start"] = message[:40]
        out[name] = record
    return out


def main() -> None:
    ns = command_line(__doc__, lambda ns: options_worker())
    version, options = run_worker(ns.python, __file__)
    OUT_OPTIONS.write_text(json.dumps({"accelerate_version": version, **options}, indent=1) + "\n")
    print(f"wrote {OUT_OPTIONS} ({len(options['launch'])} launch options)")
    with tempfile.TemporaryDirectory() as workdir:
        cases = _tpu_cases(ns.python, workdir)
    golden = {"accelerate_version": version, "config": TPU_CONFIG, "cases": cases}
    OUT_TPU.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT_TPU}")


if __name__ == "__main__":
    sys.exit(main())
