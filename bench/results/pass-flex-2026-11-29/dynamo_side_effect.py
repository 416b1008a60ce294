"""torch 2.14's Dynamo drops an attribute store that restores an outside object's attribute to its value at the
compiled frame's entry once flex attention was traced before it (section 1 of this folder's README). No ce_overlap,
CPU, no gradients:

    python bench/results/pass-flex-2026-11-29/dynamo_side_effect.py flex   # torch 2.14.1: active True (2.11.0: False)
    python bench/results/pass-flex-2026-11-29/dynamo_side_effect.py sdpa   # False under both
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

class State:
    active = False


state = State()
slots = {"active": False}  # the same, as a dict item: kept by both versions


def step(q):
    state.active, slots["active"] = True, True
    out = flex_attention(q, q, q) if sys.argv[1] == "flex" else F.scaled_dot_product_attention(q, q, q)
    state.active, slots["active"] = False, False
    return out


torch.compile(step, backend="eager", fullgraph=True)(torch.randn(1, 1, 128, 64))
print(f"torch {torch.__version__}, {sys.argv[1]}: attribute active {state.active}, dict item active {slots['active']}")
