"""A model that is not Llama-shaped: no `layers` list, blocks are attributes with other names."""
import torch
import torch.nn as nn


class Stage(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.stem = nn.Linear(32, dim)
        self.stage_a = Stage(dim)
        self.stage_b = Stage(dim)
        self.stage_c = Stage(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        h = self.stem(x)
        h = self.stage_c(self.stage_b(self.stage_a(h)))
        return self.head(h).sum()


def build():
    return Net(), (torch.randn(16, 32),)
