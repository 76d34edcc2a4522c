"""infer_auto_device_map, the budgets behind it, and device-map checks."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

from notebook_accel.utils import (
    check_device_map,
    clean_device_map,
    compute_module_sizes,
    get_balanced_memory,
    get_max_memory,
    infer_auto_device_map,
)
from notebook_accel.utils.modeling import DeviceMapPlan, plan_device_map, resolve_device_map


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)


class LM(nn.Module):
    def __init__(self, n: int = 6, d: int = 16, vocab: int = 32, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.final = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("positions", torch.arange(8.0))
        if tie:
            self.head.weight = self.embed.weight


def meta_lm(**kw) -> LM:
    with torch.device("meta"):
        return LM(**kw)


def covered(model: nn.Module, device_map: dict) -> None:
    check_device_map(model, device_map)


def test_everything_fits_on_first_gpu() -> None:
    model = meta_lm()
    assert infer_auto_device_map(model, max_memory={0: 10**9, "cpu": 10**9}) == {"": 0}


def test_cpu_only_budget_and_disk_overflow() -> None:
    model = meta_lm()
    total = compute_module_sizes(model)[""]
    dm = infer_auto_device_map(model, max_memory={"cpu": total // 2}, no_split_module_classes=["Block"])
    assert set(dm.values()) == {"cpu", "disk"}
    covered(model, dm)


def test_fills_gpus_in_order_and_respects_budgets() -> None:
    model = meta_lm(n=8, tie=False)
    sizes = compute_module_sizes(model)
    block = sizes["blocks.0"]
    budget = {0: 3 * block, 1: 3 * block, 2: 3 * block, "cpu": 10**9}
    plan = plan_device_map(model, max_memory=budget, no_split_module_classes=["Block"])
    dm = plan.device_map
    covered(model, dm)
    order = [dm[k] for k in dm]
    # devices appear in filling order: never back to an earlier device
    rank = {0: 0, 1: 1, 2: 2, "cpu": 3, "disk": 4}
    assert [rank[d] for d in order] == sorted(rank[d] for d in order)
    for device, used in plan.device_bytes.items():
        if device in budget:
            assert used + plan.reserved.get(device, 0) <= budget[device]
    # no Block is split across devices
    assert all(k.count(".") <= 1 for k in dm)


def test_main_device_keeps_room_for_largest_offloaded_layer() -> None:
    model = meta_lm(n=6, tie=False)
    sizes = compute_module_sizes(model)
    block = sizes["blocks.0"]
    plan = plan_device_map(
        model, max_memory={0: 2 * block + 100, "cpu": 10**9}, no_split_module_classes=["Block"]
    )
    assert "cpu" in plan.device_map.values()
    assert plan.reserved[0] >= block
    assert plan.device_bytes[0] + block <= 2 * block + 100


def test_tied_parameters_end_up_together() -> None:
    model = meta_lm(n=6)
    sizes = compute_module_sizes(model)
    block = sizes["blocks.0"]
    dm = infer_auto_device_map(
        model,
        max_memory={0: sizes["embed"] + 2 * block, 1: 4 * block, "cpu": 10**9},
        no_split_module_classes=["Block"],
    )

    def where(name: str):
        while name not in dm:
            name = name.rpartition(".")[0]
        return dm[name]

    assert where("embed.weight") == where("head.weight")


class _BiasedHeadLM(nn.Module):
    """embed tied to a head that also has a bias: placing embed brings the head's own bytes along."""

    def __init__(self, n: int = 4, d: int = 16, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.final = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=True)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize(
    ("budget0", "expected"),
    [
        # recorded with Accelerate 1.15's infer_auto_device_map on the same model and budgets
        (20924, {"": 1}),
        (25424, {"embed": 0, "head": 0, "final": 1, "blocks": 1}),
        (
            29924,
            {"embed": 0, "head": 0, "blocks.0": 0, "blocks.1": 1, "blocks.2": 1, "blocks.3": 1, "final": 1},
        ),
    ],
)
def test_tied_partner_bytes_count_against_the_budget(budget0: int, expected: dict) -> None:
    # The head placed with embed costs its bias too: not counting it over-fills device 0.
    with torch.device("meta"):
        model = _BiasedHeadLM()
    budget = {0: budget0, 1: 10**7, "cpu": 10**9}
    assert infer_auto_device_map(model, max_memory=budget, no_split_module_classes=["Block"]) == expected


def test_clean_result_false_keeps_fine_entries() -> None:
    model = meta_lm()
    dm = infer_auto_device_map(model, max_memory={0: 10**9}, clean_result=False)
    assert "" not in dm and "embed" in dm and "positions" in dm
    assert clean_device_map(dict(dm)) == {"": 0}


