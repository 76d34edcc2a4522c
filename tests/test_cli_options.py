"""``notebook-accel launch`` and ``tpu-config`` take Accelerate 1.15's options, as recorded from 1.15.

tests/data/cli_options_1_15.json (scripts/record_cli_options.py, run under the real 1.15) lists each
option of 1.15's ``launch`` and ``tpu-config`` parsers: option strings, destination, default, type,
nargs, choices, action kind and help group. Our parsers are read the same way and compared.
tests/data/goldens/cli_prepare.json holds, for 18 command lines, the namespace 1.15's launch command
hands its builders: ours, parsed and filled in the same way, gives the same one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import pytest

from notebook_accel.commands import cli, launch_validate
from notebook_accel.commands import launch as launch_module
from notebook_accel.commands import tpu as tpu_module
from notebook_accel.commands.launch import _validate_launch_command, launch_command, launch_command_parser
from notebook_accel.commands.tpu import tpu_command_parser
from notebook_accel.utils.imports import (
    is_megatron_lm_available,
    is_sagemaker_available,
    is_torch_xla_available,
)
from tests.script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "tests" / "data" / "cli_options_1_15.json").read_text(encoding="utf-8"))
PREPARE = json.loads((ROOT / "tests" / "data" / "goldens" / "cli_prepare.json").read_text(encoding="utf-8"))


RECORDER = load_script("record_cli_options.py")


def _ours(parser: argparse.ArgumentParser) -> list[dict]:
    actions = RECORDER._actions(parser)
    for entry in actions:  # Python 3.10 titles the parser's own group "optional arguments"
        entry["group"] = "options" if entry["group"] == "optional arguments" else entry["group"]
        if entry["type"] == "bool_triple":
            entry["type"] = "<function>"
    return actions


def _subparser(name: str) -> argparse.ArgumentParser:
    top = cli.parser()
    return next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def test_record_is_1_15s():
    assert RECORD["accelerate_version"].startswith("1.15") and len(RECORD["launch"]) == 125


@pytest.mark.parametrize("build", [launch_command_parser, lambda: _subparser("launch")], ids=["alone", "sub"])
def test_launch_parser_has_1_15s_options(build):
    ours, recorded = _ours(build()), RECORD["launch"]
    assert [a["dest"] for a in ours] == [a["dest"] for a in recorded]
    for mine, theirs in zip(ours, recorded):
        assert mine == theirs, mine["dest"]


def test_a_1_15_command_line_parses_with_every_group():
    argv = ["--multi-gpu", "--num_processes", "2", "--mixed_precision", "fp8", "--fp8_backend", "te",
            "--fp8_override_linear_precision", "true,false,true", "--use_fsdp", "--fsdp-version", "2",
            "--fsdp_offload_params", "true", "--zero_stage", "3", "--megatron_lm_tp_degree", "2",
            "--parallelism_config_tp_size", "2", "--tpu_cluster", "--vm", "a", "--vm", "b", "--no_tpu_cluster",
            "--aws_access_key_id", "k", "--mpirun_hostfile", "h", "-t", "3", "--max_restarts", "1", "s.py", "--x"]  # fmt: skip
    a = launch_command_parser().parse_args(argv)
    assert (a.multi_gpu, a.fp8_override_linear_precision, a.fsdp_version, a.zero_stage) == (
        True,
        (1, 0, 1),
        "2",
        3,
    )
    assert (a.vm, a.tpu_use_cluster, a.tee, a.training_script_args) == (["a", "b"], False, "3", ["--x"])


@pytest.mark.parametrize(
    ("argv", "match"),
    [(["--fsdp_version", "3"], "--fsdp_version.*invalid choice: '3'"),
     (["--fp8_override_linear_precision", "maybe,no"], "--fp8_override_linear_precision.*invalid bool_triple"),
     (["--dynamo_backend", "ipex"], "--dynamo_backend.*invalid choice: 'ipex'")],
)  # fmt: skip
def test_bad_values_are_refused_naming_the_option(argv, match, capsys):
    with pytest.raises(SystemExit):
        launch_command_parser().parse_args([*argv, "s.py"])
    with pytest.raises(AssertionError, match=match):
        raise AssertionError(capsys.readouterr().err)


@pytest.mark.parametrize("case", sorted(PREPARE["cases"]))
def test_launch_namespace_is_1_15s(case, monkeypatch, tmp_path):
    # no config file: 1.15 fills the same defaults in (machine-dependent thread count left out)
    monkeypatch.setattr(launch_validate, "default_config_file", str(tmp_path / "none.yaml"))
    recorded = PREPARE["cases"][case]
    args = _validate_launch_command(launch_command_parser().parse_args(recorded["argv"]))[0]
    ours = {k: RECORDER._jsonable(v) for k, v in vars(args).items() if k != "func"}
    skip = {"nondefault", "num_cpu_threads_per_process", "deepspeed_fields_from_accelerate_config"}
    theirs = {k: v for k, v in recorded["namespace"].items() if k not in skip}
    assert {k: v for k, v in ours.items() if k not in skip} == theirs


@pytest.mark.parametrize("case", sorted(RECORD["config_namespaces"]))
def test_launch_namespace_from_a_config_file_is_1_15s(case, tmp_path):
    # the options left out come from the config file (nested fsdp_config keys included), as in 1.15
    recorded = RECORD["config_namespaces"][case]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(recorded["config"]))
    args = _validate_launch_command(
        launch_command_parser().parse_args(["--config_file", str(path), *recorded["argv"]])
    )[0]
    # ``nondefault`` is compared in tests/test_launch_validation.py (this record left it out)
    skip = {"num_cpu_threads_per_process", "deepspeed_fields_from_accelerate_config", "config_file", "func",
            "nondefault"}  # fmt: skip
    ours = {k: RECORDER._jsonable(v) for k, v in vars(args).items() if k not in skip}
    assert ours == {k: v for k, v in recorded["namespace"].items() if k not in skip}


@pytest.mark.skipif(is_megatron_lm_available(), reason="megatron-core is installed")
def test_megatron_launch_runs_the_script_whose_accelerator_names_what_to_install(monkeypatch):
    """As 1.15: ``--use_megatron_lm`` launches the script (one that never builds an Accelerator runs, as
    1.15's MEGATRON_LM test configs do); the Accelerator it builds raises ImportError naming megatron-core."""
    ran = {}
    monkeypatch.setattr(launch_module, "_run", lambda cmd, env: ran.update(cmd=cmd, env=env))
    argv = ["--use_megatron_lm", "--num_processes", "2", "--megatron_lm_tp_degree", "2", "s.py"]
    launch_command(launch_command_parser().parse_args(argv))
    assert ran["cmd"][-1] == "s.py"
    assert ran["env"]["MEGATRON_LM_TP_DEGREE"] == "2" and ran["env"]["ACCELERATE_USE_MEGATRON_LM"] == "true"
    from notebook_accel import Accelerator
    from notebook_accel.state import AcceleratorState

    monkeypatch.setenv("ACCELERATE_USE_MEGATRON_LM", "true")
    try:
        with pytest.raises(ImportError, match="ACCELERATE_USE_MEGATRON_LM=true.*pip install megatron-core"):
            Accelerator(cpu=True)
    finally:
        AcceleratorState._reset_state(True)


@pytest.mark.skipif(is_sagemaker_available(), reason="the sagemaker SDK is installed")
def test_sagemaker_builds_the_estimator_arguments_then_names_the_sdk(monkeypatch, tmp_path):
    seen = {}
    real = launch_module.prepare_sagemager_args_inputs
    monkeypatch.setattr(
        launch_module, "prepare_sagemager_args_inputs", lambda c, a: seen.setdefault("kw", real(c, a))
    )
    config = tmp_path / "sm.json"
    config.write_text(json.dumps({"compute_environment": "AMAZON_SAGEMAKER", "distributed_type": "DATA_PARALLEL",
                                  "mixed_precision": "bf16", "use_cpu": False, "debug": False,
                                  "ec2_instance_type": "ml.p3.2xlarge", "iam_role_name": "role"}))  # fmt: skip
    argv = ["--config_file", str(config), "train.py", "--lr", "3"]
    with pytest.raises(ImportError, match="pip install sagemaker"):
        launch_command(launch_command_parser().parse_args(argv))
    kwargs, _ = seen["kw"]
    assert (kwargs["entry_point"], kwargs["hyperparameters"], kwargs["role"]) == (
        "train.py",
        {"lr": 3},
        "role",
    )


@pytest.mark.skipif(is_torch_xla_available(), reason="torch_xla is installed")
def test_tpu_pod_builds_the_pod_fields_then_names_torch_xla(monkeypatch, tmp_path):
    # as in 1.15, the pod's VMs and name come from the config file (tpu_vm, tpu_name)
    seen = {}
    real = launch_module.prepare_tpu
    monkeypatch.setattr(
        launch_module, "prepare_tpu", lambda a, e, pod=False: seen.setdefault("tpu", real(a, e, pod))
    )
    config = tmp_path / "tpu.json"
    config.write_text(json.dumps({"compute_environment": "LOCAL_MACHINE", "distributed_type": "XLA",
                                  "mixed_precision": "no", "use_cpu": False, "debug": True, "tpu_use_cluster": True, "num_processes": 8,
                                  "tpu_name": "pod", "tpu_vm": ["w0", "w1"]}))  # fmt: skip
    with pytest.raises(ImportError, match="pip install torch_xla"):
        launch_command(launch_command_parser().parse_args(["--config_file", str(config), "s.py", "--x"]))
    args, env = seen["tpu"]
    assert (args.vm, args.tpu_name, args.positional) == (["w0", "w1"], "pod", ["s.py", "--x"])
    assert env["ACCELERATE_DEBUG_MODE"] == "true"


# --- tpu-config ----------------------------------------------------------------------------------------

TPU_GOLDEN = json.loads(
    (ROOT / "tests" / "data" / "goldens" / "cli_tpu_config.json").read_text(encoding="utf-8")
)


@pytest.mark.parametrize(
    "build", [tpu_command_parser, lambda: _subparser("tpu-config")], ids=["alone", "sub"]
)
def test_tpu_config_parser_has_1_15s_options(build):
    assert _ours(build()) == RECORD["tpu_config"]


@pytest.fixture
def tpu_files(tmp_path, monkeypatch):
    # JSON config files (1.15 reads both; YAML needs PyYAML, not a dependency of ours)
    monkeypatch.setattr(tpu_module, "default_config_file", str(tmp_path / "none.yaml"))
    names = {"<config>": "config.json", "<config_file_too>": "config_file_too.json", "<commands>": "commands.txt",
             "<ragged>": "ragged.txt"}  # fmt: skip
    files = {key: tmp_path / name for key, name in names.items()}
    files["<config>"].write_text(json.dumps(TPU_GOLDEN["config"]))
    files["<config_file_too>"].write_text(
        json.dumps({**TPU_GOLDEN["config"], "command_file": str(files["<commands>"])})
    )
    files["<commands>"].write_text("echo one\necho two\n")
    files["<ragged>"].write_text("echo one\n\n  echo two  \n")
    return {k: str(v) for k, v in files.items()}


def _tpu_config(argv: list[str], files: dict[str, str]) -> None:
    cli.main(["tpu-config", *[files.get(a, a) for a in argv]])


@pytest.mark.parametrize("case", sorted(k for k, v in TPU_GOLDEN["cases"].items() if v["returncode"] == 0))
def test_tpu_config_debug_prints_1_15s_command(case, tpu_files, capsys):
    _tpu_config(TPU_GOLDEN["cases"][case]["argv"], tpu_files)
    assert capsys.readouterr().out == TPU_GOLDEN["cases"][case]["stdout"]


def test_tpu_config_with_nothing_to_run_names_the_options(tpu_files):
    recorded = TPU_GOLDEN["cases"]["no_command"]
    assert recorded["error"] == "ValueError"
    with pytest.raises(ValueError, match="nothing to run: pass --command .* or --command_file"):
        _tpu_config(recorded["argv"], tpu_files)


def test_tpu_config_without_a_pod_name_names_the_option(tpu_files):
    # 1.15 fails inside its own join (TypeError); we name the missing option
    assert TPU_GOLDEN["cases"]["no_tpu_name"]["error"] == "TypeError"
    with pytest.raises(ValueError, match="needs --tpu_name"):
        _tpu_config(TPU_GOLDEN["cases"]["no_tpu_name"]["argv"], tpu_files)


def test_tpu_config_without_gcloud_names_it(tpu_files, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    with pytest.raises(FileNotFoundError, match="`gcloud`, which is not on PATH"):
        _tpu_config(["--config_file", "<config>"], tpu_files)


def test_tpu_config_runs_gcloud_when_present(tpu_files, monkeypatch, tmp_path, capsys):
    # a stand-in gcloud on PATH records its arguments: the command line runs as built, not through a shell
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "gcloud"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path / 'argv.txt'}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin:/bin")
    _tpu_config(["--config_file", "<config>", "--command", "echo 'a b'"], tpu_files)
    assert (tmp_path / "argv.txt").read_text().splitlines() == [
        "compute", "tpus", "tpu-vm", "ssh", "my-tpu", "--zone", "us-central1-a",
        "--command", "cd /usr/share; echo 'a b'", "--worker", "all",
    ]  # fmt: skip
    assert capsys.readouterr().out == "Successfully setup pod.\n"


def test_tpu_config_raises_when_gcloud_fails(tpu_files, monkeypatch, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text("#!/bin/sh\nexit 2\n")
    (bin_dir / "gcloud").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin:/bin")
    with pytest.raises(subprocess.CalledProcessError, match="exit status 2"):
        _tpu_config(["--config_file", "<config>"], tpu_files)


def test_help_lists_each_option_once():
    """``launch -h`` shows the underscore spelling only; the description names ``--num-processes`` once (1.15)."""
    from notebook_accel.commands.launch import launch_command_parser

    parser = launch_command_parser()
    text = parser.format_help()
    for dest in vars(parser.parse_args(["s.py"])):
        dashed = "--" + dest.replace("_", "-")
        if "_" in dest:
            assert text.count(dashed) == (1 if dashed == "--num-processes" else 0), dashed
