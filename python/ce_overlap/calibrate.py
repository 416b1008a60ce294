"""`ce-overlap calibrate`: measure this machine and write a hardware profile (schema ce_overlap.profile/2).

Run it under torchrun, one process per GPU of one node (`torchrun --standalone --nproc-per-node N -m ce_overlap.cli
calibrate -o FILE`); a plain `ce-overlap calibrate -o FILE` calibrates one GPU and skips the collectives. It measures

- bf16 GEMMs (2048^3, 4096^3, 8192^3) and a memory-bound add of 1 GiB tensors, alone;
- per size (64 KiB .. 256 MiB per rank by default): NCCL all-gather, reduce-scatter and send/recv, the ce_overlap
  copy-engine all-gather (in place on symmetric memory, what the cost model describes) and, when the runtime has it,
  the copy-engine reduce-scatter;
- the GEMM's and the memory-bound kernel's slowdown beside each collective at one size (256 MiB per rank), and the
  collective's own slowdown beside them;
- one-way peer-copy bandwidth between two GPUs (plain cudaMemcpy through torch, for the link efficiency),

then starts from the built-in profile of the detected GPU (or `--base`), replaces what it measured, fits the rest
(docs/cost_model.md, "Calibrating") and writes the file after loading it through the C++ loader. Rank 0 writes and
prints; the other ranks take part in the collectives.

The module has two halves: the measuring code (torch, GPUs; `measure_*`) and the profile writer (`build_profile`,
`write_profile`: plain dicts in, no GPU), so a measurements file (`--measurements` / `--from-measurements`) can be
turned into a profile anywhere, and the writer is tested without GPUs.
"""
from __future__ import annotations

import copy
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Callable

from .errors import CeOverlapError

MEASUREMENTS_SCHEMA = "ce_overlap.calibration/1"
MIB = 1 << 20

GEMM_SIZES = (2048, 4096, 8192)
# Causal attention at Llama-3-8B's shape and sequence 4096 (batch, heads, sequence, head dim): the efficiency of
# the attention kernels on the FLOPs they execute (python/ce_overlap/fx/flops.py counts them the same way).
ATTENTION_SHAPE = (1, 32, 4096, 128)
# Fused AdamW over fp32 master weights, per parameter: reads param, grad, exp_avg, exp_avg_sq and writes param,
# exp_avg, exp_avg_sq, 4 bytes each (bench/train.py's step model charges the same).
ADAMW_BYTES_PER_PARAM = 28
OPTIMIZER_PARAMS = 256 << 20
# The GEMMs of a Llama-3-8B block and its output layer at 4096 tokens, (tokens, out features, in features): each
# measured as its forward (x @ w.T), input-gradient (dy @ w) and weight-gradient (dy.T @ x) product. They check the
# GEMM efficiency curve that the square GEMMs fit at the shapes a training step runs (fit_report prints them).
TRANSFORMER_GEMMS = ((4096, 4096, 4096), (4096, 1024, 4096), (4096, 14336, 4096), (4096, 4096, 14336),
                     (4096, 128256, 4096))
MEMBOUND_BYTES_PER_OPERAND = 1 << 30  # add of two 1 GiB bf16 tensors into a third: 3 GiB through HBM
COMPUTE_KINDS = {"gemm": "compute_bound", "memory_bound": "memory_bound"}  # measurement -> kernel class
COLLECTIVES = ("all_gather", "reduce_scatter", "send", "recv")
MAX_DECREASE = 0.10  # a curve's time may dip this much below a smaller size's (noise), then it is raised to it
MIN_SLOWDOWN = -0.10  # compute beside a collective faster than alone by more than this: a broken measurement

