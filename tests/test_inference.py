"""Pipeline-parallel inference (``prepare_pippy``) with real processes: gloo on CPU, two stages.

Each multi-process test runs its worker through ``notebook_launcher(num_processes=2)``; the worker
builds the same seeded model on both ranks, computes the unsplit model's output first, then prepares
the pipeline and compares. Checks that need the process group (stage count, call-time batch) run
inside the worker with ``pytest.raises``; a failed check fails that rank and so the launch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from notebook_accel import notebook_launcher, prepare_pippy
from notebook_accel.inference import (
    _balanced_boundaries,
    _split_points_from_map,
    find_pippy_batch_size,
    generate_device_map,
    pippy_forward,
)
from notebook_accel.utils import infer_auto_device_map

TIMEOUT = 240


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.inner(x)) + x


class _Stack(nn.Module):
    """An embedding, blocks and a head: the shape of a small transformer without attention."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(6, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(x)
        # The scale is read before the first block so every stage layout feeds it to stage 0 (the only
        # stage torch.distributed.pipelining gives inputs to).
        h = h if scale is None else h * scale
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _stack() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _Stack().eval(), torch.randn(8, 6)


def _linear_worker(split_points, num_chunks, gather_output):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(12, 12) for _ in range(6)]).eval()
    x = torch.randn(4, 12)
    with torch.no_grad():
        expected = [model(x), model(x * 2)]
        prepared = prepare_pippy(
            model,
            split_points=split_points,
            example_args=(x,),
            num_chunks=num_chunks,
            gather_output=gather_output,
        )
        outputs = [prepared(x), prepared(x * 2)]
    return {"points": prepared.hf_split_points, "outputs": outputs, "expected": expected}


@pytest.mark.parametrize(
    ("split_points", "num_chunks", "gather_output"),
    [("auto", None, False), (["3"], 2, True), (["2"], 4, False), ("auto", 1, True)],
)
def test_sequential_linear_two_stages_equals_unsplit(split_points, num_chunks, gather_output) -> None:
    results = notebook_launcher(
        _linear_worker, (split_points, num_chunks, gather_output), num_processes=2, sinks=[], timeout=TIMEOUT
    )
    for rank, r in enumerate(results):
        # 6 equal layers in 2 stages: "auto" cuts in the middle.
        assert r["points"] == (["3"] if split_points == "auto" else split_points)
        for got, want in zip(r["outputs"], r["expected"]):
            if rank == 1 or gather_output:
                torch.testing.assert_close(got, want)
            else:
                assert got is None


def test_three_stages_pass_through_the_middle_process() -> None:
    # The middle rank neither feeds nor holds the output: it only relays (None without gathering).
    results = notebook_launcher(
        _linear_worker, ("auto", 2, False), num_processes=3, sinks=[], timeout=TIMEOUT
    )
    assert [r["points"] for r in results] == [["2", "4"]] * 3
    assert results[0]["outputs"] == [None, None] and results[1]["outputs"] == [None, None]
    for got, want in zip(results[2]["outputs"], results[2]["expected"]):
        torch.testing.assert_close(got, want)


def _stack_worker(split_points, gather_output):
    model, x = _stack()
    scale = torch.full((8, 1), 0.5)
    with torch.no_grad():
        expected = model(x, scale=scale)
        prepared = prepare_pippy(
            model,
            split_points=split_points,
            no_split_module_classes=["_Block"],
            example_args=(x,),
            example_kwargs={"scale": scale},
            num_chunks=4,
            gather_output=gather_output,
        )
        got = prepared(x, scale=scale)
    return {"points": prepared.hf_split_points, "got": got, "expected": expected}


@pytest.mark.parametrize(("split_points", "gather_output"), [("auto", True), (["blocks.3"], False)])
def test_nested_blocks_with_example_kwargs_equal_unsplit(split_points, gather_output) -> None:
    results = notebook_launcher(
        _stack_worker, (split_points, gather_output), num_processes=2, sinks=[], timeout=TIMEOUT
    )
    for rank, r in enumerate(results):
        # "auto" opens the ModuleList (larger than half the model) but keeps each _Block whole.
        assert r["points"] == (["blocks.2"] if split_points == "auto" else split_points)
        if rank == 1 or gather_output:
            torch.testing.assert_close(r["got"], r["expected"])
        else:
            assert r["got"] is None


