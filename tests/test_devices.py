"""notebook_accel.utils.device_planning.devices: the one place a device's spelling is decided, and DeviceLookup."""

from __future__ import annotations

import pytest
import torch

from notebook_accel.utils.device_planning.device_memory import get_max_memory
from notebook_accel.utils.device_planning.devices import device_key, device_label, is_disk, torch_device
from notebook_accel.utils.device_planning.placement import DeviceLookup


def test_device_key_spells_devices_as_device_maps_do() -> None:
    # One GPU, four spellings, one key: device maps compare them equal.
    assert {device_key(d) for d in (0, "cuda", "cuda:0", torch.device("cuda", 0), " CUDA:0 ")} == {0}
    assert device_key(torch.device("cuda")) == 0 and device_key("2") == 2
    assert [device_key(d) for d in ("cpu", "MPS", "disk", torch.device("cpu"))] == [
        "cpu",
        "mps",
        "disk",
        "cpu",
    ]
    assert device_key("xpu:1") == "xpu:1"  # other accelerators keep torch's spelling
    with pytest.raises(ValueError, match="Device 'tpu' is not recognized: use GPU indices"):
        device_key("tpu")
    with pytest.raises(ValueError, match="Device 3.5 is not recognized"):
        device_key(3.5)


def test_max_memory_takes_only_budgeted_devices() -> None:
    with pytest.raises(ValueError, match="Device 'xpu:0' is not recognized in max_memory"):
        get_max_memory({"xpu:0": "1GiB"})
    assert list(get_max_memory({"disk": 10, "cpu": 5, "cuda:1": 3, 0: 2})) == [0, 1, "cpu", "disk"]


def test_torch_device_and_disk() -> None:
    assert torch_device(1) == torch.device("cuda", 1) and torch_device("cpu") == torch.device("cpu")
    meta = torch.device("meta")
    assert torch_device(meta) is meta
    with pytest.raises(
        ValueError, match="'disk' is not a device a tensor can live on.*run them on 'cpu' or a GPU"
    ):
        torch_device("disk")
    with pytest.raises(ValueError, match="False is not a device"):
        torch_device(False)
    assert is_disk("disk") and not is_disk("cpu") and not is_disk(torch.device("cpu"))


def test_device_label_never_bare_cuda() -> None:
    assert device_label("cuda") == "cuda:0" and device_label(torch.device("cuda")) == "cuda:0"
    assert device_label(3) == "cuda:3" and device_label("disk") == "disk" and device_label("cpu") == "cpu"


def test_device_lookup_takes_the_longest_prefix() -> None:
    lookup = DeviceLookup({"": "disk", "a": 0, "a.b": "cpu", "ab": 1})
    assert lookup("a.b.weight") == "cpu" and lookup("a.c.weight") == 0 and lookup("ab.weight") == 1
    assert lookup("abc.weight") == "disk" and lookup("a.b.weight") == "cpu"  # memoised answers agree
    assert DeviceLookup({"a": 0})("z.weight") is None