def parse_size(text: str) -> int:
    """'64K', '256M', '1G', '4096' -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        value = float(t[:-1]) * mult[t[-1]] if t and t[-1] in mult else float(t)
    except ValueError:
        raise CeOverlapError(f"bad size {text!r}: expected bytes with an optional K/M/G suffix (64K, 256M)") from None
    if value < 1 or value != int(value):
        raise CeOverlapError(f"bad size {text!r}: expected a whole number of bytes >= 1")
    return int(value)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return f"{n:g}"


class Progress:
    """A plain-text progress bar on stderr (rank 0 only): one line rewritten in place on a terminal, one line per
    step otherwise (logs)."""

    def __init__(self, total: int, enabled: bool = True, stream=None, width: int = 28):
        self.total = max(1, total)
        self.done = 0
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = time.monotonic()
        self._last_len = 0

    def line(self, label: str) -> str:
        filled = min(self.width, self.width * self.done // self.total)
        return (f"calibrate [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"{time.monotonic() - self.started:5.1f}s {label}")

    def step(self, label: str) -> None:
        self.done = min(self.total, self.done + 1)
        self.show(label)

    def show(self, label: str) -> None:
        if not self.enabled:
            return
        text = self.line(label)
        if self.tty:
            self.stream.write("\r" + text.ljust(self._last_len))
            self._last_len = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self._last_len:
            self.stream.write("\n")
            self.stream.flush()


# =================================================================================================================
# The profile writer: measurements (a plain dict) + base profile -> profile dict. No torch, no GPU.

def _path_num(obj: dict, key: str, path: str, *, minimum: float | None = 0.0, strict: bool = True) -> float:
    if not isinstance(obj, dict) or key not in obj:
        raise CeOverlapError(f"measurements: {path}.{key}: missing")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise CeOverlapError(f"measurements: {path}.{key}: expected a finite number, got {v!r}")
    if minimum is not None and (v <= minimum if strict else v < minimum):
        raise CeOverlapError(f"measurements: {path}.{key}: expected a number {'>' if strict else '>='} {minimum:g}, "
                             f"got {v!r}")
    return float(v)


def _path_list(obj: dict, key: str, path: str) -> list:
    v = obj.get(key, [])
    if not isinstance(v, list):
        raise CeOverlapError(f"measurements: {path}.{key}: expected a list, got {type(v).__name__}")
    return v


def check_measurements(m: dict) -> tuple[dict, list[str]]:
    """Validates a measurements dict (schema ce_overlap.calibration/1) and returns (clean copy, notes). Raises
    CeOverlapError naming the field for anything inconsistent: non-positive or non-finite numbers, sizes not
    increasing, a time that drops by more than 10% as the size grows, a curve for a group larger than the run,
    a duplicated curve, compute that ran faster beside a collective than alone. Small dips in time (noise at the
    latency floor) are raised to the running maximum, with a note."""
    if not isinstance(m, dict):
        raise CeOverlapError("measurements: expected a JSON object")
    if m.get("schema") != MEASUREMENTS_SCHEMA:
        raise CeOverlapError(f"measurements: schema: expected {MEASUREMENTS_SCHEMA!r}, got {m.get('schema')!r}")
    m = copy.deepcopy(m)
    notes: list[str] = []
    gpu = m.get("gpu")
    if not isinstance(gpu, dict) or not isinstance(gpu.get("name"), str) or not gpu["name"]:
        raise CeOverlapError("measurements: gpu.name: missing (the GPU name as CUDA reports it)")
    sms = _path_num(gpu, "sms", "gpu")
    if sms != int(sms):
        raise CeOverlapError(f"measurements: gpu.sms: expected an integer, got {gpu['sms']!r}")
    _path_num(gpu, "memory_gib", "gpu")
    world = _path_num(m, "world_size", "measurements")
    if world != int(world):
        raise CeOverlapError(f"measurements: world_size: expected an integer, got {m['world_size']!r}")
    world = int(world)

    gemms = _path_list(m, "gemm", "measurements")
    for i, g in enumerate(gemms):
        n = _path_num(g, "n", f"gemm[{i}]")
        if n != int(n):
            raise CeOverlapError(f"measurements: gemm[{i}].n: expected an integer, got {g['n']!r}")
        _path_num(g, "us", f"gemm[{i}]")
    if len({int(g["n"]) for g in gemms}) != len(gemms):
        raise CeOverlapError("measurements: gemm: the same GEMM size measured twice")
    if m.get("memory_bound") is not None:
        _path_num(m["memory_bound"], "bytes", "memory_bound")
        _path_num(m["memory_bound"], "us", "memory_bound")
    if m.get("peer_copy") is not None:
        _path_num(m["peer_copy"], "bytes", "peer_copy")
        _path_num(m["peer_copy"], "us", "peer_copy")
    if m.get("optimizer") is not None:
        _path_num(m["optimizer"], "bytes", "optimizer")
        _path_num(m["optimizer"], "us", "optimizer")
    if m.get("attention") is not None:
        a = m["attention"]
        for key in ("batch", "heads", "seq", "head_dim"):
            v = _path_num(a, key, "attention")
            if v != int(v) or v < 1:
                raise CeOverlapError(f"measurements: attention.{key}: expected a positive integer, got {a[key]!r}")
        _path_num(a, "forward_us", "attention")
        _path_num(a, "backward_us", "attention")
        if not isinstance(a.get("causal"), bool):
            raise CeOverlapError(f"measurements: attention.causal: expected true or false, got {a.get('causal')!r}")
    if m.get("kernel_gap") is not None:
        kg = m["kernel_gap"]
        if not isinstance(kg, dict):
            raise CeOverlapError("measurements: kernel_gap: expected an object with kernels and idle_us")
        _path_num(kg, "kernels", "kernel_gap")
        _path_num(kg, "idle_us", "kernel_gap", strict=False)
    if m.get("training_step") is not None:
        ts = m["training_step"]
        if not isinstance(ts, dict):
            raise CeOverlapError("measurements: training_step: expected an object")
        gemms = _path_list(ts, "gemms", "training_step")
        if not gemms:
            raise CeOverlapError("measurements: training_step.gemms: expected at least one [m, n, k, count]")
        for i, g in enumerate(gemms):
            if (not isinstance(g, list) or len(g) != 4 or not all(isinstance(v, int) and not isinstance(v, bool)
                                                                  and v >= 1 for v in g)):
                raise CeOverlapError(f"measurements: training_step.gemms[{i}]: expected [m, n, k, count] of positive "
                                     f"integers, got {g!r}")
        _path_num(ts, "gemm_us", "training_step")
        a = ts.get("attention")
        for key in ("batch", "heads", "seq", "head_dim", "layers"):
            v = _path_num(a, key, "training_step.attention")
            if v != int(v):
                raise CeOverlapError(f"measurements: training_step.attention.{key}: expected an integer, got {a[key]!r}")
        if not isinstance(a.get("causal"), bool):
            raise CeOverlapError(f"measurements: training_step.attention.causal: expected true or false, got "
                                 f"{a.get('causal')!r}")
        _path_num(ts, "attention_us", "training_step")
        if ts.get("optimizer") is not None:
            _path_num(ts["optimizer"], "bytes", "training_step.optimizer")
            _path_num(ts["optimizer"], "us", "training_step.optimizer")
    for i, k in enumerate(m.get("memory_kernels") or []):
        _path_num(k, "bytes", f"memory_kernels[{i}]")
        _path_num(k, "us", f"memory_kernels[{i}]")
    for i, g in enumerate(m.get("transformer_gemms") or []):
        for key in ("m", "n", "k"):
            v = _path_num(g, key, f"transformer_gemms[{i}]")
            if v != int(v) or v < 1:
                raise CeOverlapError(f"measurements: transformer_gemms[{i}].{key}: expected a positive integer, "
                                     f"got {g[key]!r}")
        _path_num(g, "us", f"transformer_gemms[{i}]")

    seen: dict[tuple, int] = {}
    for i, c in enumerate(_path_list(m, "collectives", "measurements")):
        p = f"collectives[{i}]"
        if not isinstance(c, dict):
            raise CeOverlapError(f"measurements: {p}: expected an object")
        if c.get("collective") not in COLLECTIVES:
            raise CeOverlapError(f"measurements: {p}.collective: expected one of {', '.join(COLLECTIVES)}, "
                                 f"got {c.get('collective')!r}")
        if c.get("backend") not in ("nccl", "ce"):
            raise CeOverlapError(f"measurements: {p}.backend: expected nccl or ce, got {c.get('backend')!r}")
        n = _path_num(c, "group_size", p)
        if n != int(n) or n < 2 or n > world:
            raise CeOverlapError(f"measurements: {p}.group_size: expected an integer in 2..world_size ({world}), "
                                 f"got {c['group_size']!r}")
        key = (c["collective"], c["backend"], int(n))
        if key in seen:
            raise CeOverlapError(f"measurements: {p}: a second curve for {key[0]} on {key[1]} with {key[2]} ranks "
                                 f"(also at collectives[{seen[key]}])")
        seen[key] = i
        pts = c.get("points")
        if not isinstance(pts, list) or len(pts) < 2:
            raise CeOverlapError(f"measurements: {p}.points: expected at least 2 [bytes, us] points")
        clean, running = [], 0.0
        for k, pt in enumerate(pts):
            pp = f"{p}.points[{k}]"
            if (not isinstance(pt, (list, tuple)) or len(pt) != 2
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pt)):
                raise CeOverlapError(f"measurements: {pp}: expected [bytes, us], got {pt!r}")
            b, us = float(pt[0]), float(pt[1])
            if not (math.isfinite(b) and b >= 1 and b == int(b)):
                raise CeOverlapError(f"measurements: {pp}[0]: expected a whole number of bytes >= 1, got {pt[0]!r}")
            if not (math.isfinite(us) and us > 0):
                raise CeOverlapError(f"measurements: {pp}[1]: expected a time > 0 us, got {pt[1]!r}")
            if clean and b <= clean[-1][0]:
                raise CeOverlapError(f"measurements: {pp}[0]: sizes must increase, got {format_bytes(b)} after "
                                     f"{format_bytes(clean[-1][0])}")
            if us < running:
                if us < (1 - MAX_DECREASE) * running:
                    raise CeOverlapError(
                        f"measurements: {pp}[1]: {key[0]} on {key[1]} took {us:.1f} us at {format_bytes(b)}, "
                        f"{(1 - us / running) * 100:.0f}% less than {running:.1f} us at a smaller size: "
                        f"inconsistent (more than {MAX_DECREASE:.0%}); measure again")
                notes.append(f"{key[0]}/{key[1]}/{key[2]}: {us:.1f} us at {format_bytes(b)} raised to {running:.1f} us "
                             f"(below a smaller size's time, within noise)")
                us = running
            running = max(running, us)
            clean.append([int(b), us])
        c["points"] = clean
        c["group_size"] = int(n)

    rk = m.get("reduction_kernel")
    if rk is not None:
        p = "reduction_kernel"
        if not isinstance(rk, dict):
            raise CeOverlapError(f"measurements: {p}: expected an object")
        ctas = _path_num(rk, "ctas", p)
        if ctas != int(ctas) or not 1 <= ctas < _path_num(m["gpu"], "sms", "gpu"):
            raise CeOverlapError(f"measurements: {p}.ctas: expected an integer in 1..gpu.sms - 1, got {rk['ctas']!r}")
        _path_num(rk, "bytes", p)
        _path_num(rk, "us", p)
        for k in COMPUTE_KINDS:
            if not isinstance(rk.get(k), dict):
                raise CeOverlapError(f"measurements: {p}.{k}: expected an object with alone_us and beside_us")
            alone = _path_num(rk[k], "alone_us", f"{p}.{k}")
            beside = _path_num(rk[k], "beside_us", f"{p}.{k}")
            if beside / alone - 1 < MIN_SLOWDOWN:
                raise CeOverlapError(f"measurements: {p}.{k}: {beside:.1f} us beside the reduction kernel but "
                                     f"{alone:.1f} us alone: inconsistent; measure again")

    for i, s in enumerate(_path_list(m, "slowdowns", "measurements")):
        p = f"slowdowns[{i}]"
        if not isinstance(s, dict):
            raise CeOverlapError(f"measurements: {p}: expected an object")
        if s.get("collective") not in COLLECTIVES or s.get("backend") not in ("nccl", "ce"):
            raise CeOverlapError(f"measurements: {p}: collective/backend: expected one of {', '.join(COLLECTIVES)} "
                                 f"on nccl or ce, got {s.get('collective')!r} on {s.get('backend')!r}")
        if s.get("compute") not in COMPUTE_KINDS:
            raise CeOverlapError(f"measurements: {p}.compute: expected gemm or memory_bound, got {s.get('compute')!r}")
        n = _path_num(s, "group_size", p)
        if n != int(n) or n < 2 or n > world:
            raise CeOverlapError(f"measurements: {p}.group_size: expected an integer in 2..{world}, "
                                 f"got {s['group_size']!r}")
        _path_num(s, "bytes", p)
        alone = _path_num(s, "compute_alone_us", p)
        beside = _path_num(s, "compute_beside_us", p)
        if beside / alone - 1 < MIN_SLOWDOWN:
            raise CeOverlapError(
                f"measurements: {p}: the {s['compute']} kernel took {beside:.1f} us beside {s['collective']} on "
                f"{s['backend']} but {alone:.1f} us alone ({(1 - beside / alone) * 100:.0f}% faster beside it): "
                f"inconsistent; measure again")
        _path_num(s, "collective_alone_us", p)
        if s.get("collective_beside_us") is not None:
            _path_num(s, "collective_beside_us", p)
    return m, notes


def _core_profile(d: dict):
    from . import _core

    return _core.Profile.from_json(json.dumps(d))


def _estimate(d: dict, coll: str, nbytes: float, n: int, backend: str) -> float:
    from . import _core

    return _core.estimate_collective(_core_profile(d), coll, int(nbytes), n, backend)


def _solve(f: Callable[[float], float], target: float, lo: float, hi: float, log: bool = True,
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


def _nnls2(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
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
    from . import _core

    d = _core.decide(profile, coll, int(nbytes), n, **_window(compute))
    entry = d[backend]
    if entry is None:
        return None
    return entry[f"{COMPUTE_KINDS[compute]}_slowdown"]


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
    gpu = m["gpu"]
    world = int(m["world_size"])
    p["name"] = name or f"{base['name']}-calibrated"
    p["gpu"]["name"] = gpu["name"]
    p["gpu"]["sms"] = int(gpu["sms"])
    p["gpu"]["memory_gib"] = round(float(gpu["memory_gib"]), 1)
    if gpu.get("copy_engines"):
        p["gpu"]["copy_engines"] = int(gpu["copy_engines"])
    if m.get("ce_reduce_sms"):  # the runtime's reduction kernel ran on this many CTAs (CE_OVERLAP_REDUCE_SMS)
        p["ce"]["reduce_sms"] = int(m["ce_reduce_sms"])
        fitted.append(f"ce.reduce_sms {int(m['ce_reduce_sms'])} (CE_OVERLAP_REDUCE_SMS of the run)")
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
    if p["nccl"]["channels"] >= p["gpu"]["sms"] or p["ce"]["reduce_sms"] >= p["gpu"]["sms"]:
        raise CeOverlapError(f"measurements: gpu.sms: {gpu['sms']} SMs, but the profile uses {p['nccl']['channels']} "
                             f"for NCCL and {p['ce']['reduce_sms']} for the CE reduction: wrong base profile (--base) "
                             f"or CE_OVERLAP_REDUCE_SMS")

    # Topology: the detected one (this machine), keeping the base's inter-node link for bigger simulations.
    topo = m.get("topology")
    if topo and topo.get("gpus_per_node") == 1 and base["topology"].get("gpus_per_node", 1) > 1:
        # One visible GPU says nothing about links; its topology would turn every group of the profile into one that
        # spans nodes (and rule out CE).
        kept.append(f"topology (one GPU visible; the base's {base['topology']['gpus_per_node']} GPUs per node kept)")
    elif topo and not keep_topology:
        topo = copy.deepcopy(topo)
        if "inter_node" in base["topology"] and "inter_node" not in topo:
            topo["inter_node"] = base["topology"]["inter_node"]
        if topo.get("gpus_per_node", 0) < world:
            raise CeOverlapError(f"measurements: topology.gpus_per_node: {topo.get('gpus_per_node')} GPUs, but "
                                 f"{world} ranks ran on this node")
        p["topology"] = topo
        fitted.append(f"topology detected ({topo['gpus_per_node']} GPUs, `ce-overlap topo`)")
    else:
        kept.append("topology")

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
                      f"fit: steady clocks)")
    opt = (ts or {}).get("optimizer") or m.get("optimizer")
    if opt:  # the step's own AdamW (all of a model's parameter shapes, steady clocks) where measured, else the burst
        eff = _hbm_fraction("optimizer", opt, hbm)
        p["efficiency"]["optimizer"] = round(eff, 4)
        fitted.append(f"efficiency.optimizer {eff:.3f} (fused AdamW, {eff * hbm:.0f} GB/s"
                      + (", inside the training step)" if opt is not m.get("optimizer") else ")"))
    else:
        kept.append("efficiency.optimizer")

    kg = m.get("kernel_gap")
    if kg:
        gap = kg["idle_us"] / kg["kernels"]
        p["efficiency"]["kernel_gap_us"] = round(gap, 2)
        fitted.append(f"efficiency.kernel_gap_us {gap:.2f} (the GPU idle {kg['idle_us'] / 1e3:.2f} ms per step between "
                      f"{kg['kernels']:.0f} kernels and copies of compiled training steps)")
    else:
        kept.append("efficiency.kernel_gap_us")

    curves = {(c["collective"], c["backend"], c["group_size"]): c["points"] for c in m.get("collectives", [])}
    analytic = copy.deepcopy(p)  # fits of the analytic model run without curves (they would mask it)
    analytic.pop("curves", None)

    # NCCL: scale every protocol line's bus efficiency to the measured all-gather slope, shift every line's base
    # latency to the smallest measured all-gather, then the reduction factor to the reduce-scatter slope.
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

        s, ok = _solve(lambda s: _estimate(with_scale(s), "all_gather", b2, world, "nccl")
                       - _estimate(with_scale(s), "all_gather", b1, world, "nccl"), t2 - t1, 0.05, 1.0 / max(eff0))
        b0, t0 = ag[0]
        shift, ok2 = _solve(lambda x: _estimate(with_scale(s, x), "all_gather", b0, world, "nccl"), t0,
                            -max(base0), 2000.0, log=False)
        analytic = with_scale(s, shift)
        fitted.append(f"nccl bus efficiencies x{s:.3f} (all-gather slope {format_bytes(b1)}..{format_bytes(b2)}"
                      f"{'' if ok else ', clamped'}) and base latencies {shift:+.1f} us ({format_bytes(b0)} point"
                      f"{'' if ok2 else ', clamped'})")
    else:
        kept.append("nccl protocol lines")
    rs = curves.get(("reduce_scatter", "nccl", world))
    if rs and len(rs) >= 2 and rs[-1][1] > rs[-2][1]:
        (b1, t1), (b2, t2) = rs[-2], rs[-1]

        def with_factor(f):
            d = copy.deepcopy(analytic)
            d["nccl"]["reduction_bandwidth_factor"] = f
            return d

        f, ok = _solve(lambda f: _estimate(with_factor(f), "reduce_scatter", b2, world, "nccl")
                       - _estimate(with_factor(f), "reduce_scatter", b1, world, "nccl"), t2 - t1, 0.05, 1.0)
        analytic = with_factor(round(f, 4))
        fitted.append(f"nccl.reduction_bandwidth_factor {f:.3f} (reduce-scatter slope{'' if ok else ', clamped'})")
    else:
        kept.append("nccl.reduction_bandwidth_factor")

    # CE: bidirectional efficiency to the in-place all-gather's slope (engine ceiling raised to what one engine
    # demonstrably moved), signal latency to its smallest point; the reduction kernel's per-SM rate to the
    # reduce-scatter slope; one-way efficiency from the peer copy.
    ce_ag = curves.get(("all_gather", "ce", world))
    if ce_ag and len(ce_ag) >= 2 and ce_ag[-1][1] > ce_ag[-2][1]:
        (b1, t1), (b2, t2) = ce_ag[-2], ce_ag[-1]
        inbound = (world - 1) * (b2 - b1) / (t2 - t1) / 1e3  # GB/s into one rank
        if inbound > analytic["ce"]["engine_gbps"]:
            analytic["ce"]["engine_gbps"] = round(1.05 * inbound, 1)
            fitted.append(f"ce.engine_gbps {analytic['ce']['engine_gbps']:g} (one engine moved {inbound:.0f} GB/s)")

        def with_bidi(e, signal=None):
            d = copy.deepcopy(analytic)
            d["ce"]["bidirectional_efficiency"] = e
            if signal is not None:
                d["ce"]["signal_latency_us"] = signal
            return d

        e, ok = _solve(lambda e: _estimate(with_bidi(e), "all_gather", b2, world, "ce")
                       - _estimate(with_bidi(e), "all_gather", b1, world, "ce"), t2 - t1, 0.02, 1.0)
        b0, t0 = ce_ag[0]
        sig, ok2 = _solve(lambda x: _estimate(with_bidi(e, x), "all_gather", b0, world, "ce"), t0, 0.0, 2000.0,
                          log=False)
        analytic = with_bidi(round(e, 4), round(sig, 2))
        fitted.append(f"ce.bidirectional_efficiency {e:.3f} (CE all-gather slope{'' if ok else ', clamped'}), "
                      f"ce.signal_latency_us {sig:.1f} ({format_bytes(b0)} point{'' if ok2 else ', clamped'})")
    else:
        kept.append("ce.bidirectional_efficiency, ce.signal_latency_us")
    ce_rs = curves.get(("reduce_scatter", "ce", world))
    if rk:
        pass  # measured directly above
    elif ce_rs and len(ce_rs) >= 2 and ce_rs[-1][1] > ce_rs[-2][1]:
        (b1, t1), (b2, t2) = ce_rs[-2], ce_rs[-1]

        def with_rate(r):
            d = copy.deepcopy(analytic)
            d["ce"]["reduce_gbps_per_sm"] = r
            return d

        r, ok = _solve(lambda r: _estimate(with_rate(r), "reduce_scatter", b2, world, "ce")
                       - _estimate(with_rate(r), "reduce_scatter", b1, world, "ce"), t2 - t1, 1.0, 5000.0)
        analytic = with_rate(round(r, 2))
        fitted.append(f"ce.reduce_gbps_per_sm {r:.1f} (CE reduce-scatter slope{'' if ok else ', clamped'})")
    else:
        kept.append("ce.reduce_gbps_per_sm")
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
    p = analytic

    # Curves: the measured times themselves, used in place of the analytic model for this group size.
    out_curves = [{"collective": k[0], "backend": k[1], "group_size": k[2], "points": [[b, round(t, 3)] for b, t in v]}
                  for k, v in sorted(curves.items())]
    if out_curves:
        p["curves"] = out_curves
        fitted.append("curves: " + ", ".join(f"{c['collective']}/{c['backend']}/{c['group_size']}" for c in out_curves))

    # Contention. The collectives' own slowdown beside compute: measured directly (mean over collectives).
    slow = m.get("slowdowns", [])
    for backend in ("nccl", "ce"):
        for compute, cls in COMPUTE_KINDS.items():
            vals = [s["collective_beside_us"] / s["collective_alone_us"] - 1 for s in slow
                    if s["backend"] == backend and s["compute"] == compute and s.get("collective_beside_us")]
            key = f"{backend}_beside_compute"
            if vals:
                v = min(5.0, max(0.0, statistics.fmean(vals)))
                p["contention"][key][cls] = round(v, 4)
                fitted.append(f"contention.{key}.{cls} {v:.3f}")
            else:
                kept.append(f"contention.{key}.{cls}")
    # The kernels' sensitivities: the model's slowdown is linear in (sm_sensitivity, hbm_sensitivity) of the class,
    # so probe the two unit vectors through _core.decide and fit non-negative least squares (percentage points).
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
                probes.append(predicted_slowdown(_core_profile(d), s["collective"], s["bytes"], s["group_size"],
                                                 s["backend"], compute))
            if None in probes:
                notes.append(f"slowdown beside {s['collective']}/{s['backend']}: the model has no {s['backend']} for "
                             f"{s['group_size']} ranks here; not fitted")
                continue
            fixed = probes[0]
            rows.append((probes[1] - fixed, probes[2] - fixed, s["compute_beside_us"] / s["compute_alone_us"] - 1 - fixed))
            used.append(f"{s['collective']}/{s['backend']}")
        if rows:
            sm, hbm = _nnls2(rows)
            p["contention"][cls] = {"sm_sensitivity": round(sm, 4), "hbm_sensitivity": round(hbm, 4)}
            fitted.append(f"contention.{cls} sm {sm:.3f} hbm {hbm:.3f} ({compute} slowdown beside {', '.join(used)})")
        else:
            kept.append(f"contention.{cls}")

    v = m.get("versions", {})
    p["description"] = (
        f"CALIBRATED by `ce-overlap calibrate` on {m.get('host', '?')} at {m.get('time', '?')}: {world} x "
        f"{gpu['name']} ({int(gpu['sms'])} SMs), torch {v.get('torch', '?')}, CUDA {v.get('cuda', '?')}, "
        f"NCCL {v.get('nccl', '?')}. Started from the built-in {base['name']!r}. MEASURED AND FITTED: "
        + "; ".join(fitted) + ". KEPT FROM THE BASE (not measured here): " + (", ".join(kept) or "nothing") + "."
        + (" SKIPPED: " + "; ".join(f"{k}: {r}" for k, r in m.get("skipped", {}).items()) + "." if m.get("skipped") else "")
        + (" NOTES: " + "; ".join(notes) + "." if notes else ""))
    _core_profile(p)  # the C++ loader must accept it (raises naming the field otherwise)
    return p, fitted + [f"kept from {base['name']}: {k}" for k in kept] + notes


def write_profile(path: str, profile: dict) -> None:
    """Writes `profile` after the C++ loader accepted its text, atomically, and loads the file back."""
    from . import profiles

    text = json.dumps(profile, indent=1) + "\n"
    _core_profile(profile)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    profiles.load(path if path.endswith(".json") or os.path.sep in path else os.path.join(".", path))


def fit_report(profile: dict, measurements: dict) -> list[str]:
    """Measured vs the written profile's prediction, one line each (what `calibrate` prints at the end)."""
    from . import _core

    m, _ = check_measurements(measurements)
    prof = _core_profile(profile)
    out = []
    for c in m.get("collectives", []):
        if c["collective"] in ("send", "recv"):
            continue
        b, t = c["points"][-1]
        pred = _core.estimate_collective(prof, c["collective"], b, c["group_size"], c["backend"])
        out.append(f"{c['collective']:<15} {c['backend']:<5} {format_bytes(b):>10}: measured {t:9.1f} us, "
                   f"profile {pred:9.1f} us")
    eff = profile["efficiency"]
    peak = float(profile["gpu"]["peak_bf16_tflops"])
    hbm = float(profile["gpu"]["hbm_gbps"])
    for k in m.get("memory_kernels", []):
        pred = k["bytes"] / (hbm * 1e3 * eff["memory"])  # CostModel::roofline's memory side
        out.append(f"{k['name']:<22}: measured {k['us']:9.1f} us, profile {pred:9.1f} us ({100 * (pred / k['us'] - 1):+.1f}%)")
    if m.get("optimizer"):
        o = m["optimizer"]
        pred = o["bytes"] / (hbm * 1e3 * eff.get("optimizer", eff["memory"]))
        out.append(f"fused AdamW {o['params'] / 2 ** 20:.0f}M params: measured {o['us']:9.1f} us, profile {pred:9.1f} us")
    for g in m.get("transformer_gemms", []):
        flops = 2.0 * g["m"] * g["n"] * g["k"]
        pred = gemm_model_us(eff, peak, flops)
        out.append(f"GEMM {int(g['m'])}x{int(g['k'])} @ {int(g['k'])}x{int(g['n'])} ({g.get('kind', '')}): measured "
                   f"{g['us']:9.1f} us, profile {pred:9.1f} us ({100 * (pred / g['us'] - 1):+.1f}%)")
    ts = m.get("training_step")
    if ts:
        pred = step_gemms_model_us(eff, peak, ts["gemms"])
        out.append(f"GEMMs of a compiled training step: measured {ts['gemm_us']:9.1f} us, profile {pred:9.1f} us "
                   f"({100 * (pred / ts['gemm_us'] - 1):+.1f}%; the bursts above run at higher clocks)")
    for s in m.get("slowdowns", []):
        meas = (s["compute_beside_us"] / s["compute_alone_us"] - 1) * 100
        pred = predicted_slowdown(prof, s["collective"], s["bytes"], s["group_size"], s["backend"], s["compute"])
        out.append(f"{s['compute']:<12} beside {s['collective']}/{s['backend']} {format_bytes(s['bytes'])}: measured "
                   f"{meas:+5.1f}%, profile " + ("n/a" if pred is None else f"{pred * 100:+5.1f}%"))
    return out


