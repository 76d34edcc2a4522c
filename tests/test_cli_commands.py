"""The ``accelerate`` command line through ``notebook_accel.commands``, compared with Accelerate 1.15.

tests/data/goldens/cli_prepare.json (scripts/record_cli_goldens.py, run under the real 1.15) holds,
for each ``accelerate launch`` command line, the namespace 1.15's launch command hands its builders
and what each ``prepare_*`` builder returns for it: the command, the environment variables it adds,
the fields it sets on the namespace, or the error it raises. Ours get the same namespace.
"""

from __future__ import annotations

import argparse
import builtins
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from notebook_accel.commands import launch_env as L
from notebook_accel.utils import launch as utils_launch
from tests.script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((ROOT / "tests" / "data" / "goldens" / "cli_prepare.json").read_text(encoding="utf-8"))
CASES = GOLDEN["cases"]
# The recorder's own conversions and clean environment, so that both ends compare alike.
_RECORDER = load_script("record_cli_goldens.py")
CLEAN_ENV, jsonable = _RECORDER.CLEAN_ENV, _RECORDER.jsonable
BUILDERS = {
    "prepare_simple_launcher_cmd_env": lambda a: L.prepare_simple_launcher_cmd_env(a),
    "prepare_multi_gpu_env": lambda a: L.prepare_multi_gpu_env(a),
    "prepare_deepspeed_cmd_env": lambda a: L.prepare_deepspeed_cmd_env(a),
    "prepare_tpu": lambda a: L.prepare_tpu(a, {}, False),
}


def _namespace(recorded: dict) -> argparse.Namespace:
    values = dict(recorded)
    values["nondefault"] = set(values.get("nondefault", []))
    if isinstance(values.get("fp8_override_linear_precision"), list):
        values["fp8_override_linear_precision"] = tuple(values["fp8_override_linear_precision"])
    return argparse.Namespace(**values)


