"""`check_measurements`: a measurements dict (schema ce_overlap.calibration/1, what `calibrate --measurements`
writes) validated field by field before anything is fitted from it. Plain dicts, no torch, no GPU."""
from __future__ import annotations

import copy
import math

from ..errors import CeOverlapError
from .common import (COLLECTIVES, COMPUTE_KINDS, MAX_DECREASE, MAX_DECREASE_US, MEASUREMENTS_SCHEMA, MIN_SLOWDOWN,
                     format_bytes, inconsistent_drop)


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
    world = _check_gpu_and_world(m)
    _check_compute(m)
    if m.get("training_step") is not None:
        _check_training_step(m["training_step"])
    _check_layer_kernels(m)
    if m.get("compute_grid") is not None:
        _check_compute_grid(m["compute_grid"])
    _check_collectives(m, world, notes)
    _check_reduction_kernel(m)
    _check_slowdowns(m, world)
    return m, notes


def _check_gpu_and_world(m: dict) -> int:
    """gpu.{name, sms, memory_gib} and world_size; returns the world size."""
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
    return int(world)


def _check_compute(m: dict) -> None:
    """The one-GPU measurements: gemm, memory_bound, peer_copy, optimizer, attention, kernel_gap."""
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


def _check_training_step(ts) -> None:
    """training_step: its GEMM list and time, its attention's shape and time, its optimizer."""
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
    if ts.get("clock") is not None:  # optional: the SM clock and power the step ran at
        if not isinstance(ts["clock"], dict):
            raise CeOverlapError("measurements: training_step.clock: expected an object {sm_mhz, power_w}")
        for key in ("sm_mhz", "power_w"):
            _path_num(ts["clock"], key, "training_step.clock")
    if ts.get("optimizer") is not None:
        _path_num(ts["optimizer"], "bytes", "training_step.optimizer")
        _path_num(ts["optimizer"], "us", "training_step.optimizer")
    for key in ("by_kind_us",):  # optional: time per kind of kernel
        if ts.get(key) is None:
            continue
        if not isinstance(ts[key], dict):
            raise CeOverlapError(f"measurements: training_step.{key}: expected an object {{kind: number}}")
        for kind in ts[key]:
            _path_num(ts[key], kind, f"training_step.{key}", strict=False)


def _check_layer_kernels(m: dict) -> None:
    """memory_kernels and transformer_gemms: the kernels at a training step's shapes."""
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


def _check_compute_grid(grid) -> None:
    """compute_grid (calibrate --compute-grid): GEMMs, attention shapes, memory-bound kernels, the tiny-kernel time."""
    if not isinstance(grid, dict):
        raise CeOverlapError("measurements: compute_grid: expected an object")
    fields = {"gemms": ("m", "n", "k", "us"), "attention": ("batch", "heads", "seq", "head_dim", "forward_us",
                                                             "backward_us"),
              "memory": ("mib", "bytes", "us")}
    for part, keys in fields.items():
        rows = _path_list(grid, part, "compute_grid")
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise CeOverlapError(f"measurements: compute_grid.{part}[{i}]: expected an object")
            for key in keys:
                _path_num(row, key, f"compute_grid.{part}[{i}]")
    for i, g in enumerate(grid.get("gemms", [])):
        if g.get("layout") not in ("nt", "nn", "tn"):
            raise CeOverlapError(f"measurements: compute_grid.gemms[{i}].layout: expected 'nt', 'nn' or 'tn', got "
                                 f"{g.get('layout')!r}")
    _path_num(grid, "tiny_kernel_us", "compute_grid")


def _check_collectives(m: dict, world: int, notes: list[str]) -> None:
    """collectives: one curve per (collective, backend, group size), its points cleaned in place."""
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
        c["points"] = _clean_points(c.get("points"), p, key, notes)
        c["group_size"] = int(n)


def _clean_points(pts, p: str, key: tuple, notes: list[str]) -> list[list]:
    """A curve's [bytes, us] points: sizes increasing, times never dropping by more than MAX_DECREASE or
    MAX_DECREASE_US, whichever is more (smaller dips raised to the running maximum, with a note)."""
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
            if inconsistent_drop(running, us):
                raise CeOverlapError(
                    f"measurements: {pp}[1]: {key[0]} on {key[1]} took {us:.1f} us at {format_bytes(b)}, "
                    f"{(1 - us / running) * 100:.0f}% less than {running:.1f} us at a smaller size: "
                    f"inconsistent (more than {MAX_DECREASE:.0%} and {MAX_DECREASE_US:.0f} us); measure again")
            notes.append(f"{key[0]}/{key[1]}/{key[2]}: {us:.1f} us at {format_bytes(b)} raised to {running:.1f} us "
                         f"(below a smaller size's time, within noise)")
            us = running
        running = max(running, us)
        clean.append([int(b), us])
    return clean


def _check_reduction_kernel(m: dict) -> None:
    """reduction_kernel: the CE reduction kernel alone and each compute kind beside it."""
    rk = m.get("reduction_kernel")
    if rk is None:
        return
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


def _check_slowdowns(m: dict, world: int) -> None:
    """slowdowns: compute beside a collective, never much faster than alone."""
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
