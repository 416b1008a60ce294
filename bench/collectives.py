"""All-gather, reduce-scatter, all-to-all and broadcast, nccl-tests style: NCCL vs ce_overlap (all-gather: staged,
zero-copy symmetric input, in-place symmetric output pulled, symmetric output pushed; reduce-scatter: ordinary and
symmetric input; all-to-all and broadcast: staged and symmetric) vs torch symm_mem's low-contention ops, 64 KiB .. 1 GiB
per rank. Prints one table per collective and variant (size, count, type, time, algbw, busbw, #wrong vs NCCL) and a
side-by-side busbw summary per collective; --out writes JSON.

    torchrun --nproc-per-node 2 bench/collectives.py --out bench/results/collectives.json
    torchrun --nproc-per-node 2 bench/collectives.py --colls all_to_all,broadcast

size = bytes per rank: the all-gather's input, the reduce-scatter's output (its input is world * size), the
all-to-all's whole input (nccl-tests' alltoall size), the broadcast tensor.
time = median over --iters ops of the per-op CUDA-event time on the caller's stream, max over ranks. Every variant's
run() leaves the caller's stream waiting for the op's completion (symm_mem's ops run on its backend stream, which the
caller now waits for: the symm_mem_lc column of earlier runs did not wait and was invalid).
algbw = world * size / time for all-gather and reduce-scatter, size / time for all-to-all and broadcast (nccl-tests);
busbw = algbw * (world - 1) / world, for broadcast busbw = algbw (nccl-tests' factors).
Reduce-scatter data is integer-valued, so every variant must match NCCL bit for bit (#wrong = 0).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (sets the multicast-off environment before torch loads NCCL)
import _ce_variants as V  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "int32": torch.int32,
          "uint8": torch.uint8}
COLLS = {"all_gather": (V.AG_VARIANTS, V.AG_HELP), "reduce_scatter": (V.RS_VARIANTS, V.RS_HELP),
         "all_to_all": (V.A2A_VARIANTS, V.A2A_HELP), "broadcast": (V.BC_VARIANTS, V.BC_HELP)}
MAKE = {"all_gather": V.make_ag_variant, "reduce_scatter": V.make_rs_variant, "all_to_all": V.make_a2a_variant,
        "broadcast": V.make_bcast_variant}


def bandwidths(coll: str, nbytes: int, t_s: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s, nccl-tests' definitions."""
    if coll in ("all_gather", "reduce_scatter"):
        algbw = world * nbytes / t_s / 1e9
    else:
        algbw = nbytes / t_s / 1e9
    return algbw, algbw if coll == "broadcast" else algbw * (world - 1) / world


def sweep(coll: str, variants: list[str], sizes: list[int], dtype: torch.dtype, dtype_name: str, args, group,
          rank: int, world: int) -> tuple[list[dict], dict[str, str]]:
    elem = torch.empty((), dtype=dtype).element_size()
    results: list[dict] = []
    na: dict[str, str] = {}
    failed_ce = ""
    for nbytes in sizes:
        count = nbytes // elem
        gen = torch.Generator(device="cuda")
        gen.manual_seed(1000 + rank)
        if coll == "all_gather":
            inp = torch.randint(0, 256, (count * elem,), dtype=torch.uint8, device="cuda", generator=gen).view(dtype)
            ref = torch.empty(world * count, dtype=dtype, device="cuda")
            dist.all_gather_into_tensor(ref, inp, group=group)
        elif coll in ("all_to_all", "broadcast"):
            count -= count % world if coll == "all_to_all" else 0
            inp = torch.randint(0, 256, (count * elem,), dtype=torch.uint8, device="cuda", generator=gen).view(dtype)
            ref = torch.empty_like(inp)
            if coll == "all_to_all":
                dist.all_to_all_single(ref, inp, group=group)
            else:
                ref.copy_(inp)
                dist.broadcast(ref, src=dist.get_global_rank(group, 0), group=group)
        else:
            inp = torch.randint(-8, 9, (world * count,), device="cuda", generator=gen).to(dtype)
            ref = torch.empty(count, dtype=dtype, device="cuda")
            dist.reduce_scatter_tensor(ref, inp.clone(), group=group)
        torch.cuda.synchronize()
        for name in variants:
            row = {"coll": coll, "variant": name, "bytes_per_rank": nbytes, "count_per_rank": count,
                   "dtype": dtype_name}
            if name in na:
                results.append({**row, "na": na[name]})
                continue
            if name.startswith("ce") and failed_ce:
                results.append({**row, "na": failed_ce})
                continue
            v = MAKE[coll](name, inp, group)
            # Every rank must agree on running it (a variant set up on one rank only would deadlock).
            if C.sum_over_ranks(0 if v.run else 1):
                reason = v.na_reason or "not available on every rank"
                na[name] = reason
                results.append({**row, "na": reason})
                C.log0(f"# {coll} {name}: n/a ({reason})")
                continue
            try:
                dist.barrier()
                times = C.time_op_ms(v.run, args.iters, args.warmup, lambda: C.settle(v, group))
                t_ms = C.max_over_ranks(C.median(times))
                wrong = C.sum_over_ranks(C.count_wrong(v.output(), ref))
            except Exception as e:  # noqa: BLE001 (report and go on with the other variants)
                C.print_exc_rank()
                reason = C.format_exc_line(e)
                if name.startswith("ce"):
                    failed_ce = f"skipped after an earlier ce_overlap failure: {reason}"
                results.append({**row, "error": reason})
                continue
            finally:
                del v
            algbw, busbw = bandwidths(coll, nbytes, t_ms / 1e3, world)
            results.append({**row, "time_us": t_ms * 1e3, "algbw_gbps": algbw, "busbw_gbps": busbw, "wrong": wrong})
        del inp, ref
        torch.cuda.empty_cache()
    return results, na


