"""Subcommand probe of bench/collectives.py: the CE runtime's design questions, on 2 GPUs (bench/run_device.sh runs
it); compact tables, JSON via --out (schema ce_overlap.bench.ce_probe/2). --parts picks among (a)..(d).

(a) Does a copy within one GPU run on a copy engine or on SMs? A bf16 8192^3 GEMM is timed alone and beside a loop
    of 256 MiB same-GPU copies on another stream, for each way of issuing the copy (ce_overlap::_local_copy modes:
    plain cudaMemcpyAsync, cudaMemcpyBatchAsync with and without the "prefer overlap with compute" hint,
    cudaMemcpyPeerAsync to the same device) and for an SM copy kernel as the reference. Every copy runs on a side
    stream (cudaMemcpyBatchAsync refuses the legacy default stream). A copy that slows the GEMM about as much as the
    SM kernel runs on SMs; one that leaves it near +0% runs on a copy engine.
(b) All-gather into a symmetric output, in place (input = own shard), 64 MiB and 256 MiB per rank: NCCL, PULL with
    each peer copy split into k = 1, 2, 3 pieces on k streams (CE_OVERLAP_PULL_SPLIT), PUSH; time, bus bandwidth,
    GEMM slowdown beside, bus bandwidth beside, bit-exact vs NCCL. Plus the per-op floor: 64 KiB and 4 MiB alone.
(c) Reduce-scatter (sum, bf16, ordinary input), 64 MiB and 256 MiB output per rank: NCCL vs ce_overlap for every
    CE_OVERLAP_REDUCE_SMS in {16, 32, 64} x CE_OVERLAP_RS_ROUND_MB in {8, 32} (set between ops on both ranks with
    ce_overlap.runtime.testing.tune); time, busbw, GEMM slowdown beside, bit-exact vs NCCL (integer-valued data).
(d) The reduction kernel alone (out = a + b, bf16, 256 MiB each, as the reduce-scatter runs it for 2 ranks), and a
    bf16 8192^3 GEMM beside it running back to back (one GPU is enough), for
    8..132 CTAs: GB/s of HBM traffic (3 x 256 MiB per call).

    torchrun --standalone --nproc-per-node 2 bench/collectives.py probe --out $OUT/ce_probe.json
    torchrun --standalone --nproc-per-node 1 bench/collectives.py probe --parts copy --sustain-gemms 700

Times: CUDA events, median over --iters, max over ranks. busbw = size * (world - 1) / time (nccl-tests' factor).
"""
from __future__ import annotations

import argparse
import math
import os

from lib import args as A
from lib import common as C

import torch
import torch.distributed as dist

import ce_overlap.runtime.testing as rtt

COPY_MODES = ["memcpy", "batch_hint", "batch", "peer", "sm_kernel"]
COPY_HELP = {
    "memcpy": "cudaMemcpyAsync device-to-device",
    "batch_hint": "cudaMemcpyBatchAsync + cudaMemcpyFlagPreferOverlapWithCompute (what the runtime uses)",
    "batch": "cudaMemcpyBatchAsync, no flag",
    "peer": "cudaMemcpyPeerAsync, same device on both sides",
    "sm_kernel": "torch.bitwise_or(src, 0, out=dst) on int16 views: an elementwise SM kernel (reference)",
}
AG_VARIANTS = ["nccl", "pull_inplace", "push_inplace", "push_from_input"]
AG_HELP = {
    "nccl": "dist.all_gather_into_tensor",
    "pull_inplace": "ce_overlap pull, symmetric output, input = own shard (no self copy)",
    "push_inplace": "ce_overlap push, symmetric output, input = own shard (no self copy)",
    "push_from_input": "ce_overlap push, symmetric output, ordinary input (+ local self copy)",
}
PARTS = ["copy", "allgather", "reducescatter", "kernel"]


