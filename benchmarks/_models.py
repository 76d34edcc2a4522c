"""Model builders shared by the device-map and loading benchmarks (plain torch, no notebook_accel import)."""

from __future__ import annotations

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.attn_dropout = nn.Dropout(0.0)


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)
        self.act = nn.GELU()


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = MLP(d)


class GPT(nn.Module):
    """GPT-2-like: embeddings, n blocks of 11 modules, final norm, lm_head tied to the token embedding."""

    def __init__(self, n_blocks: int, d: int = 1024, vocab: int = 50257, tie: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight


def gpt_meta(n_blocks: int, d: int = 1024) -> nn.Module:
    with torch.device("meta"):
        return GPT(n_blocks, d)


def leaves_meta(n_leaves: int, width: int = 256, group: int = 100) -> nn.Module:
    """``n_leaves`` Linear layers grouped in Sequentials of ``group`` (a realistic two-level tree)."""
    with torch.device("meta"):
        groups = [
            nn.Sequential(*[nn.Linear(width, width) for _ in range(group)]) for _ in range(n_leaves // group)
        ]
        return nn.Sequential(*groups)
