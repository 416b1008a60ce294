"""Subcommand overlap of bench/collectives.py: how much a collective running beside compute slows the compute: a
bf16 8192^3 GEMM and a memory-bound elementwise add of 1 GiB tensors, timed alone and while each all-gather variant
(256 MiB per rank: NCCL, ce_overlap staged / zero-copy / in-place pull / push, symm_mem) and each reduce-scatter
variant (256 MiB output per rank: NCCL, ce_overlap, symm_mem) loops back to back on its own stream. Prints the
slowdown (%) per pair; --out writes JSON (schema ce_overlap.bench.overlap/1).

    torchrun --standalone --nproc-per-node 2 bench/collectives.py overlap --out overlap.json
    torchrun --standalone --nproc-per-node 2 bench/collectives.py overlap --sustain-ms 1000 --compute gemm

The compute kernel is timed with CUDA events on the compute stream, median over --iters launches; the collective
stream is kept busy for the whole window (enough collectives are enqueued per compute launch to cover it, plus a
lead-in), and the compute stream's duty (its kernels' time over the window: under 100% it had gaps, and a rested board
runs faster than one at its power limit) and the collective's
own achieved bus bandwidth beside the compute are reported too. Max over ranks. Where NVML is there (nvidia-ml-py), the
median SM clock (slowest rank), board power (highest rank) and the share of samples NVML flagged the power cap
(`capped%`) while the compute ran (not the paced copies that outlast it) are printed next to it, for the arm beside
and the alone arm before it: a slowdown with the clock down and the cap set is the power limit, not SM or HBM
contention.
"""
from __future__ import annotations

import argparse
import math
import os

from lib import args as A
from lib import common as C
from lib import ce_variants as V

import torch
import torch.distributed as dist

COMPUTES = ["gemm", "membound"]


def make_compute(kind: str):
    """Returns (label, fn, work description) for one compute kernel on the current stream."""
    if kind == "gemm":
        n = 8192
        return "bf16 GEMM 8192^3", C.gemm(n), {"flops": 2 * n ** 3}
    if kind == "membound":
        numel = (1 << 30) // 2  # 1 GiB of bf16 per operand
        x = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
        y = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
        z = torch.empty_like(x)
        return "add of 1 GiB bf16 tensors", (lambda: torch.add(x, y, out=z)), {"bytes": 3 * numel * 2}
    raise ValueError(kind)


def time_compute_alone(fn, iters: int, warmup: int) -> float:
    return C.time_alone(fn, iters, warmup, torch.cuda.synchronize, skip_first=2)


def add_parsers(sub) -> None:
    p = sub.add_parser("overlap", help="a GEMM and a memory-bound add timed alone and beside every all-gather and "
                                       "reduce-scatter variant", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=A.at_least(1), default=256, metavar="MIB",
                   help="collective size per rank, MiB (default %(default)s)")
    A.timing_options(p, iters=40, warmup=5, min_iters=3)
    p.add_argument("--per-launch", type=A.at_least(1), default=None,
                   help="collectives enqueued per compute launch (default: 1.1 x the compute's time alone / the "
                        "collective's alone, so the side stream covers the computes without running far past them)")
    p.add_argument("--compute", default=",".join(COMPUTES), type=A.choices_list(COMPUTES),
                   help=f"comma list of {', '.join(COMPUTES)}")
    p.add_argument("--variants", default=",".join(V.AG_VARIANTS), type=A.choices_list(V.AG_VARIANTS),
                   help=f"all-gather variants, of {', '.join(V.AG_VARIANTS)}")
    p.add_argument("--rs-variants", default=",".join(V.RS_VARIANTS), type=A.choices_list(V.RS_VARIANTS),
                   help=f"reduce-scatter variants, of {', '.join(V.RS_VARIANTS)}")
    p.add_argument("--sustain-ms", type=A.non_negative(float), default=0.0,
                   help="time each measurement over about this long (iters from the compute's own time) and re-time "
                        "the compute alone before every variant, so both arms run at the board's steady, power-limited "
                        "clocks (a short burst alone runs at boost clocks; on one H200 a GEMM took 1387 us in a burst, "
                        "1621 us sustained)")
    p.add_argument("--copy-rates", type=A.int_list(0), default=None, metavar="LIST",
                   help="comma list of copy rates, GB/s (0: unlimited): every ce_overlap variant once per rate, "
                        "labelled 'ag:ce_symm_push@rate=150' (the runtime's copy_rate_gbps, set on every rank); "
                        "default: the runtime's own (unlimited)")
    A.out_option(p)
    p.set_defaults(run=run, plan=plan)