def kernel_names(fn) -> dict:
    """GPU activities of 2 calls of fn, as the profiler names them (copies show as 'Memcpy ...')."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
    names: dict[str, int] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            names[e.name] = names.get(e.name, 0) + 1
    return names


def probe_local_copies(args, results: dict) -> None:
    nbytes = args.copy_mib << 20
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    src16, dst16 = src.view(torch.int16), dst.view(torch.int16)
    mm = C.gemm()
    sync = torch.cuda.synchronize
    dist.barrier()
    gemm_alone = C.time_alone(mm, args.iters, 5, sync)
    results["gemm_alone_ms"] = gemm_alone
    if args.sustain_gemms:  # the same GEMM back to back for about a second, SM clock and board power sampled
        with C.ClockSampler() as sampler:
            sustained = C.time_alone(mm, args.sustain_gemms, 5, sync)
        results["gemm_alone_sustained"] = {"gemm_ms": sustained, **sampler.stats()}
    rows = []
    # cudaMemcpyBatchAsync refuses the legacy default stream (torch's default): everything here runs on a side
    # stream, the GEMM included (time_beside puts the copies on yet another stream).
    copy_stream = torch.cuda.Stream()
    copy_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(copy_stream):
        for mode in COPY_MODES:
            rows.append(_local_copy_row(mode, src, dst, src16, dst16, mm, gemm_alone, nbytes, args))
    torch.cuda.current_stream().wait_stream(copy_stream)
    torch.cuda.synchronize()
    results["local_copy"] = rows
    _print_local_copies(args, rows, gemm_alone, results.get("gemm_alone_sustained"))


def _local_copy_row(mode, src, dst, src16, dst16, mm, gemm_alone, nbytes, args) -> dict:
    sync = torch.cuda.synchronize
    row = {"mode": mode, "help": COPY_HELP[mode]}
    if mode == "sm_kernel":
        fn = lambda: torch.bitwise_or(src16, 0, out=dst16)  # noqa: E731
    else:
        fn = lambda m=mode: rtt.local_copy(dst, src, m)  # noqa: E731
    try:
        fn()
        torch.cuda.synchronize()
        ok = torch.equal(dst, src)
        dst.zero_()
        copy_ms = C.time_alone(fn, args.iters, 3, sync)
        per_launch = max(1, math.ceil(gemm_alone / copy_ms)) + 1
        gemm_ms, copy_beside_ms = C.time_beside(mm, fn, args.iters, 5, per_launch, 3, sync)
        if args.sustain_gemms:
            with C.ClockSampler() as sampler:
                sustained, _ = C.time_beside(mm, fn, args.sustain_gemms, 5, per_launch, 3, sync)
            row["sustained"] = {"gemm_ms": sustained, **sampler.stats()}
        row.update({"correct": ok, "copy_ms": copy_ms, "copy_gbps": nbytes / copy_ms / 1e6,
                    "gemm_beside_ms": gemm_ms, "gemm_slowdown_pct": (gemm_ms / gemm_alone - 1) * 100,
                    "copy_beside_ms": copy_beside_ms, "copy_beside_gbps": nbytes / copy_beside_ms / 1e6,
                    "copies_per_gemm": per_launch, "gpu_activities": kernel_names(fn)})
    except Exception as e:  # noqa: BLE001 (a mode the driver refuses is a result too)
        row["error"] = C.format_exc_line(e)
        torch.cuda.synchronize()
    return row


def _print_local_copies(args, rows, gemm_alone, alone: dict | None) -> None:
    C.log0()
    C.log0(f"# (a) same-GPU copies of {args.copy_mib} MiB beside a bf16 8192^3 GEMM (alone {gemm_alone * 1e3:.0f} us)")
    C.log0(f"{'mode':<12} {'copy(us)':>9} {'GB/s':>7} {'GEMM beside(us)':>16} {'GEMM slowdown':>14} "
           f"{'copy GB/s beside':>17} {'ok':>3}  activities")
    for r in rows:
        if "error" in r:
            C.log0(f"{r['mode']:<12} n/a: {r['error']}")
            continue
        C.log0(f"{r['mode']:<12} {r['copy_ms'] * 1e3:>9.1f} {r['copy_gbps']:>7.0f} {r['gemm_beside_ms'] * 1e3:>16.1f} "
               f"{r['gemm_slowdown_pct']:>+13.1f}% {r['copy_beside_gbps']:>17.0f} {'y' if r['correct'] else 'N':>3}  "
               f"{r['gpu_activities']}")
    for m in COPY_MODES:
        C.log0(f"#   {m:<12} {COPY_HELP[m]}")
    if not alone:
        return
    C.log0(f"# sustained: {args.sustain_gemms} GEMMs back to back (~{args.sustain_gemms * gemm_alone:.0f} ms), median "
           f"SM clock and board power (NVML) while they ran")
    C.log0(f"{'beside':<12} {'GEMM(us)':>9} {'slowdown':>9} {'SM MHz':>7} {'min MHz':>8} {'W':>5} {'max W':>6}")
    for label, d in [("nothing", alone)] + [(r["mode"], r.get("sustained")) for r in rows if "error" not in r]:
        if not d:
            continue
        clock = (f"{d['sm_clock_mhz']:>7.0f} {d['sm_clock_min_mhz']:>8.0f} {d['power_w']:>5.0f} {d['power_max_w']:>6.0f}"
                 if "sm_clock_mhz" in d else f"{'-':>7} {'-':>8} {'-':>5} {'-':>6}")
        C.log0(f"{label:<12} {d['gemm_ms'] * 1e3:>9.1f} {(d['gemm_ms'] / alone['gemm_ms'] - 1) * 100:>+8.1f}% {clock}")


def _ce_settle(rt, group):
    """Waits for the group's CE ops and the device: what a timed CE arm does between repeats."""
    def settle():
        rt.synchronize(group)
        torch.cuda.synchronize()
    return settle


