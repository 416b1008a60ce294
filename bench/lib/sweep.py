"""Subcommands all-gather, reduce-scatter, all-to-all, broadcast and all of bench/collectives.py, nccl-tests style:
NCCL vs ce_overlap (all-gather: staged, zero-copy symmetric input, in-place symmetric output pulled, symmetric output
pushed; reduce-scatter: ordinary and symmetric input; all-to-all and broadcast: staged and symmetric) vs torch
symm_mem's low-contention ops, 64 KiB .. 1 GiB per rank. Prints one table per collective and variant (size, count,
type, time, algbw, busbw, #wrong vs NCCL) and a side-by-side busbw summary per collective; --out writes JSON
(schema ce_overlap.bench.collectives/2). `all` runs the four collectives in one process (bench/run_device.sh's stage
collectives).

size = bytes per rank: the all-gather's input, the reduce-scatter's output (its input is world * size), the
all-to-all's whole input (nccl-tests' alltoall size), the broadcast tensor.
time = median over --iters ops of the per-op CUDA-event time on the caller's stream, max over ranks, with the ops issued
as the host goes (an op whose enqueue outlasts its GPU work is timed at the host's pace); host_ahead_time_us: the same
with a GPU sleep holding the stream until every op is queued (the GPU's work alone, as when a training step's host runs
ahead), and host_enqueue_us: the host's time per op. Every variant's
run() leaves the caller's stream waiting for the op's completion (symm_mem's ops run on its backend stream, which the
caller now waits for: the symm_mem_lc column of earlier runs did not wait and was invalid).
algbw = world * size / time for all-gather and reduce-scatter, size / time for all-to-all and broadcast (nccl-tests);
busbw = algbw * (world - 1) / world, for broadcast busbw = algbw (nccl-tests' factors).
Reduce-scatter data is integer-valued, so every variant must match NCCL bit for bit (#wrong = 0).
"""
from __future__ import annotations

import argparse
import os

from lib import args as A
from lib import common as C  # (sets the multicast-off environment before torch loads NCCL)
from lib import ce_variants as V
import copy_timeline

import torch
import torch.distributed as dist

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "int32": torch.int32,
          "uint8": torch.uint8}
REDUCED_DTYPES = ["bf16", "fp16", "fp32"]  # what ce_overlap's reduce-scatter reduces
COLLS = {"all_gather": (V.AG_VARIANTS, V.AG_HELP), "reduce_scatter": (V.RS_VARIANTS, V.RS_HELP),
         "all_to_all": (V.A2A_VARIANTS, V.A2A_HELP), "broadcast": (V.BC_VARIANTS, V.BC_HELP)}
MAKE = {"all_gather": V.make_ag_variant, "reduce_scatter": V.make_rs_variant, "all_to_all": V.make_a2a_variant,
        "broadcast": V.make_bcast_variant}
SUBCOMMANDS = {"all-gather": "all_gather", "reduce-scatter": "reduce_scatter", "all-to-all": "all_to_all",
               "broadcast": "broadcast"}


