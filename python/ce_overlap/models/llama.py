"""A Llama-3-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) with named sizes.

The model is plain torch.nn; in-graph FSDP is applied on top (ce_overlap.in_graph.fully_shard), as users do.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    dim: int
    """Model (residual stream) width."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Query heads; head_dim = dim // n_heads."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention when < n_heads)."""
    ffn_dim: int
    """Hidden width of the SwiGLU feed-forward."""
    vocab_size: int
    """Embedding rows and output projection columns (untied)."""
    seq_len: int
    """Default training sequence length for captures and benchmarks."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 500000.0
    """RoPE base frequency (Llama 3 uses 500000)."""
    expand_kv: bool = False
    """Repeat K/V heads to the query head count before attention instead of SDPA's enable_gqa (same math,
    more memory traffic). torch 2.11's overlap scheduler and flop counter reject grouped-query SDPA."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Parameter count, computed from the sizes (checked against the built module in tests)."""
        kv_dim = self.n_kv_heads * self.head_dim
        attn = self.dim * self.dim * 2 + self.dim * kv_dim * 2
        ffn = 3 * self.dim * self.ffn_dim
        block = attn + ffn + 2 * self.dim
        return self.n_layers * block + 2 * self.vocab_size * self.dim + self.dim


LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    # Llama 3 8B: 8,030,261,248 parameters.
    "llama3-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                             vocab_size=128256, seq_len=4096),
    # Llama 3 70B: 70,553,706,496 parameters (torchtitan's 70B: sequence 8192).
    "llama3-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                              vocab_size=128256, seq_len=8192),
    # Llama 3.2 1B widths, with an untied output projection (as the 8B has).
    "llama3-1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                             vocab_size=128256, seq_len=4096),
    # Small enough to capture in a second; same structure.
    "llama3-tiny": LlamaConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512,
                               vocab_size=1024, seq_len=128),
}


def _rope_tables(cfg: LlamaConfig, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # (seq, head_dim), rotate-half layout
    return angles.cos(), angles.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.expand_kv = cfg.expand_kv
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # Heads as -1: under tensor parallelism each rank holds n_heads / tp of them (torchtitan's convention).
        q = self.wq(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        grouped = k.shape[1] != q.shape[1]
        if grouped and self.expand_kv:
            repeats = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
            grouped = False
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Decoder-only LM. forward(tokens, labels) returns the mean cross-entropy; without labels, logits."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = _rope_tables(cfg, cfg.seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.rope_cos.shape[0]:
            raise ValueError(f"sequence length {seq} exceeds the model's seq_len {self.rope_cos.shape[0]}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))

    def flops_per_token(self, seq_len: int) -> int:
        """torchtitan's training FLOPs per token: 6N (non-embedding N) + 12 L H d T."""
        cfg = self.cfg
        n = cfg.num_params() - cfg.vocab_size * cfg.dim
        return 6 * n + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


def init_weights(model: Llama) -> None:
    """Deterministic small-scale init for real (non-fake) runs."""
    for name, p in model.named_parameters():
        if p.dim() == 1:
            nn.init.ones_(p)
        else:
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * model.cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02)


def tensor_parallel(model: Llama, tp_mesh, *, loss_parallel: bool = False) -> Llama:
    """torchtitan's Llama-3 tensor-parallel plan (parallelize_module over the 1-D `tp_mesh`), in place: sequence
    parallelism around the norms (the residual stream sharded by sequence), attention's and the feed-forward's input
    projections column-wise and their output projections row-wise, the embedding row-wise, the output projection
    column-wise. With `loss_parallel` the logits stay sharded by vocabulary (a DTensor) for
    torch.distributed.tensor.parallel.loss_parallel(), which must then surround the forward and the backward.
    Apply it before sharding the data-parallel dimension (FSDP2's fully_shard or ce_overlap.fully_shard)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    tp = tp_mesh.size()
    cfg = model.cfg
    for what, count in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads), ("ffn_dim", cfg.ffn_dim)):
        if count % tp:
            raise ValueError(f"tensor parallelism over {tp} ranks: the model's {what} ({count}) does not divide by it")
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    return model