@pytest.mark.parametrize("builder", sorted(BUILDERS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_prepare_builders_match_1_15(case, builder, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    # as when they were recorded: the default port taken, the explicit one free
    monkeypatch.setattr(L, "is_port_in_use", lambda port: int(port) == GOLDEN["busy_port"])
    for key in list(os.environ):
        monkeypatch.delenv(key)
    for key, value in CLEAN_ENV.items():
        monkeypatch.setenv(key, value)
    # recorded on a machine without a GPU (with the environment cleared, a GPU would show again)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    recorded = CASES[case]
    expected = recorded[builder]
    before = {k: jsonable(v) for k, v in recorded["namespace"].items()}
    args = copy.deepcopy(_namespace(recorded["namespace"]))
    if "error" in expected:
        with pytest.raises(getattr(builtins, expected["error"])) as info:
            BUILDERS[builder](args)
        assert str(info.value).startswith(expected["message_start"])
        return
    result = BUILDERS[builder](args)
    env = result[1] if isinstance(result, tuple) else result
    added = {k: str(v).replace(str(tmp_path), "<cwd>") for k, v in env.items() if CLEAN_ENV.get(k) != v}
    assert added == expected["env"]
    if builder in ("prepare_simple_launcher_cmd_env", "prepare_deepspeed_cmd_env"):
        cmd = result[0]
        assert (None if cmd is None else ["<python>" if c == sys.executable else c for c in cmd]) == expected[
            "cmd"
        ]
    changes = {k: jsonable(v) for k, v in vars(args).items() if k not in before or before[k] != jsonable(v)}
    assert changes == expected["namespace_changes"]


@pytest.mark.parametrize("case", sorted(GOLDEN["mpi_cases"]))
def test_mpi_launch_command_is_1_15s(case, monkeypatch):
    """``--mpirun_hostfile``: mpirun/mpiexec found and asked its version through ``accelerate.utils.launch``.

    Patched where 1.15's own tests patch (``utils.launch.which``, ``utils.launch.subprocess.check_output``);
    the command for Intel MPI / MPICH / Open MPI, which of the two is used, and the errors are 1.15's.
    """
    recorded = GOLDEN["mpi_cases"][case]
    from notebook_accel.commands.launch import _validate_launch_command, launch_command_parser

    monkeypatch.setenv("HF_HOME", "/nonexistent-hf-home")  # no default config file of this machine's user
    args = _validate_launch_command(launch_command_parser().parse_args(recorded["argv"]))[0]
    asked = []

    def check_output(cmd, *a, **k):
        asked.append(list(cmd))
        if recorded["version_text"] is None:
            raise subprocess.CalledProcessError(1, cmd)
        return recorded["version_text"].encode()

    monkeypatch.setattr(
        utils_launch,
        "which",
        lambda name, *a, **k: f"/usr/bin/{name}" if name in recorded["on_path"] else None,
    )
    monkeypatch.setattr(utils_launch.subprocess, "check_output", check_output)
    if "error" in recorded:
        kind = {"OSError": OSError, "CalledProcessError": subprocess.CalledProcessError}[recorded["error"]]
        with pytest.raises(kind) as info:
            L.prepare_simple_launcher_cmd_env(args)
        assert str(info.value).startswith(recorded["message"])
        return
    cmd, _ = L.prepare_simple_launcher_cmd_env(args)
    assert ["<python>" if c == sys.executable else c for c in cmd] == recorded["cmd"]
    assert asked == [[cmd[0], "--version"]]


def test_mpi_missing_names_the_way_out(monkeypatch):
    monkeypatch.setattr(utils_launch, "which", lambda name, *a, **k: None)
    args = argparse.Namespace(training_script="s.py", training_script_args=[], mpirun_hostfile="hosts",
                              num_processes=2, num_machines=1)  # fmt: skip
    with pytest.raises(OSError, match=r"--mpirun_hostfile 'hosts'.*on PATH.*without --mpirun_hostfile"):
        L.prepare_simple_launcher_cmd_env(args)


def test_a_free_default_port_needs_no_standalone_rendezvous(monkeypatch):
    recorded = GOLDEN["default_port_free"]
    monkeypatch.setattr(L, "is_port_in_use", lambda port: False)
    args = _namespace(recorded["namespace"])
    L.prepare_multi_gpu_env(args)
    expected = recorded["prepare_multi_gpu_env"]["namespace_changes"]
    assert "standalone" not in expected and not hasattr(args, "standalone")
    assert {k: getattr(args, k) for k in expected} == expected


def test_goldens_were_recorded_under_1_15():
    assert GOLDEN["accelerate_version"].startswith("1.15")
    assert len(CASES) >= 15


def test_module_and_no_python_together_are_refused():
    args = argparse.Namespace(training_script="s.py", training_script_args=[], module=True, no_python=True)
    with pytest.raises(ValueError, match="--module and --no_python"):
        L.prepare_simple_launcher_cmd_env(args)


def test_several_machines_without_a_machine_rank_is_named():
    args = argparse.Namespace(num_machines=2, num_processes=4, machine_rank=None, main_process_port=29555)
    with pytest.raises(ValueError, match="--num_machines > 1 needs --machine_rank"):
        L.prepare_multi_gpu_env(args)


def test_unknown_multinode_launcher_is_named():
    args = argparse.Namespace(deepspeed_multinode_launcher="slurmish", num_machines=1, num_processes=2)
    with pytest.raises(ValueError, match="'slurmish' is unknown"):
        L.prepare_deepspeed_cmd_env(args)


def test_sagemaker_args_need_a_python_file():
    args = argparse.Namespace(training_script="train.sh", training_script_args=[])
    with pytest.raises(ValueError, match="'train.sh' does not end in .py"):
        L.prepare_sagemager_args_inputs(object(), args)


# --- the commands, run as a user runs them: `python -m notebook_accel.commands <command>` ---------------

COMMANDS = json.loads((ROOT / "tests" / "data" / "goldens" / "cli_commands.json").read_text(encoding="utf-8"))


def _cli_env(cwd: Path) -> dict[str, str]:
    """What a command of these tests runs under: offline, quiet, its own HF_HOME (no user config)."""
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HOME": str(cwd / "hf")}


def _cli(*argv: str, cwd: Path, timeout: int = 300, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, **_cli_env(cwd)}
    proc = subprocess.run([sys.executable, "-m", "notebook_accel.commands", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _cli_here(*argv: str, cwd: Path, monkeypatch, capsys) -> str:
    """Return the stdout of ``notebook_accel.commands.cli.main(argv)`` run here, with ``_cli``'s cwd and
    environment: the command's own code, without a fresh interpreter (~4 s of importing torch) per case.
    The ``python -m notebook_accel.commands`` entry itself is run by the ``_cli`` tests."""
    from notebook_accel.commands.cli import main

    monkeypatch.chdir(cwd)
    for name, value in _cli_env(cwd).items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", sorted(COMMANDS["estimate_memory"]))
def test_estimate_memory_prints_1_15s_table(case, tmp_path, monkeypatch, capsys):
    transformers = pytest.importorskip(
        "transformers", reason="estimate-memory builds the model with transformers"
    )
    transformers.GPT2Config(**COMMANDS["tiny_gpt2"]).save_pretrained(tmp_path / "tiny-gpt2")
    recorded = COMMANDS["estimate_memory"][case]
    argv = ["estimate-memory", "tiny-gpt2", "--library_name", "transformers", *recorded["argv_after_model"]]
    assert _cli_here(*argv, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys) == recorded["stdout"]


def test_estimate_memory_numbers_match_1_15(tmp_path, monkeypatch):
    transformers = pytest.importorskip(
        "transformers", reason="estimate-memory builds the model with transformers"
    )
    from notebook_accel.commands import estimate

    transformers.GPT2Config(**COMMANDS["tiny_gpt2"]).save_pretrained(tmp_path / "tiny-gpt2")
    monkeypatch.chdir(tmp_path)
    args = estimate.estimate_command_parser().parse_args(["tiny-gpt2", "--library_name", "transformers"])
    rows = [[r[0], float(r[1]), float(r[2]), r[3]] for r in estimate.gather_data(args)]
    assert rows == COMMANDS["estimate_memory"]["default"]["data"]


def test_estimate_memory_refuses_a_missing_folder_offline(tmp_path):
    proc = _cli("estimate-memory", str(tmp_path / "nowhere"), cwd=tmp_path, check=False)
    assert proc.returncode != 0 and "nowhere" in proc.stderr


@pytest.mark.parametrize("case", sorted(COMMANDS["to_fsdp2"]))
def test_to_fsdp2_writes_what_1_15_writes(case, tmp_path, monkeypatch, capsys):
    yaml = pytest.importorskip("yaml")
    recorded = COMMANDS["to_fsdp2"][case]
    (tmp_path / "in.yaml").write_text(yaml.safe_dump(recorded["input"]))
    argv = ["to-fsdp2", "--config_file", "in.yaml", "--output_file", "out.yaml"]
    _cli_here(*argv, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert yaml.safe_load((tmp_path / "out.yaml").read_text()) == recorded["output"]


def test_to_fsdp2_refuses_like_1_15(tmp_path):
    from notebook_accel.commands.to_fsdp2 import to_fsdp2_command, to_fsdp2_command_parser

    parse = to_fsdp2_command_parser().parse_args
    (tmp_path / "in.yaml").write_text("distributed_type: FSDP\nfsdp_config: {fsdp_version: 1}\n")
    (tmp_path / "taken.yaml").write_text("x: 1\n")
    with pytest.raises(ValueError, match="--output_file must be provided"):
        to_fsdp2_command(parse(["--config_file", str(tmp_path / "in.yaml")]))
    with pytest.raises(FileExistsError, match="taken.yaml already exists and --overwrite is not set"):
        to_fsdp2_command(
            parse(["--config_file", str(tmp_path / "in.yaml"), "--output_file", str(tmp_path / "taken.yaml")])
        )
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        to_fsdp2_command(parse(["--config_file", str(tmp_path / "nope.yaml"), "--overwrite"]))


def test_to_fsdp2_reads_through_load_config_and_asks_path_exists(tmp_path, monkeypatch, caplog):
    """1.15's tests patch ``to_fsdp2.load_config`` and ``pathlib.Path.exists``: both are what ours consults."""
    import pathlib

    from notebook_accel.commands import to_fsdp2

    parse = to_fsdp2.to_fsdp2_command_parser().parse_args
    (tmp_path / "in.yaml").write_text("distributed_type: FSDP\nfsdp_config: {fsdp_version: 1}\n")
    assert to_fsdp2.load_config(str(tmp_path / "in.yaml")) == {
        "distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 1}
    }  # fmt: skip
    monkeypatch.setattr(to_fsdp2, "load_config", lambda path: {"fsdp_config": {"fsdp_version": 2}})
    with caplog.at_level("WARNING"):
        to_fsdp2.to_fsdp2_command(parse(["--config_file", str(tmp_path / "in.yaml"), "--output_file",
                                         str(tmp_path / "out.yaml")]))  # fmt: skip
    assert "Config already specifies FSDP2, skipping conversion..." in caplog.records[0].getMessage()
    monkeypatch.setattr(pathlib.Path, "exists", lambda self: True)
    with pytest.raises(FileExistsError, match="never.yaml already exists"):
        to_fsdp2.to_fsdp2_command(parse(["--config_file", str(tmp_path / "in.yaml"), "--output_file",
                                         str(tmp_path / "never.yaml")]))  # fmt: skip


def test_estimate_memory_asks_the_hub_through_verify_on_hub(monkeypatch):
    """``verify_on_hub`` answers "gated"/"repo" for those Hub errors; a gated or absent name is an OSError."""
    pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants
    from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError

    from notebook_accel.commands import estimate

    for error, answer in ((GatedRepoError, "gated"), (RepositoryNotFoundError, "repo")):

        def refuse(repo, token=None, error=error):
            exc = error.__new__(error)  # the Hub's errors want an HTTP response; the type is what counts
            Exception.__init__(exc, f"{repo}: no")
            raise exc

        monkeypatch.setattr("huggingface_hub.model_info", refuse)
        assert estimate.verify_on_hub("org/model") == answer
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    args = estimate.estimate_command_parser().parse_args(["org/llama"])
    for answer, match in (
        ("gated", "`org/llama` is gated.*hf auth login"),
        ("repo", "does not exist on the Hub"),
    ):
        monkeypatch.setattr(estimate, "verify_on_hub", lambda repo, token=None, answer=answer: answer)
        with pytest.raises(OSError, match=match):
            estimate.estimate_command(args)


# add_timm_hub_prefix's answers under Accelerate 1.15 (recorded with its add_timm_hub_prefix, issue 35).
TIMM_NAMES_1_15 = {
    "resnet50": "resnet50", "resnet50.a1_in1k": "resnet50.a1_in1k", "timm/resnet50.a1_in1k":
    "hf-hub:timm/resnet50.a1_in1k", "hf-hub:timm/r": "hf-hub:timm/r", "local-dir:/p": "local-dir:/p",
    "a/b/c": "hf-hub:a/b/c", "/abs/path": "hf-hub:/abs/path", "": "", "a:b": "a:b", "x/y:z": "x/y:z",
}  # fmt: skip


def test_estimate_memory_gives_timm_hub_names_their_prefix(monkeypatch):
    """A Hub repo id reaches timm as ``hf-hub:org/name`` (timm >= 1.0.29); registry names stay bare."""
    import types

    from notebook_accel.commands import estimate

    assert {name: estimate.add_timm_hub_prefix(name) for name in TIMM_NAMES_1_15} == TIMM_NAMES_1_15
    asked = []
    fake_timm = types.SimpleNamespace(create_model=lambda name, pretrained: asked.append((name, pretrained)))
    monkeypatch.setitem(sys.modules, "timm", fake_timm)
    monkeypatch.setattr(estimate, "_check_on_hub", lambda name, token: None)
    estimate.create_empty_model("timm/resnet50.a1_in1k", library_name="timm")
    estimate.create_empty_model("resnet50", library_name="timm")
    assert asked == [("hf-hub:timm/resnet50.a1_in1k", False), ("resnet50", False)]


def test_env_prints_1_15s_fields_and_config(tmp_path, monkeypatch, capsys):
    yaml = pytest.importorskip("yaml")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(COMMANDS["to_fsdp2"]["full_shard"]["input"]))
    here = {"cwd": tmp_path, "monkeypatch": monkeypatch, "capsys": capsys}
    ours = _cli_here("env", "--config_file", "c.yaml", **here).splitlines()
    theirs = COMMANDS["env_with_config"]["lines"]
    labels = [line.split(":")[0] for line in ours if line.startswith("- ")]
    assert labels == [line.split(":")[0] for line in theirs if line.startswith("- ")]
    assert [line for line in ours if line.startswith("\t")] == [
        line for line in theirs if line.startswith("\t")
    ]
    assert ours[:3] == theirs[:3]
    without = _cli_here("env", **here).splitlines()
    assert without[-2:] == COMMANDS["env_without_config"]["lines"][-2:]


def test_env_finds_the_accelerate_command_through_its_which(monkeypatch):
    """``env`` asks ``commands.env.which`` (1.15's tests patch that name) and says "Not found" without it."""
    from notebook_accel.commands import env

    monkeypatch.setattr(env, "which", lambda name: None)
    assert (
        env.env_command(env.env_command_parser().parse_args([]))["`accelerate` bash location"] == "Not found"
    )
    monkeypatch.setattr(env, "which", lambda name: f"/opt/bin/{name}")
    assert env.env_info()[0]["`accelerate` bash location"] == "/opt/bin/accelerate"


def test_config_default_writes_1_15s_file(tmp_path):
    _cli("config", "default", "--config_file", "c.json", "--mixed_precision", "fp16", cwd=tmp_path)
    assert json.loads((tmp_path / "c.json").read_text()) == COMMANDS["config_default_fp16"]


def test_launch_runs_a_script_on_two_cpu_processes(tmp_path):
    (tmp_path / "s.py").write_text(
        "import sys\nfrom notebook_accel import Accelerator\na = Accelerator()\n"
        # one write per line: with PYTHONUNBUFFERED, print() writes the text and the newline apart, and the
        # two ranks' lines could interleave on the shared pipe
        "sys.stdout.write(f'rank={a.process_index} world={a.num_processes} type={a.distributed_type.value} "
        "args={sys.argv[1:]}\\n')\n"
    )
    proc = _cli("launch", "--cpu", "--num_processes", "2", "--main_process_port", str(_free_port()), "s.py",
                "--lr", "3", cwd=tmp_path)  # fmt: skip
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank="))
    assert lines == [f"rank={r} world=2 type=MULTI_CPU args=['--lr', '3']" for r in (0, 1)]


def test_test_command_passes_on_two_cpu_processes(tmp_path):
    port = _free_port()
    (tmp_path / "c.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nmixed_precision: 'no'\n"
        f"num_machines: 1\nnum_processes: 2\nuse_cpu: true\nmain_process_port: {port}\n"
    )
    proc = _cli("test", "--config_file", "c.yaml", cwd=tmp_path)
    assert (
        proc.stdout.strip().splitlines()[-1]
        == "Test is a success! You are ready for your distributed training!"
    )
    assert "2 process(es)" in proc.stdout


def test_merge_weights_writes_one_safetensors_file(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    dcp.save({"model": state}, checkpoint_id=str(tmp_path / "pytorch_model_fsdp_0"))
    _cli("merge-weights", "pytorch_model_fsdp_0", "merged", "--remove_checkpoint_dir", cwd=tmp_path)
    assert sorted(p.name for p in (tmp_path / "merged").iterdir()) == ["model.safetensors"]
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert merged.keys() == state.keys() and all(torch.equal(merged[k], state[k]) for k in state)
    assert not (tmp_path / "pytorch_model_fsdp_0").exists()


def test_merge_weights_names_a_folder_that_is_not_a_checkpoint(tmp_path):
    proc = _cli("merge-weights", "missing_dir", "out", cwd=tmp_path, check=False)
    assert (
        proc.returncode != 0 and "'missing_dir' is not a torch.distributed.checkpoint folder" in proc.stderr
    )


def test_the_console_script_is_declared_and_not_named_accelerate():
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"notebook-accel": "notebook_accel.commands.cli:main"}


def test_no_command_prints_help_and_returns_1(capsys):
    from notebook_accel.commands.cli import main

    assert main([]) == 1
    assert "estimate-memory" in capsys.readouterr().out


def test_utils_launch_serves_the_builders_from_the_commands_package():
    # Accelerate's path keeps working: every name of accelerate.utils.launch, the same objects as ours
    recorded = json.loads((ROOT / "tests" / "data" / "accelerate_surface.json").read_text(encoding="utf-8"))
    names = set(recorded["modules"]["accelerate.utils.launch"]["names"])
    assert names <= set(utils_launch.__all__)
    for name in names - {"PrepareForLaunch"}:
        assert getattr(utils_launch, name) is getattr(L, name), name
    assert utils_launch._convert_nargs_to_dict is L._convert_nargs_to_dict
