"""`build_profile`: a measurements dict and a base profile in, the calibrated profile (schema ce_overlap.profile/2)
out, one named step per profile section, in the order they build on each other (the compute efficiencies first,
then the analytic collective model, its curves, and the contention fitted against all of it); and `write_profile`.
Plain dicts in, no torch, no GPU: a measurements file turns into a profile anywhere (docs/cost_model.md,
"Calibrating")."""
from __future__ import annotations

import copy
import json
import math
import os
import statistics
from typing import Callable

from ..errors import CeOverlapError
from .check import check_measurements
from .common import COMPUTE_KINDS, attention_executed_flops, format_bytes
from .model import collective_us, core_profile, predicted_slowdown, step_gemms_model_us
from .shapes import shapes_from_grid



def solve(f: Callable[[float], float], target: float, lo: float, hi: float, log: bool = True,
           iters: int = 60) -> tuple[float, bool]:
    """x in [lo, hi] with f(x) = target for a monotone f (either direction), by bisection (in log space when
    `log`). Returns (x, matched); when the target lies outside f's range the nearer bound comes back, False."""
    flo, fhi = f(lo), f(hi)
    if not (min(flo, fhi) <= target <= max(flo, fhi)):
        return (lo if abs(flo - target) <= abs(fhi - target) else hi), False
    increasing = fhi >= flo
    a, b = lo, hi
    for _ in range(iters):
        mid = math.sqrt(a * b) if log else (a + b) / 2
        if (f(mid) < target) == increasing:
            a = mid
        else:
            b = mid
    return (math.sqrt(a * b) if log else (a + b) / 2), True