# =================================================================================================================
# Measuring (torch, GPUs). Every rank runs the same sequence; times are medians per rank, then the max over ranks.

class NotAvailable(Exception):
    """A backend or op that cannot run here; the reason is reported and the run goes on without it."""


def _torch():
    import torch

    return torch


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def max_over_ranks(value: float) -> float:
    torch, dist = _torch(), _dist()
    if dist is None:
        return value
    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_ranks_ok(ok: bool) -> bool:
    torch, dist = _torch(), _dist()
    if dist is None:
        return ok
    t = torch.tensor([0 if ok else 1], dtype=torch.int32, device="cuda")
    dist.all_reduce(t)
    return int(t.item()) == 0


_SLEEP_CYCLES_PER_US: dict[int, float] = {}

# Host time one timed op may take to enqueue (Python dispatch, the CE flag protocol): the GPU head start covers it.
HEAD_START_US_PER_OP = 150.0


def gpu_head_start(us: float) -> None:
    """Occupies the current stream for about `us` microseconds (torch.cuda._sleep), so that the ops enqueued
    next queue up behind it and their events time the device alone, not the host enqueueing them."""
    torch = _torch()
    dev = torch.cuda.current_device()
    if dev not in _SLEEP_CYCLES_PER_US:
        torch.cuda._sleep(1000)  # load the kernel
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(2_000_000)
        b.record()
        b.synchronize()
        _SLEEP_CYCLES_PER_US[dev] = 2_000_000 / max(a.elapsed_time(b) * 1e3, 1.0)
    torch.cuda._sleep(int(us * _SLEEP_CYCLES_PER_US[dev]))