def _gpt2_worker(split_points):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=4, n_head=2, use_cache=False)
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (4, 8))
    with torch.no_grad():
        expected = model(ids).logits
        prepared = prepare_pippy(
            model, split_points=split_points, example_kwargs={"input_ids": ids}, gather_output=True
        )
        got = prepared(input_ids=ids)
    return {"points": prepared.hf_split_points, "got": got, "expected": expected}


@pytest.mark.parametrize("split_points", ["auto", ["transformer.h.1"]])
def test_tiny_gpt2_from_config_two_stages_equals_unsplit(split_points) -> None:
    pytest.importorskip("transformers")
    results = notebook_launcher(_gpt2_worker, (split_points,), num_processes=2, sinks=[], timeout=TIMEOUT)
    for r in results:
        assert r["points"] == (["transformer.h.2"] if split_points == "auto" else split_points)
        # The pipeline hands back the traced graph's outputs: the logits tensor, on both ranks (gathered).
        torch.testing.assert_close(r["got"], r["expected"])


# ---------------------------------------------------------------------------------------------
# bad input


def _bad_input_worker():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(12, 12) for _ in range(4)]).eval()
    x = torch.randn(4, 12)
    with pytest.raises(ValueError, match=r"2 split point\(s\) \['1', '2'\] make 3 stages, but 2 processes"):
        prepare_pippy(model, split_points=["1", "2"], example_args=(x,))
    with pytest.raises(ValueError, match=r"cut the model into 1 stage\(s\).*Give 1 distinct split points"):
        prepare_pippy(model, split_points=["0"], example_args=(x,))
    prepared = prepare_pippy(model, split_points=["2"], example_args=(x,))
    with torch.no_grad():
        with pytest.raises(
            ValueError, match=r"traced with a batch of 4 .* called with a batch of 3.*Pad the batch"
        ):
            prepared(torch.randn(3, 12))
        # Both ranks refused before any message went out: the pipeline still works afterwards.
        return prepared(x)


def test_bad_input_with_two_processes_raises_before_communicating() -> None:
    results = notebook_launcher(_bad_input_worker, num_processes=2, sinks=[], timeout=TIMEOUT)
    assert results[0] is None and results[1].shape == (4, 12)


class _LateInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x)) + bias


def _late_input_worker():
    model = _LateInput()
    x, bias = torch.randn(2, 4), torch.randn(2, 4)
    with pytest.raises(
        ValueError, match=r"input\(s\) \['bias'\] are first read in stage 1 \(after split point 'second'\)"
    ):
        prepare_pippy(model, split_points="auto", example_args=(x, bias))
    return True


def test_an_input_first_read_by_a_later_stage_is_refused_when_prepared() -> None:
    assert notebook_launcher(_late_input_worker, num_processes=2, sinks=[], timeout=TIMEOUT) == [True, True]


def test_split_point_naming_a_missing_module_names_close_ones() -> None:
    model, x = _stack()
    with pytest.raises(ValueError, match=r"Split point 'block.2' names no submodule of _Stack.*'blocks.2'"):
        prepare_pippy(model, split_points=["block.2"], example_args=(x,))


@pytest.mark.parametrize("bad", ["layer3", 3, {"blocks.2": 1}])
def test_split_points_neither_auto_nor_a_list_is_refused(bad) -> None:
    model, x = _stack()
    with pytest.raises(ValueError, match=r"split_points must be 'auto' or a list of module names"):
        prepare_pippy(model, split_points=bad, example_args=(x,))


def test_num_chunks_not_dividing_the_example_batch_names_the_divisors() -> None:
    model, x = _stack()  # batch of 8
    with pytest.raises(
        ValueError, match=r"a batch of 8 cannot be cut into num_chunks=3 .* num_chunks in \[1, 2, 4, 8\]"
    ):
        prepare_pippy(model, example_args=(x,), num_chunks=3)
    with pytest.raises(ValueError, match=r"num_chunks must be a positive int, got 0"):
        prepare_pippy(model, example_args=(x,), num_chunks=0)