def _measure(run, settle, iters: int, mm, gemm_alone: float, nbytes: int, world: int, beside: bool) -> dict:
    """Times `run` alone and (beside=True) beside the GEMM. busbw = nbytes * (world - 1) / time."""
    dist.barrier()
    t = C.time_alone(run, iters, 3, settle)
    row = {"time_us": t * 1e3, "busbw_gbps": nbytes * (world - 1) / (t / 1e3) / 1e9}
    if beside:
        per_launch = max(1, math.ceil(gemm_alone / t)) + 1
        dist.barrier()
        gemm_ms, coll_beside = C.time_beside(mm, run, iters, 5, per_launch, 2, settle)
        row.update({"gemm_beside_ms": gemm_ms, "gemm_slowdown_pct": (gemm_ms / gemm_alone - 1) * 100,
                    "busbw_beside_gbps": nbytes * (world - 1) / (coll_beside / 1e3) / 1e9})
    return row


def _collective_probe_setup(args, results: dict):
    """(group, world, rank, runtime ok, its reason, the GEMM, its time alone in ms) of a collective probe; the GEMM's
    time alone is measured once per run (results["gemm_alone_ms"]) and shared by the probes."""
    import ce_overlap.runtime as rt

    ok, reason = rt.available()
    mm = C.gemm()
    torch.cuda.synchronize()
    gemm_alone = results.get("gemm_alone_ms") or C.time_alone(mm, args.iters, 5, torch.cuda.synchronize)
    results["gemm_alone_ms"] = gemm_alone
    return dist.group.WORLD, dist.get_world_size(), dist.get_rank(), ok, reason, mm, gemm_alone


