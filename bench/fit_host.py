"""The built-in profile's host section ("host", docs/profiles.md): the host's time to issue a compiled training step,
fitted to measured steps. Each measured fully_shard row of the given runs (bench/compute_models.py --host-bound
--host-profile: the host's time to issue one step on an idle device, `host.enqueue_ms`; with --world N, every rank on
one GPU, the slowest rank's) is captured on fake tensors at its shape and world size, and its counts per step (kernels,
graph inputs, the collectives its plan issues) are fitted by non-negative least squares:

    host_us = step_us + launch_us x kernels + graph_input_us x inputs + collective_us x collectives

No GPU. Prints every row's counts, measured and fitted host ms and the error, then the section; --out writes the base
profile with it (its `source` names the runs).

    python bench/fit_host.py bench/results/host-time-2026-12-02/world.json ... --base h200-sxm \\
        --out python/ce_overlap/profiles/h200-sxm.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

from ce_overlap.analyzer.step_model import HOST_TERMS as TERMS, host_counts  # the terms and their counts: one owner

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def measured_rows(paths: list[str]) -> list[dict]:
    """The fully_shard rows of compute_models runs with a host profile, or measured --paired (whose host_ms is the
    enqueue): (model, world, host_bound, enqueue ms)."""
    rows = []
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["rows"]:
                if not r.get("ok") or r.get("setup", "fully_shard") != "fully_shard":
                    continue
                if r.get("paired"):
                    rows.append({"model": r["model"], "world": 1, "host_bound": bool(r.get("host_bound")),
                                 "enqueue_ms": r["host_ms"], "source": path})
                elif r.get("host"):
                    enqueue = r["host"]["enqueue_ms"]
                    if r.get("world", 1) > 1:  # the slowest rank's, where every rank's was kept
                        enqueue = max([enqueue] + [x.get("enqueue_ms", 0.0) for x in r.get("ranks", [])])
                    rows.append({"model": r["model"], "world": r.get("world", 1),
                                 "host_bound": bool(r.get("host_bound")), "enqueue_ms": enqueue, "source": path})
    return rows


def nnls(xs: list[dict], ys: list[float]) -> dict:
    """The non-negative least-squares coefficients of TERMS for rows `xs` (counts) and targets `ys`: the best
    unconstrained fit over every subset of the terms whose coefficients all come out non-negative (a term no row
    varies, as collectives at world size 1, stays 0)."""
    import numpy as np

    best, best_err = {t: 0.0 for t in TERMS}, float("inf")
    for k in range(1, len(TERMS) + 1):
        for subset in itertools.combinations(TERMS, k):
            a = np.array([[x[t] for t in subset] for x in xs], dtype=float)
            if np.linalg.matrix_rank(a) < len(subset):
                continue
            coef, *_ = np.linalg.lstsq(a, np.array(ys, dtype=float), rcond=None)
            if (coef < 0).any():
                continue
            err = float(((a @ coef - np.array(ys)) ** 2).sum())
            if err < best_err - 1e-12:
                best, best_err = {t: 0.0 for t in TERMS}, err
                best.update({t: float(c) for t, c in zip(subset, coef)})
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("measured", nargs="+", help="compute_models JSONs measured with --host-profile")
    p.add_argument("--base", default="h200-sxm", help="the profile the section is fitted for (built-in name or file)")
    p.add_argument("--ir-dir", metavar="DIR", help="keep the captures in DIR (compute_models --ir-dir)")
    p.add_argument("--source", default="", help="the section's source text (default: the measured files)")
    p.add_argument("--out", metavar="JSON", help="write the base profile with the fitted host section")
    p.add_argument("--tiny", action="store_true", help="capture each model at compute_models' small config (the tests)")
    args = p.parse_args(argv)

    from compute_models import MODE, predict_one
    from ce_overlap import profiles

    rows = measured_rows(args.measured)
    if not rows:
        p.error("no fully_shard row with a host profile in " + ", ".join(args.measured))
    xs = []
    for r in rows:
        pred = predict_one(r["model"], args.base, args.tiny, args.ir_dir, r["host_bound"], r["world"])
        xs.append(host_counts(pred["pieces"], MODE if r["world"] == 1 else "ce_overlap"))
        r["pred_gpu_ms"] = pred["gpu_ms"]
    fit = nnls(xs, [1e3 * r["enqueue_ms"] for r in rows])
    print(f"{'model':<16} {'world':>5} {'kernels':>7} {'inputs':>6} {'colls':>5} {'host ms':>8} {'fitted':>7} "
          f"{'error':>7} {'gpu ms':>7}")
    for r, x in zip(rows, xs):
        fitted = sum(fit[t] * x[t] for t in TERMS) / 1e3
        print(f"{r['model'] + ('@host' if r['host_bound'] else ''):<16} {r['world']:>5} {x['launch_us']:>7} "
              f"{x['graph_input_us']:>6} {x['collective_us']:>5} {r['enqueue_ms']:8.2f} {fitted:7.2f} "
              f"{100 * (fitted / r['enqueue_ms'] - 1):+6.1f}% {r['pred_gpu_ms']:7.2f}")
    section = {t: round(fit[t], 3) for t in ("launch_us", "graph_input_us", "collective_us", "step_us")}
    section["source"] = args.source or ("bench/fit_host.py over " + ", ".join(args.measured))
    print(json.dumps({"host": section}, indent=1))
    if args.out:  # through the C++ loader first, written atomically (ce-overlap calibrate's writer)
        from ce_overlap.calibrate.fit import write_profile

        write_profile(args.out, {**json.loads(profiles.read_text(args.base)), "host": section})
    return 0


if __name__ == "__main__":
    sys.exit(main())
