"""The cost model's predicted training step next to measured ones, without a GPU: captures the step of bench/train.py's
model on fake tensors (CPU), runs the cost model and ce_overlap's planner (ce_overlap.analyzer.step_model), and compares
with the medians of a bench/train.py result file and/or numbers given on the command line. Prints a table; --out
writes JSON. Re-run it after a cost-model change to see what the change does to the prediction of a measured run.

    python bench/step_prediction.py --train-json bench/results/train-2026-11-24-b/train.json --buckets
    python bench/step_prediction.py --layers 32 --world-size 2 --profile h200-sxm --measured no-comm=377.0
    python bench/step_prediction.py --train-json RUN/train.json --trace RUN/traces/trace-ce_overlap.json.gz

--trace: the model's kernels against the trace's by kind (casts, RMSNorm, SiLU, RoPE, loss, ...; ce_overlap.kernel_kinds),
with the rate each kind's kernels reached on the bytes the model counts: where its memory-bound time goes missing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))



# The model's compute classes (the analysis report's compute_by_class_us) and the measured kernel classes
# (ce_overlap.gpu_trace.kernel_class) that do that work.
CLASS_MATCH = (("matmul", "GEMMs", ("gemm",)),
               ("attention", "attention", ("attention",)),
               ("memory_bound", "fused / memory-bound kernels", ("fused", "other", "copy", "copy_kernel")))


def compare_classes(pieces: dict, kernels: dict | None) -> list[dict]:
    """Predicted vs measured ms per step by class of the no-comm step (the stand-ins of its collectives counted as
    memory-bound), plus the optimizer and the time no kernel ran (host gaps)."""
    if not kernels:
        return []
    measured = kernels.get("by_class_ms", {})
    rows = []

    def row(label, pred_ms, meas_ms):
        err = 100 * (pred_ms / meas_ms - 1) if meas_ms else None
        rows.append({"class": label, "predicted_ms": pred_ms, "measured_ms": meas_ms, "error_pct": err})

    stand_in_gaps_us = pieces.get("local_gather_kernels", 0) * pieces.get("kernel_gap_us", 0.0)
    for key, label, kinds in CLASS_MATCH:
        pred = sum((g.get("compute_by_class_us") or {}).get(key, 0.0) for g in pieces["analyze"].values()) / 1e3
        if key == "memory_bound":  # the no-comm mode's stand-ins for the collectives are memory-bound kernels
            pred += (sum((pieces.get("local_gather_us") or {}).values()) - stand_in_gaps_us) / 1e3
        row(label, pred, sum(measured.get(k, 0.0) for k in kinds))
    row("optimizer", pieces["optimizer_us"] / 1e3, measured.get("optimizer"))
    busy = kernels.get("busy_ms") or sum(measured.values())
    row("kernel busy time (sum of the above)", sum(r["predicted_ms"] for r in rows), busy)
    # The model's gap between kernels (efficiency.kernel_gap_us per kernel, stand-ins included) against the GPU's
    # idle time between kernels and copies in the profiled steps.
    gaps = (sum(g.get("kernel_gap_us") or 0.0 for g in pieces["analyze"].values()) + stand_in_gaps_us) / 1e3
    kernel_count = sum(g.get("kernels") or 0 for g in pieces["analyze"].values()) + pieces.get("local_gather_kernels", 0)
    row(f"GPU idle between kernels ({kernel_count} kernels modeled, "
        f"{kernels.get('activities_per_step', 0):.0f} measured)", gaps, kernels.get("gpu_idle_ms"))
    return rows


def kernel_kinds(ir, profile: str, trace: str, steps: int) -> list[dict]:
    """The model's kernels of every graph of `ir` against `trace`'s kernels, by kind (_kernel_kinds.table)."""
    import ce_overlap
    from lib.kernel_kinds import table
    from ce_overlap.profiles import read_text
    from timeline import gpu_events

    model = [k for name in ir.graph_names for k in ce_overlap.ir.kernels(ir, name, profile)]
    hbm = json.loads(read_text(profile))["gpu"]["hbm_gbps"]
    return table(model, [e for e in gpu_events(trace) if e.get("cat") == "kernel"], steps, hbm)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train-json", help="a bench/train.py result: its shape, world size, GPU and medians")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gqa", choices=["expand", "native"], default="expand")
    ap.add_argument("--vocab-parallel-embeddings", action="store_true",
                    help="the step as train.py --vocab-parallel-embeddings runs it (default: the result's)")
    ap.add_argument("--in-graph-wrap", choices=["blocks", "torchtitan"],
                    help="the step as train.py --in-graph-wrap shards it (default: the result's, else train.py's)")
    ap.add_argument("--fsdp2-wrap", choices=["blocks", "torchtitan"],
                    help="the FSDP2 modes' sharding, train.py --fsdp2-wrap (default: the result's, else train.py's)")
    ap.add_argument("--world-size", type=int)
    ap.add_argument("--profile", help="default: the built-in profile of the result's GPU")
    ap.add_argument("--measured", action="append", default=[], metavar="MODE=MS",
                    help="a measured median step (ms) to compare with, e.g. no-comm=377.0 (repeatable)")
    ap.add_argument("--ce-reduction", choices=["consumer", "kernel"], default="consumer",
                    help="how the plan runs a CE reduce-scatter (PassConfig.ce_reduction; default: the pass's)")
    ap.add_argument("--buckets", action="store_true",
                    help="also list every planned bucket: backend, predicted NCCL / CE cost, window, reason")
    ap.add_argument("--trace", help="a torch.profiler trace of this step (train.py --trace-dir): the model's kernels "
                                    "against the trace's, by kind")
    ap.add_argument("--trace-steps", type=int, default=2, help="steps the trace holds (train.py traces 2)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.trace and not os.path.isfile(args.trace):
        ap.error(f"--trace: no such file: {args.trace}")
    if args.trace_steps < 1:
        ap.error(f"--trace-steps: must be at least 1, got {args.trace_steps}")

    import torch

    import train
    from ce_overlap.profiles import DEFAULT, builtin_for_device, read_text
    from ce_overlap.analyzer.step_model import MODES

    measured: dict[str, float] = {}
    kernels: dict[str, dict] = {}  # mode -> its kernel profile (train.py --kernel-profile)
    source = "command line"
    if args.train_json:
        with open(args.train_json) as f:
            run = json.load(f)
        for key in ("model", "seq_len", "batch", "gqa", "vocab_parallel_embeddings"):
            setattr(args, key, run["args"].get(key, getattr(args, key)))
        args.in_graph_wrap = run["args"].get("in_graph_wrap", train.IN_GRAPH_WRAP_BEFORE)  # recorded since it exists
        args.fsdp2_wrap = args.fsdp2_wrap or run["args"].get("fsdp2_wrap")
        args.layers = args.layers or run["args"].get("layers")
        args.world_size = args.world_size or run["info"]["world_size"]
        args.profile = args.profile or builtin_for_device(run["info"]["gpu"], default=DEFAULT)
        measured = {r["mode"]: r["median_ms"] for r in run["results"] if r.get("ok", True) and r.get("median_ms")}
        kernels = {r["mode"]: r["kernels"] for r in run["results"] if r.get("kernels")}
        source = f"{args.train_json} ({run['info'].get('gpu')}, torch {run['info'].get('torch')})"
    for item in args.measured:
        mode, _, ms = item.partition("=")
        measured[mode] = float(ms)
    args.in_graph_wrap = args.in_graph_wrap or train.IN_GRAPH_WRAP
    args.fsdp2_wrap = args.fsdp2_wrap or train.parse_args([]).fsdp2_wrap
    if not args.world_size or not args.profile:
        ap.error("give --train-json, or --world-size and --profile")

    cfg = train.model_config(args)
    t0 = time.perf_counter()
    ir = train.capture_step(args, args.world_size)
    capture_s = time.perf_counter() - t0
    pieces, step_ms = train.predict_steps(args, args.world_size, args.profile, args.ce_reduction, ir)

    print(f"# {args.model} widths, {cfg.n_layers} layers, seq {args.seq_len}, batch {args.batch}, world {args.world_size}, "
          f"profile {args.profile}, CE reduce-scatter summed in the {args.ce_reduction}"
          f"{', vocabulary-parallel embeddings' if args.vocab_parallel_embeddings else ''}"
          f", in-graph wrap {args.in_graph_wrap}"
          + ("" if train.fsdp2_shards_alike(args) else f"; the FSDP2 modes captured as they shard (the table gathered, "
             f"wrap {args.fsdp2_wrap})") + f"; measured: {source}")
    print(f"{'graph':<10}{'compute ms':>11}{'exposed ms':>11}{'slowdown ms':>12}{'copies ms':>10}")
    for name, g in pieces["analyze"].items():
        plan = pieces["plan"][name]
        print(f"{name:<10}{g['compute_us'] / 1e3:11.1f}{plan['exposed_comm_us_after'] / 1e3:11.1f}"
              f"{plan['slowdown_us'] / 1e3:12.1f}{plan['bucket_copy_us'] / 1e3:10.1f}")
    print(f"{'optimizer':<10}{pieces['optimizer_us'] / 1e3:11.1f}")
    if args.buckets:
        import ce_overlap

        print(f"\n{'graph':<9}{'id':>3} {'type':<15}{'block':<10}{'MiB':>6} {'backend':<8}{'NCCL us':>8}{'CE us':>8}"
              f"{'window us':>10}  reason")
        for name in ir.graph_names:
            plan = ce_overlap.ir.plan(ir, name, args.profile, {"ce_reduction": args.ce_reduction})
            for b in plan["buckets"]:
                pr = b["predicted"]
                ce_cost = f"{pr['ce_cost_us']:.0f}" if pr.get("ce_cost_us") is not None else "-"
                print(f"{name:<9}{b['id']:>3} {b['type']:<15}{str(b.get('block_path') or '-'):<10}"
                      f"{b['bytes'] / 2**20:6.0f} {b['backend']:<8}{pr['nccl_cost_us']:8.0f}{ce_cost:>8}"
                      f"{pr['window_us']:10.0f}  {b['reason']}")
    rows = []
    print(f"\n{'mode':<26}{'predicted ms':>13}{'measured ms':>12}{'error':>8}  modelled as")
    for mode, (_, how) in MODES.items():
        pred = step_ms[mode]
        meas = measured.get(mode)
        err = 100 * (pred / meas - 1) if meas else None
        rows.append({"mode": mode, "predicted_ms": pred, "measured_ms": meas, "error_pct": err})
        print(f"{mode:<26}{pred:13.1f}{(f'{meas:.1f}' if meas else '-'):>12}"
              f"{(f'{err:+.1f}%' if err is not None else '-'):>8}  {how}")
    unmodelled = sorted(set(measured) - set(MODES))
    if unmodelled:
        print(f"# measured, not modelled (not in ce_overlap.analyzer.step_model.MODES): {', '.join(unmodelled)}")
    by_class = compare_classes(pieces, kernels.get("no-comm"))
    if by_class:
        print(f"\n# where the no-comm step's time goes: the model's compute by class vs the GPU kernel time measured by "
              f"class (train.py --kernel-profile)")
        print(f"{'class':<34}{'predicted ms':>13}{'measured ms':>12}{'error':>8}")
        for r in by_class:
            err = f"{r['error_pct']:+.1f}%" if r["error_pct"] is not None else "-"
            meas = f"{r['measured_ms']:.1f}" if r["measured_ms"] is not None else "-"
            print(f"{r['class']:<34}{r['predicted_ms']:13.1f}{meas:>12}{err:>8}")
    by_rank = {mode: k["by_rank"] for mode, k in kernels.items() if k.get("by_rank")}
    if by_rank:
        # A synchronous step runs at its slowest GPU's pace; the model predicts one GPU.
        from lib.kernel_profile import rank_summary

        print("\n# per rank, the kernel profile's busy / GEMM ms per step (SM MHz, W) (train.py --kernel-profile): "
              "the slowest GPU sets the step")
        for mode, ranks in by_rank.items():
            print(f"{mode:<26}" + "  ".join(rank_summary(r) for r in ranks))
    ce_kernels = kernels.get("ce_overlap") or {}
    if ce_kernels.get("compute_wait_ms") is not None:
        exposed = sum(p.get("exposed_comm_us_after", 0.0) for p in pieces["plan"].values()) / 1e3
        print(f"\n# ce_overlap: the compute stream waiting while other streams work (train.py --kernel-profile) vs the "
              f"plan's exposed communication: measured {ce_kernels['compute_wait_ms']:.1f} ms, predicted {exposed:.1f} ms")
    kinds = kernel_kinds(ir, args.profile, args.trace, args.trace_steps) if args.trace else []
    if kinds:
        print(f"\n# the model's kernels against {os.path.basename(args.trace)}'s by kind, per step (rate: the model's bytes "
              f"over the measured time, of the HBM peak; the profile charges fused kernels at its "
              f"efficiency.fused_memory, else memory)")
        print(f"{'kind':<20}{'model ms':>9}{'kernels':>8}{'GB':>7}{'measured ms':>12}{'kernels':>8}{'rate':>6}")
        for r in kinds:
            rate = f"{r['rate']:.2f}" if r["rate"] is not None else "-"
            print(f"{r['kind']:<20}{r['model_ms']:9.2f}{r['model_kernels']:8d}{r['gb']:7.2f}{r['measured_ms']:12.2f}"
                  f"{r['measured_kernels']:8.0f}{rate:>6}")
        from lib.kernel_kinds import fused_rate

        spec = json.loads(read_text(args.profile))
        fused = fused_rate(kinds, spec["gpu"]["hbm_gbps"])
        if fused:
            eff = spec["efficiency"]
            print(f"# the rated kinds together: {fused['gb']:.2f} GB in {fused['measured_ms']:.2f} ms, "
                  f"{fused['rate']:.3f} of the HBM peak: efficiency.fused_memory on this trace (the profile: "
                  f"{eff.get('fused_memory', eff['memory'])})")
    if args.out:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(["python"] + sys.argv), "git": git, "torch": torch.__version__,
                       "machine": platform.machine(), "shape": {"model": args.model, "layers": cfg.n_layers,
                       "seq_len": args.seq_len, "batch": args.batch, "gqa": args.gqa, "world_size": args.world_size,
                       "ce_reduction": args.ce_reduction},
                       "profile": args.profile, "measured_source": source, "capture_s": round(capture_s, 1),
                       "pieces": pieces, "rows": rows, "by_class": by_class, "kinds": kinds}, f, indent=1)
        print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