def time_each_us(fn: Callable[[], None], iters: int, warmup: int, settle: Callable[[], None] | None = None,
                 head_start: bool = True) -> list[float]:
    """Per-op device times (CUDA events around each op on the current stream), us. With `head_start` the stream
    first sleeps long enough for the host to enqueue all `iters` ops, so a small op's time is not its host
    enqueue time (the case inside a compiled training step, where the host runs ahead)."""
    torch = _torch()
    for _ in range(warmup):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    if head_start:
        (settle or torch.cuda.synchronize)()
        torch.cuda.synchronize()
        gpu_head_start(HEAD_START_US_PER_OP * iters + 500.0)
    for a, b in ev:
        a.record()
        fn()
        b.record()
    (settle or torch.cuda.synchronize)()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 for a, b in ev]


def median_us(fn, iters: int, warmup: int, settle=None) -> float:
    """Median per-op time on this rank, max over ranks."""
    return max_over_ranks(statistics.median(time_each_us(fn, iters, warmup, settle)))


def make_compute(kind: str):
    """(fn, work) for `gemm` (bf16 8192^3 by default) or `memory_bound` (add of 1 GiB bf16 tensors)."""
    torch = _torch()
    if kind == "gemm" or kind.startswith("gemm"):
        n = int(kind[4:] or 8192)
        a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        c = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
        return (lambda: torch.mm(a, b, out=c)), {"n": n, "flops": 2 * n ** 3}
    if kind == "memory_bound":
        numel = MEMBOUND_BYTES_PER_OPERAND // 2
        x = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
        y = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
        z = torch.empty_like(x)
        return (lambda: torch.add(x, y, out=z)), {"bytes": 3 * numel * 2}
    raise ValueError(kind)


