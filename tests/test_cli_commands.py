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
import sys
from pathlib import Path

import pytest

from notebook_accel.utils import launch as L

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((ROOT / "tests" / "data" / "goldens" / "cli_prepare.json").read_text(encoding="utf-8"))
CASES = GOLDEN["cases"]
CLEAN_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
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


def _jsonable(value):
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


@pytest.mark.parametrize("builder", sorted(BUILDERS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_prepare_builders_match_1_15(case, builder, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for key in list(os.environ):
        monkeypatch.delenv(key)
    for key, value in CLEAN_ENV.items():
        monkeypatch.setenv(key, value)
    recorded = CASES[case]
    expected = recorded[builder]
    before = {k: _jsonable(v) for k, v in recorded["namespace"].items()}
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
    changes = {k: _jsonable(v) for k, v in vars(args).items() if k not in before or before[k] != _jsonable(v)}
    assert changes == expected["namespace_changes"]


def test_goldens_were_recorded_under_1_15():
    assert GOLDEN["accelerate_version"].startswith("1.15")
    assert len(CASES) >= 15


def test_convert_nargs_to_dict_reads_flags_values_and_types():
    got = L._convert_nargs_to_dict(
        ["--lr", "0.1", "--epochs", "3", "--fp16", "--name", "run", "--flag=false"]
    )
    assert got == {"lr": 0.1, "epochs": 3, "fp16": True, "name": "run", "flag": False}


def test_convert_nargs_to_dict_refuses_a_value_without_key():
    with pytest.raises(ValueError, match="'stray' has no --key"):
        L._convert_nargs_to_dict(["stray"])


def test_module_and_no_python_together_are_refused():
    args = argparse.Namespace(training_script="s.py", training_script_args=[], module=True, no_python=True)
    with pytest.raises(ValueError, match="--module and --no_python"):
        L.prepare_simple_launcher_cmd_env(args)


def test_unknown_multinode_launcher_is_named():
    args = argparse.Namespace(deepspeed_multinode_launcher="slurmish", num_machines=1, num_processes=2)
    with pytest.raises(ValueError, match="'slurmish' is unknown"):
        L.prepare_deepspeed_cmd_env(args)


def test_sagemaker_args_need_a_python_file():
    args = argparse.Namespace(training_script="train.sh", training_script_args=[])
    with pytest.raises(ValueError, match="'train.sh' does not end in .py"):
        L.prepare_sagemager_args_inputs(object(), args)
