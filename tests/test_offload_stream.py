"""The streaming offload's schedule and its hooks, on the CPU: a recording engine stands for the GPU.

``StreamSchedule`` is plain logic: the order of copies, waits, marks and frees it asks of its engine
is checked here exactly. ``Streamer`` is then driven through real hooks (``cpu_offload``,
``disk_offload``, ``dispatch_model``), with an engine whose "device buffers" are CPU tensors and whose
copies are done at once, so the outputs, buffer reuse, pinning and hand-over to autograd are checked
without a GPU. The CUDA engine itself is tested in ``tests/test_cuda_streaming.py`` (marked cuda).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from notebook_accel import cpu_offload, disk_offload, dispatch_model, telemetry
from notebook_accel.hooks import remove_hook_from_submodules
from notebook_accel.hooks.host_pack import HostPinner, pack_unit, pin_limit
from notebook_accel.hooks.offloaded import find_align_hook
from notebook_accel.hooks.prefetch import Prefetcher, _groups, _lookahead_bytes
from notebook_accel.hooks.schedule import ExecutionOrder, StreamSchedule
from notebook_accel.hooks.streaming import DEFAULT_LOOKAHEAD, default_lookahead, escapes
from notebook_accel.utils.offload import OffloadedWeightsLoader

CPU = torch.device("cpu")


@dataclass(eq=False)
class U:
    name: str
    nbytes: int = 100


class Recorder:
    """A CopyEngine that logs what the schedule asks, in order; buffers and marks get short names."""

    def __init__(self, copies: bool = False, pin_ok_bytes: int | None = None) -> None:
        self.log: list[tuple] = []
        self.copies = copies
        self.names: dict[int, str] = {}
        self.marks = 0
        self.pin_ok_bytes = pin_ok_bytes
        self.pinned = 0
        self.unregistered: list[int] = []

    def _name(self, buffer) -> str:
        return self.names[id(buffer)]

    def allocate(self, nbytes: int):
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
        self.names[id(buffer)] = f"b{len(self.names)}"
        self.log.append(("allocate", self._name(buffer), nbytes))
        return buffer

    def copy(self, unit, buffer, after):
        if self.copies:
            for host, offset in unit.direct:
                buffer[offset : offset + host.numel()].copy_(host)
            for read, offset in unit.staged:
                data = read()
                buffer[offset : offset + data.numel()].copy_(data)
        self.log.append(("copy", unit.name, self._name(buffer), after))
        return f"copied {unit.name}"

    def wait(self, ticket) -> None:
        self.log.append(("wait", ticket))

    def mark(self):
        self.marks += 1
        self.log.append(("mark", f"m{self.marks}"))
        return f"m{self.marks}"

    def release(self, buffer) -> None:
        self.log.append(("release", self._name(buffer)))

    def hand_over(self, buffer) -> None:
        self.log.append(("hand_over", self._name(buffer)))

    def register_host(self, pointer: int, nbytes: int) -> str | None:
        if self.pin_ok_bytes is not None and self.pinned + nbytes > self.pin_ok_bytes:
            return "out of locked memory (test)"
        self.pinned += nbytes
        return None

    def unregister_host(self, pointer: int) -> None:
        self.unregistered.append(pointer)

    def kinds(self, kind: str) -> list[tuple]:
        return [entry for entry in self.log if entry[0] == kind]


def _run(schedule: StreamSchedule, units: list[U], forwards: int = 1) -> None:
    for _ in range(forwards):
        for unit in units:
            schedule.begin(unit)
            schedule.end(unit)


# -- the schedule ------------------------------------------------------------------------------
def test_copies_run_two_units_ahead_and_reuse_buffers_after_the_compute_mark() -> None:
    engine = Recorder()
    a, b, c, d = units = [U("a"), U("b"), U("c"), U("d")]
    schedule = StreamSchedule(engine, budget=200)
    for unit in units:
        schedule.add(unit)
    _run(schedule, units)
    assert engine.log == [
        ("allocate", "b0", 100),
        ("copy", "a", "b0", None),  # a miss: the first unit of the first forward
        ("wait", "copied a"),
        ("allocate", "b1", 100),
        ("copy", "b", "b1", None),  # ahead while a computes; the budget holds two units
        ("mark", "m1"),  # a is done: its buffer is rewritten only after this point
        ("copy", "c", "b0", "m1"),
        ("wait", "copied b"),
        ("mark", "m2"),
        ("copy", "d", "b1", "m2"),
        ("wait", "copied c"),
        ("mark", "m3"),
        ("copy", "a", "b0", "m3"),  # the next forward's first unit, as this one ends (wrap-around guess)
        ("wait", "copied d"),
        ("mark", "m4"),
        ("copy", "b", "b1", "m4"),
    ]
    assert (schedule.hits, schedule.misses) == (3, 1)
    engine.log.clear()
    _run(schedule, units)  # a second forward: every copy ahead, no allocation
    assert schedule.misses == 1 and schedule.hits == 7
    assert not engine.kinds("allocate") and not engine.kinds("release")
    assert [e[1] for e in engine.kinds("copy")] == ["c", "d", "a", "b"]
    assert [e[1] for e in engine.kinds("wait")] == [f"copied {u}" for u in "abcd"]
    assert schedule.peak_bytes == schedule.held_bytes == 200
    schedule.close()
    assert sorted(engine.kinds("release")) == [("release", "b0"), ("release", "b1")]
    assert schedule.held_bytes == 0 and schedule.in_flight == [] and schedule.active == []


def test_the_order_is_learnt_and_a_wrong_guess_gives_its_buffer_back() -> None:
    engine = Recorder()
    a, b, c = U("a"), U("b"), U("c")
    schedule = StreamSchedule(engine, budget=100)
    for unit in (a, b, c):
        schedule.add(unit)
    _run(schedule, [a, c, b])  # the model runs a, c, b: the guess b after a is wrong once
    copies = [(e[1], e[3]) for e in engine.kinds("copy")]
    assert copies[:2] == [("a", None), ("b", "m1")]  # b guessed after a
    # a; then c (b was in flight instead); then b (a was: the next forward's guess)
    assert schedule.misses == 3
    _run(schedule, [a, c, b])
    assert schedule.misses == 4  # a again: "b -> a" is learnt when a starts after b
    engine.log.clear()
    _run(schedule, [a, c, b], forwards=2)
    assert schedule.misses == 4  # learnt: a -> c -> b -> a
    assert [e[1] for e in engine.kinds("copy")] == ["c", "b", "a"] * 2
    assert schedule.held_bytes <= 100


def test_depth_limits_the_units_ahead_and_a_unit_bigger_than_the_budget_still_runs() -> None:
    engine = Recorder()
    units = [U(str(i)) for i in range(5)]
    schedule = StreamSchedule(engine, budget=10_000, depth=1)
    for unit in units:
        schedule.add(unit)
    schedule.begin(units[0])
    assert schedule.in_flight == [units[1]]  # one ahead, though the budget holds them all
    schedule.end(units[0])
    small = StreamSchedule(Recorder(), budget=50)
    big = U("big", 400)
    small.add(big)
    small.begin(big)  # past the budget: a model always runs
    assert small.held_bytes == 400 and small.in_flight == []
    small.end(big)  # and the pool is back within its budget at once
    assert small.held_bytes == 0 and small.engine.log[-1] == ("release", "b0")
    with pytest.raises(ValueError, match="budget must be a number of bytes >= 0, got -1"):
        StreamSchedule(engine, budget=-1)
    with pytest.raises(ValueError, match="depth must be None or an int >= 1, got 0"):
        StreamSchedule(engine, budget=1, depth=0)


def test_an_escaped_buffer_is_handed_over_and_leaves_the_budget() -> None:
    engine = Recorder()
    a, b = U("a"), U("b")
    schedule = StreamSchedule(engine, budget=200)
    schedule.add(a)
    schedule.add(b)
    schedule.begin(a)
    schedule.end(a, escaped=True)  # autograd kept a's weights for the backward pass
    assert ("hand_over", "b0") in engine.log and schedule.held_bytes == 100  # only b's, in flight
    schedule.begin(b)
    schedule.end(b)
    # a's next copy needs a new buffer: b0 is autograd's now
    assert engine.kinds("copy")[-1][1:3] == ("a", "b2")


def test_free_buffers_too_small_are_released_for_a_bigger_unit() -> None:
    engine = Recorder()
    small, large = U("small", 100), U("large", 300)
    schedule = StreamSchedule(engine, budget=300, depth=1)
    schedule.add(small)
    schedule.add(large)
    schedule.begin(small)  # large does not fit beside small: not copied ahead
    assert schedule.in_flight == []
    schedule.end(small)  # now small's buffer is free but too small: released for large
    assert engine.log[-3:-1] == [("release", "b0"), ("allocate", "b1", 300)]
    assert schedule.in_flight == [large] and schedule.held_bytes == 300
    schedule.begin(large)
    schedule.end(large)
    schedule.begin(small)  # reuses the large buffer rather than allocating
    assert engine.kinds("copy")[-1][1:3] == ("small", "b1") and schedule.held_bytes == 300
    schedule.remove(small)
    assert small not in schedule.active and schedule.held_bytes == 300  # back on the free list


def test_execution_order_guesses_registration_order_then_learns() -> None:
    order = ExecutionOrder()
    for unit in "abc":
        order.add(unit)
    assert list(order.ahead("a")) == ["b", "c"]
    for unit in "acb":
        order.observe(unit)
    assert list(order.ahead("a")) == ["c", "b"]
    order.remove("c")
    assert list(order.ahead("a")) == [] and len(order) == 2 and "c" not in order
    wrapped = ExecutionOrder(wrap=True)
    for unit in "abc":
        wrapped.add(unit)
    assert list(wrapped.ahead("c")) == ["a", "b"]


# -- helpers of the streamer ---------------------------------------------------------------------
def test_default_lookahead_and_the_option_checks() -> None:
    mib = 2**20
    assert default_lookahead(free_bytes=80 * 2**30, largest_unit=128 * mib) == 384 * mib  # three units
    assert default_lookahead(80 * 2**30, 10 * mib) == DEFAULT_LOOKAHEAD
    assert default_lookahead(100 * mib, 10 * mib) == 50 * mib  # half of what is free
    assert default_lookahead(0, 10 * mib) == 10 * mib  # never less than a unit
    assert pin_limit(True) is None and pin_limit(False) == 0 and pin_limit("1KiB") == 1024
    with pytest.raises(ValueError, match="pin_memory='lots' is not True, False or a size"):
        pin_limit("lots")
    assert _lookahead_bytes("2MiB") == 2 * mib
    for bad in (0, "soon", True):
        with pytest.raises(ValueError, match=r"lookahead=.* is not a size: give the GPU bytes"):
            _lookahead_bytes(bad)
    with pytest.raises(ValueError, match=r"prefetch='yes': give True, False or how many blocks ahead"):
        cpu_offload(_stack(2), CPU, prefetch="yes")


def test_escapes_sees_autograd_and_views_of_the_buffer() -> None:
    buffer = torch.zeros(64, dtype=torch.uint8)
    weight = buffer.view(torch.float32)[:4]
    fresh = torch.ones(4)
    assert not escapes((fresh, {"x": [fresh]}), buffer)
    assert escapes({"out": [weight[:2]]}, buffer)  # an output viewing a weight
    needs_grad = torch.ones(2, requires_grad=True) * 2
    assert escapes((fresh, needs_grad), buffer)
    with torch.no_grad():
        assert not escapes(needs_grad, buffer)


def test_groups_follow_the_blocks_given() -> None:
    hooks = [type("H", (), {"module_name": n})() for n in ("a.0", "a.1", "b", "c.x.y", "d")]
    groups = _groups(hooks, ["a", "c.x"])
    assert [(name, [h.module_name for h in hs]) for name, hs in groups] == [
        ("a", ["a.0", "a.1"]), ("b", ["b"]), ("c.x", ["c.x.y"]), ("d", ["d"]),
    ]  # fmt: skip


# -- the streamer through real hooks ---------------------------------------------------------------
def _stack(n: int = 4, width: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(n)])


def _hooks(model: nn.Module) -> list:
    return [h for m in model.modules() if (h := find_align_hook(m)) is not None and h.offload]


def _stream(model: nn.Module, engine: Recorder, **options) -> Prefetcher:
    prefetcher = Prefetcher(depth=options.pop("depth", None))
    for hook in _hooks(model):
        prefetcher.register(hook)
    prefetcher.stream(CPU, engine=engine, **options)
    return prefetcher


def test_cpu_offload_streams_through_pooled_buffers_with_the_same_outputs() -> None:
    reference = _stack()
    x = torch.randn(3, 16)
    expected = reference(x)
    model = cpu_offload(copy.deepcopy(reference), CPU, prefetch=False)
    engine = Recorder(copies=True)
    unit_bytes = 16 * 16 * 4 + 256  # weight, then the bias at the next 256-byte boundary
    prefetcher = _stream(model, engine, lookahead=2 * unit_bytes, owned=True)
    streamer = prefetcher.streamer
    assert [u.nbytes for u in streamer.units] == [unit_bytes] * 4 and engine.pinned == 4 * unit_bytes
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(model(x), expected)
    assert len(engine.kinds("allocate")) == 2  # two buffers serve every forward
    assert prefetcher.misses == 1 and prefetcher.hits == 11
    waits = [e[1] for e in engine.kinds("wait")]
    assert waits == [f"copied {i}.0" for i in range(4)] * 3
    # the weights map now serves views of the pinned blocks: the model's own copies were freed
    hook = find_align_hook(model[1][0])
    block = streamer.units[1].blocks[0].bytes
    assert hook.weights_map["weight"].data_ptr() == block.data_ptr()
    assert model[1][0].weight.device.type == "meta"  # released between forwards
    remove_hook_from_submodules(model)
    assert prefetcher.closed and engine.kinds("release")
    torch.testing.assert_close(model(x), expected)


def test_a_training_step_hands_the_buffers_over_to_autograd() -> None:
    reference = _stack(3)
    x = torch.randn(2, 16, requires_grad=True)
    reference(x).sum().backward()
    expected_grad = x.grad.clone()
    x.grad = None
    model = cpu_offload(copy.deepcopy(reference), CPU, prefetch=False)
    for p in model.parameters():
        p.requires_grad_(False)
    engine = Recorder(copies=True)
    _stream(model, engine, lookahead=10_000, owned=True)
    model(x).sum().backward()
    torch.testing.assert_close(x.grad, expected_grad)
    assert len(engine.kinds("hand_over")) == 3  # each unit's weights were saved for the backward pass
    engine.log.clear()
    with torch.no_grad():
        model(x)
    assert not engine.kinds("hand_over")


def test_the_host_refusing_to_pin_falls_back_to_staging_with_one_warning() -> None:
    reference = _stack(3)
    x = torch.randn(2, 16)
    expected = reference(x)
    model = cpu_offload(copy.deepcopy(reference), CPU, prefetch=False)
    engine = Recorder(copies=True, pin_ok_bytes=1500)  # one unit of 1,280 bytes fits
    with pytest.warns(
        ResourceWarning, match=r"Could not pin 0 MiB more .*out of locked memory \(test\).*pin_memory="
    ):
        prefetcher = _stream(model, engine, owned=True)
    units = prefetcher.streamer.units
    assert [bool(u.direct) for u in units] == [True, False, False]
    assert [bool(u.staged) for u in units] == [False, True, True]
    assert prefetcher.streamer.pinner.pageable_bytes == 2 * 1280
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected)
    limited = cpu_offload(copy.deepcopy(reference), CPU, prefetch=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a limit the user set is not a refusal: no warning
        capped = _stream(limited, Recorder(copies=True), pin_memory=1300)
    assert capped.streamer.pinner.pinned_bytes == 1280
    with pytest.raises(ValueError, match="pin_memory=-1 is negative"):
        _stream(cpu_offload(_stack(1), CPU, prefetch=False), Recorder(), pin_memory=-1)


def test_disk_entries_stream_their_pages_and_blocks_copy_as_one_unit(tmp_path) -> None:
    reference = _stack(4)
    x = torch.randn(2, 16)
    expected = reference(x)
    device_map = {"0": "disk", "1": "disk", "2": "disk", "3": "disk"}
    model = dispatch_model(copy.deepcopy(reference), device_map, offload_dir=tmp_path, prefetch=False)
    engine = Recorder(copies=True)
    prefetcher = Prefetcher(depth=None)
    for hook in _hooks(model):
        prefetcher.register(hook)
    blocks = ["0", "1", "2", "3"]
    prefetcher.stream(CPU, engine=engine, groups=_groups(_hooks(model), blocks), lookahead=10_000, owned=True)
    units = prefetcher.streamer.units
    assert [u.name for u in units] == blocks
    assert [sorted(u.sources) for u in units] == [["disk"]] * 4
    assert units[2].staged and not units[2].direct and units[2].staged_range == (0, units[2].nbytes)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(model(x), expected)
    loader = find_align_hook(model[0][0]).weights_map.dataset
    assert isinstance(loader, OffloadedWeightsLoader) and loader.source("0.0.weight") == "disk"
    assert prefetcher.streamer.pinner.pinned_bytes == 0  # disk pages stay on disk


def test_telemetry_reports_prefetched_loads_of_streamed_units() -> None:
    model = cpu_offload(_stack(3), CPU, prefetch=False)
    _stream(model, Recorder(copies=True), lookahead=10_000)
    seen: list = []
    with telemetry.subscribe(seen.append), torch.no_grad():
        model(torch.randn(1, 16))
        model(torch.randn(1, 16))
    loads = [e for e in seen if e.kind == "load"]
    assert len(loads) == 6 and [e.prefetched for e in loads] == [False, True, True, True, True, True]


def test_pack_unit_places_a_tensor_shared_within_a_unit_once() -> None:
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    model[1].weight = model[0].weight
    cpu_offload(model, CPU, prefetch=False)
    hooks = _hooks(model)
    engine = Recorder()
    unit = pack_unit(
        "both", hooks, HostPinner(None, engine.register_host, engine.unregister_host), owned=False
    )
    assert unit.nbytes == 256 and unit.views[id(hooks[0])][0][0] == unit.views[id(hooks[1])][0][0] == 0


def test_the_default_lookahead_is_half_of_what_the_device_has_free_once_packed() -> None:
    class Small(Recorder):
        def free_memory(self) -> int:
            return 5000

    model = cpu_offload(_stack(3), CPU, prefetch=False)
    prefetcher = _stream(model, Small(copies=True))
    assert prefetcher.streamer.schedule.budget == 2500  # three 1,280-byte units would be 3,840
    tiny = cpu_offload(_stack(3), CPU, prefetch=False)

    class Tiny(Recorder):
        def free_memory(self) -> int:
            return 100

    assert _stream(tiny, Tiny(copies=True)).streamer.schedule.budget == 1280  # never below one unit


def test_reading_a_streamed_model_on_the_cpu_bypasses_the_streamer() -> None:
    from notebook_accel.utils import get_state_dict_offloaded_model

    reference = _stack(3)
    expected = {k: v.clone() for k, v in reference.state_dict().items()}
    model = cpu_offload(copy.deepcopy(reference), CPU, prefetch=False)
    engine = Recorder(copies=True)
    prefetcher = _stream(model, engine, lookahead=10_000, owned=True)
    prefetcher.streamer.device = torch.device(
        "cpu", 1
    )  # the model "runs" elsewhere: reads here are not streamed
    for hook in _hooks(model):
        hook.execution_device = torch.device("cpu", 1)
    queued = []
    prefetcher._submit = queued.append  # a background load of a streamed hook would copy it for nothing
    state = get_state_dict_offloaded_model(model)
    assert state.keys() == expected.keys() and all(torch.equal(state[k], v) for k, v in expected.items())
    assert not engine.kinds("copy") and queued == []


def test_a_block_that_would_leave_the_host_short_is_not_pinned() -> None:
    engine = Recorder()
    pinner = HostPinner(
        None, engine.register_host, engine.unregister_host, available=lambda: 2 * 2**30 + 1000
    )
    with pytest.warns(
        ResourceWarning, match=r"Could not pin 2 MiB more .*\(it would leave 2046 MiB of host memory"
    ):
        pinner.block(2 * 2**20)  # 2 MiB would leave less than HOST_RESERVE (2 GiB) available
    assert pinner.pinned_bytes == 0 and engine.pinned == 0  # CUDA was not even asked
    assert pinner.block(100).pinned is False  # refused once: the rest stays pageable, no second warning


def test_streaming_twice_and_weights_that_no_longer_match_are_refused_with_the_way_out(tmp_path) -> None:
    model = disk_offload(_stack(2), tmp_path, CPU, prefetch=False)
    prefetcher = _stream(model, Recorder(copies=True), lookahead=10_000)
    with pytest.raises(RuntimeError, match="streams already; create a new one"):
        prefetcher.stream(CPU, engine=Recorder())
    unit = prefetcher.streamer.units[0]
    hook = unit.hooks[0]
    hook.weights_map = {"weight": torch.zeros(3), "bias": torch.zeros(16)}  # not the model's weight any more
    read, _ = unit.staged[0]
    with pytest.raises(
        ValueError, match=r"0\.weight: the weights map holds 12 bytes .* has 1024 .*offload them again"
    ):
        read()