def bandwidths(coll: str, nbytes: int, t_s: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s, nccl-tests' definitions."""
    if coll in ("all_gather", "reduce_scatter"):
        algbw = world * nbytes / t_s / 1e9
    else:
        algbw = nbytes / t_s / 1e9
    return algbw, algbw if coll == "broadcast" else algbw * (world - 1) / world


# The tuning knobs a sweep can run every ce_overlap variant under: (args attribute = tune() keyword, label key,
# broadcasts only). Every combination of the listed settings runs, in this order.
TUNING_KNOBS = (("peer_lanes", "lanes", False), ("peer_sync", "sync", False), ("pull_split", "split", False),
                ("bcast_segments", "segments", True))


def tuned_variants(coll: str, names: list[str], args) -> list[tuple[str, str, dict]]:
    """(label, variant, knobs) for every variant and combination of the settings of --peer-lanes, --peer-sync,
    --pull-split (and --bcast-segments for broadcasts): each CE variant once per combination, labelled
    'ce_staged@lanes=0,sync=1,segments=4'; NCCL and symm_mem once."""
    combos: list[dict] = [{}]
    for knob, _, bcast_only in TUNING_KNOBS:
        values = getattr(args, knob, None) if coll == "broadcast" or not bcast_only else None
        combos = [c | ({} if v is None else {knob: v}) for c in combos for v in (values or [None])]
    labels = dict((knob, key) for knob, key, _ in TUNING_KNOBS)
    out = []
    for name in names:
        if not name.startswith("ce"):
            out.append((name, name, {}))
            continue
        for knobs in combos:
            label = name + ("@" + ",".join(f"{labels[k]}={v}" for k, v in knobs.items()) if knobs else "")
            out.append((label, name, knobs))
    return out


def trace_path(trace_dir: str, coll: str, label: str, nbytes: int, ahead: bool, rank: int) -> str:
    """Where --trace-dir puts one rank's trace of one variant and size (file-name-safe: no '@', '=' or ',')."""
    safe = label.replace("@", "_").replace("=", "").replace(",", "_")
    return os.path.join(trace_dir, f"{coll}-{safe}-{nbytes}-{'ahead' if ahead else 'paced'}-rank{rank}.json.gz")


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
        for name, base, knobs in tuned_variants(coll, variants, args):
            row = {"coll": coll, "variant": name, "bytes_per_rank": nbytes, "count_per_rank": count,
                   "dtype": dtype_name, **({"knobs": knobs} if knobs else {})}
            if name in na:
                results.append({**row, "na": na[name]})
                continue
            if name.startswith("ce") and failed_ce:
                results.append({**row, "na": failed_ce})
                continue
            if knobs:
                try:  # a setting the runtime refuses (--pull-split 9): that row says why, the others still run
                    V.tune(group, **knobs)
                except (RuntimeError, ValueError) as e:
                    V.tune(group, restore=True)  # whatever part of the setting the runtime took
                    results.append({**row, "error": C.format_exc_line(e)})
                    C.log0(f"# {coll} {name}: refused: {C.format_exc_line(e)}")
                    continue
            v = MAKE[coll](base, inp, group)
            reason = C.unavailable(v)
            if reason:
                na[name] = reason
                results.append({**row, "na": reason})
                C.log0(f"# {coll} {name}: n/a ({reason})")
                continue
            try:
                t_ms = C.time_variant_ms(v, group, args.iters, args.warmup)
                ahead_ms, host_ms = C.time_host_ahead(v.run, group, args.iters, args.warmup,
                                                      lambda: C.settle(v, group))
                wrong = C.sum_over_ranks(C.count_wrong(v.output(), ref))
                if getattr(args, "trace_dir", None):
                    for ahead in (False, True):
                        dist.barrier(group=group)
                        copy_timeline.capture(v.run, args.trace_ops, trace_path(args.trace_dir, coll, name, nbytes,
                                                                                 ahead, rank),
                                              ahead, lambda: C.settle(v, group))
            except Exception as e:  # noqa: BLE001 (report and go on with the other variants)
                C.print_exc_rank()
                reason = C.format_exc_line(e)
                if name.startswith("ce"):
                    failed_ce = f"skipped after an earlier ce_overlap failure: {reason}"
                results.append({**row, "error": reason})
                continue
            finally:
                del v
                if knobs:
                    V.tune(group, restore=True)
            algbw, busbw = bandwidths(coll, nbytes, t_ms / 1e3, world)
            results.append({**row, "time_us": t_ms * 1e3, "algbw_gbps": algbw, "busbw_gbps": busbw, "wrong": wrong,
                            "host_ahead_time_us": ahead_ms * 1e3,
                            "host_ahead_busbw_gbps": bandwidths(coll, nbytes, ahead_ms / 1e3, world)[1],
                            "host_enqueue_us": host_ms * 1e3})
        del inp, ref
        torch.cuda.empty_cache()
    return results, na


def print_tables(coll: str, variants: list[str], helps: dict, sizes: list[int], results: list[dict]) -> None:
    for name in variants:
        C.size_table(f"# {coll}, variant: {name} -- {helps.get(name, '')}",
                     [{"size": r["bytes_per_rank"], "count": r["count_per_rank"], "type": r["dtype"],
                       "why": r.get("na") or r.get("error", ""), **r} for r in results if r["variant"] == name])

    def at(key: str):
        return lambda nbytes, name: next(r for r in results
                                         if r["variant"] == name and r["bytes_per_rank"] == nbytes).get(key)

    C.side_by_side(f"# {coll}, busbw (GB/s)", sizes, variants, at("busbw_gbps"))
    C.side_by_side(f"# {coll}, busbw (GB/s) with the host ahead of the GPU (its work alone)", sizes, variants,
                   at("host_ahead_busbw_gbps"))
    C.side_by_side(f"# {coll}, host enqueue us per op", sizes, variants, at("host_enqueue_us"), ratio=False)


def add_parsers(sub) -> None:
    """The subcommands all-gather, reduce-scatter, all-to-all, broadcast (one collective each) and all."""
    for name, coll in SUBCOMMANDS.items():
        variants, helps = COLLS[coll]
        p = sub.add_parser(name, help=f"{coll.replace('_', '-')} sweep: NCCL vs ce_overlap ({', '.join(variants)})",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        A.sweep_options(p, iters=30, warmup=5)
        p.add_argument("-d", "--dtype", default="bf16",
                       choices=REDUCED_DTYPES if coll == "reduce_scatter" else sorted(DTYPES))
        p.add_argument("--variants", default=",".join(variants), type=A.choices_list(variants),
                       help="comma list of " + "; ".join(f"{v}: {helps[v]}" for v in variants))
        tuning_options(p, coll == "broadcast")
        A.out_option(p)
        p.set_defaults(run=run, plan=plan, colls=coll)
    p = sub.add_parser("all", help="all four collectives in one process, one JSON (bench/run_device.sh's stage)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    A.sweep_options(p, iters=30, warmup=5)
    p.add_argument("-d", "--dtype", default="bf16", choices=sorted(DTYPES),
                   help="element type (reduce-scatter runs only for bf16, fp16, fp32)")
    p.add_argument("--colls", default=",".join(COLLS), type=A.choices_list(list(COLLS)),
                   help=f"comma list of {', '.join(COLLS)}")
    p.add_argument("--variants", default=",".join(V.AG_VARIANTS), type=A.choices_list(V.AG_VARIANTS),
                   help=f"all-gather variants, of {', '.join(V.AG_VARIANTS)}")
    p.add_argument("--rs-variants", default=",".join(V.RS_VARIANTS), type=A.choices_list(V.RS_VARIANTS),
                   help=f"reduce-scatter variants, of {', '.join(V.RS_VARIANTS)}")
    tuning_options(p, True)
    A.out_option(p)
    p.set_defaults(run=run, plan=plan)


def tuning_options(p: argparse.ArgumentParser, broadcast: bool) -> None:
    """--peer-lanes, --peer-sync, --pull-split (and --bcast-segments): run every ce_overlap variant once per combination
    of the listed settings, side by side."""
    p.add_argument("--peer-lanes", type=A.int_list(0), default=None, metavar="LIST",
                   help="comma list of peer lane counts to run every ce_overlap variant with (0: one stream per peer, "
                        "every peer at once; 1: one after another); default: the runtime's own")
    p.add_argument("--peer-sync", type=A.int_list(0), default=None, metavar="LIST",
                   help="comma list of peer signalling modes to run every ce_overlap variant with (0: each peer's "
                        "wait, copies and done in turn; 1: wait for every peer, copy, then every done; 2: as 1 with "
                        "batched signal copies); default: the runtime's own")
    p.add_argument("--pull-split", type=A.int_list(1), default=None, metavar="LIST",
                   help="comma list of pull splits (1..4: pieces of every pulled peer copy of 2 MiB or more, each on "
                        "its own stream) to run every ce_overlap variant with; default: the runtime's own")
    p.add_argument("--trace-dir", default=None, metavar="DIR",
                   help="also trace --trace-ops ops of every variant and size with torch.profiler, issued as the host "
                        "goes and queued ahead of the GPU, one Chrome trace per rank (bench/copy_timeline.py "
                        "summarizes them)")
    p.add_argument("--trace-ops", type=int, default=10, metavar="N", help="ops per trace (default 10)")
    if broadcast:
        p.add_argument("--bcast-segments", type=A.int_list(0), default=None, metavar="LIST",
                       help="comma list of broadcast segment counts (3+ ranks: scatter + all-gather pipelined over "
                            "that many segments; 0: chosen from the size); default: the runtime's choice")


def plan(args) -> dict:
    """What a run does: sizes, and per collective its variants (CPU only: bench/collectives.py --dry-run prints it)."""
    colls = A.items(args.colls)
    if args.subcommand == "all":
        chosen = {"all_gather": A.items(args.variants), "reduce_scatter": A.items(args.rs_variants),
                  "all_to_all": list(V.A2A_VARIANTS), "broadcast": list(V.BC_VARIANTS)}
    else:
        chosen = {colls[0]: A.items(args.variants)}
    if args.dtype not in REDUCED_DTYPES and "reduce_scatter" in colls:
        colls.remove("reduce_scatter")  # announced when run
    sizes = C.size_sweep(args.min, args.max, args.factor)
    # The largest in-place output is world * max; the largest symmetric reduce-scatter input is world * max too.
    return {"sizes": sizes, "variants": {c: chosen[c] for c in colls},
            "runs": {c: [label for label, _, _ in tuned_variants(c, chosen[c], args)] for c in colls},
            "pool_env": C.pool_env(max(sizes), int(os.environ.get("WORLD_SIZE", "1")))}


def run(args) -> int:
    todo = plan(args)
    sizes = todo["sizes"]
    rank, world, group = C.start(todo)
    dtype = DTYPES[args.dtype]
    colls = A.items(args.colls)
    info = C.header(f"{', '.join(colls)}, {world} ranks, {args.dtype}, median of {args.iters} ops after "
                    f"{args.warmup} warmup")
    all_results, all_na = [], {}
    for coll in colls:
        if coll not in todo["variants"]:
            C.log0(f"# reduce_scatter skipped: dtype {args.dtype} (ce_overlap reduces bf16, fp16, fp32)")
            continue
        helps = COLLS[coll][1]
        chosen = todo["variants"][coll]
        for v in chosen:
            C.log0(f"#   {coll} {v:<18} {helps.get(v, '')}")
        results, na = sweep(coll, chosen, sizes, dtype, args.dtype, args, group, rank, world)
        runs = tuned_variants(coll, chosen, args)
        print_tables(coll, [label for label, _, _ in runs], {label: helps.get(base, "") for label, base, _ in runs},
                     sizes, results)
        all_results += results
        all_na.update({f"{coll}:{k}": v for k, v in na.items()})
    C.finish(group, args.out, {"schema": "ce_overlap.bench.collectives/2", "args": A.recorded(args),
                               "results": all_results}, all_na, info)
    wrong_total = sum(r.get("wrong", 0) for r in all_results)
    rc = 0 if wrong_total == 0 and not any("error" in r for r in all_results) else 1
    dist.barrier()
    dist.destroy_process_group()
    return rc
