"""Hierarchical all-gather and reduce-scatter (ce_overlap.runtime.hierarchical) against the flat collective's result,
on randomized cases of integer-valued data (every sum exact, so any order of summation gives the same bits).

    CE_OVERLAP_RANKS_PER_NODE=2 torchrun --standalone --nproc-per-node 4 tests/runtime/hierarchical_check.py \
        [--cases 300] [--device cpu|cuda]

--device cpu (gloo): both halves on the group's backend (the layout and the groups; CI). --device cuda: every rank on
GPU 0 (ranks sharing one GPU; its default group "cpu:gloo,cuda:ce_overlap"), the node half on copy engines (the
runtime's ops), the rail half on the group's backend. Each case draws a dtype, a shard size (1 element to 1 MiB) and
the ranks' data from a seed every rank knows, so each rank computes the flat result itself. Prints one PASS/FAIL line
per collective and the errors (a group whose nodes differ in size, a node whose ranks are not consecutive); exits 1
on a failure. Results to $OUT/hierarchical_check.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ce_overlap.errors import CeOverlapError
from ce_overlap.runtime import hierarchical

DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float64, torch.int32),
          "cuda": (torch.float32, torch.bfloat16, torch.float16)}


def case(seed: int, device: str, world: int):
    """(dtype, elements per shard, every rank's input for an all-gather, every rank's input for a reduce-scatter)."""
    g = torch.Generator().manual_seed(seed)
    dtypes = DTYPES[device]
    dtype = dtypes[int(torch.randint(len(dtypes), (1,), generator=g))]
    n = int(torch.randint(1, 1 << 20, (1,), generator=g)) if seed % 4 == 0 else \
        int(torch.randint(1, 4096, (1,), generator=g))
    n = max(1, n // torch.empty((), dtype=dtype).element_size())
    # Integers small enough that a sum over every rank is exact in the dtype (bf16: 8 bits of mantissa).
    hi = 8 if dtype in (torch.bfloat16, torch.float16) else 1000
    ag = [torch.randint(-hi, hi, (n,), generator=g).to(dtype) for _ in range(world)]
    rs = [torch.randint(-hi // 2 or -1, hi // 2 or 1, (world * n,), generator=g).to(dtype) for _ in range(world)]
    return dtype, n, ag, rs


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", type=int, default=300)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:ce_overlap", timeout=timedelta(seconds=300))
        inside_ag, inside_rs = hierarchical._ce_all_gather, hierarchical._ce_reduce_scatter
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=300))
        inside_ag, inside_rs = hierarchical._nccl_all_gather, hierarchical._nccl_reduce_scatter
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(args.device)
    group = dist.group.WORLD
    h = hierarchical.hierarchy(group)
    failures = {"all_gather": [], "reduce_scatter": []}
    for i in range(args.cases):
        dtype, n, ag, rs = case(1000 + i, args.device, world)
        out = torch.full((world * n,), 7, dtype=dtype, device=dev)
        hierarchical.all_gather_into_tensor(out, ag[rank].to(dev), group, inside=inside_ag)
        if not torch.equal(out.cpu(), torch.cat(ag)):
            failures["all_gather"].append((i, str(dtype), n))
        op = "avg" if (i % 5 == 0 and dtype.is_floating_point and world & (world - 1) == 0) else "sum"
        red = torch.full((n,), 7, dtype=dtype, device=dev)
        hierarchical.reduce_scatter_tensor(red, rs[rank].to(dev), op, group, inside=inside_rs)
        want = torch.stack([x.double() for x in rs]).sum(0).view(world, n)[rank]
        want = (want / world if op == "avg" else want).to(dtype)
        if not torch.equal(red.cpu(), want):
            failures["reduce_scatter"].append((i, str(dtype), n, op))
    if args.device == "cuda":
        torch.cuda.synchronize()
    errors = []
    for nodes_of, want in ((["a", "a", "b"], "as many ranks on every node"),
                           (["a", "b", "a", "b"], "each node's ranks consecutive"),
                           (["a", "a"], "a group that spans nodes")):
        try:
            hierarchical.layout(nodes_of)
            errors.append((nodes_of, "no error"))
        except CeOverlapError as e:
            if want not in str(e):
                errors.append((nodes_of, str(e)))
    rows = []
    all_ok = True
    for name, bad in failures.items():
        flags = torch.tensor([len(bad)], device=dev if args.device == "cuda" else "cpu")
        dist.all_reduce(flags)
        ok = int(flags.item()) == 0
        all_ok &= ok
        rows.append({"collective": name, "cases": args.cases, "failed_cases": int(flags.item()), "ok": ok,
                     "first_failures_rank": bad[:3]})
    if rank == 0:
        print(f"{world} ranks as {h.nodes} nodes x {h.per_node} ({args.device}; node half on "
              f"{'copy engines' if args.device == 'cuda' else 'gloo'}, rail half on the group's backend)")
        for r in rows:
            print(f"  {'PASS' if r['ok'] else 'FAIL'}  hierarchical {r['collective']}: {r['cases']} randomized cases "
                  f"bit-exact vs the flat result" + ("" if r["ok"] else f": {r['failed_cases']} failed "
                                                                         f"(rank 0: {r['first_failures_rank']})"))
        print(f"  {'PASS' if not errors else 'FAIL'}  layouts that are not nodes x ranks are refused by name"
              + (f": {errors}" if errors else ""))
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "hierarchical_check.json"), "w") as f:
                json.dump({"world_size": world, "nodes": h.nodes, "per_node": h.per_node, "device": args.device,
                           "torch": torch.__version__, "rows": rows, "layout_errors": errors}, f, indent=1)
    all_ok &= not errors
    dist.destroy_process_group()
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
