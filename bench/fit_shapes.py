"""The built-in profile's compute-by-shape section ("shapes", docs/profiles.md) from a compute grid, with its in-step
factors fitted to recorded training steps: every bench/results train.json whose no-comm mode (compute only, no
collective beside it) was profiled by kernel class on the profile's GPU. Each such step is captured on fake tensors at
its shape (bench/train.py's capture), predicted with the grid at factor 1, and per class (GEMMs, attention, fused /
memory-bound kernels) the factor is the median over the steps of the predicted time over the measured. No GPU.

    python bench/fit_shapes.py --grid bench/results/compute-models-2026-12-01/compute_grid.json \\
        --base h200-sxm --out python/ce_overlap/profiles/h200-sxm.json

Prints the steps used, their class times and the factors; --out writes the base profile with the section (its
description is the caller's to update).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def recorded_steps(results: str, gpu: str, mode: str = "no-comm") -> list[tuple[str, dict, dict]]:
    """(path, run, kernels) of every train.json under `results` whose `mode` ran on a `gpu` (a substring of the
    device name) with a kernel profile; `run` is the whole JSON."""
    out = []
    for path in sorted(glob.glob(os.path.join(results, "**", "train.json"), recursive=True)):
        with open(path) as f:
            run = json.load(f)
        if gpu not in run.get("info", {}).get("gpu", ""):
            continue
        for r in run.get("results", []):
            kernels = r.get("kernels") or {}
            if r.get("mode") == mode and r.get("ok", True) and kernels.get("by_class_ms"):
                out.append((path, run, kernels))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--grid", required=True, help="a compute grid JSON (calibrate --compute-grid's measurements)")
    p.add_argument("--base", default="h200-sxm", help="the profile the section is added to (a built-in name or file)")
    p.add_argument("--gpu", default="H200", help="the recorded steps' device (a substring of its name)")
    p.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--source", default=None, help="the section's source text (default: the grid's path and command)")
    p.add_argument("--out", help="write the base profile with the fitted section here")
    args = p.parse_args(argv)

    import train
    from lib.predict import recorded_step_args
    from ce_overlap import profiles
    from ce_overlap.calibrate.shapes import in_step_factors, shapes_from_grid
    from ce_overlap.analyzer.step_model import step_model
    from step_prediction import compare_classes

    with open(args.grid) as f:
        grid = json.load(f)
    base = json.loads(profiles.read_text(args.base))
    source = args.source or f"{args.grid}: {grid.get('meta', {}).get('command', 'ce-overlap calibrate --compute-grid')}"
    base["shapes"] = shapes_from_grid(grid, base["gpu"], source)
    steps = recorded_steps(args.results, args.gpu)
    if not steps:
        p.error(f"no recorded no-comm step with a kernel profile on {args.gpu} under {args.results}")
    captures: dict = {}
    class_rows = []
    with tempfile.TemporaryDirectory() as tmp:
        unit = os.path.join(tmp, "factor-1.json")
        with open(unit, "w") as f:
            json.dump(base, f)
        for path, run, kernels in steps:
            world = int(run["info"]["world_size"])
            sa = recorded_step_args(run["args"])
            key = (world, sa.layers, sa.vocab_parallel_embeddings, sa.in_graph_wrap, sa.seq_len, sa.gqa)
            if key not in captures:
                captures[key] = train.capture_step(sa, world)
            rows = compare_classes(step_model(captures[key], unit, world), kernels)
            class_rows.append(rows)
            cells = "  ".join(f"{r['class'].split(' ')[0]} {r['predicted_ms']:.1f}/{r['measured_ms'] or 0:.1f}"
                              for r in rows[:3])
            print(f"{os.path.relpath(path, args.results)} (world {world}, {sa.layers} layers): {cells}", flush=True)
    factors = in_step_factors(class_rows)
    base["shapes"]["in_step"] = factors
    print(f"in-step factors over {len(class_rows)} steps (median of predicted at factor 1 / measured): {factors}")
    if args.out:
        from ce_overlap.calibrate.model import core_profile

        core_profile(base)  # the C++ loader must take it
        with open(args.out, "w") as f:
            json.dump(base, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
