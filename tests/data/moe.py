"""A mixture-of-experts decoder for the tests: per block a router over `n_experts` routed SwiGLU experts (top-k gates,
softmax over the chosen ones) and one shared expert, with dense dispatch (every routed expert runs on every token as one
batched GEMM over the stacked expert weights; the gates, zero off the top-k, weight their outputs): no token
permutation, as small MoE training codebases do; QK-norm (an RMSNorm over each head's query and key), grouped-query
attention (K/V heads repeated to the query heads), RMSNorm, an untied output projection and the loss inside. Small
sizes; built on the meta device like the zoo."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    vocab_size: int = 1024
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    n_experts: int = 4
    top_k: int = 2
    expert_hidden: int = 256
    seq_len: int = 64
    batch: int = 2


class Attention(nn.Module):
    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(cfg.dim, 2 * cfg.n_kv_heads * self.head_dim, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=1e-6)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=1e-6)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_norm(self.wq(x).view(b, t, self.n_heads, self.head_dim)).transpose(1, 2)
        k, v = self.wkv(x).view(b, t, 2, self.n_kv_heads, self.head_dim).unbind(2)
        k = self.k_norm(k).transpose(1, 2)
        v = v.transpose(1, 2)
        repeats = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class Experts(nn.Module):
    """Routed experts' SwiGLU weights stacked on a leading expert dimension, run densely."""

    def __init__(self, cfg: MoeConfig):
        super().__init__()
        e, d, h = cfg.n_experts, cfg.dim, cfg.expert_hidden
        self.w1 = nn.Parameter(torch.empty(e, d, h))
        self.w3 = nn.Parameter(torch.empty(e, d, h))
        self.w2 = nn.Parameter(torch.empty(e, h, d))
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=0.02)

    def forward(self, x, gates):  # x: (tokens, dim), gates: (tokens, experts)
        xs = x.unsqueeze(0).expand(self.w1.shape[0], -1, -1)
        hidden = F.silu(torch.bmm(xs, self.w1)) * torch.bmm(xs, self.w3)
        out = torch.bmm(hidden, self.w2)  # (experts, tokens, dim)
        # The gated sum as a pointwise product and a reduction (Inductor fuses them). Written as
        # einsum("etd,te->td") it ran as a batched GEMM of one row per token (magma's sgemm on an H200: 6.5 ms of a
        # 74 ms step for 134 MB read), a kernel no GEMM grid prices.
        return (out * gates.t().unsqueeze(-1).to(out.dtype)).sum(0)


class MoeFeedForward(nn.Module):
    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg)
        self.shared_w1 = nn.Linear(cfg.dim, cfg.expert_hidden, bias=False)
        self.shared_w3 = nn.Linear(cfg.dim, cfg.expert_hidden, bias=False)
        self.shared_w2 = nn.Linear(cfg.expert_hidden, cfg.dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        logits = self.router(flat).float()
        top, idx = logits.topk(self.top_k, dim=-1)
        gates = torch.zeros_like(logits).scatter(-1, idx, top.softmax(dim=-1))
        routed = self.experts(flat, gates)
        shared = self.shared_w2(F.silu(self.shared_w1(flat)) * self.shared_w3(flat))
        return (routed + shared).view(b, t, d)


class Block(nn.Module):
    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=1e-6)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=1e-6)
        self.moe = MoeFeedForward(cfg)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.moe(self.ffn_norm(h))


class Moe(nn.Module):
    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=1e-6)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens, labels):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def build(cfg: MoeConfig = MoeConfig()):
    with torch.device("meta"):
        model = Moe(cfg)
    tokens = torch.zeros((cfg.batch, cfg.seq_len), dtype=torch.long, device="meta")
    return model, (tokens, tokens)