def _print_rows(title: str, rows: list[dict], world: int) -> None:
    """(b) and (c): nccl-tests' columns (size = bytes per rank, bf16; algbw = world * size / time), then the variant,
    the GEMM's slowdown beside the op and the op's busbw beside the GEMM."""
    def shown(r: dict) -> dict:
        row = {"size": r["bytes"], "count": r["bytes"] // 2, "type": "bf16", **r}
        if "time_us" in r and "wrong" in r and "error" not in r:
            row["algbw_gbps"] = world * r["bytes"] / (r["time_us"] / 1e6) / 1e9
        else:
            row.update(time_us=None, why=r.get("na") or r.get("error", ""))
        return row

    C.size_table(title, [shown(r) for r in rows], extra=(
        ("variant", 22, lambda r: r["variant"]),
        ("GEMM+%", 7, lambda r: f"{r['gemm_slowdown_pct']:+.1f}%" if "gemm_slowdown_pct" in r else "-"),
        ("busbw beside", 13, lambda r: f"{r['busbw_beside_gbps']:.1f}" if "busbw_beside_gbps" in r else "-")))


def probe_all_gather(args, results: dict) -> None:
    """(b): NCCL, pull in place split k = 1..3, push in place; GEMM beside at the large sizes."""
    import ce_overlap.runtime as rt

    group, world, rank, ok, reason, mm, gemm_alone = _collective_probe_setup(args, results)
    # "staged" (ordinary input and output: the input is copied into the staging region, the own shard into the
    # output, both by the runtime's local copies) shows what local copies really use (describe's local_copy).
    plan = [(64 << 10, ["nccl", "pull", "push"], False), (4 << 20, ["nccl", "pull", "push", "staged"], False)]
    plan += [(mib << 20, ["nccl", "pull", "pull_split2", "pull_split3", "push"], True) for mib in args.ag_mib]
    rows = []
    for nbytes, variants, beside in plan:
        count = nbytes // 2
        gen = torch.Generator(device="cuda")
        gen.manual_seed(77 + rank)
        inp = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=gen).view(torch.bfloat16)
        ref = torch.empty(world * count, dtype=torch.bfloat16, device="cuda")
        dist.all_gather_into_tensor(ref, inp, group=group)
        sym_out = rt.empty_symmetric((world * count,), torch.bfloat16, group) if ok else None
        for name in variants:
            row = {"variant": name, "bytes": nbytes}
            if name != "nccl" and not ok:
                rows.append({**row, "na": reason})
                continue
            try:
                if name == "nccl":
                    out = torch.empty(world * count, dtype=torch.bfloat16, device="cuda")
                    run = lambda: dist.all_gather_into_tensor(out, inp, group=group)  # noqa: E731
                    settle = torch.cuda.synchronize
                elif name == "staged":
                    out = torch.empty(world * count, dtype=torch.bfloat16, device="cuda")
                    run = lambda: rt.all_gather_into_tensor(out, inp, group)  # noqa: E731
                    settle = _ce_settle(rt, group)
                else:
                    out = sym_out
                    shard = out.view(world, count)[rank]
                    shard.copy_(inp)
                    split = int(name[-1]) if "split" in name else 1
                    rtt.tune(group, pull_split=split)
                    rtt.set_all_gather_mode("push" if name == "push" else "pull")
                    run = lambda: rt.all_gather_into_tensor(out, shard, group)  # noqa: E731
                    settle = _ce_settle(rt, group)
                row.update(_measure(run, settle, args.iters, mm, gemm_alone, nbytes, world, beside))
                row["wrong"] = C.sum_over_ranks(C.count_wrong(out, ref))
            except Exception as e:  # noqa: BLE001
                C.print_exc_rank()
                row["error"] = C.format_exc_line(e)
            finally:
                if ok:
                    rtt.set_all_gather_mode("pull")
                    rtt.tune(group, pull_split=1)
            rows.append(row)
            torch.cuda.synchronize()
        # Drop every reference to this size's symmetric output: the next (larger) one needs its pool range.
        inp = ref = sym_out = out = shard = run = None
        torch.cuda.synchronize()
    results["all_gather"] = rows
    results["runtime_local_copy_mode"] = rtt.local_copy_mode() if ok else reason
    _print_rows(f"# (b) all-gather in place into a symmetric output, {world} ranks, bf16; size per rank; GEMM alone "
                f"{gemm_alone * 1e3:.0f} us; pull_splitK: each peer copy in K pieces on K streams; staged: ordinary "
                f"input and output", rows, world)
    C.log0(f"# runtime local copies after the staged all-gather: {results['runtime_local_copy_mode']}")