def attention_executed_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool = True) -> tuple[int, int]:
    """(forward, backward) FLOPs of self-attention as the analyzer counts them (python/ce_overlap/fx/flops.py:
    executed work, causal masking discounted)."""
    from .fx.flops import attention_backward_flops, attention_flops

    q = (batch, heads, seq, head_dim)
    return attention_flops(q, q, q, causal), attention_backward_flops(q, q, q, causal)


# Memory-bound kernels the size of a training step's activations (4096 tokens x 4096 .. 14336 bf16 is 32-112 MiB),
# as Inductor fuses them: elementwise adds (2 reads, 1 write), SwiGLU's silu(a) * b, and a row-wise RMSNorm-like
# reduction (1 read, 1 write). Their median efficiency is efficiency.memory: a 1 GiB add streams faster than these.
MEMORY_KERNEL_MIB = (32, 112)


def measure_memory_kernels(iters: int, warmup: int) -> list[dict]:
    """[{name, bytes, us}] for the memory-bound kernels above, each at MEMORY_KERNEL_MIB per operand."""
    torch = _torch()
    out = []
    for mib in MEMORY_KERNEL_MIB:
        numel = (mib << 20) // 2
        a = torch.randn(numel // 4096, 4096, dtype=torch.bfloat16, device="cuda")
        b = torch.randn_like(a)
        c = torch.empty_like(a)
        # dynamic=False: the same code at a second size would otherwise recompile as a dynamic-shape kernel,
        # which is not what a training step's static shapes run.
        silu_mul = torch.compile(lambda x, y: torch.nn.functional.silu(x) * y, dynamic=False)
        rms = torch.compile(lambda x: x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype),
                            dynamic=False)
        for name, fn, nbytes in (("add", lambda: torch.add(a, b, out=c), 3 * numel * 2),
                                 ("silu_mul", lambda: silu_mul(a, b), 3 * numel * 2),
                                 ("rmsnorm", lambda: rms(a), 2 * numel * 2)):
            out.append({"name": f"{name} {mib} MiB", "bytes": nbytes, "us": median_us(fn, iters, warmup)})
        del a, b, c
    torch.cuda.empty_cache()
    return out


def measure_optimizer(iters: int, warmup: int, numel: int = OPTIMIZER_PARAMS) -> dict:
    """One fused AdamW step (torch.optim.AdamW(fused=True)) over `numel` fp32 parameters in 64 tensors, as a training
    step runs it over fp32 master shards: ADAMW_BYTES_PER_PARAM bytes of HBM traffic per parameter."""
    torch = _torch()
    n = numel // 64
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for _ in range(64)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    us = median_us(opt.step, iters, warmup)
    del opt, params
    torch.cuda.empty_cache()
    return {"params": 64 * n, "bytes": ADAMW_BYTES_PER_PARAM * 64 * n, "us": us}


def measure_attention(iters: int, warmup: int, shape: tuple[int, int, int, int] = ATTENTION_SHAPE) -> dict:
    """Causal bf16 scaled-dot-product attention as the models call it: forward alone, and forward + backward (the
    backward is the difference), medians in us."""
    torch = _torch()
    import torch.nn.functional as F

    b, h, s, d = shape
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, s, d, dtype=torch.bfloat16, device="cuda")

    def forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward_backward():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    fwd = median_us(forward, iters, warmup)
    both = median_us(forward_backward, iters, warmup)
    return {"batch": b, "heads": h, "seq": s, "head_dim": d, "causal": True, "forward_us": fwd,
            "backward_us": max(both - fwd, 1e-3)}


