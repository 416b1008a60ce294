"""Capture time of a zoo model two ways, in one process: tracing every block, and tracing 3 and 4 blocks then
extrapolating (ce_overlap.extrapolate; what `ce-overlap analyze MODEL` does). Checks that the two IRs hold the
same graphs and blocks, node for node, and prints a table; --out writes JSON. Torch's compile work dominates both.

    python bench/capture_speed.py --model llama3-8b --world-size 8 --out bench/results/capture_speed.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from ce_overlap import models
from ce_overlap.analyzer.model_capture import capture_named


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b", choices=models.names())
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args()

    rows = {}
    docs = {}
    for how, full in (("every block traced", True), ("extrapolated from 3 and 4 blocks", False)):
        t0 = time.perf_counter()
        ir = capture_named(args.model, world_size=args.world_size, full=full)
        rows[how] = time.perf_counter() - t0
        docs[how] = ir.to_dict()
    full_doc, fast_doc = docs.values()
    identical = full_doc["graphs"] == fast_doc["graphs"] and full_doc["blocks"] == fast_doc["blocks"]
    nodes = {g["name"]: len(g["nodes"]) for g in full_doc["graphs"]}
    print(f"{args.model}, world size {args.world_size}, {len(full_doc['blocks'])} blocks, "
          f"nodes {nodes}, torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"{'capture':36s} {'seconds':>8s}")
    for how, s in rows.items():
        print(f"{how:36s} {s:8.1f}")
    print(f"speedup {rows['every block traced'] / rows['extrapolated from 3 and 4 blocks']:.2f}x; "
          f"graphs and blocks identical: {identical}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "world_size": args.world_size, "blocks": len(full_doc["blocks"]),
                       "nodes": nodes, "seconds": rows, "identical": identical, "torch": torch.__version__,
                       "python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
                       "command": "python " + " ".join(sys.argv)}, f, indent=1)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