def test_missing_example_inputs_and_non_modules_are_refused() -> None:
    model, _ = _stack()
    with pytest.raises(ValueError, match=r"no tensor with a batch dimension.*example_args"):
        prepare_pippy(model)
    with pytest.raises(TypeError, match=r"needs a torch.nn.Module, got function"):
        prepare_pippy(lambda x: x, example_args=(torch.ones(2, 2),))


def test_a_single_process_is_told_to_launch_more() -> None:
    model, x = _stack()
    with pytest.raises(ValueError, match=r"single process.*notebook_launcher\(fn, num_processes=N\)"):
        prepare_pippy(model, example_args=(x,))


# ---------------------------------------------------------------------------------------------
# the pieces


def test_generate_device_map_balances_stages_by_size_and_keeps_no_split_blocks() -> None:
    model, _ = _stack()
    assert generate_device_map(model, 2, ["_Block"]) == {
        "embed": 0, "blocks.0": 0, "blocks.1": 0, "blocks.2": 1, "blocks.3": 1, "head": 1,
    }  # fmt: skip
    # Without no_split classes the blocks open too; four stages still cut one block apiece.
    four = generate_device_map(model, 4)
    assert [four[k] for k in ("embed", "head")] == [0, 3]
    assert sorted(set(four.values())) == [0, 1, 2, 3]
    assert generate_device_map(model, 1) == {"embed": 0, "blocks": 0, "head": 0}


def test_generate_device_map_refuses_more_stages_than_blocks() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(
        ValueError, match=r"into 3 pipeline stages: it has only 2 block\(s\).*Use fewer processes"
    ):
        generate_device_map(model, 3)
    with pytest.raises(ValueError, match=r"num_processes must be a positive int, got 0"):
        generate_device_map(model, 0)


def test_generate_device_map_with_max_memory_is_the_auto_device_map_under_those_budgets() -> None:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])  # 288 bytes a layer
    budgets = {0: 600, 1: 600}
    assert generate_device_map(model, 2, max_memory=budgets) == infer_auto_device_map(
        model, max_memory=budgets, clean_result=False
    )
    assert _split_points_from_map({"a": 0, "b": 0, "c": 1, "d": 1, "e": 2}) == ["c", "e"]


def test_balanced_boundaries_cut_nearest_each_share() -> None:
    assert _balanced_boundaries([1, 1, 1, 1, 1, 1], 2) == [3]
    assert _balanced_boundaries([10, 1, 1, 1], 2) == [1]
    assert _balanced_boundaries([1, 1, 1, 1, 1, 1], 3) == [2, 4]
    # Every stage keeps at least one block even when one block holds almost everything.
    assert _balanced_boundaries([1, 100, 1], 3) == [1, 2]


def test_find_pippy_batch_size_reads_args_then_kwargs() -> None:
    assert find_pippy_batch_size((torch.ones(5, 2),), {"m": torch.ones(7)}) == 5
    assert find_pippy_batch_size(("text", 3), {"m": torch.ones(7, 1)}) == 7
    assert find_pippy_batch_size((), {}) is None


def test_pippy_forward_in_one_process_checks_chunks_and_runs_forward() -> None:
    seen = []
    out = pippy_forward(
        lambda *a, **k: seen.append((a, k)) or "done", 2, False, torch.ones(4, 1), flag=torch.ones(4)
    )
    assert out == "done" and seen[0][0][0].shape == (4, 1) and "flag" in seen[0][1]
    with pytest.raises(ValueError, match=r"pippy_forward: a batch of 3 cannot be cut into num_chunks=2"):
        pippy_forward(lambda *a: None, 2, False, torch.ones(3, 1))


def test_a_torch_without_pipelining_is_told_which_torch_to_install(monkeypatch) -> None:
    import notebook_accel.inference as inference

    monkeypatch.setattr(inference, "is_pippy_available", lambda: False)
    with pytest.raises(
        ImportError, match=r"torch\.distributed\.pipelining, which torch .* lacks.*torch>=2.4"
    ):
        inference._pipelining()