def plan(args) -> dict:
    """What a run does (CPU only: bench/collectives.py --dry-run prints it). Labels "ag:<variant>", "rs:<variant>"."""
    nbytes = args.size_mib << 20
    rates = getattr(args, "copy_rates", None)

    def per_rate(label: str) -> list[str]:
        return [f"{label}@rate={r}" for r in rates] if rates and label.split(":", 1)[1].startswith("ce") else [label]

    labels = [f"ag:{v}" for v in A.items(args.variants)] + [f"rs:{v}" for v in A.items(args.rs_variants)]
    return {"size_bytes_per_rank": nbytes, "computes": A.items(args.compute),
            "variants": [x for label in labels for x in per_rate(label)],
            "pool_env": C.pool_env(nbytes, int(os.environ.get("WORLD_SIZE", "1")))}


def run(args) -> int:
    todo = plan(args)
    nbytes = todo["size_bytes_per_rank"]
    rank, world, group = C.start(todo)
    info = C.header(f"compute slowdown beside all-gathers / reduce-scatters of {args.size_mib} MiB per rank, "
                    f"{world} ranks")
    variants, computes = todo["variants"], todo["computes"]

    count = nbytes // 2
    inp = torch.randn(count, dtype=torch.bfloat16, device="cuda")
    rs_inp = torch.randint(-8, 9, (world * count,), device="cuda").to(torch.bfloat16)

    def make(label: str) -> C.Variant:
        """The variant of `label`, with the group's copy rate set for it ('@rate=R') or back to the runtime's own."""
        coll, name = label.split(":", 1)
        name, _, rate = name.partition("@rate=")
        if name.startswith("ce") and not C.ce_unavailable(group):
            if rate:
                V.tune(group, copy_rate_gbps=float(rate))
            else:
                V.tune(group, restore=True)
        v = V.make_ag_variant(name, inp, group) if coll == "ag" else V.make_rs_variant(name, rs_inp, group)
        v.name = label
        return v

    def per_launch(name: str, compute_ms: float) -> float:
        """Collectives per compute launch: --per-launch, or enough to keep the side stream busy while the computes
        run and no more. A fixed 2 queued paced copies worth seconds beyond a 1 s compute window, and their launches
        then held back the compute's (time_beside's duty)."""
        if args.per_launch:
            return float(args.per_launch)
        return 1.1 * compute_ms / coll_alone[name] if coll_alone.get(name) else 2.0

    results, na = [], {}
    failed_ce = ""
    sampler = C.ClockSampler()
    if sampler.error:
        C.log0(f"# SM clock / power not sampled: {sampler.error}")
    # Collective alone, for reference.
    coll_alone = {}
    for name in variants:
        v = make(name)
        reason = C.unavailable(v)
        if reason:
            na[name] = reason
            continue
        try:
            coll_alone[name] = C.time_variant_ms(v, group, 20, 5)
        except Exception as e:  # noqa: BLE001
            C.print_exc_rank()
            na[name] = C.format_exc_line(e)
            if ":ce" in name:
                failed_ce = na[name]
        del v

    for kind in computes:
        label, fn, work = make_compute(kind)
        dist.barrier()
        iters = args.iters
        if args.sustain_ms > 0:
            burst = time_compute_alone(fn, args.iters, args.warmup)
            iters = max(args.iters, int(C.max_over_ranks(args.sustain_ms / burst)))
        with sampler:
            alone_ms = time_compute_alone(fn, iters, args.warmup)
        row = {"compute": kind, "label": label, "variant": None, "compute_ms": alone_ms, "slowdown_pct": 0.0,
               **C.clocks_over_ranks(sampler.stats())}
        if "flops" in work:
            row["tflops"] = work["flops"] / (alone_ms / 1e3) / 1e12
        if "bytes" in work:
            row["hbm_gbps"] = work["bytes"] / (alone_ms / 1e3) / 1e9
        results.append(row)
        for name in variants:
            if name in na:
                results.append({"compute": kind, "label": label, "variant": name, "na": na[name]})
                continue
            if ":ce" in name and failed_ce:
                results.append({"compute": kind, "label": label, "variant": name, "na": failed_ce})
                continue
            v = make(name)
            reason = C.unavailable(v)
            if reason:
                results.append({"compute": kind, "label": label, "variant": name, "na": reason})
                continue
            try:
                dist.barrier()
                if args.sustain_ms > 0:  # the alone arm again, right before: the board's state drifts
                    with sampler:
                        alone_ms = time_compute_alone(fn, iters, args.warmup)
                    alone_clocks = C.clocks_over_ranks(sampler.stats())
                info: dict = {}  # the clocks while the compute ran (not while paced copies outlast it), its duty
                side_per_compute = per_launch(name, alone_ms)
                with sampler:
                    if args.sustain_ms > 0:  # fed: the computes back to back however many launches a copy takes
                        side_ops = 3 + math.ceil(side_per_compute * (iters + args.warmup))
                        beside_ms, coll_ms = C.time_beside_fed(fn, v.run, iters, args.warmup, side_ops,
                                                               lambda: C.settle(v, group), info)
                    else:
                        beside_ms, coll_ms = C.time_beside(fn, v.run, iters, args.warmup, side_per_compute, 3,
                                                           lambda: C.settle(v, group), info)
            except Exception as e:  # noqa: BLE001
                C.print_exc_rank()
                reason = C.format_exc_line(e)
                if ":ce" in name:
                    failed_ce = reason
                results.append({"compute": kind, "label": label, "variant": name, "error": reason})
                continue
            finally:
                del v
            r = {"compute": kind, "label": label, "variant": name, "compute_ms": beside_ms,
                 "slowdown_pct": (beside_ms / alone_ms - 1) * 100, "compute_alone_ms": alone_ms, "iters": iters,
                 **({"alone_" + k: val for k, val in alone_clocks.items()} if args.sustain_ms > 0 else {}),
                 "collective_ms_beside": coll_ms,
                 "collective_busbw_beside_gbps": nbytes * (world - 1) / (coll_ms / 1e3) / 1e9,  # = algbw*(n-1)/n
                 "collective_ms_alone": coll_alone.get(name), "side_per_compute": side_per_compute,
                 "compute_duty_pct": -C.max_over_ranks(-info["duty_pct"]),
                 **C.clocks_over_ranks(sampler.stats(info["window"]))}
            if "flops" in work:
                r["tflops"] = work["flops"] / (beside_ms / 1e3) / 1e12
            if "bytes" in work:
                r["hbm_gbps"] = work["bytes"] / (beside_ms / 1e3) / 1e9
            results.append(r)
        del fn
        torch.cuda.empty_cache()

    C.log0()
    C.log0(f"# collective alone (256 MiB per rank unless --size-mib): "
           + ", ".join(f"{k} {v * 1e3:.0f} us" for k, v in coll_alone.items()))
    if args.sustain_ms > 0:
        C.log0(f"# sustained: each arm ~{args.sustain_ms:.0f} ms; a variant's slowdown is against the alone arm re-timed "
               f"right before it (alone(us))")
    C.log0(f"{'compute':<28} {'beside':<24} {'compute(us)':>12} {'alone(us)':>10} {'slowdown%':>10} {'TFLOP/s|GB/s':>13} "
           f"{'coll(us)':>10} {'coll busbw':>11} {'duty%':>6} {'SM MHz':>7} {'W':>5} {'capped%':>8} {'alone MHz':>10} "
           f"{'capped%':>8}")
    for r in results:
        if "compute_ms" not in r:
            C.log0(f"{r['label']:<28} {r['variant']:<24} n/a: {r.get('na') or r.get('error')}")
            continue
        rate = r.get("tflops", r.get("hbm_gbps", 0.0))
        coll = r.get("collective_ms_beside")
        alone = r.get("compute_alone_ms", r["compute_ms"] if r["variant"] is None else None)
        C.log0(f"{r['label']:<28} {(r['variant'] or 'alone'):<24} {r['compute_ms'] * 1e3:>12.1f} "
               + (f"{alone * 1e3:>10.1f}" if alone else f"{'-':>10}")
               + f" {r['slowdown_pct']:>+10.1f} {rate:>13.1f} "
               + (f"{coll * 1e3:>10.1f} {r['collective_busbw_beside_gbps']:>11.1f} {r['compute_duty_pct']:>6.1f}" if coll
                  else f"{'-':>10} {'-':>11} {'-':>6}")
               + (f" {r['sm_clock_mhz']:>7.0f} {r['power_w']:>5.0f} {r['power_cap_pct']:>8.0f}" if "sm_clock_mhz" in r
                  else f" {'-':>7} {'-':>5} {'-':>8}")
               + (f" {r['alone_sm_clock_mhz']:>10.0f} {r['alone_power_cap_pct']:>8.0f}" if "alone_sm_clock_mhz" in r
                  else ""))
    C.finish(group, args.out, {"schema": "ce_overlap.bench.overlap/1", "args": A.recorded(args),
                               "size_bytes_per_rank": nbytes, "collective_alone_ms": coll_alone,
                               "results": results}, na, info)
    rc = 0 if not any("error" in r for r in results) else 1
    dist.barrier()
    dist.destroy_process_group()
    return rc