def print_tables(coll: str, variants: list[str], helps: dict, sizes: list[int], results: list[dict]) -> None:
    for name in variants:
        rows = [r for r in results if r["variant"] == name]
        C.log0()
        C.log0(f"# {coll}, variant: {name} -- {helps.get(name, '')}")
        C.log0(f"#{'size(B/rank)':>14} {'count':>12} {'type':>9} {'time(us)':>11} {'algbw(GB/s)':>12} "
               f"{'busbw(GB/s)':>12} {'#wrong':>8}")
        bws = []
        for r in rows:
            if "time_us" in r:
                bws.append(r["busbw_gbps"])
                C.log0(f"{r['bytes_per_rank']:>15} {r['count_per_rank']:>12} {r['dtype']:>9} {r['time_us']:>11.2f} "
                       f"{r['algbw_gbps']:>12.2f} {r['busbw_gbps']:>12.2f} {r['wrong']:>8}")
            else:
                C.log0(f"{r['bytes_per_rank']:>15} {r['count_per_rank']:>12} {r['dtype']:>9} "
                       f"{'n/a: ' + (r.get('na') or r.get('error', '')):>11}")
        if bws:
            C.log0(f"# Out of bounds values : {sum(r.get('wrong', 0) for r in rows if 'wrong' in r)} "
                   f"{'OK' if all(r.get('wrong', 0) == 0 for r in rows) else 'FAILED'}")
            C.log0(f"# Avg bus bandwidth    : {sum(bws) / len(bws):.2f}")
    C.log0()
    C.log0(f"# {coll}: busbw (GB/s) side by side; last column: best ce_overlap variant / nccl")
    C.log0(f"{'size/rank':>12} " + " ".join(f"{n:>18}" for n in variants) + f" {'best_ce/nccl':>13}")
    for nbytes in sizes:
        cells, best_ce, nccl_bw = [], 0.0, None
        for name in variants:
            r = next(r for r in results if r["variant"] == name and r["bytes_per_rank"] == nbytes)
            if "busbw_gbps" in r:
                cells.append(f"{r['busbw_gbps']:>18.1f}")
                if name.startswith("ce"):
                    best_ce = max(best_ce, r["busbw_gbps"])
                if name == "nccl":
                    nccl_bw = r["busbw_gbps"]
            else:
                cells.append(f"{'n/a':>18}")
        ratio = f"{best_ce / nccl_bw:>13.2f}" if nccl_bw and best_ce else f"{'-':>13}"
        C.log0(f"{nbytes:>12} " + " ".join(cells) + " " + ratio)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min", default="64K", help="smallest size per rank (bytes, K/M/G suffix)")
    p.add_argument("--max", default="1G", help="largest size per rank")
    p.add_argument("--factor", type=int, default=4, help="size multiplier between rows")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--colls", default="all_gather,reduce_scatter,all_to_all,broadcast",
                   help=f"comma list of {sorted(COLLS)}")
    p.add_argument("--variants", default=",".join(V.AG_VARIANTS), help=f"all-gather variants, of {V.AG_VARIANTS}")
    p.add_argument("--rs-variants", default=",".join(V.RS_VARIANTS),
                   help=f"reduce-scatter variants, of {V.RS_VARIANTS}")
    p.add_argument("--out", help="JSON result path (written by rank 0)")
    args = p.parse_args()

    sizes = C.size_sweep(args.min, args.max, args.factor)
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    # The largest in-place output is world * max; the largest symmetric reduce-scatter input is world * max too.
    C.size_pool_env(max(sizes), world_env)
    rank, world, _ = C.init()
    group = dist.group.WORLD
    dtype = DTYPES[args.dtype]
    colls = [c for c in args.colls.split(",") if c]
    chosen = {"all_gather": [v for v in args.variants.split(",") if v],
              "reduce_scatter": [v for v in args.rs_variants.split(",") if v],
              "all_to_all": list(V.A2A_VARIANTS), "broadcast": list(V.BC_VARIANTS)}
    info = C.header(f"{', '.join(colls)}, {world} ranks, {args.dtype}, median of {args.iters} ops after "
                    f"{args.warmup} warmup")
    all_results, all_na = [], {}
    for coll in colls:
        if coll == "reduce_scatter" and dtype not in (torch.bfloat16, torch.float16, torch.float32):
            C.log0(f"# reduce_scatter skipped: dtype {args.dtype} (ce_overlap reduces bf16, fp16, fp32)")
            continue
        helps = COLLS[coll][1]
        for v in chosen[coll]:
            C.log0(f"#   {coll} {v:<18} {helps.get(v, '')}")
        results, na = sweep(coll, chosen[coll], sizes, dtype, args.dtype, args, group, rank, world)
        print_tables(coll, chosen[coll], helps, sizes, results)
        all_results += results
        all_na.update({f"{coll}:{k}": v for k, v in na.items()})
    C.finish(group, args.out, {"schema": "ce_overlap.bench.collectives/2", "args": vars(args), "results": all_results},
             all_na, info)
    wrong_total = sum(r.get("wrong", 0) for r in all_results)
    rc = 0 if wrong_total == 0 and not any("error" in r for r in all_results) else 1
    dist.barrier()
    dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
