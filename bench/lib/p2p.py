"""Subcommand p2p of bench/collectives.py: point-to-point send / recv (pipeline-parallel activations), nccl-tests
style: NCCL vs ce_overlap (staged through the receiver's landing banks, and direct into one empty_symmetric buffer),
64 KiB .. 1 GiB per message, in two patterns:

    one_way   rank 0 sends to rank 1 (the others idle): one pipeline hand-off
    exchange  every rank sends to (rank + 1) % n and receives from (rank - 1) % n in one batch: both directions of
              every link busy, as in a 1F1B steady state

    torchrun --standalone --nproc-per-node 2 bench/collectives.py p2p --out p2p.json

time = median over --iters batches of the CUDA-event time on the caller's stream around one batch (each variant's
batch leaves the caller's stream waiting for its completion), max over ranks. algbw = busbw = size / time (nccl-tests'
sendrecv). #wrong = received elements that differ from what the same batch delivers over NCCL. Prints a table per
pattern and variant and a side-by-side busbw summary per pattern; --out writes JSON (schema ce_overlap.bench.p2p/1).
"""
from __future__ import annotations

import argparse
import os

from lib import args as A
from lib import common as C  # (sets the multicast-off environment before torch loads NCCL)

import torch
import torch.distributed as dist

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


def add_parsers(sub) -> None:
    p = sub.add_parser("p2p", help="send / recv, one way and exchange: NCCL vs ce_overlap staged / direct",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    A.sweep_options(p, iters=30, warmup=5)
    p.add_argument("--patterns", default=",".join(PATTERNS), type=A.choices_list(PATTERNS),
                   help=f"comma list of {', '.join(PATTERNS)}")
    p.add_argument("--variants", default=",".join(VARIANTS), type=A.choices_list(VARIANTS),
                   help="comma list of " + "; ".join(f"{v}: {HELP[v]}" for v in VARIANTS))
    A.out_option(p)
    p.set_defaults(run=run, plan=plan)


def plan(args) -> dict:
    """What a run does (CPU only: bench/collectives.py --dry-run prints it)."""
    sizes = C.size_sweep(args.min, args.max, args.factor)
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    # ce_direct holds world buffers of the largest size in the user region; nothing is staged.
    size_mb = -(-max(sizes) // (1 << 20))
    return {"sizes": sizes, "patterns": A.items(args.patterns), "variants": A.items(args.variants),
            "pool_env": {**C.pool_env(max(sizes), world_env), "CE_OVERLAP_STAGING_MB": "1",
                         "CE_OVERLAP_POOL_MB": str(world_env * size_mb + 128)}}


def run(args) -> int:
    todo = plan(args)
    sizes, variants, patterns = todo["sizes"], todo["variants"], todo["patterns"]
    rank, world, group = C.start(todo)
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
                reason = C.unavailable(v)
                if reason:
                    na[name] = reason
                    results.append({**row, "na": na[name]})
                    continue
                try:
                    t_ms = C.time_variant_ms(v, group, args.iters, args.warmup)
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
        print_tables(pattern, variants, sizes, results)
    C.finish(group, args.out, {"schema": "ce_overlap.bench.p2p/1", "args": A.recorded(args), "results": results}, na,
             info)
    rc = 0 if all(r.get("wrong", 0) == 0 and "error" not in r for r in results) else 1
    dist.barrier()
    dist.destroy_process_group()
    return rc


def print_tables(pattern: str, variants: list[str], sizes: list[int], results: list[dict]) -> None:
    mine = [r for r in results if r["pattern"] == pattern]
    for name in variants:
        C.size_table(f"# send/recv, pattern {pattern}, variant: {name} -- {HELP.get(name, '')}",
                     [{"size": r["bytes"], "count": r["bytes"], "type": "uint8",
                       "why": r.get("na") or r.get("error", ""), **r} for r in mine if r["variant"] == name])

    def busbw_at(nbytes: int, name: str) -> float | None:
        return next((r for r in mine if r["variant"] == name and r["bytes"] == nbytes), {}).get("busbw_gbps")

    C.side_by_side(f"# send/recv, pattern {pattern}, busbw (GB/s)", sizes, variants, busbw_at)
