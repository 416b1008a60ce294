"""The small model the pipelining checks run (tests/runtime/pipeline_check.py over the backend and NCCL,
tests/pipeline_fsdp/worker.py with FSDP2): an embedding, pre-norm transformer blocks with attention written out
(deterministic), a head; split into stages."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, SEQ, MB_SIZE = 256, 64, 4, 32, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        mask = torch.full((s, s), float("-inf"), device=x.device).triu(1)
        att = torch.softmax(q @ k.transpose(-1, -2) / (DIM // HEADS) ** 0.5 + mask, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, DIM))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Stage(nn.Module):
    def __init__(self, first: bool, last: bool, blocks: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM) if first else None
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(DIM, VOCAB) if last else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x) if self.head is not None else x


def build_stages(num_stages: int, device) -> list[Stage]:
    """Every stage of the model, identically on every rank (seeded), on `device`."""
    torch.manual_seed(2024)
    return [Stage(i == 0, i == num_stages - 1, 1).to(device) for i in range(num_stages)]


def loss_fn(out, target):
    return F.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))


def pipeline_stages(modules: list, mine: list[int], device, group) -> list:
    """A PipelineStage per stage index in `mine` (this rank's), with static examples: tokens into the first stage,
    logits out of the last, activations between. The activation example requires grad: torch 2.14 takes from it
    whether a stage's output gets a gradient (without, the first stage's backward gets none)."""
    from torch.distributed.pipelining import PipelineStage

    num_stages = len(modules)
    hidden = torch.empty(MB_SIZE, SEQ, DIM, device=device, requires_grad=True)
    stages = []
    for idx in mine:
        inp = torch.zeros(MB_SIZE, SEQ, dtype=torch.long, device=device) if idx == 0 else hidden
        out = torch.empty(MB_SIZE, SEQ, VOCAB, device=device) if idx == num_stages - 1 else hidden
        stages.append(PipelineStage(modules[idx], idx, num_stages, device, input_args=(inp,), output_args=out,
                                    group=group))
    return stages
