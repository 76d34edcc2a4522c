"""The streaming offload on a real GPU: pinned blocks, the side stream, events, buffer reuse, peak memory.

Every test needs a CUDA device (a session of its own: ``NOTEBOOK_ACCEL_TEST_CUDA=1 python -m pytest -m
cuda``); the schedule and the hooks are also checked on the CPU in ``tests/test_offload_stream.py``.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from tests._cuda import CUDA_ONLY

pytestmark = CUDA_ONLY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20


def _stack(n: int = 8, width: int = 1024, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n)]).to(dtype).eval()


def _streamer(model: nn.Module):
    from notebook_accel.hooks.offloaded import find_align_hook

    for module in model.modules():
        hook = find_align_hook(module)
        if hook is not None and hook._prefetcher is not None and hook._prefetcher.streamer is not None:
            return hook._prefetcher.streamer
    raise AssertionError("the model is not streamed")


def test_cpu_offload_streams_pinned_units_within_the_lookahead() -> None:
    from notebook_accel import cpu_offload
    from notebook_accel.hooks import remove_hook_from_submodules

    reference = _stack()
    x = torch.randn(16, 1024)
    expected = reference.cuda()(x.cuda())
    reference.cpu()
    unit = 1024 * 1024 * 4 + 1024 * 4  # one Linear's weight and bias (plus alignment)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = cpu_offload(copy.deepcopy(reference), "cuda:0", lookahead=3 * unit)
    streamer = _streamer(model)
    assert all(u.direct and not u.staged and u.blocks[0].pinned for u in streamer.units)
    assert streamer.units[0].direct[0][0].is_pinned()
    with torch.no_grad():
        for _ in range(3):
            out = model(x.cuda())
            torch.testing.assert_close(out, expected)
    torch.cuda.synchronize()
    schedule = streamer.schedule
    assert schedule.misses == 1 and schedule.hits == 3 * 8 - 1  # only the very first unit waited for a copy
    assert schedule.peak_bytes <= 3 * unit + 3 * 256
    # no weight stays on the GPU: the pool is all that the offloaded weights take there
    activations = 2 * 16 * 1024 * 4
    assert torch.cuda.max_memory_allocated() - before <= schedule.peak_bytes + activations + 4 * MiB
    remove_hook_from_submodules(model)
    assert streamer.schedule.held_bytes == 0


def test_dispatch_streams_cpu_and_disk_entries_block_by_block(tmp_path) -> None:
    from notebook_accel import dispatch_model

    reference = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(6)]).eval()
    x = torch.randn(4, 256)
    expected = reference(x)
    device_map = {"0": 0, "1": "cpu", "2": "cpu", "3": "disk", "4": "disk", "5": 0}
    model = dispatch_model(copy.deepcopy(reference), device_map, offload_dir=tmp_path)
    streamer = _streamer(model)
    assert [u.name for u in streamer.units] == ["1", "2", "3", "4"]
    assert [sorted(u.sources) for u in streamer.units] == [["cpu"], ["cpu"], ["disk"], ["disk"]]
    assert streamer.units[2].staged and not streamer.units[2].direct
    with torch.no_grad():
        for _ in range(3):
            out = model(x)
            assert out.device.type == "cpu"
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert streamer.schedule.hits > streamer.schedule.misses


def test_a_training_step_with_frozen_offloaded_weights_matches_the_plain_model() -> None:
    from notebook_accel import cpu_offload

    reference = _stack(4, 256).cuda()
    for p in reference.parameters():
        p.requires_grad_(False)
    x = torch.randn(8, 256, device="cuda", requires_grad=True)
    reference(x).square().sum().backward()
    expected = x.grad.clone()
    x.grad = None
    model = cpu_offload(copy.deepcopy(reference).cpu(), "cuda:0")
    for _ in range(2):
        model(x).square().sum().backward()
        torch.testing.assert_close(x.grad, expected)
        x.grad = None
    assert _streamer(model).engine.handed_over_bytes > 0  # the weights went to autograd, not back to the pool


def test_host_memory_not_pinned_goes_through_the_staging_buffer() -> None:
    from notebook_accel import cpu_offload

    reference = _stack(4, 512)
    x = torch.randn(2, 512)
    expected = reference(x)
    model = cpu_offload(copy.deepcopy(reference), "cuda:0", pin_memory=False)
    streamer = _streamer(model)
    assert streamer.pinner.pinned_bytes == 0 and all(u.staged for u in streamer.units)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(model(x.cuda()).cpu(), expected, atol=1e-5, rtol=1e-5)


def test_gpu_timed_transfers_and_waits_reach_the_monitor() -> None:
    from notebook_accel import cpu_offload, telemetry
    from notebook_accel.hooks.streaming import measure_pinned_bandwidth

    model = cpu_offload(_stack(6, 1024), "cuda:0")
    seen = []
    with telemetry.subscribe(seen.append), torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 1024, device="cuda"))
        torch.cuda.synchronize()
        model(torch.randn(4, 1024, device="cuda"))  # reports what completed
    transfers = [e for e in seen if e.kind == "transfer"]
    assert transfers and all(e.nbytes > 4 * MiB and e.seconds > 0 for e in transfers)
    assert any(e.kind == "wait" for e in seen)
    achieved = sum(e.nbytes for e in transfers) / sum(e.seconds for e in transfers)
    assert 0 < achieved < 2 * measure_pinned_bandwidth()


def test_transformers_generate_with_device_map_auto_streams_and_gives_the_same_tokens() -> None:
    pytest.importorskip("transformers")
    code = textwrap.dedent(
        """
        import tempfile, torch, notebook_accel
        notebook_accel.install_as_accelerate()
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
        torch.manual_seed(0)
        folder = tempfile.mkdtemp()
        LlamaForCausalLM(config).save_pretrained(folder)
        ids = torch.tensor([[1, 5, 9, 2]])
        full = LlamaForCausalLM.from_pretrained(folder, device_map={"": 0}).eval()
        want = full.generate(ids.cuda(), max_new_tokens=8, do_sample=False).tolist()
        del full
        layer = 4 * 256 * 256 * 4 + 3 * 256 * 1024 * 4
        model = LlamaForCausalLM.from_pretrained(folder, device_map="auto", max_memory={0: 3 * layer, "cpu": 2**32}).eval()
        got = model.generate(ids.cuda(), max_new_tokens=8, do_sample=False).tolist()
        from notebook_accel.hooks.offloaded import find_align_hook
        streamed = [h._prefetcher.streamer for m in model.modules() if (h := find_align_hook(m)) is not None
                    and h._prefetcher is not None and h._prefetcher.streamer is not None]
        print("same", got == want, "cpu", "cpu" in set(map(str, model.hf_device_map.values())), "streamed", bool(streamed))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "same True cpu True streamed True" in proc.stdout, proc.stdout + proc.stderr[-2000:]
