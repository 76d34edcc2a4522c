"""Big-model behaviours that code written against Accelerate 1.15 relies on (issue 22, "Big-model")."""

from __future__ import annotations

import json
import logging
import platform
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from notebook_accel.utils import infer_auto_device_map, load_checkpoint_in_model, set_module_tensor_to_device

DATA = Path(__file__).parent / "data" / "fallback_device_maps_1_15.json"


# --------------------------------------------------------------------------- load_checkpoint_in_model


def _linear_checkpoint(folder: Path, extra: bool = False) -> dict[str, torch.Tensor]:
    folder.mkdir(parents=True, exist_ok=True)
    state = {"weight": torch.full((2, 3), 2.0), "bias": torch.zeros(2)}
    if extra:
        state["extra"] = torch.zeros(1)
    save_file(state, str(folder / "shard.safetensors"), metadata={"format": "pt"})
    return state


def test_unexpected_keys_are_warned_with_1_15s_wording(tmp_path, caplog) -> None:
    _linear_checkpoint(tmp_path, extra=True)
    with caplog.at_level(logging.WARNING, logger="notebook_accel.utils.checkpoint_io.checkpoints"):
        load_checkpoint_in_model(nn.Linear(3, 2), tmp_path / "shard.safetensors")
    expected = (
        f"Some weights of the model checkpoint at {tmp_path / 'shard.safetensors'} were not used when "
        "initializing Linear: {'extra'}. This may or may not be an issue - make sure that the checkpoint does "
        "not have unnecessary parameters, or that the model definition correctly corresponds to the checkpoint."
    )
    assert expected in caplog.messages


@pytest.mark.parametrize("name", ["custom.json", "weights_map", "index.txt"])
def test_an_index_of_any_name_is_read(tmp_path, name) -> None:
    state = _linear_checkpoint(tmp_path)
    (tmp_path / name).write_text(
        json.dumps({"metadata": {}, "weight_map": dict.fromkeys(state, "shard.safetensors")})
    )
    with torch.device("meta"):
        model = nn.Linear(3, 2)
    load_checkpoint_in_model(model, tmp_path / name, device_map={"": "cpu"})
    assert torch.equal(model.weight, state["weight"])


def test_a_folder_without_checkpoint_is_a_value_error_too(tmp_path) -> None:
    # Accelerate 1.15 raises ValueError; ours is also a FileNotFoundError (what the path lacks).
    with pytest.raises(ValueError, match="is not a folder containing a `.index.json` file"):
        load_checkpoint_in_model(nn.Linear(3, 2), tmp_path)
    with pytest.raises(FileNotFoundError, match="neither a file nor a folder"):
        load_checkpoint_in_model(nn.Linear(3, 2), tmp_path / "missing")


# ----------------------------------------------------------------------- set_module_tensor_to_device


def test_a_wrong_shape_is_1_15s_message_with_the_tensor_named_in_a_note() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError) as ours:
        set_module_tensor_to_device(model, "0.weight", "cpu", value=torch.zeros(3))
    message = str(ours.value)
    assert message == (
        'Trying to set a tensor of shape torch.Size([3]) in "weight" (which has shape torch.Size([2, 2])), '
        "this looks incorrect."
    )
    # Our detail is a note on the exception (shown under its traceback), not part of its text.
    assert ours.value.__notes__ == [
        "'0.weight' of Sequential has shape (2, 2), the value (3,); the checkpoint does not match the model."
    ]
    accelerate = pytest.importorskip("accelerate.utils.modeling")
    with pytest.raises(ValueError) as theirs:
        accelerate.set_module_tensor_to_device(
            nn.Sequential(nn.Linear(2, 2)), "0.weight", "cpu", value=torch.zeros(3)
        )
    assert message == str(theirs.value)


@pytest.mark.parametrize(
    ("old", "value", "expected"),
    [
        (torch.float32, torch.int64, torch.float32),
        (torch.int64, torch.float32, torch.int64),
        (torch.float16, torch.bool, torch.float16),
        (torch.float32, torch.float16, torch.float32),
    ],
)
def test_a_value_of_another_dtype_takes_the_tensors_dtype(old, value, expected) -> None:
    module = nn.Module()
    module.register_buffer("b", torch.zeros(3, dtype=old, device="meta"))
    module.p = nn.Parameter(torch.zeros(3, dtype=old), requires_grad=False)
    for name in ("b", "p"):
        set_module_tensor_to_device(module, name, "cpu", value=torch.ones(3, dtype=value))
        assert getattr(module, name).dtype == expected


# ------------------------------------------------------------------ infer_auto_device_map fallback


class Block(nn.Module):
    def __init__(self, d: int, big: bool) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, 4 * d if big else d)
        self.register_buffer("buf", torch.zeros(d * 8))