def probe_reduce_scatter(args, results: dict) -> None:
    """(c): NCCL vs ce_overlap over reduction CTAs x round size, GEMM beside."""
    import ce_overlap.runtime as rt

    group, world, rank, ok, reason, mm, gemm_alone = _collective_probe_setup(args, results)
    name = rt.rendezvous(group) if ok else ""
    before = rtt.tune(group) if ok else ""
    rows = []
    for mib in args.rs_mib:
        nbytes = mib << 20
        count = nbytes // 2
        gen = torch.Generator(device="cuda")
        gen.manual_seed(99 + rank)
        inp = torch.randint(-8, 9, (world * count,), device="cuda", generator=gen).to(torch.bfloat16)
        ref = torch.empty(count, dtype=torch.bfloat16, device="cuda")
        dist.reduce_scatter_tensor(ref, inp.clone(), group=group)
        out = torch.empty(count, dtype=torch.bfloat16, device="cuda")
        lanes = args.peer_lanes or [None]
        configs = [("nccl", 0, 0, None)] + [
            (f"ce sms={s} round={r}M" + ("" if L is None else f" lanes={L}"), s, r, L)
            for r in args.rs_round_mb for s in args.reduce_sms for L in lanes]
        for label, sms, round_mb, lane in configs:
            row = {"variant": label, "bytes": nbytes, "reduce_sms": sms, "rs_round_mb": round_mb,
                   **({} if lane is None else {"peer_lanes": lane})}
            if label != "nccl" and not ok:
                rows.append({**row, "na": reason})
                continue
            try:
                if label == "nccl":
                    run = lambda: dist.reduce_scatter_tensor(out, inp, group=group)  # noqa: E731
                    settle = torch.cuda.synchronize
                else:
                    # Both ranks set the same round size between ops (it is part of the ops' signature).
                    rtt.tune(group, reduce_sms=sms, rs_round_mb=round_mb, peer_lanes=lane)
                    row["round_bytes"] = rtt.reduce_scatter_round_bytes(name)
                    run = lambda: rt.reduce_scatter_tensor(out, inp, "sum", group)  # noqa: E731
                    settle = _ce_settle(rt, group)
                row.update(_measure(run, settle, args.iters, mm, gemm_alone, nbytes, world, True))
                row["wrong"] = C.sum_over_ranks(C.count_wrong(out, ref))
            except Exception as e:  # noqa: BLE001
                C.print_exc_rank()
                row["error"] = C.format_exc_line(e)
            rows.append(row)
            torch.cuda.synchronize()
        inp = ref = out = run = None
        torch.cuda.synchronize()
    if ok:  # back to the configured defaults
        cfg = dict(kv.split("=") for kv in before.split())
        rtt.tune(group, reduce_sms=int(cfg["reduce_ctas"]), rs_round_mb=int(cfg["rs_round_bytes"]) / (1 << 20),
                 peer_lanes=int(cfg["peer_lanes"]))
    results["reduce_scatter"] = rows
    results["reduce_scatter_defaults"] = before
    _print_rows(f"# (c) reduce-scatter sum, bf16, ordinary input, {world} ranks; size = output per rank; GEMM alone "
                f"{gemm_alone * 1e3:.0f} us; defaults: {before}", rows, world)


