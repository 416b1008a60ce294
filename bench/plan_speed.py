"""How fast the C++ core loads, analyzes and plans a captured program (the budget is < 1 s for a 32-layer
model): load + validate the IR, the analysis report, and the Plan (docs/plan.md) of each graph. Prints a
table; --out writes JSON. Capture time is reported apart: it is torch's.

    python bench/plan_speed.py --model llama3-8b --world-size 8 --out bench/results/plan_speed.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import ce_overlap
from ce_overlap import _core, models, profiles


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--profile", default=profiles.DEFAULT)
    ap.add_argument("--ir", help="analyze this IR JSON instead of capturing")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out")
    args = ap.parse_args()

    capture_s = None
    if args.ir:
        with open(args.ir, encoding="utf-8") as f:
            text = f.read()
    else:
        built = models.build_named(args.model)
        t0 = time.perf_counter()
        ir = ce_overlap.capture(built.module, built.example_inputs, world_size=args.world_size, name=args.model)
        capture_s = time.perf_counter() - t0
        text = ir.to_json()
    profile = profiles.load(args.profile)

    runs = [_core.time_load_and_analyze(text, profile) for _ in range(args.repeats)]
    doc = _core.IrDocument.from_json(text)
    plans = {}
    for graph in doc.graph_names:
        walls, cpp = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            plan = json.loads(_core.plan(doc, graph, profile, None))
            walls.append(time.perf_counter() - t0)
            cpp.append(plan["summary"]["plan_ms"] / 1e3)
        s = plan["summary"]
        plans[graph] = {"nodes": doc.num_nodes(graph), "collectives": s["collectives"], "buckets": s["buckets"],
                        "ce_buckets": s["ce_buckets"], "plan_ms_median": statistics.median(cpp) * 1e3,
                        "plan_ms_max": max(cpp) * 1e3, "call_ms_median": statistics.median(walls) * 1e3,
                        "exposed_comm_us_before": s["exposed_comm_us_before"],
                        "exposed_comm_us_after": s["exposed_comm_us_after"]}
    load = statistics.median(r["load_s"] for r in runs)
    analyze = statistics.median(r["analyze_s"] for r in runs)
    total = statistics.median(r["load_s"] + r["analyze_s"] for r in runs)
    print(f"{'what':<34}{'median ms':>10}{'max ms':>10}")
    print(f"{'load + validate IR (C++)':<34}{load * 1e3:>10.1f}{max(r['load_s'] for r in runs) * 1e3:>10.1f}")
    print(f"{'analyze (blocks, memory, timeline)':<34}{analyze * 1e3:>10.1f}{max(r['analyze_s'] for r in runs) * 1e3:>10.1f}")
    for graph, p in plans.items():
        print(f"{'plan ' + graph + ' (C++)':<34}{p['plan_ms_median']:>10.1f}{p['plan_ms_max']:>10.1f}")
        print(f"{'  _core.plan call (+ JSON)':<34}{p['call_ms_median']:>10.1f}")
    plan_total = sum(p["plan_ms_median"] for p in plans.values())
    print(f"{'total (load + analyze + plans)':<34}{total * 1e3 + plan_total:>10.1f}")
    print(f"nodes: {runs[0]['nodes']}, IR JSON {len(text) / 2**20:.1f} MiB, repeats {args.repeats}"
          + (f", capture (torch.compile on fake tensors) {capture_s:.1f} s" if capture_s else ""))

    if args.out:
        import torch
        result = {
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "python": platform.python_version(), "torch": torch.__version__},
            "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "model": args.model if not args.ir else args.ir, "world_size": args.world_size,
            "nodes": runs[0]["nodes"], "ir_bytes": len(text),
            "load_ms_median": load * 1e3, "analyze_ms_median": analyze * 1e3, "total_ms_median": total * 1e3,
            "total_ms_max": max(r["load_s"] + r["analyze_s"] for r in runs) * 1e3,
            "profile": profile.name, "plan": plans, "plan_ms_median_all_graphs": plan_total,
            "total_with_plans_ms_median": total * 1e3 + plan_total,
            "capture_s": capture_s,
        }
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
