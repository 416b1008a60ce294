"""The cost model's kernels (ce_overlap.ir.kernels) against a GPU trace's by kind (ce_overlap.kernel_kinds), for
bench/step_prediction.py --trace: per kind the time, the kernel count, the bytes the model counts and the rate the
measured kernels reached on those bytes as a fraction of the HBM peak. Where the model's memory-bound time goes missing
(a kind far below the profile's efficiency.fused_memory), without reading a trace by hand.
"""
from __future__ import annotations

from ce_overlap.kernel_kinds import COMPUTE_BOUND, model_kind, trace_kind


def table(model_kernels: list[dict], trace_kernels: list[dict], steps: int, hbm_gbps: float) -> list[dict]:
    """Per kind, in order of time: {kind, model_ms, model_kernels, gb, measured_ms, measured_kernels, rate} per step;
    `model_kernels`: ce_overlap.ir.kernels' entries of every graph of one step; `trace_kernels`: the trace's kernel
    events (name, dur in us) over `steps` steps; rate: the model's bytes over the measured time, as a fraction of
    `hbm_gbps` (None for GEMMs and attention, and where either side has none)."""
    rows: dict[str, dict] = {}

    def row(kind):
        return rows.setdefault(kind, {"kind": kind, "model_ms": 0.0, "model_kernels": 0, "gb": 0.0,
                                      "measured_ms": 0.0, "measured_kernels": 0.0})
    for k in model_kernels:
        r = row(model_kind(k))
        r["model_ms"] += k["us"] / 1e3
        r["model_kernels"] += 1
        r["gb"] += k["bytes"] / 1e9
    for e in trace_kernels:
        kind = trace_kind(e["name"])
        if kind is not None:
            r = row(kind)
            r["measured_ms"] += float(e.get("dur", 0.0)) / 1e3 / steps
            r["measured_kernels"] += 1 / steps
    for r in rows.values():
        r["rate"] = (r["gb"] / r["measured_ms"] / hbm_gbps * 1e3
                     if r["kind"] not in COMPUTE_BOUND and r["gb"] and r["measured_ms"] else None)
    return sorted(rows.values(), key=lambda r: -max(r["measured_ms"], r["model_ms"]))


def fused_rate(rows: list[dict], hbm_gbps: float) -> dict | None:
    """Over the kinds `table` gave a rate (the memory-bound kinds the model has bytes for): {gb, measured_ms, rate},
    the model's bytes over their kernels' measured time as a fraction of `hbm_gbps`: what efficiency.fused_memory is
    on this trace (how the built-in profiles' values were fitted). None without such a kind."""
    rated = [r for r in rows if r["rate"] is not None]
    if not rated:
        return None
    gb, ms = sum(r["gb"] for r in rated), sum(r["measured_ms"] for r in rated)
    return {"gb": gb, "measured_ms": ms, "rate": gb / ms / hbm_gbps * 1e3}
