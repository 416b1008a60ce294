"""The graphs capture produces on the CPU and on fake CUDA tensors (issue 31), side by side, no GPU needed: per model
and graph, the nodes, the collectives and their bytes, the FLOPs, the attention kernels, and what the analyzer
predicts from each (compute, exposed communication, step, under one profile). Zoo models by name, user models as
path/to/file.py:build. A model one way cannot compile is reported as such, with the error.

    python bench/capture_devices.py --out bench/results/capture-devices-2026-11-27/capture_devices.json

"kernels" is the analyzer's count of compute kernels (its fusion model over the graph), "step" its makespan.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time

import torch

import ce_overlap
from ce_overlap import models
from ce_overlap.analyzer.model_capture import capture_named

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODELS = ["llama3-8b", "llama3-1b", "llama3-tiny"] + [
    os.path.join(REPO, "tests", "data", f"{name}.py:build") for name in ("gpt2_tied", "vit", "titan_llama")]


def _capture(target: str, device: str, world_size: int):
    if models.is_build_target(target):
        built = models.build_from_file(target)
        return ce_overlap.capture(built.module, built.example_inputs, world_size=world_size, device=device,
                                  name=built.name)
    return capture_named(target, world_size=world_size, device=device)


def summarize(ir, profile: str) -> dict:
    doc, report = ir.to_dict(), ce_overlap.analyze(ir, profile)
    out = {}
    for g, r in zip(doc["graphs"], report["graphs"], strict=True):
        nodes = g["nodes"]
        coll = [n for n in nodes if n["kind"] == "collective"]
        attention = collections.Counter(n["op"].split(".")[-2] if n["op"].startswith("aten.") else n["op"]
                                        for n in nodes if "attention" in n["op"])
        out[g["name"]] = {
            "nodes": len(nodes), "collectives": len(coll),
            "collective_mib": round(sum(n["outputs"][0]["bytes"] for n in coll) / 2**20, 1),
            "gflop": round(sum(n["flops"] for n in nodes) / 1e9, 1),
            "attention": dict(attention),
            "kernels": r["kernels"], "compute_ms": round(r["compute_us"] / 1e3, 2),
            "exposed_ms": round(r["exposed_comm_us"] / 1e3, 2),
            "step_ms": round(r["makespan_us"] / 1e3, 2)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated zoo names or file.py:build")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--profile", default="h100-sxm")
    ap.add_argument("--out")
    args = ap.parse_args()

    results = []
    for target in args.models.split(","):
        row = {"model": os.path.relpath(target, REPO) if models.is_build_target(target) else target}
        for device in ("cpu", "cuda"):
            started = time.perf_counter()
            try:
                ir = _capture(target, device, args.world_size)
            except ce_overlap.CeOverlapError as e:
                row[device] = {"error": str(e)[:300]}
                continue
            row[device] = {"seconds": round(time.perf_counter() - started, 1), **summarize(ir, args.profile)}
        results.append(row)

    print(f"# capture on the CPU vs on fake CUDA tensors, world size {args.world_size}, profile {args.profile}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    head = (f"{'model':<26} {'graph':<9} {'dev':<5} {'nodes':>6} {'coll':>5} {'coll MiB':>9} {'GFLOP':>9} "
            f"{'kernels':>7} {'compute ms':>10} {'exposed ms':>10} {'step ms':>9}  attention")
    print(head)
    for row in results:
        for device in ("cpu", "cuda"):
            r = row[device]
            if "error" in r:
                print(f"{row['model']:<26} {'-':<9} {device:<5} fails: {r['error'][:150]}")
                continue
            for graph in ("forward", "backward"):
                g = r[graph]
                att = ", ".join(f"{k} x{v}" for k, v in g["attention"].items()) or "-"
                print(f"{row['model']:<26} {graph:<9} {device:<5} {g['nodes']:>6} {g['collectives']:>5} "
                      f"{g['collective_mib']:>9.1f} {g['gflop']:>9.1f} {g['kernels']:>7} {g['compute_ms']:>10.2f} "
                      f"{g['exposed_ms']:>10.2f} {g['step_ms']:>9.2f}  {att}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"world_size": args.world_size, "profile": args.profile, "torch": torch.__version__,
                       "python": platform.python_version(), "cpus": os.cpu_count(), "results": results,
                       "command": "python " + " ".join(sys.argv)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
