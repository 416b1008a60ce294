"""Reproduction, with no ce_overlap in the process: unbatched isend / irecv pairs in opposite directions between two
ranks over NCCL (what bench/pipeline.py's GEMM test did until 2026-11-27, and what crashed its NCCL arm).

    torchrun --standalone --nproc-per-node 2 bench/repro_nccl_unbatched_p2p.py                  # 32 MiB, unbatched
    torchrun --standalone --nproc-per-node 2 bench/repro_nccl_unbatched_p2p.py --mode batched   # the workaround

Every rank posts --n times isend(to the next rank) then irecv(from the previous), unbatched, then waits for all. NCCL
requires a send and a receive between the same two ranks to be grouped (ncclGroupStart / End, which
dist.batch_isend_irecv does); ungrouped, each rank's first send waits for a receive its peer queued behind its own
send. Measured on 2 and 4 H100s, torch 2.11.0+cu130, NCCL 2.28.9 (bench/results/pipeline-2026-11-27/root-cause):
32 MiB: "CUDA error: an illegal memory access was encountered" in the watchdog on both ranks (default group gloo or
NCCL alike); 256 KiB, receives posted first, or 4 ranks: a hang. --mode batched (dist.batch_isend_irecv): completes,
the bytes exact. Exit status 0 when every rank received the right bytes.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # as every benchmark here (multicast stays off on the lent machines)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("unbatched", "recv-first", "batched"), default="unbatched")
    p.add_argument("--default-backend", choices=("gloo", "nccl"), default="gloo",
                   help="the default group's backend (with gloo, the NCCL group is a new_group)")
    p.add_argument("--mib", type=float, default=32.0, help="message size (MiB)")
    p.add_argument("--n", type=int, default=10, help="send / receive pairs per rank")
    p.add_argument("--timeout-s", type=int, default=60)
    args = p.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group(args.default_backend, timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    ours = sorted(m for m in sys.modules if m.split(".")[0] == "ce_overlap")
    print(f"rank {rank}: ce_overlap modules loaded: {ours or 'none'}", flush=True)
    group = dist.new_group(backend="nccl") if args.default_backend != "nccl" else None
    numel = int(args.mib * (1 << 20)) // 2
    send = torch.full((numel,), float(rank + 1), device="cuda", dtype=torch.bfloat16)
    recv = torch.zeros_like(send)
    right, left = (rank + 1) % world, (rank - 1) % world
    works = []
    for _ in range(args.n):
        if args.mode == "unbatched":
            works += [dist.isend(send, right, group=group), dist.irecv(recv, left, group=group)]
        elif args.mode == "recv-first":
            works += [dist.irecv(recv, left, group=group), dist.isend(send, right, group=group)]
        else:
            works += dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, group),
                                             dist.P2POp(dist.irecv, recv, left, group)])
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    ok = bool((recv == float(left + 1)).all())
    print(f"rank {rank}: {args.mode}, {args.n} x {args.mib} MiB: received the right bytes: {ok}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