def test_dtype_shrinks_footprint() -> None:
    model = meta_lm(n=6, tie=False)
    total32 = compute_module_sizes(model)[""]
    budget = {0: int(total32 * 0.6), "cpu": 10**9}
    assert "cpu" in infer_auto_device_map(model, max_memory=budget).values()
    assert infer_auto_device_map(model, max_memory=budget, dtype=torch.float16) == {"": 0}


def test_string_budgets_and_key_spellings() -> None:
    model = meta_lm()
    assert infer_auto_device_map(model, max_memory={"cuda:0": "1GiB", "cpu": "2GB"}) == {"": 0}
    with pytest.raises(
        ValueError, match=r"max_memory\[0\]: Memory size '12 parsecs' is not in a valid format"
    ):
        infer_auto_device_map(model, max_memory={0: "12 parsecs"})
    with pytest.raises(ValueError, match="Device 'tpu' is not recognized.*'mps', 'cpu' or 'disk'"):
        infer_auto_device_map(model, max_memory={"tpu": 10})


def test_verbose_records_decisions(caplog) -> None:
    model = meta_lm()
    with caplog.at_level(logging.INFO, logger="notebook_accel.utils.device_planning.planner"):
        plan = plan_device_map(model, max_memory={0: 2000, "cpu": 10**9}, verbose=True)
    assert plan.decisions and any("next device" in d or "splitting" in d for d in plan.decisions)
    assert "->" in caplog.text


def test_fallback_allocation_uses_room_a_block_cannot() -> None:
    model = meta_lm(n=4, tie=False)
    sizes = compute_module_sizes(model)
    room = (
        sizes["final"] + sizes["embed"] // 2 + sizes["blocks.0"]
    )  # less than embed + a block, more than final
    budget = {0: room, "cpu": 10**9}
    plain = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=["Block"])
    fallback = infer_auto_device_map(
        model, max_memory=budget, no_split_module_classes=["Block"], fallback_allocation=True
    )
    covered(model, fallback)
    # without the fallback no block fits and GPU 0 stays empty; with it the small "final" goes there
    assert 0 not in plain.values()
    assert fallback["final"] == 0


