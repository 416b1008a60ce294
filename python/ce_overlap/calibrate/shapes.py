"""The profile's compute-by-shape tables ("shapes", csrc/cost_model/shapes.h, docs/profiles.md) from a compute grid
(`ce-overlap calibrate --compute-grid`'s measurements), and the in-step factors that carry the grid's bursts into a
training step, fitted to steps whose kernel time per class was measured. No torch, no GPU."""
from __future__ import annotations

import itertools
import math
import statistics

from ..errors import CeOverlapError
from .common import GRID_ATTENTION_TOKENS

# Memory kind of the profile -> the grid's kernels whose efficiencies it averages (calibrate/kernels.py).
MEMORY_KINDS = {
    "pointwise": ("add", "silu_mul"),
    "reduction": ("rmsnorm", "layernorm", "column_sum"),
    "gelu_tanh": ("gelu_tanh",),
    "gelu_erf": ("gelu_erf",),
    "loss_forward": ("loss_forward",),
    "loss_backward": ("loss_backward",),
}
# The kinds a profile must have (the others fall back to these: shapes.h).
REQUIRED_MEMORY = ("pointwise", "reduction")
# The class rows of bench/step_prediction.py's compare_classes whose measured time fits each factor.
IN_STEP_CLASSES = {"gemm": "GEMMs", "attention": "attention", "memory": "fused / memory-bound kernels"}


def shapes_from_grid(grid: dict, gpu: dict, source: str, in_step: dict | None = None) -> dict:
    """The "shapes" section from `grid` ({gemms, attention, memory}: measure_compute_grid's) on a GPU of `gpu`'s peaks
    (the profile's "gpu": peak_bf16_tflops, hbm_gbps). Efficiencies are the bursts' (median times); `in_step` the
    factors per class ({gemm, attention, memory}; default 1). Raises CeOverlapError on a grid that does not cover
    its axes (a missing m, n, k combination, attention shape or memory size)."""
    peak_flops_per_us = gpu["peak_bf16_tflops"] * 1e6
    hbm_bytes_per_us = gpu["hbm_gbps"] * 1e3
    return {"source": source,
            "gemm": _gemm_table(grid.get("gemms", []), peak_flops_per_us),
            "attention": _attention_tables(grid.get("attention", []), peak_flops_per_us),
            "memory": _memory_table(grid.get("memory", []), hbm_bytes_per_us),
            "in_step": {"gemm": 1.0, "attention": 1.0, "memory": 1.0, **(in_step or {})}}


def _row_major(axes: list[list[int]], cells: dict, missing) -> list:
    """The values of `cells` (keyed by one coordinate per axis) in row-major order over `axes`; a missing one raises
    CeOverlapError(missing(*coordinates))."""
    out = []
    for key in itertools.product(*axes):
        if key not in cells:
            raise CeOverlapError(missing(*key))
        out.append(cells[key])
    return out


def _gemm_table(rows: list[dict], peak: float) -> dict:
    dims = sorted({int(r["m"]) for r in rows})
    if not dims:
        raise CeOverlapError("compute grid: no GEMMs")
    by_shape: dict[tuple, list[float]] = {}
    for r in rows:  # the layouts averaged: the grid's three differ by under 1% at 4096^3
        by_shape.setdefault((int(r["m"]), int(r["n"]), int(r["k"])), []).append(
            2.0 * r["m"] * r["n"] * r["k"] / (r["us"] * peak))
    cells = {shape: statistics.mean(effs) for shape, effs in by_shape.items()}
    eff = _row_major([dims] * 3, cells, lambda m, n, k: f"compute grid: no GEMM of m={m}, n={n}, k={k} (the table "
                                                        f"needs every combination of {dims})")
    return {"dims": dims, "efficiency": [_fraction(e) for e in eff]}


