"""A Llama-3 for the tests in the shape of torchtitan's (torchtitan/models/llama3/model): layers in a ModuleDict keyed
by index, RoPE through complex frequencies (torch.polar, view_as_complex), grouped-query attention (fewer K/V heads,
given to the kernel as they are), flex attention with a causal block mask (torchtitan 0.3 allows only flex or varlen
attention for its language models), RMSNorm, SwiGLU, and a cross-entropy loss around the model. Small sizes; built on
the meta device like the zoo. Flex attention has no CPU backward, so this model captures only on fake CUDA tensors."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


@dataclasses.dataclass(frozen=True)
class TitanConfig:
    vocab_size: int = 2048
    dim: int = 256
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 2
    ffn_dim: int = 768
    seq_len: int = 512
    batch: int = 1
    rope_theta: float = 500000.0


def precompute_freqs_cis(head_dim: int, end: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    t = torch.arange(end, device=freqs.device)
    return torch.polar(torch.ones(end, head_dim // 2), torch.outer(t, freqs).float())


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    return (torch.view_as_real(xq_ * freqs).flatten(3).type_as(xq),
            torch.view_as_real(xk_ * freqs).flatten(3).type_as(xk))


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class Attention(nn.Module):
    def __init__(self, cfg: TitanConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, freqs_cis, block_mask):
        bs, seq, _ = x.shape
        xq = self.wq(x).view(bs, seq, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bs, seq, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bs, seq, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        out = flex_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), block_mask=block_mask,
                             enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: TitanConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: TitanConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=1e-5)

    def forward(self, x, freqs_cis, block_mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, block_mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: TitanConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(cfg.dim // cfg.n_heads, cfg.seq_len * 2,
                                                               cfg.rope_theta), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens):
        seq = tokens.shape[1]
        block_mask = create_block_mask(causal, None, None, seq, seq, device=tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, block_mask)
        return self.output(self.norm(h))


class WithLoss(nn.Module):
    """The cross-entropy around the model, as torchtitan's trainer computes it."""

    def __init__(self, cfg: TitanConfig):
        super().__init__()
        self.model = Transformer(cfg)

    def forward(self, tokens, labels):
        logits = self.model(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def build(cfg: TitanConfig = TitanConfig()):
    with torch.device("meta"):
        model = WithLoss(cfg)
    tokens = torch.zeros(cfg.batch, cfg.seq_len, dtype=torch.long)
    return model, (tokens, tokens.clone())
