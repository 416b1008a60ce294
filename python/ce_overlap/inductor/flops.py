"""FLOPs of one post-grad FX node: torch.utils.flop_counter's formulas, plus our own for attention.

torch 2.11's sdpa formulas assert on grouped-query attention (fewer K/V heads than query heads) and
no torch version covers the CPU flash-attention ops that fake-tensor capture produces, so every
scaled-dot-product-attention op is counted here, GQA-aware, as are flex attention's (its block mask evaluated for
the tiles it computes), and everything else is delegated.
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


# flex_attention's arguments: (q, k, v, score_mod, block_mask, scale, kernel_options, score_mod_other_buffers,
# mask_mod_other_buffers); its backward's: (q, k, v, out, logsumexp, grad_out, grad_logsumexp, fw_graph, joint_graph,
# block_mask, ...) with the mask's buffers last. A block mask is (q_len, kv_len, tensors..., q_block, kv_block, mask_mod).
_FLEX = {"flex_attention": 4, "flex_attention_backward": 9}  # HOP name -> index of the block mask
_MASK_SAMPLES = 1024  # at most this many query and key positions sampled per block edge when evaluating a mask


def flex_block_density(node: torch.fx.Node, block_mask: tuple) -> float:
    """The fraction of (query block, key block) tiles flex attention computes: its mask_mod evaluated on real index
    tensors (flex skips a tile whose every pair is masked and computes the whole of any other). 1.0 (dense) when
    the mask cannot be evaluated here: it reads tensors of the model (document ids, lengths: values a capture on
    fake tensors does not have), or fails."""
    mask_node = block_mask[-1] if block_mask else None
    buffers = node.args[-1] if node.args and isinstance(node.args[-1], (tuple, list)) else ()
    if buffers or not isinstance(mask_node, torch.fx.Node) or mask_node.op != "get_attr":
        return 1.0
    try:
        q_len, kv_len, q_block, kv_block = (int(x) for x in (block_mask[0], block_mask[1], block_mask[-3],
                                                             block_mask[-2]))
        mask_mod = getattr(node.graph.owning_module, mask_node.target)
        q_tiles, kv_tiles = -(-q_len // q_block), -(-kv_len // kv_block)
        # a tile is computed if any pair in it is unmasked: sample each tile's rows and columns (all of them for
        # tiles up to _MASK_SAMPLES wide, else evenly with the edges)
        def positions(length: int, block: int) -> torch.Tensor:
            step = max(1, block // min(block, _MASK_SAMPLES))
            idx = torch.arange(0, length, step)
            last = torch.arange(block - 1, length, block)
            return torch.unique(torch.cat([idx, last, torch.tensor([length - 1])]))
        q_idx, kv_idx = positions(q_len, q_block), positions(kv_len, kv_block)
        zero = torch.zeros((), dtype=torch.int64)
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            keep = mask_mod(zero, zero, q_idx[:, None], kv_idx[None, :])
        keep = torch.broadcast_to(torch.as_tensor(keep, dtype=torch.bool), (len(q_idx), len(kv_idx)))
        tiles = torch.zeros(q_tiles, kv_tiles, dtype=torch.bool)
        tiles.index_put_((q_idx[:, None].expand_as(keep) // q_block, kv_idx[None, :].expand_as(keep) // kv_block),
                         keep, accumulate=True)
        return float(tiles.sum()) / (q_tiles * kv_tiles)
    except Exception:  # noqa: BLE001 (a mask we cannot evaluate is counted dense, never fails a capture)
        return 1.0


def _flex_flops(node: torch.fx.Node, name: str) -> int:
    tensors = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in node.args[:3]]
    if any(t is None for t in tensors):
        return 0
    q, k, v = (_shape(t) for t in tensors)
    block_mask = node.args[_FLEX[name]] if len(node.args) > _FLEX[name] else ()
    density = flex_block_density(node, tuple(block_mask) if isinstance(block_mask, (tuple, list)) else ())
    dense = attention_backward_flops(q, k, v) if name.endswith("_backward") else attention_flops(q, k, v)
    return int(dense * density)


def _async_tp_flops(node: torch.fx.Node, name: str) -> int:
    """torch's micro-pipeline TP ops (symm_mem, Inductor's _micro_pipeline_tp): their matmuls' FLOPs, which the
    flop counter does not know. fused_all_gather_matmul(A_shard, [B_i], gather_dim, group) -> (A, [C_i]): each C_i =
    A @ B_i, 2 x numel(C_i) x K; fused_matmul_reduce_scatter(A, B, ...) -> the reduce-scattered A @ B: 2 x numel(A) x
    N (the whole product each rank computes before it is scattered)."""
    def val(x):
        return x.meta.get("val") if isinstance(x, torch.fx.Node) else None

    if name == "fused_all_gather_matmul":
        bs = node.args[1] if len(node.args) > 1 else ()
        outs = node.meta.get("val")
        cs = outs[1] if isinstance(outs, (tuple, list)) and len(outs) > 1 else ()
        return sum(2 * int(c.numel()) * int(val(b).shape[0]) for b, c in zip(bs, cs)
                   if isinstance(c, torch.Tensor) and val(b) is not None)
    a, b = (val(x) for x in node.args[:2])
    if a is None or b is None:
        return 0
    return 2 * int(a.numel()) * int(b.shape[-1])


_ASYNC_TP_OPS = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter")


def node_flops(node: torch.fx.Node) -> int:
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.HigherOrderOperator) and target.name() in _FLEX:
        return _flex_flops(node, target.name())
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return 0
    name = target._opname
    if target.namespace == "symm_mem" and name in _ASYNC_TP_OPS:
        return _async_tp_flops(node, name)
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
