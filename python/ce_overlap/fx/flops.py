"""FLOPs of one post-grad FX node: torch.utils.flop_counter's formulas, plus our own for attention.

torch 2.11's sdpa formulas assert on grouped-query attention (fewer K/V heads than query heads) and
no torch version covers the CPU flash-attention ops that fake-tensor capture produces, so every
scaled-dot-product-attention op is counted here, GQA-aware, and everything else is delegated.
Causal masking is not discounted (as torch's counter and torchtitan's MFU formula do).
"""
from __future__ import annotations

import torch
import torch.fx
from torch.utils.flop_counter import flop_registry


def _shape(value) -> tuple[int, ...]:
    return tuple(int(d) for d in value.shape)


def attention_flops(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...]) -> int:
    """Forward FLOPs of softmax(q k^T) v for (batch, heads, seq, head_dim) tensors; K/V heads broadcast."""
    b, h_q, s_q, d_qk = q
    s_k, d_v = k[2], v[3]
    return 2 * b * h_q * s_q * s_k * d_qk + 2 * b * h_q * s_q * s_k * d_v


def attention_backward_flops(q, k, v) -> int:
    """Backward: recompute scores, then grad through (scores @ v) and (q @ k^T): 5 matmuls."""
    b, h_q, s_q, d_qk = q
    s_k, d_v = k[2], v[3]
    scores = 2 * b * h_q * s_q * s_k * d_qk
    return scores + 2 * (2 * b * h_q * s_q * s_k * d_v) + 2 * (2 * b * h_q * s_q * s_k * d_qk)


def _is_attention(name: str) -> bool:
    return name.startswith("_scaled_dot_product_") and "attention" in name


def node_flops(node: torch.fx.Node) -> int:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return 0
    name = target._opname
    if _is_attention(name):
        tensors = [a.meta.get("val") for a in node.args if isinstance(a, torch.fx.Node)]
        if name.endswith("_backward"):
            _, q, k, v = (_shape(t) for t in tensors[:4])
            return attention_backward_flops(q, k, v)
        q, k, v = (_shape(t) for t in tensors[:3])
        return attention_flops(q, k, v)
    formula = flop_registry.get(target.overloadpacket)
    if formula is None:
        return 0
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    return int(formula(*args, **kwargs, out_val=node.meta.get("val")))