def _attention_tables(rows: list[dict], peak: float) -> dict:
    out: dict = {"tokens": GRID_ATTENTION_TOKENS}
    for causal, key in ((True, "causal"), (False, "non_causal")):
        cells = {}  # (seq, heads at GRID_ATTENTION_TOKENS tokens, head_dim) -> (forward, backward) efficiency
        for r in rows:
            if bool(r.get("causal", True)) != causal:
                continue
            flops = 4.0 * r["batch"] * r["heads"] * r["seq"] ** 2 * r["head_dim"] * (0.5 if causal else 1.0)
            h = int(r["batch"]) * int(r["heads"]) * int(r["seq"]) // GRID_ATTENTION_TOKENS
            cells[(int(r["seq"]), h, int(r["head_dim"]))] = (flops / (r["forward_us"] * peak),
                                                            2.5 * flops / (r["backward_us"] * peak))
        if not cells:
            continue
        axes = [sorted({c[i] for c in cells}) for i in range(3)]
        effs = _row_major(axes, cells, lambda s, h, d: f"compute grid: no {key} attention at seq {s}, {h} heads at "
                                                       f"{GRID_ATTENTION_TOKENS} tokens, head dim {d}")
        out[key] = {"seqs": axes[0], "heads": axes[1], "head_dims": axes[2],
                    "forward": [_fraction(f) for f, _ in effs], "backward": [_fraction(b) for _, b in effs]}
    if len(out) == 1:
        raise CeOverlapError("compute grid: no attention shapes")
    return out


def _memory_table(rows: list[dict], hbm: float) -> dict:
    # Per kernel and operand size (MiB): its efficiency and its traffic. One bytes axis for every kind: a size's
    # traffic differs by kernel (an add moves 3 operands, a norm 2, a column sum 1), so each kernel's efficiency is read
    # at the common axis's traffic (the pointwise kernels'), linear in log bytes between its own points.
    by_name: dict[str, dict[int, float]] = {}
    traffic: dict[str, dict[int, float]] = {}
    for r in rows:
        by_name.setdefault(r["name"], {})[int(r["mib"])] = r["bytes"] / (r["us"] * hbm)
        traffic.setdefault(r["name"], {})[int(r["mib"])] = float(r["bytes"])
    base = [n for n in MEMORY_KINDS["pointwise"] if n in by_name]
    if not base:
        raise CeOverlapError("compute grid: no pointwise memory-bound kernels (add, silu_mul)")
    sizes = sorted(by_name[base[0]])
    axis = [traffic[base[0]][s] for s in sizes]
    out: dict = {"bytes": axis}
    for kind, names in MEMORY_KINDS.items():
        present = [n for n in names if n in by_name]
        if not present:
            if kind in REQUIRED_MEMORY:
                raise CeOverlapError(f"compute grid: no {kind} kernels ({', '.join(names)})")
            continue
        out[kind] = [_fraction(statistics.mean(_at_bytes(by_name[n], traffic[n], b) for n in present)) for b in axis]
    return out


def _at_bytes(eff_by_size: dict[int, float], traffic_by_size: dict[int, float], nbytes: float) -> float:
    """A kernel's efficiency at `nbytes` of traffic, linear in log bytes between its measured sizes (clamped)."""
    pts = sorted((traffic_by_size[s], eff_by_size[s]) for s in eff_by_size)
    if nbytes <= pts[0][0]:
        return pts[0][1]
    for (b0, e0), (b1, e1) in zip(pts, pts[1:]):
        if nbytes <= b1:
            f = math.log(nbytes / b0) / math.log(b1 / b0)
            return e0 + f * (e1 - e0)
    return pts[-1][1]


def _fraction(x: float) -> float:
    """An efficiency rounded for the profile, within (0, 1] (a burst a hair over the peak is the peak)."""
    return min(1.0, max(1e-4, round(x, 4)))


def in_step_factors(class_rows: list[list[dict]]) -> dict:
    """The in-step factor per class ({gemm, attention, memory}): over training steps whose kernel time per class was
    measured, the median over the steps of the predicted time at factor 1 over the measured (a median: one profiled
    step whose clocks sagged must not move the factor). `class_rows`: per step, bench/step_prediction.py
    compare_classes' rows, predicted with a profile whose in_step factors are 1."""
    out = {}
    for key, label in IN_STEP_CLASSES.items():
        ratios = [r["predicted_ms"] / r["measured_ms"] for rows in class_rows for r in rows
                  if r["class"] == label and r.get("measured_ms") and r.get("predicted_ms")]
        if not ratios:
            raise CeOverlapError(f"in-step factors: no measured {label} time in the steps given")
        out[key] = round(statistics.median(ratios), 3)
    return out
