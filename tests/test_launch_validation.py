"""``accelerate launch``'s namespace before it launches, its script-argument parser and its free port, as 1.15's.

tests/data/launch_validation_1_15.json (scripts/record_launch_validation.py, run under the real 1.15)
holds, for a spread of command lines and config files, the namespace ``_validate_launch_command``
returned (with the other two items of its tuple and the records it logged) or the error it raised;
what ``_convert_nargs_to_dict`` returned or raised for a spread of script argument lists; and what
``prepare_multi_gpu_env`` did with ``--main_process_port 0``. Ours is held to each.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from notebook_accel.commands import launch as launch_module
from notebook_accel.commands import launch_validate
from notebook_accel.commands.launch import _validate_launch_command, launch_command, launch_command_parser
from notebook_accel.commands.launch_env import _convert_nargs_to_dict, prepare_multi_gpu_env
from tests.clients._subproc import last_line, run_python
from tests.script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "tests" / "data" / "launch_validation_1_15.json").read_text(encoding="utf-8"))
RECORDER = load_script("record_launch_validation.py")
CASES = {**RECORD["argv_cases"], **{f"config:{k}": v for k, v in RECORD["config_cases"].items()}}
# 1.15's validation fails on a SageMaker config (AttributeError: no ``parallelism_config``); ours hands
# the command line to the SageMaker launcher (docs/guide/migrating.md).
KEPT_DIFFERENT = {"config:sagemaker"}


def test_record_is_1_15s_and_spread():
    assert RECORD["accelerate_version"].startswith("1.15")
    assert len(RECORD["argv_cases"]) >= 20 and len(RECORD["config_cases"]) >= 10
    assert sum("error" in case for case in CASES.values()) >= 2


@pytest.fixture
def no_default_config(tmp_path, monkeypatch):
    monkeypatch.setattr(launch_validate, "default_config_file", str(tmp_path / "none.yaml"))
    return tmp_path


def _argv(name: str, folder: Path) -> list[str]:
    case = CASES[name]
    if "config" not in case:
        return case["argv"]
    path = folder / "config.json"
    path.write_text(json.dumps(case["config"]))
    return ["--config_file", str(path), *case["argv"]]


def _messages(caplog) -> list[str]:
    return [f"{r.levelname}: {r.getMessage()}" for r in caplog.records if r.name.startswith("notebook_accel")]


@pytest.mark.parametrize("name", sorted(set(CASES) - KEPT_DIFFERENT))
def test_validation_is_1_15s(name, no_default_config, caplog):
    recorded = CASES[name]
    args = launch_command_parser().parse_args(_argv(name, no_default_config))
    caplog.set_level(logging.DEBUG, logger="notebook_accel")
    if "error" in recorded:
        with pytest.raises(getattr(__builtins__, recorded["error"], None) or Exception) as info:
            _validate_launch_command(args)
        # 1.15's message, then (on its own sentence) what ours adds
        assert type(info.value).__name__ == recorded["error"]
        assert str(info.value).startswith(recorded["message"])
        return
    ours, config, mp_from_config = _validate_launch_command(args)
    namespace = {
        k: RECORDER._jsonable(v)
        for k, v in vars(ours).items()
        if k not in ("config_file", "func", *RECORDER.MACHINE_FIELDS)
    }
    assert namespace == recorded["result"]["namespace"]
    assert (type(config).__name__, mp_from_config) == (
        recorded["result"]["defaults"],
        recorded["result"]["mp_from_config_flag"],
    )
    assert _messages(caplog) == recorded["logged"]


def test_a_sagemaker_config_goes_to_its_launcher_unfilled(no_default_config):
    args = launch_command_parser().parse_args(_argv("config:sagemaker", no_default_config))
    ours, config, mp_from_config = _validate_launch_command(args)
    assert (type(config).__name__, mp_from_config, ours.mixed_precision) == ("SageMakerConfig", False, None)


def test_two_paradigm_flags_are_refused_naming_them(no_default_config):
    args = launch_command_parser().parse_args(["--tpu", "--use_fsdp", "s.py"])
    with pytest.raises(ValueError, match="only use one of `--cpu`, `--multi_gpu`, `--tpu`"):
        launch_command(args)


def test_launch_command_runs_the_validated_namespace(no_default_config, monkeypatch):
    seen = {}
    monkeypatch.setattr(launch_module, "simple_launcher", lambda a: seen.setdefault("args", a))
    path = no_default_config / "config.json"
    path.write_text(json.dumps(RECORD["config_cases"]["bf16_from_config"]["config"]))
    launch_command(launch_command_parser().parse_args(["--config_file", str(path), "s.py", "--lr", "1"]))
    args = seen["args"]
    assert (args.mixed_precision, args.nondefault) == ("bf16", {"config_file", "training_script",
                                                               "training_script_args"})  # fmt: skip


def test_the_accelerate_path_serves_what_1_15s_launch_module_offers():
    # a fresh interpreter: install_as_accelerate() must not leak into the other tests
    out = run_python(
        """
        import notebook_accel
        notebook_accel.install_as_accelerate()
        from accelerate.commands.launch import _validate_launch_command, launch_command, launch_command_parser
        from notebook_accel.commands import launch_validate
        print(_validate_launch_command is launch_validate._validate_launch_command, callable(launch_command))
        """
    )
    assert last_line(out) == "True True"


@pytest.mark.parametrize("case", RECORD["nargs_cases"], ids=lambda c: " ".join(c["nargs"]) or "empty")
def test_convert_nargs_to_dict_is_1_15s(case):
    if "result" in case:
        assert _convert_nargs_to_dict(case["nargs"]) == case["result"]
        return
    # 1.15 raises ValueError for a key without its value; where its argparse exits the interpreter
    # (a value without a key) or fails on a repeated key, ours raises ValueError too (migrating.md)
    with pytest.raises(
        ValueError, match="SageMaker doesn’t support" if case["error"] == "ValueError" else ""
    ):
        _convert_nargs_to_dict(case["nargs"])


@pytest.mark.parametrize("case", RECORD["nargs_values"], ids=lambda c: repr(c["text"]))
def test_convert_nargs_to_dict_converts_each_value_as_1_15(case):
    """``"False"`` becomes a bool, ``"3"`` and ``"1e3"`` ints, ``"5e-5"`` a float: type and value as 1.15's."""
    value = _convert_nargs_to_dict(["--a", case["text"]])["a"]
    assert (type(value).__name__, repr(value)) == (case["type"], case["repr"])


@pytest.mark.parametrize(
    ("nargs", "match"),
    [(["--fp16"], "give '--fp16' a value of its own"), (["--a=1"], r"`--a <value>`"),
     (["stray"], "'stray' has no `--name` before it"), (["--a", "1", "--a", "2"], "'--a' is given twice")],
)  # fmt: skip
def test_convert_nargs_to_dict_names_the_bad_item(nargs, match):
    with pytest.raises(ValueError, match=match):
        _convert_nargs_to_dict(nargs)


def test_port_zero_picks_a_free_port(no_default_config):
    fact = RECORD["free_port"]
    argv = ["--num_processes", "2", "--main_process_port", "0", "s.py"]
    args = _validate_launch_command(launch_command_parser().parse_args(argv))[0]
    env = prepare_multi_gpu_env(args)
    port = int(args.master_port)
    assert (
        (str(port) == args.master_port, port != 0)
        == (True, True)
        == (
            fact["master_port_is_int_string"],
            fact["port_is_not_zero"],
        )
    )
    assert args.main_process_port == port and not getattr(args, "standalone", False)
    assert env.get("MASTER_PORT") == fact["env_master_port"]
