"""torchtitan's own Llama-3 as a build target for the analyzer: the debugmodel flavor (6 layers, flex attention with
torchtitan's causal + packed-document block mask, its RoPE, GQA), with the cross-entropy its trainer computes around
it, built on the meta device. Needs torchtitan (0.3.0 tried; `pip install --target DIR torchtitan`, then
PYTHONPATH=DIR):

    ce-overlap analyze tests/data/torchtitan_llama3.py:build --world-size 8

`:build_8b` is the 8B flavor at sequence length 8192 (torchtitan's llama3_8b training config).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchtitan.models.llama3 import model_registry


class WithLoss(nn.Module):
    """positions and the block mask made in the forward, as torchtitan's trainer does before calling the model."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, labels):
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        masks = self.model.get_attention_masks(positions)
        logits = self.model(tokens, positions, masks)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def build(flavor: str = "debugmodel", seq_len: int = 2048):
    spec = model_registry(flavor)
    with torch.device("meta"):
        model = spec.model.build()
    tokens = torch.zeros(1, seq_len, dtype=torch.long)
    return WithLoss(model), (tokens, tokens.clone())


def build_8b():
    return build("8B", 8192)
