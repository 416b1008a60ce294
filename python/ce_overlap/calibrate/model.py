"""What the cost model (the C++ core, ce_overlap._core) predicts from a profile dict: the profile loaded through the
C++ loader, a collective's time, a GEMM's and a training step's GEMM time, and a kernel's slowdown beside a
collective. fit.py fits profiles against these, report.py compares measurements with them. No torch, no GPU."""
from __future__ import annotations

import json

from .common import COMPUTE_KINDS


def core_profile(d: dict):
    """A profile dict through the C++ loader (a _core.Profile; raises naming the field when it is refused)."""
    from .. import _core

    return _core.Profile.from_json(json.dumps(d))


def collective_us(d: dict, coll: str, nbytes: float, n: int, backend: str) -> float:
    """The model's time of `coll` over `nbytes` on `n` ranks and `backend`, under the profile dict `d`."""
    from .. import _core

    return _core.estimate_collective(core_profile(d), coll, int(nbytes), n, backend)


def _window(kind: str) -> dict:
    big = 1e5  # us; the slowdown fractions do not depend on the window's length, only on its class
    return {"window_compute_bound_us": big} if COMPUTE_KINDS[kind] == "compute_bound" else {"window_memory_bound_us": big}


def gemm_model_us(eff: dict, peak_tflops: float, flops: float) -> float:
    """A bf16 GEMM's time under the profile's efficiency and ramp (CostModel::roofline's FLOP side)."""
    return (flops + eff["gemm_ramp_flops"]) / (peak_tflops * 1e6 * eff["gemm"])


def step_gemms_model_us(eff: dict, peak_tflops: float, gemms: list) -> float:
    """The model's time for a training step's [m, n, k, count] GEMMs (step_gemms)."""
    return sum(c * gemm_model_us(eff, peak_tflops, 2.0 * mm * nn * kk) for mm, nn, kk, c in gemms)


def predicted_slowdown(profile, coll: str, nbytes: int, n: int, backend: str, compute: str) -> float | None:
    """The cost model's fractional slowdown of a `compute` kernel (gemm | memory_bound) beside the collective:
    the time-weighted slowdown of `_core.decide` with a window of that kernel class alone. None when the backend
    cannot serve the group. `profile`: a _core.Profile."""
    from .. import _core

    d = _core.decide(profile, coll, int(nbytes), n, **_window(compute))
    entry = d[backend]
    if entry is None:
        return None
    return entry[f"{COMPUTE_KINDS[compute]}_slowdown"]