class Net(nn.Module):
    def __init__(self, blocks: int, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.blocks = nn.ModuleList([Block(d, i == 1) for i in range(blocks)])
        self.head = nn.Linear(d, 50, bias=False)


_CASES = json.loads(DATA.read_text())["cases"]


@pytest.mark.parametrize("case", _CASES, ids=[f"{i}" for i in range(len(_CASES))])
def test_fallback_allocation_and_buffer_warning_agree_with_1_15(case) -> None:
    model = Net(case["blocks"])
    max_memory = {(int(k) if k.isdigit() else k): v for k, v in case["max_memory"].items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        device_map = infer_auto_device_map(
            model, max_memory=max_memory, no_split_module_classes=case["no_split_module_classes"],
            fallback_allocation=True, offload_buffers=case["offload_buffers"],
        )  # fmt: skip
    # Each parameter goes where 1.15 put it. (A split block's own buffer gets an entry of its own here,
    # which 1.15 leaves out of the map -- docs/guide/migrating.md -- so the maps are compared per parameter.)
    assert _per_parameter(model, device_map) == _per_parameter(model, case["device_map"])
    messages = [str(w.message) for w in caught if "bytes of buffer for offloaded layers" in str(w.message)]
    expected = case["buffer_warning_bytes"]
    assert bool(messages) == (expected is not None), messages
    if messages:
        own = sum(size for _, size in _uncounted_buffers(model, case["device_map"], device_map))
        assert messages[0].startswith(
            f"Current model requires {expected + own} bytes of buffer for offloaded"
        )


def _per_parameter(model: nn.Module, device_map: dict) -> dict[str, str]:
    placed = {}
    for name, _ in model.named_parameters():
        owner = max((k for k in device_map if k == "" or name == k or name.startswith(k + ".")), key=len)
        placed[name] = str(device_map[owner])
    return placed


def _uncounted_buffers(model: nn.Module, theirs: dict, ours: dict) -> list[tuple[str, int]]:
    """The buffers 1.15's map does not cover (a split block's own) that ours offloads: 1.15 does not count them."""
    covered = [k for k in theirs if k]
    return [
        (name, b.numel() * b.element_size())
        for name, b in model.named_buffers()
        if "" not in theirs
        and not any(name == k or name.startswith(k + ".") for k in covered)
        and str(ours.get(name)) in ("cpu", "disk")
    ]


# ------------------------------------------------------------------------------ layerwise casting


class _Probe(nn.Linear):
    """A Linear recording its weight's dtype inside forward (where the computation happens)."""

    seen: list[torch.dtype]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.weight.dtype)
        return super().forward(x)


@pytest.mark.parametrize("storage", [torch.float16, torch.float8_e4m3fn])
def test_layerwise_casting_stores_in_storage_and_computes_in_compute_dtype(storage) -> None:
    from notebook_accel.big_modeling import attach_layerwise_casting_hooks

    torch.manual_seed(0)
    model = nn.Sequential(_Probe(4, 4), nn.LayerNorm(4), _Probe(4, 2))
    for layer in (model[0], model[2]):
        layer.seen = []
    reference = {k: v.to(storage).float() for k, v in model.state_dict().items()}
    attach_layerwise_casting_hooks(model, storage_dtype=storage, compute_dtype=torch.float32)
    for _ in range(2):  # between calls: storage dtype; during: compute dtype; the norm is never cast
        assert model[0].weight.dtype == storage and model[2].bias.dtype == storage
        assert model[1].weight.dtype == torch.float32
        out = model(torch.ones(1, 4))
        assert out.dtype == torch.float32
    assert model[0].seen == [torch.float32, torch.float32] and model[2].seen == [torch.float32] * 2
    expected = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    expected.load_state_dict(
        {k: v if k.startswith("1.") else reference[k] for k, v in model.state_dict().items()}
    )
    expected[1].load_state_dict(model[1].state_dict())
    assert torch.equal(out, expected(torch.ones(1, 4)))  # storage rounding only, no drift across calls


# ------------------------------------------------------------------------------ old kernel warning


@pytest.mark.parametrize(("release", "shown"), [("4.19.0-1-amd64", "4.19.0"), ("4.19.112+", "4.19.112")])
def test_the_old_kernel_warning_names_the_running_version(caplog, release, shown) -> None:
    from notebook_accel.utils import check_os_kernel

    uname = platform.uname_result("Linux", "host", release, "#1", "x86_64")
    with mock.patch("platform.uname", return_value=uname), caplog.at_level(logging.WARNING):
        check_os_kernel()
    (record,) = [r for r in caplog.records if "kernel" in r.getMessage()]
    # The version is in the record's own msg (formatted when logged, as 1.15), with no args left.
    assert record.msg.startswith(
        f"Detected kernel version {shown}, which is below the recommended minimum of 5.5.0"
    )
    assert f"(running kernel: {release})" in record.msg and not record.args
    caplog.clear()
    recent = platform.uname_result("Linux", "host", "6.1.0-18-amd64", "#1", "x86_64")
    with mock.patch("platform.uname", return_value=recent), caplog.at_level(logging.WARNING):
        check_os_kernel()
    assert not [m for m in caplog.messages if "kernel" in m]
