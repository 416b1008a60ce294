"""A ViT for the tests: conv patch embedding of float32 images, a class token and learned positions (parameters
of the root module, 1 row each: FSDP pads them to the world size), pre-norm blocks under `blocks` (fused qkv,
GELU MLP), a LayerNorm and a linear head; the forward returns the loss. Small sizes; built on the meta device."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class VitConfig:
    image: int = 32
    patch: int = 8
    channels: int = 3
    dim: int = 64
    n_heads: int = 4
    n_layers: int = 2
    classes: int = 10
    batch: int = 4

    @property
    def tokens(self) -> int:
        return (self.image // self.patch) ** 2 + 1


class Attention(nn.Module):
    def __init__(self, cfg: VitConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, c // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: VitConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.fc1 = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.fc2 = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Vit(nn.Module):
    def __init__(self, cfg: VitConfig):
        super().__init__()
        self.patch_embed = nn.Conv2d(cfg.channels, cfg.dim, kernel_size=cfg.patch, stride=cfg.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.tokens, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.classes)

    def forward(self, images, labels):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)[:, 0]).float(), labels)


def build(cfg: VitConfig = VitConfig()):
    with torch.device("meta"):
        model = Vit(cfg)
    images = torch.empty((cfg.batch, cfg.channels, cfg.image, cfg.image), dtype=torch.float32, device="meta")
    labels = torch.zeros((cfg.batch,), dtype=torch.long, device="meta")
    return model, (images, labels)
