"""Big-model scenarios of transformers and peft, run in a fresh interpreter; prints one JSON line of results.

``python -c "from tests.clients._big_model_scenarios import main; main('ours')"`` installs notebook_accel
as accelerate first; ``main('real')`` runs the same on the real accelerate (to compare device maps).
Each scenario records its numbers or its traceback, so one failure does not hide the others.
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback
import warnings

import torch

from tests.clients._tiny import VOCAB, meta_report, tiny_llama

SMALL = {"cpu": "60KB", "disk": "1GB"}
EXPLICIT_DISK_MAP = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "disk",
    "model.layers.3": "cpu",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "disk",
}


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _summary(model, ids, ref, inner=None) -> dict:
    """Return logits difference to ``ref`` and where tensors live after a forward (``inner``: the dispatched base)."""
    out = _logits(model, ids)
    inner = model if inner is None else inner
    device_map = getattr(inner, "hf_device_map", None) or {"": "cpu"}
    return {
        "max_diff": float((out - ref).abs().max()),
        "out_device": out.device.type,
        "devices": sorted({str(v) for v in device_map.values()}),
        "device_map": {k: str(v) for k, v in device_map.items()},
        **meta_report(inner, device_map),
    }


def _run(results: dict, name: str, fn) -> None:
    try:
        results[name] = fn()
    except Exception:
        results[name] = {"error": traceback.format_exc()}


def _from_pretrained(folder, device_map, budget, offload_root):
    from transformers import LlamaForCausalLM

    kwargs = {"device_map": device_map}
    if budget is not None:
        kwargs.update(max_memory=dict(budget), offload_folder=tempfile.mkdtemp(dir=offload_root))
    return LlamaForCausalLM.from_pretrained(folder, **kwargs).eval()


def _peft_on_offloaded(single, ids, offload_root) -> dict:
    """Return the LoRA model's logits difference: loaded onto a disk-offloaded base vs on the plain base."""
    from peft import LoraConfig, PeftModel, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(5)
    plain = get_peft_model(tiny_llama(), config).eval()
    ref = _logits(plain, ids)
    base_ref = _logits(tiny_llama(), ids)
    adapter = tempfile.mkdtemp(dir=offload_root)
    plain.save_pretrained(adapter)
    base = _from_pretrained(single, "auto", SMALL, offload_root)
    # peft's own path for an offloaded base: it re-dispatches the model with the adapter weights,
    # writing those of disk-offloaded layers into the offload folder.
    offload = tempfile.mkdtemp(dir=offload_root)
    dispatched = PeftModel.from_pretrained(base, adapter, max_memory=dict(SMALL), offload_dir=offload).eval()
    summary = _summary(dispatched, ids, ref, inner=dispatched.get_base_model())
    summary["lora_changes_output"] = float((ref - base_ref).abs().max())
    return summary


def main(mode: str = "ours") -> None:
    warnings.simplefilter("ignore")
    if mode == "ours":
        import notebook_accel

        notebook_accel.install_as_accelerate()
    import accelerate
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import AutoModelForCausalLM

    root = tempfile.mkdtemp()
    model = tiny_llama()
    single, sharded = os.path.join(root, "single"), os.path.join(root, "sharded")
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="40KB")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = _logits(model, ids)
    results: dict = {"accelerate": accelerate.__name__, "shards": sorted(os.listdir(sharded))}

    for device_map in ("auto", "sequential", "balanced"):
        for budget in (None, SMALL):
            name = f"from_pretrained[{device_map},{'budget' if budget else 'no budget'}]"
            _run(
                results,
                name,
                lambda d=device_map, b=budget: _summary(_from_pretrained(single, d, b, root), ids, ref),
            )

    _run(results, "explicit_disk_map", lambda: _summary(_explicit(sharded, root), ids, ref))

    def generate() -> dict:
        offloaded = _from_pretrained(single, "auto", SMALL, root)
        kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
        with torch.no_grad():
            want = model.generate(ids, **kwargs).tolist()
            got = offloaded.generate(ids, **kwargs).tolist()
        return {
            "same": want == got,
            "tokens": got[0][-8:],
            "devices": sorted(set(offloaded.hf_device_map.values())),
        }

    _run(results, "generate_offloaded", generate)

    def dispatch(folder, device_map) -> dict:
        with init_empty_weights():
            empty = AutoModelForCausalLM.from_config(model.config)
        loaded = load_checkpoint_and_dispatch(
            empty,
            folder,
            device_map=device_map,
            max_memory=dict(SMALL),
            no_split_module_classes=["LlamaDecoderLayer"],
            offload_folder=tempfile.mkdtemp(dir=root),
        ).eval()
        loaded.hf_device_map = loaded.hf_device_map if hasattr(loaded, "hf_device_map") else {"": "cpu"}
        return _summary(loaded, ids, ref)

    _run(results, "load_checkpoint_and_dispatch[sharded,auto]", lambda: dispatch(sharded, "auto"))
    _run(
        results,
        "load_checkpoint_and_dispatch[single,sequential]",
        lambda: dispatch(os.path.join(single, "model.safetensors"), "sequential"),
    )
    _run(results, "peft_lora_on_offloaded", lambda: _peft_on_offloaded(single, ids, root))

    def missing_module() -> dict:
        """Return the exception dispatch_model raises for a map that names a module the model lacks."""
        try:
            accelerate.dispatch_model(tiny_llama(), {"model.nope": "cpu", "model": "cpu"})
        except Exception as err:
            return {"type": type(err).__name__, "message": str(err)}
        return {"type": None}

    _run(results, "missing_module_map", missing_module)
    print(json.dumps(results))


def _explicit(folder, root):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(
        folder, device_map=dict(EXPLICIT_DISK_MAP), offload_folder=tempfile.mkdtemp(dir=root)
    ).eval()
