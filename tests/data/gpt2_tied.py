"""A GPT-2-style decoder for the tests: tied embeddings (the output projection reuses the token embedding's
weight through F.linear), fused qkv, LayerNorm, tanh GELU, learned positions, blocks under `h`; the forward
returns (loss, logits) as many training codebases do. Small sizes; built on the meta device like the zoo.
The vocabulary (1001 rows, GPT-2's is 50257) does not divide by 8 ranks: FSDP pads the tied weight's shard."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class Gpt2Config:
    vocab_size: int = 1001
    n_ctx: int = 64
    dim: int = 128
    n_heads: int = 4
    n_layers: int = 2
    seq_len: int = 64
    batch: int = 2


class Attention(nn.Module):
    def __init__(self, cfg: Gpt2Config):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.c_attn = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.c_proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (y.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class Mlp(nn.Module):
    def __init__(self, cfg: Gpt2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.c_proj = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: Gpt2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim)
        self.mlp = Mlp(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt2(nn.Module):
    def __init__(self, cfg: Gpt2Config):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.n_ctx, cfg.dim)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied: the token embedding's weight
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
        return loss, logits


def build(cfg: Gpt2Config = Gpt2Config()):
    with torch.device("meta"):
        model = Gpt2(cfg)
    tokens = torch.zeros((cfg.batch, cfg.seq_len), dtype=torch.long, device="meta")
    return model, (tokens, tokens)
