"""Accelerate 1.15's model helpers in utils.other, regional compilation and ports."""

from __future__ import annotations

import io
import logging
import socket

import numpy as np
import pytest
import torch
from torch import nn

from notebook_accel.utils import compilation
from notebook_accel.utils.other import (
    check_os_kernel,
    clean_state_dict_for_safetensors,
    convert_bytes,
    get_free_port,
    get_model_tp_size,
    get_module_children_bottom_up,
    is_port_in_use,
    load,
    model_has_dtensor,
    recursive_getattr,
)


def test_convert_bytes_picks_the_largest_unit() -> None:
    values = (0, 1023, 1024, 1536, 1234567, 5 * 2**30, 3 * 2**40, 2**60)
    expected = ["0 bytes", "1023 bytes", "1.0 KB", "1.5 KB", "1.18 MB", "5.0 GB", "3.0 TB", "1024.0 PB"]
    assert [convert_bytes(v) for v in values] == expected


def test_module_children_bottom_up_and_recursive_getattr() -> None:
    model = nn.Sequential(nn.Linear(1, 1), nn.Sequential(nn.ReLU(), nn.Linear(1, 1)))
    names = [name for name, _ in get_module_children_bottom_up(model, return_fqns=True)]
    assert names == ["0", "1.0", "1.1", "1", ""]
    assert get_module_children_bottom_up(model)[-1] is model
    assert recursive_getattr(model, "1.1.weight") is model[1][1].weight
    with pytest.raises(AttributeError, match="nope"):
        recursive_getattr(model, "1.nope")


def test_clean_state_dict_drops_repeated_names_and_copies_views(caplog) -> None:
    shared = torch.arange(4.0)
    state = {"embed": shared, "head": shared, "half": shared[:2], "other": torch.ones(1)}
    with caplog.at_level(logging.WARNING):
        out = clean_state_dict_for_safetensors(state)
    assert out is state and list(out) == ["embed", "half", "other"]
    assert "Removed shared tensor {'head'} while saving" in caplog.text and len(caplog.records) == 1
    assert (
        out["half"].tolist() == [0.0, 1.0] and out["half"].untyped_storage().data_ptr() != shared.data_ptr()
    )
    from safetensors.torch import save

    save(out)  # accepted now: no two entries over one memory


class _NotAllowed:
    """An arbitrary class: unpickling it could run code, so load refuses it."""


def test_load_reads_tensors_and_numpy_states_only() -> None:
    buffer = io.BytesIO()
    torch.save({"rng": np.random.get_state(), "t": torch.ones(2)}, buffer)
    buffer.seek(0)
    state = load(buffer)
    assert isinstance(state["rng"][1], np.ndarray) and state["t"].tolist() == [1.0, 1.0]

    buffer = io.BytesIO()
    torch.save({"x": _NotAllowed()}, buffer)
    buffer.seek(0)
    with pytest.raises(Exception, match="Weights only load failed"):
        load(buffer)


def test_tp_size_read_from_transformers_5_distributed_config() -> None:
    """transformers 5 leaves ``model.tp_size`` None and keeps the degree in ``config.distributed_config``
    (an object, or a dict after JSON); 1.15 reads both (issue 35)."""
    from types import SimpleNamespace

    model = nn.Linear(1, 1)
    model.tp_size = None
    model.config = SimpleNamespace(distributed_config=SimpleNamespace(tp_size=4))
    assert get_model_tp_size(model) == 4
    model.config = SimpleNamespace(distributed_config={"tp_size": 8})
    assert get_model_tp_size(model) == 8
    model.config = SimpleNamespace(distributed_config=None)
    assert get_model_tp_size(model) is None
    model.tp_size = 2  # the model's own (transformers < 5) comes first
    assert get_model_tp_size(model) == 2


def test_tp_size_dtensor_and_kernel_check(monkeypatch, caplog) -> None:
    model = nn.Linear(1, 1)
    assert get_model_tp_size(model) is None and not model_has_dtensor(model)
    model._tp_size = 4
    assert get_model_tp_size(model) == 4
    import notebook_accel.utils.other as other

    uname = other.platform.uname_result("Linux", "host", "5.4.0-150-generic", "#1", "x86_64")
    monkeypatch.setattr(other.platform, "uname", lambda: uname)
    with caplog.at_level(logging.WARNING):
        check_os_kernel()
    assert "Detected kernel version 5.4.0, which is below the recommended minimum of 5.5.0" in caplog.text


def test_ports() -> None:
    port = get_free_port()
    assert not is_port_in_use(port)
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
        server.listen()
        assert is_port_in_use(port)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block() for _ in range(3)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_repeated_blocks_detection() -> None:
    net = _Net()
    assert compilation.is_repeated_blocks(net.layers) and not compilation.is_repeated_blocks(nn.ModuleList())
    assert not compilation.is_repeated_blocks(nn.ModuleList([nn.Linear(1, 1), nn.ReLU()]))
    assert compilation.has_repeated_blocks(net) and not compilation.has_repeated_blocks(nn.Linear(1, 1))


def test_compile_regions_compiles_each_block_and_keeps_the_original() -> None:
    net = _Net()
    x = torch.randn(2, 4)
    expected = net(x)
    compiled = compilation.compile_regions(net, backend="eager")
    assert compiled is not net and compiled._orig_mod is net
    assert all(compilation.is_compiled_module(block) for block in compiled.layers)
    assert compilation.is_compiled_module(compiled.head)
    assert not compilation.has_compiled_regions(net) and compilation.has_compiled_regions(compiled)
    assert compiled.layers[0]._orig_mod.lin.weight is net.layers[0].lin.weight  # weights shared
    assert torch.allclose(compiled(x), expected)


def test_compile_regions_in_place_variants() -> None:
    net = _Net()
    x = torch.randn(2, 4)
    expected = net(x)
    compilation.compile_regions_deepspeed(net, backend="eager")
    assert all(block._compiled_call_impl is not None for block in net.layers)
    assert net.head._compiled_call_impl is not None  # the part without repeated blocks, whole
    assert net._compiled_call_impl is None and net.layers._compiled_call_impl is None  # containers stay eager
    assert torch.allclose(net(x), expected)
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU())  # no repeated blocks: compiled whole, in place
    compilation.compile_regions_fsdp2(plain, backend="eager")
    assert plain._compiled_call_impl is not None and plain[0]._compiled_call_impl is None
