"""A model that compiles on the CPU and not for a GPU, for the tests: its forward branches on the device type and
calls an op that has no CUDA kernel (the CLI then captures it on the CPU and says why). Tiny, on the meta device."""
from __future__ import annotations

import torch
import torch.nn as nn


class CpuOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        if x.device.type == "cuda":
            raise NotImplementedError("this model's forward has no CUDA implementation")
        for block in self.blocks:
            x = torch.relu(block(x))
        return x.float().pow(2).mean()


def build():
    with torch.device("meta"):
        model = CpuOnly()
    return model, (torch.zeros(2, 16),)
