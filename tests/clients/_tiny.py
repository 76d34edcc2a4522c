"""Tiny transformers models built from configs (nothing downloaded), shared by the client scenario scripts."""

from __future__ import annotations

import torch

VOCAB = 96


def tiny_llama(seed: int = 0, layers: int = 4):
    """Return a randomly initialised 4-layer Llama of ~60k parameters (a fixed seed, so runs agree)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def tiny_gpt2(seed: int = 0):
    """Return a randomly initialised 2-layer GPT-2 (tied embeddings) for training scenarios."""
    from transformers import GPT2Config, GPT2LMHeadModel

    # No dropout: runs that should be equal (accumulation vs a big batch, resumed vs straight) are.
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def device_of(name: str, device_map: dict) -> object:
    """Return the device ``device_map`` gives the tensor ``name`` (its longest matching module prefix)."""
    best = None
    for key in device_map:
        if key == "" or name == key or name.startswith(key + "."):
            if best is None or len(key) > len(best):
                best = key
    return device_map[best]


def meta_report(model, device_map: dict) -> dict:
    """Return which tensors are on meta, split by whether the map sends their module to disk."""
    on_meta_not_disk, disk_total, disk_on_meta = [], 0, 0
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        to_disk = device_of(name, device_map) == "disk"
        disk_total += to_disk
        if tensor.device.type == "meta":
            if to_disk:
                disk_on_meta += 1
            else:
                on_meta_not_disk.append(name)
    return {"on_meta_not_disk": on_meta_not_disk, "disk_tensors": disk_total, "disk_on_meta": disk_on_meta}


def lm_dataset(n: int = 32, length: int = 12, seed: int = 0) -> list[dict]:
    """Return ``n`` causal-LM examples (a learnable pattern: each token is the previous one plus one)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (n, 1), generator=g)
    ids = (starts + torch.arange(length)) % VOCAB
    return [{"input_ids": row, "labels": row.clone()} for row in ids]
