"""A transformers model sharded by layer class name, FSDP1 and FSDP2, on 2 CPU processes (gloo).

Skipped where transformers (the ``clients`` extra) is not installed. The model is built from a small
config: nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed

transformers = pytest.importorskip("transformers")


def _model():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _train(plugin) -> dict:
    from notebook_accel import Accelerator
    from notebook_accel.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    acc = Accelerator(fsdp_plugin=plugin)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(acc.process_index)
    losses = []
    for _ in range(2):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    wrapped = sorted(filter(None, (_sharded_layer_name(m) for m in model.modules())))
    return {"wrapped": wrapped, "losses": losses, "weights": acc.get_state_dict(model)}


def _sharded_layer_name(module) -> str | None:
    """Return the class name of a decoder layer sharded on its own (FSDP1 wrapper or FSDP2 module)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if isinstance(module, FullyShardedDataParallel):
        name = type(module._fsdp_wrapped_module).__name__
    elif isinstance(module, FSDPModule):
        name = type(module).__name__
    else:
        return None
    return name if name.endswith("LlamaDecoderLayer") else None


def _worker() -> dict:
    from notebook_accel.utils import FullyShardedDataParallelPlugin

    ddp = _train(None)
    by_name = FullyShardedDataParallelPlugin(
        auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"]
    )
    # No names: the model's own _no_split_modules (["LlamaDecoderLayer"]) say what a layer is.
    by_default = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    return {"ddp": ddp, "fsdp1": _train(by_name), "fsdp2": _train(by_default)}


def test_transformers_model_sharded_by_layer_class_name() -> None:
    r = run_distributed(_worker, nprocs=2, timeout=300)[0]
    assert r["fsdp1"]["wrapped"] == ["LlamaDecoderLayer"] * 2  # each of the 2 layers its own unit
    assert r["fsdp2"]["wrapped"] == ["FSDPLlamaDecoderLayer"] * 2
    for engine in ("fsdp1", "fsdp2"):
        assert r[engine]["losses"] == pytest.approx(r["ddp"]["losses"], abs=1e-5)
        for name, value in r["ddp"]["weights"].items():
            torch.testing.assert_close(r[engine]["weights"][name], value, rtol=0, atol=1e-5)