def probe_reduce_kernel(args, results: dict) -> None:
    """(d): the reduction kernel alone for several CTA counts."""
    nbytes = 256 << 20
    a = torch.randn(nbytes // 2, device="cuda").to(torch.bfloat16)
    b = torch.randn(nbytes // 2, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(a)
    want = (a.float() + b.float()).to(torch.bfloat16)
    rows = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for ctas in args.kernel_ctas:
            fn = lambda c=ctas: rtt.reduce_bench(out, a, b, c)  # noqa: E731
            t = C.time_alone(fn, args.iters, 3, torch.cuda.synchronize)
            rows.append({"ctas": ctas, "time_us": t * 1e3, "hbm_gbps": 3 * nbytes / (t / 1e3) / 1e9,
                         "exact": bool(torch.equal(out, want))})
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    # The bf16 8192^3 GEMM beside the kernel running back to back on a side stream (its SM share is what a
    # reduce-scatter costs the compute beside it).
    mm = C.gemm()
    gemm_alone = C.time_alone(mm, args.iters, 3, torch.cuda.synchronize)
    for r in rows:
        if r["ctas"] > 64:
            continue
        fn = lambda c=r["ctas"]: rtt.reduce_bench(out, a, b, c)  # noqa: E731
        # Enough kernels per GEMM to cover it: GEMM time / kernel time, plus one.
        per = int(gemm_alone / (r["time_us"] / 1e3)) + 1
        beside, _ = C.time_beside(mm, fn, args.iters, 3, per, per, torch.cuda.synchronize)
        r["gemm_alone_ms"], r["gemm_beside_ms"] = gemm_alone, beside
        r["gemm_slowdown_pct"] = 100 * (beside / gemm_alone - 1)
    results["reduce_kernel"] = rows
    C.log0()
    C.log0("# (d) reduction kernel alone: out = a + b, bf16, 256 MiB each (fp32 accumulation, 16-byte loads); "
           "GB/s = 3 x 256 MiB / time")
    C.log0(f"{'CTAs':>5} {'time(us)':>9} {'GB/s':>7} {'exact':>6} {'GEMM beside':>12}")
    for r in rows:
        slow = f"{r['gemm_slowdown_pct']:+.1f}%" if "gemm_slowdown_pct" in r else "-"
        C.log0(f"{r['ctas']:>5} {r['time_us']:>9.1f} {r['hbm_gbps']:>7.0f} {'y' if r['exact'] else 'N':>6} {slow:>12}")


def add_parsers(sub) -> None:
    p = sub.add_parser("probe", help="(a) same-GPU copy APIs beside a GEMM, (b) all-gather pull split / push, (c) "
                                     "reduce-scatter tuning, (d) the reduction kernel", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--copy-mib", type=A.at_least(1), default=256, help="size of one same-GPU copy, MiB")
    p.add_argument("--ag-mib", type=A.int_list(), default="64,256",
                   help="all-gather sizes per rank (MiB) measured beside the GEMM")
    p.add_argument("--rs-mib", type=A.int_list(), default="64,256", help="reduce-scatter output sizes per rank, MiB")
    p.add_argument("--reduce-sms", type=A.int_list(), default="16,32,64", help="reduction CTAs swept in (c)")
    p.add_argument("--peer-lanes", type=A.int_list(0), default=None, metavar="LIST",
                   help="(c) also over these peer lane counts (0: every peer at once); default: the runtime's own")
    p.add_argument("--rs-round-mb", type=A.int_list(), default="8,32",
                   help="reduce-scatter round sizes (MiB) swept in (c)")
    p.add_argument("--kernel-ctas", type=A.int_list(), default="8,16,32,64,132", help="CTA counts of (d)")
    A.timing_options(p, iters=15, warmup=None, min_iters=3)
    p.add_argument("--sustain-gemms", type=A.non_negative(int), default=0,
                   help="(a): also time this many GEMMs back to back alone and beside each copy mode, with the SM clock "
                        "and board power sampled (NVML): a slowdown with the clock down is the board's power limit")
    p.add_argument("--parts", default=",".join(PARTS), type=A.choices_list(PARTS),
                   help=f"comma list of {', '.join(PARTS)}: (a) .. (d) above")
    A.out_option(p)
    p.set_defaults(run=run, plan=plan)


def plan(args) -> dict:
    """What a run does and the pool it asks for (CPU only: bench/collectives.py --dry-run prints it). User region:
    the largest in-place all-gather output (world * size); staging: 2 banks of the largest round."""
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    staging_mb = max(64, 2 * max(args.rs_round_mb + [1]) * max(1, world_env - 1))
    staging_mb_set = int(os.environ.get("CE_OVERLAP_STAGING_MB", staging_mb))  # an explicit setting wins
    return {"parts": A.items(args.parts), "pool_env": {
        "CE_OVERLAP_STAGING_MB": str(staging_mb),
        "CE_OVERLAP_POOL_MB": str(world_env * max(args.ag_mib + [1]) + 128 + staging_mb_set),
        "CE_OVERLAP_TIMEOUT_S": "30"}}


def run(args) -> int:
    todo = plan(args)
    C.apply_env_defaults(todo["pool_env"])
    C.init()
    import ce_overlap.runtime as rt

    info = C.header("ce_overlap probe: same-GPU copies; all-gather pull split / push; reduce-scatter tuning; "
                    "reduction kernel")
    results: dict = {}
    parts = todo["parts"]
    ok, reason = rt.available()
    if ok:
        rt.rendezvous(dist.group.WORLD)
    if "copy" in parts:
        if ok:
            probe_local_copies(args, results)
        else:
            C.log0(f"# (a) skipped: {reason}")
    if "allgather" in parts:
        probe_all_gather(args, results)
    if "reducescatter" in parts:
        probe_reduce_scatter(args, results)
    if "kernel" in parts and ok:
        probe_reduce_kernel(args, results)
    group = dist.group.WORLD
    C.finish(group, args.out, {"schema": "ce_overlap.bench.ce_probe/2", "args": A.recorded(args), **results}, {},
             info)
    rows = results.get("all_gather", []) + results.get("reduce_scatter", [])
    bad = any(r.get("wrong", 0) for r in rows) or any("error" in r for r in rows) or any(
        not r["exact"] for r in results.get("reduce_kernel", []))
    dist.barrier()
    dist.destroy_process_group()
    return 1 if bad else 0
