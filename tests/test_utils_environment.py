"""Environment helpers, the default config file writer, and environment checks (truthful, CUDA-safe)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from notebook_accel import utils
from notebook_accel.utils import PrecisionType, clear_environment, patch_environment, write_basic_config
from notebook_accel.utils.environment import get_int_from_env, parse_flag_from_env, str_to_bool

# ------------------------------------------------------------------------------- patch / clear


def test_patch_environment_sets_upper_cased_str_values_and_restores() -> None:
    os.environ["NA_KEEP"] = "old"
    os.environ.pop("NA_NEW", None)
    with patch_environment(na_keep=1, na_new=True):
        assert os.environ["NA_KEEP"] == "1" and os.environ["NA_NEW"] == "True"
    assert os.environ["NA_KEEP"] == "old" and "NA_NEW" not in os.environ


def test_patch_environment_restores_when_the_block_raises() -> None:
    before = dict(os.environ)
    with pytest.raises(KeyError, match="boom"):
        with patch_environment(NA_X="1", PATH="/nowhere"):
            raise KeyError("boom")
    assert dict(os.environ) == before


def test_clear_environment_empties_and_restores_exactly() -> None:
    os.environ["NA_FOO"] = "bar"
    before = dict(os.environ)
    with clear_environment():
        assert dict(os.environ) == {}
        os.environ["NA_FOO"] = "new_bar"
        os.environ["NA_OTHER"] = "x"
    assert dict(os.environ) == before
    with pytest.raises(RuntimeError, match="inside"):
        with clear_environment():
            raise RuntimeError("inside")
    assert dict(os.environ) == before


def test_str_to_bool_and_flags() -> None:
    assert [str_to_bool(v) for v in ("yes", "TRUE", "1", "on")] == [1, 1, 1, 1]
    assert [str_to_bool(v) for v in ("no", "False", "0", "off")] == [0, 0, 0, 0]
    assert str_to_bool("y", to_bool=True) is True
    with pytest.raises(ValueError, match=r"invalid truth value 'maybe'"):
        str_to_bool("maybe")
    with patch_environment(NA_FLAG="true", NA_BAD="sometimes"):
        assert parse_flag_from_env("NA_FLAG") is True
        assert parse_flag_from_env("NA_UNSET_FLAG", default=True) is True
        with pytest.raises(ValueError, match=r"NA_BAD='sometimes' is not a flag"):
            parse_flag_from_env("NA_BAD")


def test_get_int_from_env() -> None:
    with patch_environment(NA_A="-1", NA_B="3", NA_C="x"):
        assert get_int_from_env(["NA_MISSING", "NA_A", "NA_B"], 7) == 3
        assert get_int_from_env(["NA_MISSING"], 7) == 7
        with pytest.raises(ValueError, match=r"NA_C='x' is not an integer"):
            get_int_from_env(["NA_C"], 0)


# ------------------------------------------------------------------------------- write_basic_config


def test_write_basic_config_yaml_json_and_no_overwrite(tmp_path, caplog) -> None:
    path = write_basic_config(mixed_precision="bf16", save_location=str(tmp_path / "a" / "cfg.yaml"))
    assert path == tmp_path / "a" / "cfg.yaml"
    text = path.read_text()
    assert "mixed_precision: bf16\n" in text and "compute_environment: LOCAL_MACHINE\n" in text
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load(text)
    expected_processes = max(torch.cuda.device_count(), 1)
    assert config["num_processes"] == expected_processes and config["distributed_type"] in ("NO", "MULTI_GPU")
    assert config["use_cpu"] is (torch.cuda.device_count() == 0 and not utils.is_mps_available())
    json_path = write_basic_config(save_location=str(tmp_path / "cfg.json"))
    assert json.loads(json_path.read_text())["mixed_precision"] == "no"
    with caplog.at_level("WARNING"):
        assert write_basic_config(save_location=str(path)) is False
    assert "will not override" in caplog.text
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["cfg.yaml"]  # no temp file left behind


def test_write_basic_config_default_location_honours_hf_home(tmp_path) -> None:
    with patch_environment(HF_HOME=str(tmp_path / "hf")):
        path = write_basic_config()
    assert path == tmp_path / "hf" / "accelerate" / "default_config.yaml" and path.exists()
    env = {k: v for k, v in os.environ.items() if k != "HF_HOME"}
    with clear_environment():
        os.environ.update(env)
        os.environ["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
        path = write_basic_config()
    assert path == tmp_path / "xdg" / "huggingface" / "accelerate" / "default_config.yaml"


def test_write_basic_config_rejects_bad_precision(tmp_path) -> None:
    with pytest.raises(
        ValueError, match=r"Unknown mixed_precision 'fp12': choose one of 'no', 'fp16', 'bf16', 'fp8'"
    ):
        write_basic_config(mixed_precision="fp12", save_location=str(tmp_path / "c.yaml"))
    assert not (tmp_path / "c.yaml").exists()
    # The PrecisionType enum is accepted and written as its value.
    path = write_basic_config(mixed_precision=PrecisionType.FP16, save_location=str(tmp_path / "d.yaml"))
    assert "mixed_precision: fp16\n" in path.read_text()


# ------------------------------------------------------------------------------- environment checks


def test_package_checks_are_truthful() -> None:
    for name, module in [
        ("is_safetensors_available", "safetensors"),
        ("is_tqdm_available", "tqdm"),
        ("is_ipython_available", "IPython"),
        ("is_bnb_available", "bitsandbytes"),
        ("is_wandb_available", "wandb"),
        ("is_comet_ml_available", "comet_ml"),
        ("is_mlflow_available", "mlflow"),
        ("is_aim_available", "aim"),
        ("is_clearml_available", "clearml"),
        ("is_dvclive_available", "dvclive"),
        ("is_transformer_engine_available", "transformer_engine"),
        ("is_msamp_available", "msamp"),
        ("is_torch_xla_available", "torch_xla"),
    ]:
        assert getattr(utils, name)() is (importlib.util.find_spec(module) is not None), name
    assert utils.is_safetensors_available() is True
    assert utils.is_deepspeed_available() is (importlib.util.find_spec("deepspeed") is not None)


def test_npu_probe_reads_the_backend_torch_npu_registers(monkeypatch, request) -> None:
    import importlib.machinery
    import sys
    import types

    from notebook_accel.utils.package_checks import is_package_available

    fake = types.ModuleType("torch_npu")
    fake.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    is_package_available.cache_clear()  # the answers are cached; forget the real "not installed"
    request.addfinalizer(is_package_available.cache_clear)

    class _Npu:
        count_fails, available = False, True

        def device_count(self) -> int:
            if self.count_fails:
                raise RuntimeError("no NPU driver")
            return 1

        def is_available(self) -> bool:
            return self.available

    npu = _Npu()
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    assert utils.is_npu_available() is True and utils.is_npu_available(check_device=True) is True
    npu.count_fails = True  # the runtime cannot start: only the device check notices
    assert utils.is_npu_available() is True and utils.is_npu_available(check_device=True) is False
    npu.available = False
    assert utils.is_npu_available() is False
    monkeypatch.delattr(torch, "npu")  # torch_npu installed but registered nothing
    assert utils.is_npu_available() is False and utils.is_npu_available(check_device=True) is False


def test_device_checks_are_truthful() -> None:
    assert utils.is_cuda_available() is (torch.cuda.device_count() > 0)
    assert utils.is_mps_available() is torch.backends.mps.is_available()
    assert utils.is_xpu_available() is (hasattr(torch, "xpu") and torch.xpu.is_available())
    assert utils.is_npu_available() is False or importlib.util.find_spec("torch_npu") is not None
    assert utils.is_tpu_available() is False or importlib.util.find_spec("torch_xla") is not None
    assert (
        utils.is_ipex_available() is False
        or importlib.util.find_spec("intel_extension_for_pytorch") is not None
    )
    assert isinstance(utils.is_bf16_available(), bool) and isinstance(
        utils.is_bf16_available(ignore_tpu=True), bool
    )
    if not torch.cuda.device_count():
        assert utils.is_bf16_available() is True  # CPU kernels support bf16
    with patch_environment(ACCELERATE_USE_XPU="false"):
        assert utils.is_xpu_available() is False


def test_is_torch_version() -> None:
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert utils.is_torch_version(">=", "2.0")
    assert utils.is_torch_version("<", f"{major + 1}.0")
    assert not utils.is_torch_version("<", f"{major}.{minor}")
    assert utils.is_torch_version("!=", "1.0")
    with pytest.raises(ValueError, match=r"operation '=>' is not a comparison.*'>='"):
        utils.is_torch_version("=>", "2.0")


def test_torch_xla_check_argument_conflict() -> None:
    with pytest.raises(ValueError, match="cannot both be True"):
        utils.is_torch_xla_available(check_is_tpu=True, check_is_gpu=True)


def test_device_queries_never_initialise_cuda() -> None:
    code = (
        "import torch\n"
        "from notebook_accel.utils import imports as i\n"
        "n = i.cuda_device_count(); a = i.is_cuda_available(); b = i.is_bf16_available()\n"
        "i.is_tpu_available(); i.is_xpu_available(); i.is_npu_available(); i.is_mps_available()\n"
        "assert not torch.cuda.is_initialized(), 'CUDA was initialised'\n"
        "print(n, a)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    count, available = out.stdout.split()
    assert int(count) == torch.cuda.device_count() and available == str(torch.cuda.device_count() > 0)


@pytest.mark.parametrize(("gpus", "expected"), [(4, ("MULTI_GPU", 4, False)), (1, ("NO", 1, False))])
def test_write_basic_config_describes_the_gpus(tmp_path, monkeypatch, gpus, expected) -> None:
    from notebook_accel.utils import config_file

    monkeypatch.setattr(config_file, "cuda_device_count", lambda: gpus)
    path = write_basic_config(save_location=str(tmp_path / "cfg.json"))
    config = json.loads(path.read_text())
    assert (config["distributed_type"], config["num_processes"], config["use_cpu"]) == expected
