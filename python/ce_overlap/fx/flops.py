"""FLOPs of one post-grad FX node: torch.utils.flop_counter's formulas, plus our own for attention.

torch 2.11's sdpa formulas assert on grouped-query attention (fewer K/V heads than query heads) and
no torch version covers the CPU flash-attention ops that fake-tensor capture produces, so every
scaled-dot-product-attention op is counted here, GQA-aware, and everything else is delegated.
Attention counts the FLOPs the kernels execute: with causal masking only the query/key pairs at or below the
diagonal (s (s + 1) / 2 of s^2 for a square mask), unlike torch's counter and torchtitan's MFU formula, which count
the full square. The cost model charges time for executed work (its attention efficiency is calibrated on it);
MFU figures (bench/train.py) keep torchtitan's formula.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.utils.flop_counter import flop_registry


def _shape(value) -> tuple[int, ...]:
    return tuple(int(d) for d in value.shape)


def attended_pairs(s_q: int, s_k: int, causal: bool) -> int:
    """Query/key pairs attention computes: all s_q x s_k, or with torch's causal mask (query i sees keys 0..i, the
    mask aligned to the top left) sum over i of min(i + 1, s_k)."""
    if not causal:
        return s_q * s_k
    if s_q <= s_k:
        return s_q * (s_q + 1) // 2
    return s_k * (s_k + 1) // 2 + (s_q - s_k) * s_k


def attention_flops(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...], causal: bool = False) -> int:
    """Forward FLOPs of softmax(q k^T) v for (batch, heads, seq, head_dim) tensors; K/V heads broadcast."""
    b, h_q, s_q, d_qk = q
    s_k, d_v = k[2], v[3]
    pairs = attended_pairs(s_q, s_k, causal)
    return 2 * b * h_q * pairs * d_qk + 2 * b * h_q * pairs * d_v


def attention_backward_flops(q, k, v, causal: bool = False) -> int:
    """Backward: recompute scores, then grad through (scores @ v) and (q @ k^T): 5 matmuls."""
    b, h_q, s_q, d_qk = q
    s_k, d_v = k[2], v[3]
    pairs = attended_pairs(s_q, s_k, causal)
    scores = 2 * b * h_q * pairs * d_qk
    return scores + 2 * (2 * b * h_q * pairs * d_v) + 2 * (2 * b * h_q * pairs * d_qk)


def _is_causal(node: torch.fx.Node) -> bool:
    """The op's is_causal argument (every scaled-dot-product-attention op and backward has one), by schema name."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == "is_causal":
            if i < len(node.args):
                return bool(node.args[i])
            return bool(node.kwargs.get("is_causal", arg.default_value or False))
    return False


def _is_attention(name: str) -> bool:
    return name.startswith("_scaled_dot_product_") and "attention" in name


def node_flops(node: torch.fx.Node) -> int:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return 0
    name = target._opname
    if _is_attention(name):
        tensors = [a.meta.get("val") for a in node.args if isinstance(a, torch.fx.Node)]
        causal = _is_causal(node)
        if name.endswith("_backward"):
            _, q, k, v = (_shape(t) for t in tensors[:4])
            return attention_backward_flops(q, k, v, causal)
        q, k, v = (_shape(t) for t in tensors[:3])
        return attention_flops(q, k, v, causal)
    formula = flop_registry.get(target.overloadpacket)
    if formula is None:
        return 0
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    return int(formula(*args, **kwargs, out_val=node.meta.get("val")))
