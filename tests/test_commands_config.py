"""accelerate.commands.config: config files written, read back, validated; the default/update subcommands."""

from __future__ import annotations

import json

import pytest

from notebook_accel.commands.config import get_config_parser, load_config_from_file, main
from notebook_accel.commands.config.config_args import BaseConfig, ClusterConfig, SageMakerConfig
from notebook_accel.utils import DistributedType
from notebook_accel.utils.config_file import write_basic_config


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_basic_config_round_trip(tmp_path, suffix):
    path = tmp_path / f"c{suffix}"
    write_basic_config("fp16", str(path))
    config = load_config_from_file(str(path))
    assert isinstance(config, ClusterConfig)
    assert config.distributed_type is DistributedType.NO and config.mixed_precision == "fp16"
    assert config.num_processes == 1 and config.fsdp_config == {} and config.deepspeed_config == {}
    as_dict = config.to_dict()
    assert as_dict["distributed_type"] == "NO" and "fsdp_config" not in as_dict
    out = tmp_path / f"o{suffix}"
    config.to_json_file(out) if suffix == ".json" else config.to_yaml_file(out)
    assert load_config_from_file(str(out)) == config


def test_unquoted_no_from_yaml_is_no(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: NO\nmixed_precision: bf16\n")
    config = load_config_from_file(str(path))
    assert config.distributed_type is DistributedType.NO and config.use_cpu is False


def test_legacy_keys_are_converted():
    out = BaseConfig.process_config(
        {"distributed_type": "MULTI_CPU", "fp16": True, "dynamo_backend": "inductor"}
    )
    assert out["mixed_precision"] == "fp16" and out["dynamo_config"] == {"dynamo_backend": "INDUCTOR"}


def test_sagemaker_file_gives_sagemaker_config(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(
        json.dumps(
            {
                "compute_environment": "AMAZON_SAGEMAKER",
                "distributed_type": "DATA_PARALLEL",
                "mixed_precision": "no",
                "ec2_instance_type": "ml.p3.2xlarge",
                "iam_role_name": "role",
            }
        )
    )
    config = load_config_from_file(str(path))
    assert isinstance(config, SageMakerConfig) and config.base_job_name == "accelerate-sagemaker-1"


def test_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml` does not exist"):
        load_config_from_file(str(tmp_path / "nope.yaml"))


def test_default_missing_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(
        "notebook_accel.commands.config.config_args.default_config_file", str(tmp_path / "d.yaml")
    )
    with pytest.raises(FileNotFoundError, match="accelerate config default"):
        load_config_from_file(None)


@pytest.mark.parametrize(
    "body, match",
    [
        (
            "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nfoo: 1\n",
            r"unknown keys \(\['foo'\]\)",
        ),
        ("mixed_precision: 'no'\n", "A `distributed_type` must be specified"),
        ("distributed_type: BLAH\n", "distributed_type 'BLAH' is not a DistributedType; choose one of NO"),
        ("distributed_type: 'NO'\nmixed_precision: fp17\n", "mixed_precision 'fp17' is not supported"),
    ],
)
def test_bad_files_raise_value_error(tmp_path, body, match):
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(ValueError, match=match):
        load_config_from_file(str(path))


def test_update_keeps_the_format_and_falls_back_to_the_default_file(tmp_path, monkeypatch):
    from notebook_accel.commands.config import update

    path = tmp_path / "cli.json"
    path.write_text(json.dumps({"distributed_type": "NO", "mixed_precision": "fp16"}))
    assert main(argv=["update", "--config_file", str(path)]) == str(path)
    written = json.loads(path.read_text())  # still JSON, now with every current field
    assert written["mixed_precision"] == "fp16" and "num_processes" in written
    monkeypatch.setattr(update, "default_config_file", str(tmp_path / "default_config.yaml"))
    with pytest.raises(FileNotFoundError, match=r"default_config.yaml' \(the default config file\)"):
        main(argv=["update"])
    main(argv=["default", "--config_file", str(tmp_path / "default_config.yaml")])
    assert main(argv=["update"]) == str(tmp_path / "default_config.yaml")


def test_default_and_update_subcommands(tmp_path):
    path = tmp_path / "cli.yaml"
    assert main(argv=["default", "--config_file", str(path), "--mixed_precision", "bf16"]) == path
    path.write_text(path.read_text() + "gpu_ids: all\n")
    assert main(argv=["update", "--config_file", str(path)]) == str(path)
    assert load_config_from_file(str(path)).mixed_precision == "bf16"
    with pytest.raises(FileNotFoundError, match=r"nothing to update at '.*none.yaml' \(--config_file\)"):
        main(argv=["update", "--config_file", str(tmp_path / "none.yaml")])
    args = get_config_parser().parse_args([])
    with pytest.raises(RuntimeError, match="accelerate config default"):
        args.func(args)
