"""A prepared FSDP2 model does per training step what torch's own ``fully_shard`` does, nothing more.

The same model sharded by hand (``fully_shard`` on each block, then the root, AdamW) and prepared by
``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...))`` sharding the same
blocks: on 2 CPU processes (gloo) both must run the same collectives (all-gathers, reduce-scatters,
all-reduces; counted with torch's profiler) and end on the same weights. Speed itself is measured in
``benchmarks/bench_fsdp.py``; counting is what a test can pin without timing.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from tests._dist import run_distributed
from tests.test_fsdp_engines import BATCH, TinyTransformer, _data, _fresh_accelerator


def _train_and_count(model, opt, backward) -> tuple[Counter, dict]:
    from torch.profiler import ProfilerActivity, profile

    def step(i: int) -> None:
        x, y = _data()[i * BATCH : (i + 1) * BATCH]
        backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()

    step(0)  # the first step also initialises FSDP's lazy state
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in (1, 2):
            step(i)
    calls = Counter({e.key: e.count for e in prof.key_averages() if e.key.startswith(("c10d::", "FSDP::"))})
    weights = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return calls, weights


def _step_worker() -> dict:
    from torch.distributed.fsdp import fully_shard

    from notebook_accel.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    acc = _fresh_accelerator(fsdp_plugin=plugin)
    ours = TinyTransformer()
    ours, ours_opt = acc.prepare(ours, torch.optim.AdamW(ours.parameters(), lr=1e-2))
    raw = TinyTransformer()
    for layer in raw.layers:
        fully_shard(layer)
    fully_shard(raw)
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    ours_calls, ours_weights = _train_and_count(ours, ours_opt, acc.backward)
    raw_calls, raw_weights = _train_and_count(raw, raw_opt, torch.Tensor.backward)
    return {"ours": ours_calls, "raw": raw_calls, "ours_w": ours_weights, "raw_w": raw_weights}


def test_prepared_fsdp2_step_runs_the_collectives_of_raw_fully_shard() -> None:
    r0 = run_distributed(_step_worker, nprocs=2, timeout=300)[0]
    collectives = {k: v for k, v in r0["raw"].items() if k.startswith("c10d::")}
    assert collectives.get("c10d::_allgather_base_", 0) > 0  # the profiler saw FSDP's collectives
    assert {k: r0["ours"][k] for k in r0["raw"]} == r0["raw"]
    assert {k: v for k, v in r0["ours"].items() if k not in r0["raw"]} == {}
    for name, value in r0["raw_w"].items():
        torch.testing.assert_close(r0["ours_w"][name], value, rtol=0, atol=1e-6)