def nnls2(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """min sum (a x + b y - t)^2 over x, y >= 0 for rows (a, b, t)."""
    def sse(x, y):
        return sum((a * x + b * y - t) ** 2 for a, b, t in rows)

    cands = [(0.0, 0.0)]
    saa = sum(a * a for a, _, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    sab = sum(a * b for a, b, _ in rows)
    sat = sum(a * t for a, _, t in rows)
    sbt = sum(b * t for _, b, t in rows)
    if saa > 0:
        cands.append((max(0.0, sat / saa), 0.0))
    if sbb > 0:
        cands.append((0.0, max(0.0, sbt / sbb)))
    det = saa * sbb - sab * sab
    if abs(det) > 1e-12 * max(1.0, saa * sbb):
        x, y = (sat * sbb - sbt * sab) / det, (sbt * saa - sat * sab) / det
        if x >= 0 and y >= 0:
            cands.append((x, y))
    return min(cands, key=lambda c: sse(*c))


def _link01_gbps(topology: dict) -> float:
    """GB/s per direction between GPUs 0 and 1 of a profile's topology object."""
    if "matrix" in topology:
        return float(topology["matrix"]["gbps_per_direction"][0][1])
    for pair in topology.get("pairs", []):
        if sorted(pair["gpus"]) == [0, 1]:
            return float(pair["gbps_per_direction"])
    return float(topology["intra_node"]["gbps_per_direction"])



def _hbm_fraction(label: str, kernel: dict, hbm_gbps: float) -> float:
    """A memory-bound measurement ({bytes, us}) as a fraction of the base profile's HBM bandwidth; above 1 is refused."""
    gbps = kernel["bytes"] / kernel["us"] / 1e3
    if gbps > hbm_gbps:
        raise CeOverlapError(f"measurements: {label}: {gbps:.0f} GB/s, above the base profile's HBM {hbm_gbps:g} GB/s: "
                             f"wrong base profile (--base) or a broken measurement")
    return gbps / hbm_gbps


def build_profile(base: dict, measurements: dict, *, name: str | None = None,
                  keep_topology: bool = False) -> tuple[dict, list[str]]:
    """The calibrated profile (a dict in schema ce_overlap.profile/2) and notes on what was measured, fitted and
    kept. `base`: the built-in profile dict it starts from. Raises CeOverlapError on inconsistent measurements."""
    m, notes = check_measurements(measurements)
    p = copy.deepcopy(base)
    fitted: list[str] = []
    kept: list[str] = []
    world = int(m["world_size"])
    _fit_gpu(p, m, base, name, fitted)
    _fit_reduction_kernel(p, m, fitted)
    _check_sms(p, m)
    _fit_topology(p, m, base, world, keep_topology, fitted, kept)
    _fit_gemm(p, m, fitted, kept)
    _fit_memory(p, m, fitted, kept)
    _fit_attention(p, m, fitted, kept)
    _fit_training_step(p, m, fitted)
    _fit_optimizer(p, m, fitted, kept)
    _fit_kernel_gap(p, m, fitted, kept)
    _fit_shapes(p, m, base, fitted, kept)

    curves = {(c["collective"], c["backend"], c["group_size"]): c["points"] for c in m.get("collectives", [])}
    analytic = copy.deepcopy(p)  # fits of the analytic model run without curves (they would mask it)
    analytic.pop("curves", None)
    analytic = _fit_nccl_all_gather(analytic, curves, world, fitted, kept)
    analytic = _fit_nccl_reduce_scatter(analytic, curves, world, fitted, kept)
    analytic = _fit_ce_all_gather(analytic, curves, world, fitted, kept)
    analytic = _fit_ce_reduce_scatter(analytic, curves, m, world, fitted, kept)
    _fit_peer_copy(analytic, m, fitted, kept)
    p = analytic

    _add_curves(p, curves, fitted)
    _fit_collective_slowdowns(p, m, fitted, kept)
    p["contention"].pop("ce_copies", None)  # the sensitivities first, then what they leave of the CE copies
    _fit_sensitivities(p, m, fitted, kept, notes)
    _fit_ce_copies(p, m, fitted, kept)
    p["description"] = _description(base, m, world, fitted, kept, notes)
    core_profile(p)  # the C++ loader must accept it (raises naming the field otherwise)
    return p, fitted + [f"kept from {base['name']}: {k}" for k in kept] + notes


def _fit_gpu(p: dict, m: dict, base: dict, name: str | None, fitted: list[str]) -> None:
    """The profile's name and the GPU as measured; ce.reduce_sms as the run set it."""
    gpu = m["gpu"]
    p["name"] = name or f"{base['name']}-calibrated"
    p["gpu"]["name"] = gpu["name"]
    p["gpu"]["sms"] = int(gpu["sms"])
    p["gpu"]["memory_gib"] = round(float(gpu["memory_gib"]), 1)
    if gpu.get("copy_engines"):
        p["gpu"]["copy_engines"] = int(gpu["copy_engines"])
    if m.get("ce_reduce_sms"):  # the runtime's reduction kernel ran on this many CTAs (CE_OVERLAP_REDUCE_SMS)
        p["ce"]["reduce_sms"] = int(m["ce_reduce_sms"])
        fitted.append(f"ce.reduce_sms {int(m['ce_reduce_sms'])} (CE_OVERLAP_REDUCE_SMS of the run)")


def _fit_reduction_kernel(p: dict, m: dict, fitted: list[str]) -> None:
    """ce.reduce_sms, ce.reduce_gbps_per_sm and contention.ce_reduction from the reduction kernel measured
    directly."""
    rk = m.get("reduction_kernel")
    if rk:  # the CE reduction kernel alone and beside each kernel class (one GPU is enough)
        ctas = int(rk["ctas"])
        per_cta = rk["bytes"] / rk["us"] / 1e3 / ctas
        slow = {COMPUTE_KINDS[k]: max(0.0, rk[k]["beside_us"] / rk[k]["alone_us"] - 1) for k in COMPUTE_KINDS}
        p["ce"]["reduce_sms"] = ctas
        p["ce"]["reduce_gbps_per_sm"] = round(per_cta, 2)
        p["contention"]["ce_reduction"] = {k: round(v, 4) for k, v in slow.items()}
        fitted.append(f"ce.reduce_sms {ctas}, ce.reduce_gbps_per_sm {per_cta:.1f} (the reduction kernel alone: "
                      f"{rk['bytes'] / rk['us'] / 1e3:.0f} GB/s), contention.ce_reduction compute_bound "
                      f"{slow['compute_bound']:.3f} memory_bound {slow['memory_bound']:.3f} (GEMM and memory-bound "
                      f"kernel beside it)")


def _check_sms(p: dict, m: dict) -> None:
    """NCCL's channels and the CE reduction's CTAs must leave SMs for compute."""
    gpu = m["gpu"]
    if p["nccl"]["channels"] >= p["gpu"]["sms"] or p["ce"]["reduce_sms"] >= p["gpu"]["sms"]:
        raise CeOverlapError(f"measurements: gpu.sms: {gpu['sms']} SMs, but the profile uses {p['nccl']['channels']} "
                             f"for NCCL and {p['ce']['reduce_sms']} for the CE reduction: wrong base profile (--base) "
                             f"or CE_OVERLAP_REDUCE_SMS")


def _fit_topology(p: dict, m: dict, base: dict, world: int, keep_topology: bool, fitted: list[str],
                  kept: list[str]) -> None:
    """The detected topology (this machine), keeping the base's inter-node link for bigger simulations."""
    topo = m.get("topology")
    if topo and topo.get("gpus_per_node") == 1 and base["topology"].get("gpus_per_node", 1) > 1:
        # One visible GPU says nothing about links; its topology would turn every group of the profile into one that
        # spans nodes (and rule out CE).
        kept.append(f"topology (one GPU visible; the base's {base['topology']['gpus_per_node']} GPUs per node kept)")
    elif topo and not keep_topology:
        topo = copy.deepcopy(topo)
        if "inter_node" in base["topology"] and "inter_node" not in topo:
            topo["inter_node"] = base["topology"]["inter_node"]
            if "rails" in base["topology"]:  # NICs per node: at most one per GPU of the detected node
                topo["rails"] = min(base["topology"]["rails"], topo.get("gpus_per_node", 1))
        if topo.get("gpus_per_node", 0) < world:
            raise CeOverlapError(f"measurements: topology.gpus_per_node: {topo.get('gpus_per_node')} GPUs, but "
                                 f"{world} ranks ran on this node")
        p["topology"] = topo
        fitted.append(f"topology detected ({topo['gpus_per_node']} GPUs, `ce-overlap topo`)")
    else:
        kept.append("topology")


def _fit_gemm(p: dict, m: dict, fitted: list[str], kept: list[str]) -> None:
    """efficiency.gemm and gemm_ramp_flops from the square bf16 GEMMs."""
    peak = float(p["gpu"]["peak_bf16_tflops"])
    # GEMM efficiency and ramp: t_us = (F + ramp) / (peak x 1e6 x gemm), a line in F.
    gemms = sorted(m.get("gemm", []), key=lambda g: g["n"])
    for g in gemms:
        tflops = 2 * g["n"] ** 3 / g["us"] / 1e6
        if tflops > peak:
            raise CeOverlapError(f"measurements: gemm n={int(g['n'])}: {tflops:.0f} TFLOP/s, above the base profile's "
                                 f"bf16 peak of {peak:g}: wrong base profile (--base) or a broken measurement")
    if len(gemms) >= 2:
        xs = [2.0 * g["n"] ** 3 for g in gemms]
        ys = [g["us"] for g in gemms]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        icpt = my - slope * mx
        if slope <= 0:
            raise CeOverlapError("measurements: gemm: larger GEMMs did not take longer; measure again")
        eff, ramp = 1.0 / (peak * 1e6 * slope), max(0.0, icpt / slope)
        if icpt < 0:  # no ramp: the largest GEMM alone sets the efficiency
            eff = xs[-1] / (peak * 1e6 * ys[-1])
        if eff > 1.0:
            eff, ramp = 1.0, max(0.0, peak * 1e6 * ys[-1] - xs[-1])
        p["efficiency"]["gemm"], p["efficiency"]["gemm_ramp_flops"] = round(eff, 4), float(f"{ramp:.3g}")
        fitted.append(f"efficiency.gemm {eff:.3f} and gemm_ramp_flops {ramp:.3g} from bf16 GEMMs "
                      + ", ".join(f"{int(g['n'])}^3 {2 * g['n'] ** 3 / g['us'] / 1e6:.0f} TFLOP/s" for g in gemms))
    elif gemms:
        g = gemms[0]
        eff = (2 * g["n"] ** 3 + p["efficiency"]["gemm_ramp_flops"]) / (peak * 1e6 * g["us"])
        p["efficiency"]["gemm"] = round(min(1.0, eff), 4)
        fitted.append(f"efficiency.gemm {min(1.0, eff):.3f} from one bf16 GEMM ({int(g['n'])}^3)")
    else:
        kept.append("efficiency.gemm")


def _fit_memory(p: dict, m: dict, fitted: list[str], kept: list[str]) -> None:
    """efficiency.memory from the activation-sized memory-bound kernels, else the 1 GiB add."""
    mb = m.get("memory_bound")
    hbm = float(p["gpu"]["hbm_gbps"])
    kernels = m.get("memory_kernels") or []
    for k in ([mb] if mb else []) + kernels:
        _hbm_fraction(k.get("name", "memory_bound"), k, hbm)
    if kernels:  # activation-sized kernels as a step runs them: their median
        effs = sorted(_hbm_fraction(k["name"], k, hbm) for k in kernels)
        p["efficiency"]["memory"] = round(statistics.median(effs), 4)
        fitted.append(f"efficiency.memory {statistics.median(effs):.3f}, the median of {len(kernels)} activation-sized "
                      f"memory-bound kernels ({effs[0]:.3f}..{effs[-1]:.3f})")
    elif mb:
        gbps = mb["bytes"] / mb["us"] / 1e3
        p["efficiency"]["memory"] = round(gbps / hbm, 4)
        fitted.append(f"efficiency.memory {gbps / hbm:.3f} ({gbps:.0f} GB/s, memory-bound add)")
    else:
        kept.append("efficiency.memory")
    # Measured from training steps' traces. calibrate's own step does not give it: its model bytes came out 1.25x what
    # the HBM peak moves in the kernels' measured time on one H200 (bench/results/compute-2026-11-28).
    if "fused_memory" in p["efficiency"]:
        kept.append("efficiency.fused_memory")


def _fit_attention(p: dict, m: dict, fitted: list[str], kept: list[str]) -> None:
    """efficiency.attention and attention_backward on the FLOPs causal attention executes."""
    peak = float(p["gpu"]["peak_bf16_tflops"])
    att = m.get("attention")
    if att:
        fwd_f, bwd_f = attention_executed_flops(int(att["batch"]), int(att["heads"]), int(att["seq"]),
                                                int(att["head_dim"]), att["causal"])
        for key, flops, us in (("attention", fwd_f, att["forward_us"]), ("attention_backward", bwd_f,
                                                                         att["backward_us"])):
            eff = flops / (peak * 1e6 * us)
            if eff > 1.0:
                raise CeOverlapError(f"measurements: attention.{'forward' if key == 'attention' else 'backward'}_us: "
                                     f"{flops / us / 1e6:.0f} TFLOP/s executed, above the base profile's bf16 peak of "
                                     f"{peak:g}: wrong base profile (--base) or a broken measurement")
            p["efficiency"][key] = round(eff, 4)
        fitted.append(f"efficiency.attention {p['efficiency']['attention']:.3f} / attention_backward "
                      f"{p['efficiency']['attention_backward']:.3f} from {'causal ' if att['causal'] else ''}attention "
                      f"{int(att['batch'])}x{int(att['heads'])}x{int(att['seq'])}x{int(att['head_dim'])} "
                      f"({fwd_f / att['forward_us'] / 1e6:.0f} / {bwd_f / att['backward_us'] / 1e6:.0f} TFLOP/s "
                      f"executed)")
    else:
        kept.append("efficiency.attention")
    if "flex_attention" in p["efficiency"] or "flex_attention_backward" in p["efficiency"]:
        kept.append("efficiency.flex_attention (calibrate does not run flex attention)")


def _fit_training_step(p: dict, m: dict, fitted: list[str]) -> None:
    """The burst-fitted GEMM and attention efficiencies scaled to what a compiled training step's kernels
    took at steady clocks."""
    peak = float(p["gpu"]["peak_bf16_tflops"])
    ts = m.get("training_step")
    if ts:  # GEMMs and attention inside a compiled step at steady clocks: scale the burst-fitted efficiencies to them
        eff = p["efficiency"]
        gemm_model_us = step_gemms_model_us(eff, peak, ts["gemms"])
        a = ts["attention"]
        fwd_f, bwd_f = attention_executed_flops(int(a["batch"]), int(a["heads"]), int(a["seq"]), int(a["head_dim"]),
                                                a["causal"])
        att_eff = {k: eff.get(k) or eff["gemm"] for k in ("attention", "attention_backward")}  # as the model reads them
        att_model_us = a["layers"] * (fwd_f / (peak * 1e6 * att_eff["attention"])
                                      + bwd_f / (peak * 1e6 * att_eff["attention_backward"]))
        for field, what, modeled in (("gemm_us", "GEMM", gemm_model_us), ("attention_us", "attention", att_model_us)):
            measured = ts[field]
            if not 0.5 <= measured / modeled <= 2.0:
                raise CeOverlapError(f"measurements: training_step.{field}: "
                                     f"{measured:.0f} us of {what} kernels per step, but the bursts predict "
                                     f"{modeled:.0f} us for its work: inconsistent (another kernel mix?); measure again")
        g_scale, a_scale = ts["gemm_us"] / gemm_model_us, ts["attention_us"] / att_model_us
        eff["gemm"] = round(min(1.0, eff["gemm"] / g_scale), 4)
        for key, e in att_eff.items():
            eff[key] = round(min(1.0, e / a_scale), 4)
        fitted.append(f"efficiency.gemm {eff['gemm']:.3f}, attention {eff['attention']:.3f} / attention_backward "
                      f"{eff['attention_backward']:.3f} inside a compiled training step (its GEMM kernels took "
                      f"{(g_scale - 1) * 100:+.1f}% and its attention {(a_scale - 1) * 100:+.1f}% against the bursts' "
                      f"fit: steady clocks"
                      + (f", SM {ts['clock']['sm_mhz']:.0f} MHz at {ts['clock']['power_w']:.0f} W" if ts.get("clock")
                         else "") + ")")


def _fit_optimizer(p: dict, m: dict, fitted: list[str], kept: list[str]) -> None:
    """efficiency.optimizer from the training step's fused AdamW where measured, else the burst's."""
    hbm = float(p["gpu"]["hbm_gbps"])
    ts = m.get("training_step")
    opt = (ts or {}).get("optimizer") or m.get("optimizer")
    if opt:  # the step's own AdamW (all of a model's parameter shapes, steady clocks) where measured, else the burst
        eff = _hbm_fraction("optimizer", opt, hbm)
        p["efficiency"]["optimizer"] = round(eff, 4)
        fitted.append(f"efficiency.optimizer {eff:.3f} (fused AdamW, {eff * hbm:.0f} GB/s"
                      + (", inside the training step)" if opt is not m.get("optimizer") else ")"))
    else:
        kept.append("efficiency.optimizer")


def _fit_kernel_gap(p: dict, m: dict, fitted: list[str], kept: list[str]) -> None:
    """efficiency.kernel_gap_us: the GPU's idle time per kernel of compiled training steps."""
    kg = m.get("kernel_gap")
    if kg:
        gap = kg["idle_us"] / kg["kernels"]
        p["efficiency"]["kernel_gap_us"] = round(gap, 2)
        fitted.append(f"efficiency.kernel_gap_us {gap:.2f} (the GPU idle {kg['idle_us'] / 1e3:.2f} ms per step between "
                      f"{kg['kernels']:.0f} kernels and copies of compiled training steps)")
    else:
        kept.append("efficiency.kernel_gap_us")


def _fit_shapes(p: dict, m: dict, base: dict, fitted: list[str], kept: list[str]) -> None:
    """shapes: compute priced by shape from the compute grid (--compute-grid), its efficiencies this GPU's bursts; the
    in-step factors are the base's (they are fitted to training steps profiled by kernel class: bench/fit_shapes.py),
    1 where the base has none."""
    grid = m.get("compute_grid")
    if not grid:
        if "shapes" in p:
            kept.append("shapes (no --compute-grid in this run)")
        return
    in_step = (base.get("shapes") or {}).get("in_step")
    p["shapes"] = shapes_from_grid(grid, p["gpu"], f"ce-overlap calibrate --compute-grid on {m['gpu']['name']}",
                                   in_step)
    sh = p["shapes"]
    fitted.append(f"shapes from the compute grid ({len(sh['gemm']['dims'])}^3 GEMMs, "
                  f"{sum(len(t['forward']) for k, t in sh['attention'].items() if k != 'tokens')} attention shapes, "
                  f"{len(sh['memory']) - 1} memory kinds at {len(sh['memory']['bytes'])} sizes)")
    kept.append(f"shapes.in_step {sh['in_step']}" if in_step else
                "shapes.in_step 1 (the base has none: fit them with bench/fit_shapes.py)")


def _fit_nccl_all_gather(analytic: dict, curves: dict, world: int, fitted: list[str], kept: list[str]) -> dict:
    """NCCL: every protocol line's bus efficiency scaled to the measured all-gather slope, every line's base
    latency shifted to the smallest measured all-gather. Returns the fitted analytic profile."""
    ag = curves.get(("all_gather", "nccl", world))
    if ag and len(ag) >= 2 and ag[-1][1] > ag[-2][1]:
        (b1, t1), (b2, t2) = ag[-2], ag[-1]
        eff0 = [pr["bus_efficiency"] for pr in analytic["nccl"]["protocols"]]
        base0 = [pr["base_latency_us"] for pr in analytic["nccl"]["protocols"]]

        def with_scale(s, shift=0.0):
            d = copy.deepcopy(analytic)
            for pr, e, b in zip(d["nccl"]["protocols"], eff0, base0):
                pr["bus_efficiency"] = round(min(1.0, e * s), 5)
                pr["base_latency_us"] = round(max(0.0, b + shift), 3)
            return d

        s, ok = solve(lambda s: collective_us(with_scale(s), "all_gather", b2, world, "nccl")
                      - collective_us(with_scale(s), "all_gather", b1, world, "nccl"), t2 - t1, 0.05, 1.0 / max(eff0))
        b0, t0 = ag[0]
        shift, ok2 = solve(lambda x: collective_us(with_scale(s, x), "all_gather", b0, world, "nccl"), t0,
                           -max(base0), 2000.0, log=False)
        analytic = with_scale(s, shift)
        fitted.append(f"nccl bus efficiencies x{s:.3f} (all-gather slope {format_bytes(b1)}..{format_bytes(b2)}"
                      f"{'' if ok else ', clamped'}) and base latencies {shift:+.1f} us ({format_bytes(b0)} point"
                      f"{'' if ok2 else ', clamped'})")
    else:
        kept.append("nccl protocol lines")
    return analytic


def _slope_fit(analytic: dict, points: list, coll: str, backend: str, world: int, set_field, lo: float,
               hi: float) -> tuple[float, bool]:
    """The value of one profile field (set_field(profile copy, value)) at which the model's time difference between
    the two largest points equals the measured one; (value, whether it fell inside [lo, hi])."""
    (b1, t1), (b2, t2) = points[-2], points[-1]

    def model_slope(v):
        d = copy.deepcopy(analytic)
        set_field(d, v)
        return collective_us(d, coll, b2, world, backend) - collective_us(d, coll, b1, world, backend)

    return solve(model_slope, t2 - t1, lo, hi)


def _rising(points) -> bool:
    """At least two points and the largest slower than the one before it: a slope to fit."""
    return bool(points) and len(points) >= 2 and points[-1][1] > points[-2][1]


def _with(analytic: dict, section: str, **fields) -> dict:
    d = copy.deepcopy(analytic)
    d[section].update(fields)
    return d


def _fit_to_slope(analytic: dict, curve, kind: str, backend: str, world: int, field: str, bounds: tuple,
                  digits: int, what: str, fitted: list[str], kept: list[str]) -> dict:
    """Profile field `field` ("section.name") fitted to the slope of the measured `curve` within `bounds` and
    rounded to `digits` decimals, said in `fitted` (one decimal fewer), or named in `kept` when the curve does not
    rise. Returns the fitted analytic profile."""
    section, name = field.split(".")
    if not _rising(curve):
        kept.append(field)
        return analytic
    v, ok = _slope_fit(analytic, curve, kind, backend, world, lambda d, x: d[section].update({name: x}), *bounds)
    fitted.append(f"{field} {v:.{digits - 1}f} ({what} slope{'' if ok else ', clamped'})")
    return _with(analytic, section, **{name: round(v, digits)})


def _fit_nccl_reduce_scatter(analytic: dict, curves: dict, world: int, fitted: list[str],
                             kept: list[str]) -> dict:
    """nccl.reduction_bandwidth_factor to the reduce-scatter slope. Returns the fitted analytic profile."""
    return _fit_to_slope(analytic, curves.get(("reduce_scatter", "nccl", world)), "reduce_scatter", "nccl", world,
                         "nccl.reduction_bandwidth_factor", (0.05, 1.0), 4, "reduce-scatter", fitted, kept)


def _fit_ce_all_gather(analytic: dict, curves: dict, world: int, fitted: list[str], kept: list[str]) -> dict:
    """CE: the bidirectional efficiency to the in-place all-gather's slope (the engine ceiling raised to what
    one engine demonstrably moved), the signal latency to its smallest point. Returns the fitted analytic
    profile."""
    ce_ag = curves.get(("all_gather", "ce", world))
    if _rising(ce_ag):
        (b1, t1), (b2, t2) = ce_ag[-2], ce_ag[-1]
        inbound = (world - 1) * (b2 - b1) / (t2 - t1) / 1e3  # GB/s into one rank
        if inbound > analytic["ce"]["engine_gbps"]:
            analytic["ce"]["engine_gbps"] = round(1.05 * inbound, 1)
            fitted.append(f"ce.engine_gbps {analytic['ce']['engine_gbps']:g} (one engine moved {inbound:.0f} GB/s)")
        e, ok = _slope_fit(analytic, ce_ag, "all_gather", "ce", world,
                           lambda d, v: d["ce"].update(bidirectional_efficiency=v), 0.02, 1.0)
        b0, t0 = ce_ag[0]
        sig, ok2 = solve(lambda x: collective_us(_with(analytic, "ce", bidirectional_efficiency=e, signal_latency_us=x),
                                                 "all_gather", b0, world, "ce"), t0, 0.0, 2000.0, log=False)
        analytic = _with(analytic, "ce", bidirectional_efficiency=round(e, 4), signal_latency_us=round(sig, 2))
        fitted.append(f"ce.bidirectional_efficiency {e:.3f} (CE all-gather slope{'' if ok else ', clamped'}), "
                      f"ce.signal_latency_us {sig:.1f} ({format_bytes(b0)} point{'' if ok2 else ', clamped'})")
    else:
        kept.append("ce.bidirectional_efficiency, ce.signal_latency_us")
    return analytic


def _fit_ce_reduce_scatter(analytic: dict, curves: dict, m: dict, world: int, fitted: list[str],
                           kept: list[str]) -> dict:
    """The reduction kernel's per-SM rate to the CE reduce-scatter slope (unless the kernel was measured
    directly). Returns the fitted analytic profile."""
    if m.get("reduction_kernel"):
        return analytic  # measured directly (_fit_reduction_kernel)
    return _fit_to_slope(analytic, curves.get(("reduce_scatter", "ce", world)), "reduce_scatter", "ce", world,
                         "ce.reduce_gbps_per_sm", (1.0, 5000.0), 2, "CE reduce-scatter", fitted, kept)


def _fit_peer_copy(analytic: dict, m: dict, fitted: list[str], kept: list[str]) -> None:
    """ce.one_way_efficiency from the peer copy, against the link between GPUs 0 and 1."""
    pc = m.get("peer_copy")
    if pc:
        gbps = pc["bytes"] / pc["us"] / 1e3
        link = _link01_gbps(analytic["topology"])
        if gbps > link:
            raise CeOverlapError(f"measurements: peer_copy: {gbps:.0f} GB/s one way, above the {link:g} GB/s link "
                                 f"between GPUs 0 and 1 (topology): wrong topology or a broken measurement")
        analytic["ce"]["one_way_efficiency"] = round(gbps / link, 4)
        fitted.append(f"ce.one_way_efficiency {gbps / link:.3f} (peer copy {gbps:.0f} GB/s of {link:g})")
    else:
        kept.append("ce.one_way_efficiency")


def _add_curves(p: dict, curves: dict, fitted: list[str]) -> None:
    """The measured times themselves, used in place of the analytic model for their group size."""
    out_curves = [{"collective": k[0], "backend": k[1], "group_size": k[2], "points": [[b, round(t, 3)] for b, t in v]}
                  for k, v in sorted(curves.items())]
    if out_curves:
        p["curves"] = out_curves
        fitted.append("curves: " + ", ".join(f"{c['collective']}/{c['backend']}/{c['group_size']}" for c in out_curves))


# The collectives whose own slowdown beside compute stands for the backend's. CE: the all-gather only, copies and
# nothing else, as the pass's default reduce-scatter is (its sum left to the consumer); calibrate times the CE
# reduce-scatter with the reduction kernel, whose fight for SMs with a GEMM (+153% on 2x H200,
# bench/results/cost_model_validation-2026-11-24) is a different mechanism, priced by contention.ce_reduction.
OWN_SLOWDOWN_COLLECTIVES = {"nccl": ("all_gather", "reduce_scatter"), "ce": ("all_gather",)}


def _fit_collective_slowdowns(p: dict, m: dict, fitted: list[str], kept: list[str]) -> None:
    """The collectives' own slowdown beside compute: measured directly (mean over OWN_SLOWDOWN_COLLECTIVES)."""
    slow = m.get("slowdowns", [])
    for backend, collectives in OWN_SLOWDOWN_COLLECTIVES.items():
        for compute, cls in COMPUTE_KINDS.items():
            vals = [s["collective_beside_us"] / s["collective_alone_us"] - 1 for s in slow
                    if s["backend"] == backend and s["compute"] == compute and s.get("collective_beside_us")
                    and s["collective"] in collectives]
            key = f"{backend}_beside_compute"
            if vals:
                v = min(5.0, max(0.0, statistics.fmean(vals)))
                p["contention"][key][cls] = round(v, 4)
                fitted.append(f"contention.{key}.{cls} {v:.3f}")
            else:
                kept.append(f"contention.{key}.{cls}")
        if p["contention"][f"{backend}_beside_compute"].get("residency_us"):  # not measured here (a traced step is)
            kept.append(f"contention.{backend}_beside_compute.residency_us")


def _fit_sensitivities(p: dict, m: dict, fitted: list[str], kept: list[str], notes: list[str]) -> None:
    """The kernels' sensitivities: the model's slowdown is linear in (sm_sensitivity, hbm_sensitivity) of the
    class, so probe the two unit vectors through _core.decide and fit non-negative least squares
    (percentage points)."""
    slow = m.get("slowdowns", [])
    for compute, cls in COMPUTE_KINDS.items():
        rows, used = [], []
        for s in slow:
            if s["compute"] != compute:
                continue
            # The slowdown is linear in the two sensitivities plus what they do not scale (a measured reduction
            # kernel, contention.ce_reduction): probe zero and the two unit vectors, fit to what is left.
            probes = []
            for unit in ({"sm_sensitivity": 0.0, "hbm_sensitivity": 0.0}, {"sm_sensitivity": 1.0, "hbm_sensitivity": 0.0},
                         {"sm_sensitivity": 0.0, "hbm_sensitivity": 1.0}):
                d = copy.deepcopy(p)
                d["contention"][cls] = unit
                probes.append(predicted_slowdown(core_profile(d), s["collective"], s["bytes"], s["group_size"],
                                                 s["backend"], compute))
            if None in probes:
                notes.append(f"slowdown beside {s['collective']}/{s['backend']}: the model has no {s['backend']} for "
                             f"{s['group_size']} ranks here; not fitted")
                continue
            fixed = probes[0]
            rows.append((probes[1] - fixed, probes[2] - fixed, s["compute_beside_us"] / s["compute_alone_us"] - 1 - fixed))
            used.append(f"{s['collective']}/{s['backend']}")
        if rows:
            sm, hbm = nnls2(rows)
            p["contention"][cls] = {"sm_sensitivity": round(sm, 4), "hbm_sensitivity": round(hbm, 4)}
            fitted.append(f"contention.{cls} sm {sm:.3f} hbm {hbm:.3f} ({compute} slowdown beside {', '.join(used)})")
        else:
            kept.append(f"contention.{cls}")


def _fit_ce_copies(p: dict, m: dict, fitted: list[str], kept: list[str]) -> None:
    """contention.ce_copies: per kernel class, what the fitted SM/HBM formula leaves unexplained of the slowdown
    beside the CE all-gather (copies only: no SMs, little HBM; what is left is mostly the SM clock the copies' power
    takes), mean over the measurements, never below 0."""
    slow = [s for s in m.get("slowdowns", []) if s["backend"] == "ce" and s["collective"] == "all_gather"]
    formula = core_profile(p)  # the fitted sensitivities, no ce_copies yet
    out = {}
    for compute, cls in COMPUTE_KINDS.items():
        rows = [s for s in slow if s["compute"] == compute]
        resid = []
        for s in rows:
            model = predicted_slowdown(formula, s["collective"], s["bytes"], s["group_size"], "ce", compute)
            if model is not None:
                resid.append(s["compute_beside_us"] / s["compute_alone_us"] - 1 - model)
        if resid:
            out[cls] = round(max(0.0, statistics.fmean(resid)), 4)
    if len(out) == len(COMPUTE_KINDS):
        p["contention"]["ce_copies"] = out
        fitted.append(f"contention.ce_copies compute_bound {out['compute_bound']:.3f} memory_bound "
                      f"{out['memory_bound']:.3f} (beside the CE all-gather, beyond the SM/HBM formula)")
    else:
        kept.append("contention.ce_copies")


def _description(base: dict, m: dict, world: int, fitted: list[str], kept: list[str], notes: list[str]) -> str:
    """The profile's description: where and how it was calibrated, what was fitted, kept, skipped and noted."""
    gpu = m["gpu"]
    v = m.get("versions", {})
    return (
        f"CALIBRATED by `ce-overlap calibrate` on {m.get('host', '?')} at {m.get('time', '?')}: {world} x "
        f"{gpu['name']} ({int(gpu['sms'])} SMs), torch {v.get('torch', '?')}, CUDA {v.get('cuda', '?')}, "
        f"NCCL {v.get('nccl', '?')}. Started from the built-in {base['name']!r}. MEASURED AND FITTED: "
        + "; ".join(fitted) + ". KEPT FROM THE BASE (not measured here): " + (", ".join(kept) or "nothing") + "."
        + (" SKIPPED: " + "; ".join(f"{k}: {r}" for k, r in m.get("skipped", {}).items()) + "." if m.get("skipped") else "")
        + (" NOTES: " + "; ".join(notes) + "." if notes else ""))


def write_profile(path: str, profile: dict) -> None:
    """Writes `profile` after the C++ loader accepted its text, atomically, and loads the file back."""
    from .. import profiles

    text = json.dumps(profile, indent=1) + "\n"
    core_profile(profile)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    profiles.load(path if path.endswith(".json") or os.path.sep in path else os.path.join(".", path))
