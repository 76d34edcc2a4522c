"""notebook_accel.telemetry: subscriptions, the events hooks emit, and weight placement."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from notebook_accel import telemetry
from notebook_accel.hooks import AlignDevicesHook, add_hook_to_module, attach_align_device_hook
from notebook_accel.telemetry import HookEvent, has_subscribers, subscribe, weight_placement


def test_subscribe_close_and_context_manager() -> None:
    assert not has_subscribers()
    got: list = []
    sub = subscribe(got.append)
    assert has_subscribers() and not sub.closed and "open" in repr(sub)
    telemetry.emit(HookEvent("load", "m", "cpu", "disk", 4, 0.1, 1.0, True))
    sub.close()
    sub.close()  # idempotent
    assert sub.closed and not has_subscribers()
    telemetry.emit(HookEvent("load", "m", "cpu", "disk", 4, 0.1, 1.0))
    assert len(got) == 1 and got[0].prefetched
    with subscribe(got.append) as inner:
        assert has_subscribers()
    assert inner.closed and not has_subscribers()


def test_event_validation_and_bad_callback() -> None:
    with pytest.raises(ValueError, match="kind 'boom' is not one of"):
        HookEvent("boom", "m", "cpu", "cpu", 0, 0.0, 0.0)
    with pytest.raises(TypeError, match="needs a callable"):
        subscribe(42)
    event = HookEvent("forward", "m", "cpu", "cpu", 0, 0.0, 0.0)
    with pytest.raises(AttributeError):
        event.kind = "load"  # frozen


def test_broken_subscriber_does_not_break_forward(caplog) -> None:
    def broken(event):
        raise RuntimeError("listener bug")

    lin = nn.Linear(2, 2)
    add_hook_to_module(lin, AlignDevicesHook("cpu", offload=True))
    with subscribe(broken), caplog.at_level(logging.ERROR, logger="notebook_accel.hooks.events"):
        lin(torch.randn(1, 2))
    assert "listener bug" in caplog.text


def test_hooks_report_loads_offloads_and_forwards() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    attach_align_device_hook(model, "cpu", offload=True, weights_map=dict(model.state_dict()))
    model(torch.randn(1, 4))  # no subscriber: nothing recorded anywhere
    events: list[HookEvent] = []
    with subscribe(events.append):
        model(torch.randn(1, 4))
    kinds = [(e.kind, e.module) for e in events]
    assert kinds == [
        ("load", "0"),
        ("offload", "0"),
        ("forward", "0"),
        ("load", "2"),
        ("offload", "2"),
        ("forward", "2"),
    ]
    load = events[0]
    assert load.nbytes == (16 + 4) * 4 and load.device == "cpu" and load.source == "cpu"
    assert load.seconds >= 0 and load.time > 0 and load.prefetched is False


def test_weight_placement() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with torch.device("meta"):
        empty = nn.Linear(2, 2)
    model.add_module("empty", empty)
    attach_align_device_hook(model[0], "cpu", offload=True, weights_map=dict(model[0].state_dict()))
    add_hook_to_module(model[2], AlignDevicesHook("cpu"))
    placement = weight_placement(model)
    assert placement["0"] == {"execution_device": "cpu", "storage": "cpu", "nbytes": 80}
    assert placement["1"]["execution_device"] is None and placement["1"]["storage"] == "cpu"
    assert placement["2"]["execution_device"] == "cpu"
    assert placement["empty"]["storage"] == "meta"
    assert "" not in placement  # the Sequential has no own tensors
    model[2]._hf_hook.execution_device = 0  # a GPU index reads as the events name it
    assert weight_placement(model)["2"]["execution_device"] == "cuda:0"
