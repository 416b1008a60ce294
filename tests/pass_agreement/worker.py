"""Two gloo ranks on the CPU (torchrun) compile one ce_overlap.fully_shard model with the pass, planned differently on
purpose, and check that the ranks agree before any collective is issued (inductor/agreement.py):

- `differ`: rank 1 buckets nothing (bucket_cap_mb tiny), rank 0 buckets each block. Both ranks must leave both graphs
  as captured (the same refusal, naming the group), and three steps must train as the eager model does.
- `silent`: rank 1 compiles without the pass, so it never publishes a plan: rank 0 must raise within its
  agree_timeout_s naming rank 1, not hang (Inductor raises it from the compile; the launch fails, as it should).

Each step's loss is the unsharded model's (the same weights: nothing steps)."""
from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import ce_overlap


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Model(torch.nn.Module):
    def __init__(self, width: int = 32, blocks: int = 3):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return x.square().mean()


def sharded(model, mesh):
    for block in model.layers:
        ce_overlap.fully_shard(block, mesh=mesh)
    return ce_overlap.fully_shard(model, mesh=mesh)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("what", choices=["differ", "silent"])
    p.add_argument("--out", help="a folder: each rank writes rank<r>.json, its graphs' refusals")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    ref = Model()
    model = sharded(copy.deepcopy(ref), mesh)
    config = ce_overlap.PassConfig(bucket_cap_mb=1e-4 if rank == 1 else 512, agree_timeout_s=10)
    passes = None
    if args.what == "silent" and rank == 1:
        run = torch.compile(model, fullgraph=True)
    else:
        options = ce_overlap.inductor_options(config)
        passes = options["post_grad_custom_post_pass"]
        run = torch.compile(model, fullgraph=True, options=options)
    for s in range(3):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * s + rank))
        loss = run(x)
        loss.backward()
        with torch.no_grad():
            ref_loss = ref(x)
        assert torch.allclose(loss, ref_loss, rtol=1e-5), (loss, ref_loss)
        for p_ in model.parameters():
            p_.grad = None
    refused = {r.graph: r.refused for r in (passes.reports if passes else []) if r.collectives or r.refused}
    if args.out:  # a file per rank: two ranks' prints can interleave within a line
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(refused, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
