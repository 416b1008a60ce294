"""Point-to-point send / recv (pipeline-parallel activations), nccl-tests style: NCCL vs ce_overlap (staged through the
receiver's landing banks, and direct into one empty_symmetric buffer), 64 KiB .. 1 GiB per message, in two patterns:

    one_way   rank 0 sends to rank 1 (the others idle): one pipeline hand-off
    exchange  every rank sends to (rank + 1) % n and receives from (rank - 1) % n in one batch: both directions of
              every link busy, as in a 1F1B steady state

    torchrun --nproc-per-node 2 bench/p2p.py --out bench/results/p2p.json

time = median over --iters batches of the CUDA-event time on the caller's stream around one batch (each variant's
batch leaves the caller's stream waiting for its completion), max over ranks. algbw = busbw = size / time (nccl-tests'
sendrecv). #wrong = received elements that differ from what the same batch delivers over NCCL.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (sets the multicast-off environment before torch loads NCCL)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

VARIANTS = ["nccl", "ce_staged", "ce_direct"]
HELP = {
    "nccl": "dist.batch_isend_irecv (NCCL kernels)",
    "ce_staged": "ce_overlap.runtime.batch_isend_irecv, ordinary tensors: the sender's copy engine pushes into the "
                 "receiver's landing banks (CE_OVERLAP_P2P_MB), the receiver copies out, pipelined in rounds",
    "ce_direct": "ce_overlap.runtime.batch_isend_irecv, both sides one empty_symmetric buffer: pushed in place",
}
PATTERNS = ["one_way", "exchange"]


def peers(pattern: str, rank: int, world: int) -> tuple[int | None, int | None]:
    """(send_to, recv_from) of this rank, None when it does not take part."""
    if pattern == "one_way":
        return (1 if rank == 0 else None), (0 if rank == 1 else None)
    return (rank + 1) % world, (rank - 1) % world


def make(name: str, pattern: str, nbytes: int, group, rank: int, world: int) -> C.Variant:
    """Sets up one variant: run() enqueues one batch on the current stream, which waits for its completion."""
    import ce_overlap.runtime as rt

    dst, src = peers(pattern, rank, world)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(77 + rank)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=gen)
    try:
        if name == "nccl":
            out = torch.empty_like(data)
            ops = ([dist.P2POp(dist.isend, data, dist.get_global_rank(group, dst), group)] if dst is not None else []) + \
                  ([dist.P2POp(dist.irecv, out, dist.get_global_rank(group, src), group)] if src is not None else [])

            def run():
                for w in dist.batch_isend_irecv(ops) if ops else []:
                    w.wait()
            return C.Variant(name, run, lambda: out, keep=[data])
        why = C.ce_unavailable(group)
        if why:
            return C.Variant(name, na_reason=why)
        if name == "ce_staged":
            send_t, out = data, torch.empty_like(data)
        elif name == "ce_direct":
            # One symmetric buffer per sender: rank k sends bufs[k] into bufs[k] of its receiver (the same offset).
            bufs = [rt.empty_symmetric((nbytes,), torch.uint8, group) for _ in range(world)]
            bufs[rank].copy_(data)
            send_t = bufs[rank]
            out = bufs[src] if src is not None else torch.empty(0, dtype=torch.uint8, device="cuda")
        else:
            return C.Variant(name, na_reason=f"unknown variant {name!r}")
        ops = ([rt.P2POp("send", send_t, dst)] if dst is not None else []) + \
              ([rt.P2POp("recv", out, src)] if src is not None else [])
        return C.Variant(name, lambda: rt.batch_isend_irecv(ops, group), lambda: out, keep=[data, send_t, out],
                         is_ce=True)
    except Exception as e:  # noqa: BLE001
        return C.Variant(name, na_reason=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min", default="64K")
    p.add_argument("--max", default="1G")
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--patterns", default=",".join(PATTERNS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", help="JSON result path (written by rank 0)")
    args = p.parse_args()
    sizes = C.size_sweep(args.min, args.max, args.factor)
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    # ce_direct holds world buffers of the largest size in the user region; nothing is staged (only defaults:
    # explicit CE_OVERLAP_* settings win).
    size_mb = -(-max(sizes) // (1 << 20))
    os.environ.setdefault("CE_OVERLAP_STAGING_MB", "1")
    os.environ.setdefault("CE_OVERLAP_POOL_MB", str(world_env * size_mb + 128))
    C.size_pool_env(max(sizes), world_env)
    rank, world, _ = C.init()
    group = dist.group.WORLD
    variants = [v for v in args.variants.split(",") if v]
    patterns = [q for q in args.patterns.split(",") if q]
    info = C.header(f"send/recv, {world} ranks, median of {args.iters} batches after {args.warmup} warmup")
    for v in variants:
        C.log0(f"#   {v:<10} {HELP.get(v, '')}")
    results, na = [], {}
    for pattern in patterns:
        for nbytes in sizes:
            ref = None
            for name in variants:
                row = {"pattern": pattern, "variant": name, "bytes": nbytes}
                v = make(name, pattern, nbytes, group, rank, world)
                if C.sum_over_ranks(0 if v.run else 1):
                    na[name] = v.na_reason or "not available on every rank"
                    results.append({**row, "na": na[name]})
                    continue
                try:
                    dist.barrier()
                    times = C.time_op_ms(v.run, args.iters, args.warmup, lambda: C.settle(v, group))
                    t_ms = C.max_over_ranks(C.median(times))
                    got = v.output()
                    if name == "nccl":
                        ref = got.clone()
                    receives = peers(pattern, rank, world)[1] is not None
                    wrong = C.sum_over_ranks(C.count_wrong(got, ref) if receives and ref is not None else 0)
                except Exception as e:  # noqa: BLE001
                    C.print_exc_rank()
                    results.append({**row, "error": C.format_exc_line(e)})
                    continue
                finally:
                    del v
                bw = nbytes / (t_ms / 1e3) / 1e9
                results.append({**row, "time_us": t_ms * 1e3, "algbw_gbps": bw, "busbw_gbps": bw, "wrong": wrong})
            torch.cuda.empty_cache()
        C.log0()
        C.log0(f"# send/recv, pattern {pattern}: time (us) and busbw (GB/s) side by side; #wrong vs NCCL")
        C.log0(f"#{'size(B)':>14} " + " ".join(f"{v + ' us':>14} {v + ' GB/s':>16}" for v in variants) +
               f" {'#wrong':>7} {'best_ce/nccl':>13}")
        for nbytes in sizes:
            rows = {r["variant"]: r for r in results if r["pattern"] == pattern and r["bytes"] == nbytes}
            cells, best_ce, nccl_bw, wrong = [], 0.0, None, 0
            for v in variants:
                r = rows.get(v, {})
                if "time_us" in r:
                    cells.append(f"{r['time_us']:>14.1f} {r['busbw_gbps']:>16.1f}")
                    wrong += r["wrong"]
                    best_ce = max(best_ce, r["busbw_gbps"]) if v.startswith("ce") else best_ce
                    nccl_bw = r["busbw_gbps"] if v == "nccl" else nccl_bw
                else:
                    cells.append(f"{'n/a':>14} {'n/a':>16}")
            ratio = f"{best_ce / nccl_bw:>13.2f}" if nccl_bw and best_ce else f"{'-':>13}"
            C.log0(f"{nbytes:>15} " + " ".join(cells) + f" {wrong:>7} {ratio}")
    C.finish(group, args.out, {"schema": "ce_overlap.bench.p2p/1", "args": vars(args), "results": results}, na, info)
    rc = 0 if all(r.get("wrong", 0) == 0 and "error" not in r for r in results) else 1
    dist.barrier()
    dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