def test_offload_buffers_flag_and_buffer_warning() -> None:
    class Buffered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.b = nn.BatchNorm1d(4096)

    model = Buffered()
    size_a = compute_module_sizes(model)["a"]
    budget = {0: size_a + 100, "cpu": 10**9}
    # A UserWarning with Accelerate 1.15's text (tests/test_big_model_behaviours.py compares where).
    with pytest.warns(UserWarning, match="bytes of buffer for offloaded layers.*offload_buffers=True"):
        dm = infer_auto_device_map(model, max_memory=budget)
    # the BatchNorm layer is larger than GPU 0, and room for it must stay free: everything is offloaded
    assert dm == {"": "cpu"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert infer_auto_device_map(model, max_memory=budget, offload_buffers=True) == dm


def test_plan_repr_and_html() -> None:
    model = meta_lm(n=4)
    plan = plan_device_map(model, max_memory={0: 3000, 1: 3000, "cpu": 10**9})
    assert isinstance(plan, DeviceMapPlan)
    text = repr(plan)
    assert "DeviceMapPlan" in text and "cpu" in text
    page = plan._repr_html_()
    assert page.startswith("<div>") and "<table>" in page
    assert sum(plan.device_bytes.values()) == plan.total_size


def test_get_max_memory_defaults_without_cuda() -> None:
    budget = get_max_memory()
    assert "cpu" in budget and budget["cpu"] > 0
    if not torch.cuda.is_available():
        assert not any(isinstance(k, int) for k in budget)
    assert get_max_memory({"cpu": "1GB", 1: 5, 0: "1KiB", "disk": 3}) == {
        0: 1024,
        1: 5,
        "cpu": 10**9,
        "disk": 3,
    }
    assert list(get_max_memory({"cpu": 1, 0: 2})) == [0, "cpu"]
    with pytest.raises(TypeError, match="max_memory must be a dict"):
        get_max_memory([1, 2])  # type: ignore[arg-type]


def test_get_balanced_memory() -> None:
    model = meta_lm(n=8, tie=False)
    total = compute_module_sizes(model)[""]
    budget = get_balanced_memory(model, {0: total, 1: total, 2: total, "cpu": 10 * total}, ["Block"])
    assert budget[2] == total and budget["cpu"] == 10 * total
    assert total // 3 < budget[0] == budget[1] < total
    low = get_balanced_memory(model, {0: total, 1: total, 2: total}, ["Block"], low_zero=True)
    assert low[0] < budget[0]
    assert get_balanced_memory(model, {"cpu": 100}) == {"cpu": 100}


def test_check_device_map_errors() -> None:
    model = meta_lm()
    # Keys naming nothing in the model: 1.15's UserWarning listing them, then the closest names.
    with pytest.warns(UserWarning, match=r"^The following device_map keys do not match any submodules in the model: \['blocks\.0\.fc3'\]\nClosest names: 'blocks\.0\.fc3': 'blocks\.0\.fc[12]'"):  # fmt: skip
        check_device_map(model, {"": 0, "blocks.0.fc3": 1})
    # Too short for a fuzzy match: the names at the same level are offered instead.
    with pytest.warns(UserWarning, match=r"\['x'\]\nClosest names: 'x': 'head', 'embed', 'final', 'blocks'"):
        check_device_map(model, {"": 0, "x": 1})
    with (
        pytest.warns(UserWarning, match=r"\['x', 'y\.z'\]"),
        pytest.raises(ValueError, match="following parameters: "),
    ):
        check_device_map(model, {"x": 1, "y.z": 0})
    with pytest.raises(ValueError, match=r"does not give any device.*positions.*blocks\.1\.fc1\.weight"):
        check_device_map(model, {"embed": 0, "blocks.0": 0, "head": 0})
    with pytest.raises(TypeError, match="must be a dict"):
        check_device_map(model, "auto")  # type: ignore[arg-type]
    check_device_map(model, {"": "cpu"})


def test_clean_device_map_merges_only_uniform_prefixes() -> None:
    dm = {"a.x": 0, "a.y": 0, "b.x": 0, "b.y": 1, "c": 1}
    assert clean_device_map(dm) == {"a": 0, "b.x": 0, "b.y": 1, "c": 1}
    assert clean_device_map({"a.x": 0, "b": 0}) == {"": 0}
    assert clean_device_map({"a.x": 0}) == {"a.x": 0}
    only_a = {"a.x": 0, "a.y": 0, "b.x": 1, "b.y": 1}
    assert clean_device_map(only_a, module_name="a") == {"a": 0, "b.x": 1, "b.y": 1}
    assert clean_device_map({"x.0": "cpu", "x.1": torch.device("cpu")}) == {"": "cpu"}


def test_resolve_device_map_strategies() -> None:
    model = meta_lm(n=8, tie=False)
    total = compute_module_sizes(model)[""]
    budget = {0: total, 1: total, "cpu": 10 * total}
    seq = resolve_device_map(model, "sequential", max_memory=budget, no_split_module_classes=["Block"])
    assert seq == {"": 0}
    balanced = resolve_device_map(model, "balanced", max_memory=budget, no_split_module_classes=["Block"])
    assert set(balanced.values()) == {0, 1}
    low0 = resolve_device_map(model, "balanced_low_0", max_memory=budget, no_split_module_classes=["Block"])
    assert 1 in low0.values()
    for not_a_strategy in ("fastest", "cpu", None):
        with pytest.raises(
            ValueError, match=r"device_map=.* is not a device-map strategy: choose one of \['auto'"
        ):
            resolve_device_map(model, not_a_strategy)


def test_nested_module_lists_on_meta_are_fully_covered() -> None:
    with torch.device("meta"):
        model = nn.Sequential(
            *[nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)) for _ in range(3)])] * 1
        )
    sizes = compute_module_sizes(model)
    dm = infer_auto_device_map(model, max_memory={0: sizes[""] // 3, 1: sizes[""] // 3, "cpu": 10**6})
    covered(model, dm)
    assert len(set(dm.values())) >= 2


def test_linear_in_module_count_smoke() -> None:
    # Not a timing assertion: a 5,000-leaf model must plan without quadratic blow-ups (finishes at once).
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Sequential(*[nn.Linear(4, 4) for _ in range(50)]) for _ in range(100)])
    total = compute_module_sizes(model)[""]
    dm = infer_auto_device_map(model, max_memory={i: total // 4 + 1000 for i in range(4)} | {"cpu": total})
    covered(model, dm)
    assert set(dm.values()) <= {0, 1, 2, 3, "cpu"}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_get_max_memory_queries_gpus_when_present() -> None:
    budget = get_max_memory()
    assert list(budget)[: torch.cuda.device_count()] == list(range(torch.cuda.device_count()))
    assert all(budget[i] > 0 for i in range(torch.cuda.device_count()))


def test_cpu_budget_honours_cgroup_limit(monkeypatch) -> None:
    import psutil

    from notebook_accel.utils.device_planning import device_memory

    # A fixed reading: two real ones differ on a busy machine (the suite's other worker allocates between them).
    reading = psutil.virtual_memory()._replace(available=50_000)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: reading)
    monkeypatch.setattr(device_memory, "_cgroup_memory_left", lambda: None)
    assert device_memory.available_cpu_memory() == 50_000
    monkeypatch.setattr(device_memory, "_cgroup_memory_left", lambda: 80_000)  # a roomier cgroup: the host's
    assert device_memory.available_cpu_memory() == 50_000
    monkeypatch.setattr(device_memory, "_cgroup_memory_left", lambda: 12345)
    assert get_max_memory()["cpu"] == 12345


def test_device_key_errors() -> None:
    from notebook_accel.utils.device_planning.devices import device_key

    assert device_key("cuda") == 0 and device_key(torch.device("cuda:2")) == 2
    assert device_key(" CPU ") == "cpu" and device_key("3") == 3
    with pytest.raises(ValueError, match="GPU index -1 is negative"):
        device_key(-1)
    with pytest.raises(ValueError, match="True is not a device"):
        device_key(True)


def test_model_larger_than_every_budget_including_disk() -> None:
    model = meta_lm(n=4, tie=False)
    with pytest.raises(ValueError, match="does not fit on any device of max_memory.*raise the budgets"):
        infer_auto_device_map(
            model, max_memory={"cpu": 1000, "disk": 1000}, no_split_module_classes=["Block"]
        )


def test_strategy_memory_is_the_one_meaning_of_each_strategy() -> None:
    from notebook_accel.utils.device_planning.device_map import strategy_memory

    model = meta_lm(n=4, tie=False)
    assert strategy_memory(model, "sequential", {"cpu": "1KiB"}) == {"cpu": 1024}
    assert strategy_memory(model, "balanced", {"cpu": 1024}) == {"cpu": 1024}  # no GPU: nothing to balance
    roomy = {0: 10**9, 1: 10**9, "cpu": 10**9}
    balanced = strategy_memory(model, "balanced", dict(roomy))
    assert 0 < balanced[0] < 10**9 and balanced[1] == 10**9  # the last GPU keeps its whole budget
    assert strategy_memory(model, "auto", dict(roomy)) == balanced
    assert (
        strategy_memory(model, "balanced_low_0", dict(roomy))[0] == 0
    )  # GPU 1 holds it all: GPU 0 stays empty
    assert strategy_memory(model, "sequential", dict(roomy)) == roomy
    with pytest.raises(
        ValueError, match="strategy='fastest' is not a device-map strategy: choose one of \\['auto'"
    ):
        strategy_memory(model, "fastest")


def test_check_strategy_is_the_one_strategy_check() -> None:
    from notebook_accel.utils.device_planning.device_map import DEVICE_MAP_STRATEGIES, check_strategy

    assert [check_strategy(s) for s in DEVICE_MAP_STRATEGIES] == list(DEVICE_MAP_STRATEGIES)
    with pytest.raises(
        ValueError, match=r"^device_map=3 is not a device-map strategy: choose one of \['auto', "
    ):
        check_strategy(3)
    with pytest.raises(ValueError, match=r"plan='Auto' is not a .*'sequential'\], or a dict$"):
        check_strategy("Auto", name="plan", alternatives="a dict")


def test_a_streaming_budget_keeps_room_for_the_lookahead_on_the_first_gpu() -> None:
    model = meta_lm(tie=False)
    sizes = compute_module_sizes(model)
    block = sizes["blocks.0"]
    budget = {0: 4 * block, "cpu": 10**9}
    plain = plan_device_map(model, dict(budget), no_split_module_classes=["Block"])
    streamed = plan_device_map(
        model, dict(budget), no_split_module_classes=["Block"], streaming_budget=2 * block
    )
    # the first GPU now holds one block fewer: room for two blocks streamed ahead instead of one
    on_gpu = [k for k, v in plain.device_map.items() if v == 0]
    on_gpu_streamed = [k for k, v in streamed.device_map.items() if v == 0]
    assert len(on_gpu_streamed) < len(on_gpu)
    assert streamed.reserved[0] >= 2 * block and streamed.streaming_budget == 2 * block
    assert streamed.device_bytes[0] + streamed.reserved[0] <= budget[0]
    assert plain.streaming_budget == 0 and plain.reserved[0] < 2 * block
    assert (
        infer_auto_device_map(model, dict(budget), ["Block"], streaming_budget=2 * block)
        == streamed.device_map
    )
    assert infer_auto_device_map(model, dict(budget), ["Block"], streaming_budget=None) == plain.device_map
    # without a GPU nothing is streamed: the budget changes nothing
    cpu_only = {"cpu": 3 * block}
    assert infer_auto_device_map(model, dict(cpu_only), streaming_budget="1GiB") == infer_auto_device_map(
        model, dict(cpu_only)
    )
    assert resolve_device_map(model, "sequential", dict(budget), ["Block"], streaming_budget=2 * block) == (
        streamed.device_map
    )
    with pytest.raises(
        ValueError, match=r"streaming_budget='plenty' is not a size: give the bytes the first GPU"
    ):
        infer_auto_device_map(model, dict(budget), streaming_budget="plenty")