def measure_transformer_gemms(iters: int, warmup: int) -> list[dict]:
    """bf16 GEMMs of TRANSFORMER_GEMMS, each as forward / input gradient / weight gradient: [{m, n, k, kind, us}]
    where the product is (m x k) @ (k x n)."""
    torch = _torch()
    out = []
    for tokens, n_out, n_in in TRANSFORMER_GEMMS:
        x = torch.randn(tokens, n_in, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(n_out, n_in, dtype=torch.bfloat16, device="cuda")
        dy = torch.randn(tokens, n_out, dtype=torch.bfloat16, device="cuda")
        for kind, fn, (m, n, k) in (("forward", lambda: x @ w.t(), (tokens, n_out, n_in)),
                                    ("input_grad", lambda: dy @ w, (tokens, n_in, n_out)),
                                    ("weight_grad", lambda: dy.t() @ x, (n_out, n_in, tokens))):
            out.append({"m": m, "n": n, "k": k, "kind": kind, "us": median_us(fn, iters, warmup)})
        del x, w, dy
    torch.cuda.empty_cache()
    return out


# A training step in miniature: forward + backward of two Llama-3-8B-width blocks (with the embedding and the
# 128256-vocabulary output layer) at 4096 tokens, fp32 parameters under bf16 autocast, compiled as a training step
# compiles them, then a fused AdamW step, so the kernels are
# Inductor's fused kernels, cuBLAS GEMMs and cuDNN attention at the sizes a step runs, launched back to back with
# the host ahead of the GPU, for long enough that the board runs at its steady (power-limited) clocks. It sets
# efficiency.kernel_gap_us (the GPU's idle time between kernels), and it corrects the GEMM and attention efficiencies
# fitted from short bursts to what the same kernels reach inside a step: on one H200 a bf16 8192^3 GEMM took 1387 us
# in a burst and 1621 us sustained (bench/results/compute-2026-11-24).
STEP_MODEL = dict(dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256, seq_len=4096)
STEP_PROFILED = 3   # steps under the profiler
STEP_SUSTAIN_MS = 1500.0  # steps run before the profiled ones, so the clocks have settled


def step_gemms(cfg) -> list[list[int]]:
    """[m, n, k, count] of every GEMM of forward + backward of `STEP_MODEL`-like configs, one batch of seq_len tokens:
    each linear layer's forward (tokens x in -> out), input gradient and weight gradient (the same FLOPs each)."""
    t, d, kv = cfg.seq_len, cfg.dim, cfg.n_kv_heads * cfg.head_dim
    per_block = [(d, d), (d, kv), (d, kv), (d, d), (d, cfg.ffn_dim), (d, cfg.ffn_dim), (cfg.ffn_dim, d)]
    out: dict[tuple[int, int, int], int] = {}
    for n_in, n_out in per_block * cfg.n_layers + [(d, cfg.vocab_size)]:
        for shape in ((t, n_out, n_in), (t, n_in, n_out), (n_out, n_in, t)):  # forward, input grad, weight grad
            out[shape] = out.get(shape, 0) + 1
    return [[m, n, k, c] for (m, n, k), c in sorted(out.items())]


def measure_training_step(warmup: int, steps: int = STEP_PROFILED) -> tuple[dict, dict]:
    """(kernel_gap, training_step) measurements of the workload above, from torch.profiler: the GPU's idle time
    between consecutive kernels and copies ({workload, steps, kernels and idle_us per step, largest_gaps}), and the
    time per step of its GEMM and attention kernels with the work they did ({gemms, gemm_us, attention, attention_us})."""
    torch = _torch()
    from torch.profiler import ProfilerActivity, profile

    from .gpu_trace import gpu_activities, idle_between, largest_gaps, time_by_class
    from .models.llama import Llama, LlamaConfig, init_weights

    cfg = LlamaConfig(**STEP_MODEL)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Llama(cfg)
    init_weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    params = sum(p.numel() for p in model.parameters())

    def loss_fn(x, y):  # fp32 parameters, bf16 compute: what a mixed-precision step runs
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(x, y)

    step_fn = torch.compile(loss_fn)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1), device="cuda")
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def one_step():
        step_fn(inputs, labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(max(2, warmup)):  # the first compiles
        one_step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    one_step()
    torch.cuda.synchronize()
    for _ in range(int(STEP_SUSTAIN_MS / 1e3 / max(time.perf_counter() - t0, 1e-3))):
        one_step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            one_step()
        torch.cuda.synchronize()
    activities = gpu_activities(prof)
    del model, step_fn, opt
    torch.cuda.empty_cache()
    if not activities:
        raise NotAvailable("torch.profiler recorded no GPU activity (CUPTI unavailable?)")
    by_class = time_by_class(activities, steps)
    workload = (f"forward + backward + fused AdamW, {cfg.n_layers} blocks dim {cfg.dim} ffn {cfg.ffn_dim} vocab "
                f"{cfg.vocab_size}, {cfg.seq_len} tokens, fp32 parameters, bf16 autocast, torch.compile")
    gap = {"workload": workload, "steps": steps, "kernels": round(len(activities) / steps, 1),
           "idle_us": round(idle_between([a[:2] for a in activities]) / steps, 1),
           "largest_gaps": largest_gaps([a[:3] for a in activities], 3)}
    step = {"workload": workload, "gemms": step_gemms(cfg), "gemm_us": round(by_class.get("gemm", 0.0), 1),
            "attention": {"batch": 1, "heads": cfg.n_heads, "seq": cfg.seq_len, "head_dim": cfg.head_dim,
                          "causal": True, "layers": cfg.n_layers},
            "attention_us": round(by_class.get("attention", 0.0), 1),
            "optimizer": {"params": params, "bytes": ADAMW_BYTES_PER_PARAM * params,
                          "us": round(by_class.get("optimizer", 0.0), 1)},
            "by_class_us": {k: round(v, 1) for k, v in sorted(by_class.items())}}
    return gap, step


def pool_env(max_bytes_per_rank: int, world: int) -> None:
    """Symmetric pool big enough for the in-place all-gather output and a whole reduce-scatter input staged in one
    round (defaults only; explicit CE_OVERLAP_* settings win). Must run before the first rendezvous."""
    mb = -(-max_bytes_per_rank // MIB)
    os.environ.setdefault("CE_OVERLAP_STAGING_MB", str(world * mb))
    os.environ.setdefault("CE_OVERLAP_POOL_MB", str(3 * world * mb + 64))
    os.environ.setdefault("CE_OVERLAP_TIMEOUT_S", "30")


class Collectives:
    """Sets up and runs the collectives that calibrate and bench/cost_model_validation.py measure, on one group.

    Sizes are per rank: all-gather moves a shard of `nbytes` per rank (IR bytes = nbytes), reduce-scatter leaves
    `nbytes` per rank (input world x nbytes = the IR bytes), send/recv moves `nbytes` from rank 0 to rank 1.
    The CE all-gather is the in-place one on symmetric memory (the own shard is not copied), which is what the cost
    model describes."""

    def __init__(self, group, max_bytes: int):
        torch, dist = _torch(), _dist()
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.max_bytes = max_bytes
        self.ce_reason = ""
        self.ce_rs_reason = ""
        self._sym = None
        self._rs_call = None
        self._rs_candidates = None
        try:
            import ce_overlap.runtime as rt

            ok, reason = rt.available()
            if not ok:
                raise NotAvailable(reason)
            rt.rendezvous(group)
            self._sym = rt.empty_symmetric((self.world * (max_bytes // 2),), torch.bfloat16, group)
        except NotAvailable as e:
            self.ce_reason = str(e)
        except Exception as e:  # noqa: BLE001 (CE is optional: report why it is off)
            self.ce_reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if not all_ranks_ok(not self.ce_reason):
            self.ce_reason = self.ce_reason or "the ce_overlap runtime is not available on every rank"
        if self.ce_reason:
            self.ce_rs_reason = self.ce_reason
        else:
            self._rs_candidates, self.ce_rs_reason = self._find_ce_reduce_scatter()
            if not all_ranks_ok(self._rs_candidates is not None):
                self._rs_candidates, self.ce_rs_reason = None, self.ce_rs_reason or "not available on every rank"

    def _find_ce_reduce_scatter(self):
        """(callables to try in order, '') or (None, why not). Each callable is fn(out, inp); check() keeps the first
        that gives NCCL's result."""
        torch = _torch()
        import ce_overlap.runtime as rt

        try:
            op = torch.ops.ce_overlap.reduce_scatter_tensor
        except (AttributeError, RuntimeError):
            return None, "torch.ops.ce_overlap.reduce_scatter_tensor is not in this build of the runtime"
        name = self.group.group_name
        candidates = []
        if hasattr(rt, "reduce_scatter_tensor"):  # the Python wrapper, by analogy with all_gather_into_tensor
            candidates.append(lambda out, inp: rt.reduce_scatter_tensor(out, inp, group=self.group))
        try:  # the functional op: map its schema's arguments by name
            schema = op.default._schema
            args = []
            for a in schema.arguments:
                if str(a.type).startswith("Tensor") and not args:
                    args.append("input")
                elif "op" in a.name:
                    args.append("sum")
                elif a.name == "group_size":
                    args.append(self.world)
                elif a.name == "group_name":
                    args.append(name)
                elif a.has_default_value():
                    break
                else:
                    raise ValueError(f"unknown argument {a.name!r} in {schema}")

            def call(out, inp):
                res = op(*[inp if a == "input" else a for a in args])
                out.copy_(res)  # the functional op returns a new tensor; the copy is a small local kernel

            candidates.append(call)
        except Exception as e:  # noqa: BLE001
            if not candidates:
                return None, f"cannot call torch.ops.ce_overlap.reduce_scatter_tensor: {e}"
        return candidates, ""

    def backends(self, coll: str) -> dict[str, str]:
        """backend -> '' if it can run, else why not."""
        if coll in ("send", "recv"):
            return {"nccl": ""}
        if coll == "all_gather":
            return {"nccl": "", "ce": self.ce_reason}
        return {"nccl": "", "ce": self.ce_rs_reason or ("" if self._rs_call else "not checked against NCCL (verify())")}

    def runner(self, coll: str, backend: str, nbytes: int) -> tuple[Callable[[], None], Callable[[], None]]:
        """(run one op on the current stream, settle) for this collective at `nbytes` per rank."""
        torch, dist = _torch(), _dist()
        count = max(1, nbytes // 2)
        w, g = self.world, self.group
        if backend == "ce":
            import ce_overlap.runtime as rt

            def sync():
                rt.synchronize(g)
                torch.cuda.synchronize()
        else:
            sync = torch.cuda.synchronize
        if coll == "all_gather" and backend == "nccl":
            inp = torch.randint(-8, 8, (count,), device="cuda").to(torch.bfloat16)
            out = torch.empty(w * count, dtype=torch.bfloat16, device="cuda")
            return (lambda: dist.all_gather_into_tensor(out, inp, group=g)), sync
        if coll == "all_gather" and backend == "ce":
            if nbytes > self.max_bytes:
                raise NotAvailable(f"{format_bytes(nbytes)} is above the symmetric buffer's {format_bytes(self.max_bytes)}")
            out = self._sym[: w * count]
            shard = out.view(w, count)[self.rank]
            shard.copy_(torch.randint(-8, 8, (count,), device="cuda").to(torch.bfloat16))
            return (lambda: rt.all_gather_into_tensor(out, shard, g)), sync
        if coll == "reduce_scatter":
            inp = torch.randint(-8, 8, (w * count,), device="cuda").to(torch.bfloat16)
            out = torch.empty(count, dtype=torch.bfloat16, device="cuda")
            if backend == "nccl":
                return (lambda: dist.reduce_scatter_tensor(out, inp, group=g)), sync
            if self._rs_call is None:
                raise NotAvailable(self.ce_rs_reason)
            call = self._rs_call
            return (lambda: call(out, inp)), sync
        if coll in ("send", "recv"):
            buf = torch.zeros(count, dtype=torch.bfloat16, device="cuda")
            if self.rank == 0:
                return (lambda: dist.send(buf, 1, group=g)), sync
            if self.rank == 1:
                return (lambda: dist.recv(buf, 0, group=g)), sync
            return (lambda: None), sync
        raise ValueError((coll, backend))

    def _check(self, coll: str, nbytes: int, rs_call=None) -> str:
        """'' when the CE op gives NCCL's result bit for bit on small integers (exact in bf16), else why not.
        TypeError (a call that does not fit the op) propagates: nothing was enqueued."""
        torch, dist = _torch(), _dist()
        import ce_overlap.runtime as rt

        count = nbytes // 2
        try:
            if coll == "all_gather":
                fn, settle = self.runner(coll, "ce", nbytes)
                fn()
                settle()
                got = self._sym[: self.world * count].clone()
                shard = got.view(self.world, count)[self.rank].contiguous()
                want = torch.empty_like(got)
                dist.all_gather_into_tensor(want, shard, group=self.group)
            else:
                g = torch.Generator(device="cuda")
                g.manual_seed(17 + self.rank)
                inp = torch.randint(-8, 8, (self.world * count,), device="cuda", generator=g).to(torch.bfloat16)
                got = torch.empty(count, dtype=torch.bfloat16, device="cuda")
                want = torch.empty_like(got)
                rs_call(got, inp)
                rt.synchronize(self.group)
                dist.reduce_scatter_tensor(want, inp, group=self.group)
            torch.cuda.synchronize()
            bad = int((got != want).sum().item())
            return "" if bad == 0 else f"{bad} of {got.numel()} elements differ from NCCL's result"
        except TypeError:
            raise
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"

    def verify(self, nbytes: int = 1 << 16) -> dict[str, str]:
        """Checks the CE ops against NCCL once (all ranks agree on the verdict); turns off what fails. Returns
        {what: why} for everything CE that will not be measured."""
        na: dict[str, str] = {}
        if self.ce_reason:
            return {"ce": self.ce_reason}
        try:
            bad = self._check("all_gather", nbytes)
        except TypeError as e:
            bad = f"TypeError: {e}"
        if not all_ranks_ok(not bad):
            self.ce_reason = self.ce_rs_reason = f"wrong result: {bad or 'on another rank'}"
            self._rs_candidates = None
            return {"ce": self.ce_reason}
        errors = []
        for call in self._rs_candidates or []:
            try:
                bad = self._check("reduce_scatter", nbytes, call)
            except TypeError as e:  # this way of calling does not fit the op; try the next
                bad = f"TypeError: {str(e).splitlines()[0][:200]}"
            if all_ranks_ok(not bad):
                self._rs_call = call
                break
            errors.append(bad or "wrong result on another rank")
        if self._rs_candidates is not None and self._rs_call is None:
            self.ce_rs_reason = "; ".join(errors)
        if self.ce_rs_reason:
            na["ce reduce_scatter"] = self.ce_rs_reason
        return na


def measure_beside(compute_fn, coll_fn, settle, compute_alone_us: float, coll_alone_us: float,
                   iters: int) -> tuple[float, float]:
    """Compute kernels on the current stream, the collective back to back on a side stream, both timed per op with
    CUDA events; enqueued interleaved so the side stream always has work queued ahead of the compute. Returns
    (median compute us among the kernels that ran entirely beside collectives, median collective us among those
    that ran entirely beside compute), max over ranks."""
    torch = _torch()
    compute = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(compute)
    for _ in range(2):
        compute_fn()
    ref = torch.cuda.Event(enable_timing=True)
    ref.record()
    side.wait_stream(compute)
    c_ev, s_ev = [], []
    lead = 2
    n_target = lead + math.ceil(1.5 * iters * compute_alone_us / max(coll_alone_us, 1e-3)) + 2
    queued = 0.0

    def one_collective():
        nonlocal queued
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            a.record()
            coll_fn()
            b.record()
        s_ev.append((a, b))
        queued += coll_alone_us

    for _ in range(lead):
        one_collective()
    for i in range(iters):
        while queued < (i + 1 + lead) * compute_alone_us and len(s_ev) < n_target:
            one_collective()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        compute_fn()
        b.record()
        c_ev.append((a, b))
    while len(s_ev) < n_target:
        one_collective()
    compute.wait_stream(side)
    settle()
    torch.cuda.synchronize()
    cs = [(ref.elapsed_time(a), ref.elapsed_time(b)) for a, b in c_ev]
    ss = [(ref.elapsed_time(a), ref.elapsed_time(b)) for a, b in s_ev]
    s_lo, s_hi = ss[0][0], ss[-1][1]
    c_lo, c_hi = cs[0][0], cs[-1][1]
    comp = [(b - a) * 1e3 for a, b in cs if a >= s_lo and b <= s_hi] or [(b - a) * 1e3 for a, b in cs]
    coll = [(b - a) * 1e3 for a, b in ss if a >= c_lo and b <= c_hi] or [(b - a) * 1e3 for a, b in ss]
    return max_over_ranks(statistics.median(comp)), max_over_ranks(statistics.median(coll))


def measure_reduction_kernel(iters: int, warmup: int) -> dict:
    """The CE reduce-scatter's reduction kernel (out = a + b, bf16, 256 MiB operands, on the runtime's CTA count,
    CE_OVERLAP_REDUCE_SMS) alone, and the bf16 GEMM and the memory-bound add each beside it running non-stop: what
    ce.reduce_gbps_per_sm and contention.ce_reduction come from. One GPU is enough."""
    torch = _torch()
    from . import runtime

    lib = runtime.library_loaded()
    if not lib:
        raise NotAvailable(f"CE runtime unavailable ({lib.reason})")
    if not hasattr(torch.ops.ce_overlap, "_reduce_bench"):
        raise NotAvailable("the CE runtime has no _reduce_bench op")
    ctas = int(float(os.environ.get("CE_OVERLAP_REDUCE_SMS", "32")))
    numel = 256 * MIB // 2
    a = torch.randn(numel, device="cuda").to(torch.bfloat16)
    b = torch.randn(numel, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(a)

    def kernel():
        torch.ops.ce_overlap._reduce_bench(out, a, b, ctas)

    k_us = median_us(kernel, iters, warmup)
    r: dict = {"ctas": ctas, "bytes": 3 * numel * 2, "us": k_us}
    for compute in COMPUTE_KINDS:
        cfn, _ = make_compute(compute)
        alone = median_us(cfn, iters, warmup)
        beside, _ = measure_beside(cfn, kernel, torch.cuda.synchronize, alone, k_us, iters)
        r[compute] = {"alone_us": alone, "beside_us": beside}
        del cfn
        torch.cuda.empty_cache()
    return r


def measure_peer_copy(nbytes: int = 256 * MIB, iters: int = 5) -> dict:
    """One-way cudaMemcpy from this process's GPU into the next visible one (torch copy between devices: peer
    access, not a ce_overlap collective). Only the link's bandwidth is taken from it."""
    torch = _torch()
    src = torch.cuda.current_device()
    dst = (src + 1) % torch.cuda.device_count()
    if dst == src:
        raise NotAvailable("one visible GPU")
    if not torch.cuda.can_device_access_peer(src, dst):
        raise NotAvailable(f"no P2P between cuda:{src} and cuda:{dst}")
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{d}") for d in (src, dst)]
    us = statistics.median(time_each_us(lambda: bufs[1].copy_(bufs[0], non_blocking=True), iters, 2,
                                        lambda: (torch.cuda.synchronize(src), torch.cuda.synchronize(dst))))
    bufs.clear()
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "us": us, "from": src, "to": dst}


def _sizes(lo: int, hi: int, factor: int = 4) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    if out[-1] != hi:
        out.append(hi)
    return out


def _versions() -> dict:
    torch = _torch()
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001
        nccl = "unknown"
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl, "python": platform.python_version()}


def measure(args, progress_enabled: bool = True) -> dict:
    """Every measurement of `ce-overlap calibrate` (all ranks call it; the dict is only meaningful on rank 0)."""
    torch, dist = _torch(), _dist()
    world = dist.get_world_size() if dist else 1
    rank = dist.get_rank() if dist else 0
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    sizes = _sizes(parse_size(args.min_size), parse_size(args.max_size))
    slow_bytes = parse_size(args.slowdown_size)
    m: dict = {"schema": MEASUREMENTS_SCHEMA, "gpu": {"name": props.name, "sms": props.multi_processor_count,
                                                    "memory_gib": props.total_memory / 2 ** 30, "visible": torch.cuda.device_count()},
               "world_size": world, "host": platform.node(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
               "versions": _versions(), "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "iters": args.iters, "warmup": args.warmup, "gemm": [], "collectives": [], "slowdowns": [],
               "skipped": {}}
    colls = ["all_gather", "reduce_scatter", "send"] if world > 1 else []
    n_points = len(sizes) * (2 * 2 + 1) if world > 1 else 0
    n_slow = 4 * 2 if world > 1 else 0
    prog = Progress(len(GEMM_SIZES) + 7 + n_points + n_slow + 2, enabled=progress_enabled and rank == 0)
    prog.show("starting")

    for n in GEMM_SIZES:
        fn, work = make_compute(f"gemm{n}")
        m["gemm"].append({"n": n, "us": median_us(fn, args.iters, args.warmup)})
        del fn
        prog.step(f"bf16 GEMM {n}^3")
    fn, work = make_compute("memory_bound")
    m["memory_bound"] = {"bytes": work["bytes"], "us": median_us(fn, args.iters, args.warmup)}
    del fn
    torch.cuda.empty_cache()
    prog.step("memory-bound add")
    m["attention"] = measure_attention(args.iters, args.warmup)
    prog.step("causal attention")
    m["transformer_gemms"] = measure_transformer_gemms(args.iters, args.warmup)
    prog.step("transformer GEMMs")
    m["optimizer"] = measure_optimizer(args.iters, args.warmup)
    prog.step("fused AdamW")
    try:
        m["memory_kernels"] = measure_memory_kernels(args.iters, args.warmup)
    except Exception as e:  # noqa: BLE001 (torch.compile may be unusable here; the 1 GiB add then sets the efficiency)
        m["skipped"]["memory kernels"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    prog.step("memory-bound kernels")
    try:
        m["reduction_kernel"] = measure_reduction_kernel(args.iters, args.warmup)
    except NotAvailable as e:
        m["skipped"]["CE reduction kernel"] = str(e)
    except Exception as e:  # noqa: BLE001
        m["skipped"]["CE reduction kernel"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    prog.step("CE reduction kernel")
    try:
        m["kernel_gap"], m["training_step"] = measure_training_step(args.warmup)
    except NotAvailable as e:
        m["skipped"]["training step"] = str(e)
    except Exception as e:  # noqa: BLE001 (torch.compile may be unusable here; the base profile's values are kept)
        m["skipped"]["training step"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    torch.cuda.empty_cache()
    prog.step("a compiled training step")

    if world == 1:
        m["skipped"]["collectives"] = ("1 GPU: no NCCL/CE curves and no contention (run under torchrun "
                                       "--nproc-per-node N for them)")
    else:
        group = dist.group.WORLD
        cols = Collectives(group, max(max(sizes), slow_bytes))
        m["skipped"].update(cols.verify())
        if cols._rs_call is not None:
            m["ce_reduce_sms"] = int(float(os.environ.get("CE_OVERLAP_REDUCE_SMS", "32")))  # the runtime default
        for coll in colls:
            for backend, reason in cols.backends(coll).items():
                if reason:
                    for _ in sizes:
                        prog.step(f"{coll} {backend}: skipped")
                    continue
                pts = []
                for nbytes in sizes:
                    fn, settle = cols.runner(coll, backend, nbytes)
                    dist.barrier()
                    us = median_us(fn, args.iters, args.warmup, settle)
                    ir_bytes = world * nbytes if coll == "reduce_scatter" else nbytes
                    pts.append([ir_bytes, us])
                    del fn
                    prog.step(f"{coll} {backend} {format_bytes(nbytes)}")
                if coll == "send":
                    m["collectives"].append({"collective": "send", "backend": backend, "group_size": world, "points": pts})
                    m["collectives"].append({"collective": "recv", "backend": backend, "group_size": world,
                                             "points": [list(p) for p in pts]})
                else:
                    m["collectives"].append({"collective": coll, "backend": backend, "group_size": world, "points": pts})
        torch.cuda.empty_cache()
        m["slowdowns"] = measure_slowdowns(cols, slow_bytes, args.iters, args.warmup, prog)
    try:
        if rank == 0:
            m["peer_copy"] = measure_peer_copy()
    except NotAvailable as e:
        m["skipped"]["peer copy"] = str(e)
    except Exception as e:  # noqa: BLE001
        m["skipped"]["peer copy"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    if dist:
        dist.barrier()
    prog.step("peer copy")
    m["progress"] = prog
    return m


def measure_slowdowns(cols: Collectives, nbytes: int, iters: int, warmup: int, prog: Progress | None = None,
                      pairs: list[tuple[str, str]] | None = None) -> list[dict]:
    """GEMM (bf16 8192^3) and memory-bound slowdowns beside each collective/backend at `nbytes` per rank, and the
    collective's own time beside them."""
    torch, dist = _torch(), _dist()
    out = []
    pairs = pairs or [("all_gather", "nccl"), ("all_gather", "ce"), ("reduce_scatter", "nccl"), ("reduce_scatter", "ce")]
    for compute in ("gemm", "memory_bound"):
        cfn, _ = make_compute(compute)
        for coll, backend in pairs:
            reason = cols.backends(coll).get(backend, "unknown backend")
            if reason:
                if prog:
                    prog.step(f"{compute} beside {coll} {backend}: skipped")
                continue
            fn, settle = cols.runner(coll, backend, nbytes)
            dist.barrier()
            coll_alone = median_us(fn, iters, warmup, settle)
            comp_alone = median_us(cfn, iters, warmup)
            dist.barrier()
            comp_beside, coll_beside = measure_beside(cfn, fn, settle, comp_alone, coll_alone, iters)
            out.append({"collective": coll, "backend": backend, "group_size": cols.world,
                        "bytes": cols.world * nbytes if coll == "reduce_scatter" else nbytes,
                        "bytes_per_rank": nbytes, "compute": compute, "compute_alone_us": comp_alone,
                        "compute_beside_us": comp_beside, "collective_alone_us": coll_alone,
                        "collective_beside_us": coll_beside})
            del fn
            if prog:
                prog.step(f"{compute} beside {coll} {backend}: {(comp_beside / comp_alone - 1) * 100:+.1f}%")
        del cfn
        torch.cuda.empty_cache()
    return out


# =================================================================================================================
# The command

def _base_profile(name: str | None, gpu_name: str) -> dict:
    from . import profiles

    base = name or profiles.builtin_for_device(gpu_name)
    if base is None:
        raise CeOverlapError(f"no built-in profile for {gpu_name!r}: pass --base with the closest one "
                             f"({', '.join(profiles.names())}) or a profile file")
    return json.loads(profiles.read_text(base))


def _detect_topology(world: int) -> tuple[dict | None, str]:
    from . import _core, topo

    try:
        d = topo.detect()
        if d is None:
            return None, "no GPUs visible"
        t = json.loads(_core.check_topology(json.dumps(topo.topology_json(d))))
        return t, ""
    except CeOverlapError as e:
        return None, str(e)


def _finish_profile(args, m: dict) -> int:
    base = _base_profile(args.base, m["gpu"]["name"])
    prof, notes = build_profile(base, m, name=args.name, keep_topology=args.keep_topology)
    write_profile(args.output, prof)
    print(f"wrote {args.output}: profile {prof['name']!r} ({prof.get('schema')}), loaded back through the C++ loader: ok")
    print(f"  {m['world_size']} x {m['gpu']['name']} ({m['gpu']['sms']} SMs), started from {base['name']!r}")
    for line in notes:
        print(f"  {line}")
    for what, why in m.get("skipped", {}).items():
        print(f"  skipped {what}: {why}")
    report = fit_report(prof, m)
    if report:
        print("  measured vs the written profile:")
        for line in report:
            print(f"    {line}")
    print(f"use it: ce-overlap analyze MODEL --profile {args.output}")
    return 0


def main(args) -> int:
    """`ce-overlap calibrate` (cli.py parses the arguments). Exit 0 on success, 2 with one line on bad input,
    no GPU, or inconsistent measurements."""
    if args.from_measurements:
        try:
            with open(args.from_measurements, encoding="utf-8") as f:
                m = json.load(f)
        except json.JSONDecodeError as e:
            raise CeOverlapError(f"{args.from_measurements}: malformed JSON: {e}") from None
        return _finish_profile(args, m)
    for text in (args.min_size, args.max_size, args.slowdown_size):
        parse_size(text)
    if parse_size(args.min_size) > parse_size(args.max_size):
        raise CeOverlapError(f"--min-size {args.min_size} is larger than --max-size {args.max_size}")
    under_torchrun = "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ
    env_world = int(os.environ.get("WORLD_SIZE", "1")) if under_torchrun else 1
    if args.gpus and args.gpus > 1 and not under_torchrun:
        raise CeOverlapError(f"--gpus {args.gpus} needs one process per GPU: run `torchrun --standalone "
                             f"--nproc-per-node {args.gpus} -m ce_overlap.cli calibrate -o {args.output}` "
                             f"(a plain `ce-overlap calibrate` calibrates 1 GPU and skips the collectives)")
    if under_torchrun and int(os.environ.get("LOCAL_WORLD_SIZE", env_world)) != env_world:
        raise CeOverlapError("calibrate measures one node (CE lives inside one NVLink domain): run torchrun with "
                             "--nnodes 1")
    if args.gpus and under_torchrun and args.gpus != env_world:
        raise CeOverlapError(f"--gpus {args.gpus} but torchrun started {env_world} processes")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast: calibrate what the runtime uses
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch = _torch()
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise CeOverlapError("calibrate needs a CUDA GPU and none is visible (torch.cuda.is_available() is False); "
                             "`--from-measurements FILE` builds a profile from saved measurements without one")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= torch.cuda.device_count():
        raise CeOverlapError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPU(s) are visible")
    torch.cuda.set_device(local_rank)
    dist = None
    if under_torchrun and env_world > 1:
        import torch.distributed as dist
        from datetime import timedelta

        pool_env(max(parse_size(args.max_size), parse_size(args.slowdown_size)), env_world)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=timedelta(seconds=180))
    rank = dist.get_rank() if dist else 0
    try:
        if rank == 0 and not under_torchrun and torch.cuda.device_count() > 1:
            print(f"calibrate: 1 process, so 1 GPU of {torch.cuda.device_count()}: collectives skipped (run under "
                  f"`torchrun --standalone --nproc-per-node {torch.cuda.device_count()} -m ce_overlap.cli calibrate` "
                  f"for NCCL/CE curves and contention)", file=sys.stderr)
        elif rank == 0 and env_world == 1:
            print("calibrate: 1 GPU: collectives and contention skipped", file=sys.stderr)
        m = measure(args)
        prog = m.pop("progress")
        if rank != 0:
            return 0 if dist is None or all_ranks_ok(True) else 2  # rank 0 says why
        ok = False
        try:
            topo_json, why = _detect_topology(env_world)
            m["topology"] = topo_json
            if topo_json is None:
                m["skipped"]["topology"] = why
            if args.measurements:
                with open(args.measurements, "w", encoding="utf-8") as f:
                    json.dump(m, f, indent=1)
            prog.step("profile")
            prog.close()
            rc = _finish_profile(args, m)
            ok = True
            return rc
        finally:
            if dist:
                all_ranks_ok(ok)  # the other ranks wait here for rank 0's verdict
    finally:
        if dist and dist.is_initialized():
            dist.destroy_process_group()
