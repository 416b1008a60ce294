"""`measure`: every measurement of `ce-overlap calibrate` on this machine, in the order it runs them, into one
measurements dict (schema ce_overlap.calibration/1) that check.py validates and fit.py turns into a profile. All
ranks call it; the dict is only meaningful on rank 0. torch is imported when it runs, not when this loads."""
from __future__ import annotations

import os
import platform
import sys
import time

from .collectives import Collectives, measure_slowdowns
from .common import (GEMM_SIZES, MEASUREMENTS_SCHEMA, REMEASURES, Progress, format_bytes, inconsistent_drop, one_line,
                     parse_size)
from .kernels import (make_compute, measure_attention, measure_compute_grid, measure_memory_kernels, measure_optimizer,
                      measure_peer_copy, measure_reduction_kernel, measure_transformer_gemms)
from .step import measure_training_step
from .timing import NotAvailable, dist_if_initialized, median_us, torch_module


def _sizes(lo: int, hi: int, factor: int = 4) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    if out[-1] != hi:
        out.append(hi)
    return out


def _versions() -> dict:
    torch = torch_module()
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001
        nccl = "unknown"
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl, "python": platform.python_version()}


def measure(args, progress_enabled: bool = True) -> dict:
    """Every measurement of `ce-overlap calibrate` (all ranks call it; the dict is only meaningful on rank 0)."""
    torch, dist = torch_module(), dist_if_initialized()
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
    n_points = len(sizes) * (2 * 2 + 1) if world > 1 else 0
    n_slow = 4 * 2 if world > 1 else 0
    grid = bool(getattr(args, "compute_grid", False))
    prog = Progress(len(GEMM_SIZES) + 7 + n_points + n_slow + 2 + grid, enabled=progress_enabled and rank == 0)
    prog.show("starting")

    _measure_kernels(m, args, prog)
    _measure_optional_kernels(m, args, prog)
    if grid:  # compute by shape (issue 55): measured and recorded; the profile's efficiencies do not use it yet
        m["compute_grid"] = measure_compute_grid(args.iters, args.warmup)
        prog.step("compute grid")
    if world == 1:
        m["skipped"]["collectives"] = ("1 GPU: no NCCL/CE curves and no contention (run under torchrun "
                                       "--nproc-per-node N for them)")
    else:
        _measure_collectives(m, args, prog, sizes, slow_bytes)
    # The other ranks wait on the host while rank 0 copies: a rank waiting in an NCCL barrier spins a kernel on the
    # receiving GPU, which slowed the copy 3.5x (112 against 388 GB/s, 2x H200, 2026-11-27).
    host_group = dist.new_group(backend="gloo") if dist else None
    if dist:
        dist.barrier()
        torch.cuda.synchronize()
        dist.barrier(group=host_group)
    try:
        if rank == 0:
            m["peer_copy"] = measure_peer_copy()
    except NotAvailable as e:
        m["skipped"]["peer copy"] = str(e)
    except Exception as e:  # noqa: BLE001
        m["skipped"]["peer copy"] = one_line(e)
    if dist:
        dist.barrier(group=host_group)
        dist.destroy_process_group(host_group)
    prog.step("peer copy")
    m["progress"] = prog
    return m


def _measure_kernels(m: dict, args, prog: Progress) -> None:
    """The compute measurements every run has: square GEMMs, the 1 GiB add, attention, transformer GEMMs, AdamW."""
    torch = torch_module()
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


def _measure_optional_kernels(m: dict, args, prog: Progress) -> None:
    """The measurements a run may lack (torch.compile, the CE runtime or CUPTI unusable here): each one's reason
    goes into m["skipped"] instead."""
    torch = torch_module()
    try:
        m["memory_kernels"] = measure_memory_kernels(args.iters, args.warmup)
    except Exception as e:  # noqa: BLE001 (torch.compile may be unusable here; the 1 GiB add then sets the efficiency)
        m["skipped"]["memory kernels"] = one_line(e)
    prog.step("memory-bound kernels")
    try:
        m["reduction_kernel"] = measure_reduction_kernel(args.iters, args.warmup)
    except NotAvailable as e:
        m["skipped"]["CE reduction kernel"] = str(e)
    except Exception as e:  # noqa: BLE001
        m["skipped"]["CE reduction kernel"] = one_line(e)
    prog.step("CE reduction kernel")
    try:
        m["kernel_gap"], m["training_step"] = measure_training_step(args.warmup)
    except NotAvailable as e:
        m["skipped"]["training step"] = str(e)
    except Exception as e:  # noqa: BLE001 (torch.compile may be unusable here; the base profile's values are kept)
        m["skipped"]["training step"] = one_line(e)
    torch.cuda.empty_cache()
    prog.step("a compiled training step")


def remeasure_stalls(pts: list, sizes: list[int], measure) -> None:
    """A curve's points ([bytes, us] per size of `sizes`, in order) whose time is inconsistent with a larger size's
    (check's rule, common.inconsistent_drop) measured again with `measure(size)`, up to REMEASURES times, each keeping
    the lower median: a stall of the GPU or the host during one size's ops only adds time (4x H200, 2026-11-28: a
    send took 42.6 us at a smaller size and 15.9 at 1 MiB, and the whole calibration stopped). The times are max over
    ranks, so every rank picks the same points and the collectives stay matched."""
    for _ in range(REMEASURES):
        stalled = [i for i in range(len(pts)) if any(inconsistent_drop(pts[i][1], later[1]) for later in pts[i + 1:])]
        if not stalled:
            return
        for i in stalled:
            pts[i][1] = min(pts[i][1], measure(sizes[i]))


def _measure_collectives(m: dict, args, prog: Progress, sizes: list[int], slow_bytes: int) -> None:
    """The NCCL and CE curves per size on the whole group, then the slowdowns beside them at `slow_bytes`."""
    torch, dist = torch_module(), dist_if_initialized()
    world = dist.get_world_size()
    group = dist.group.WORLD
    cols = Collectives(group, max(max(sizes), slow_bytes))
    m["skipped"].update(cols.verify())
    if cols.ce_reduce_scatter_verified:
        import ce_overlap.runtime as rt

        m["ce_reduce_sms"] = int(rt.config_of(group).reduce_sms)  # what the group's reduction kernel ran on
    for coll in ("all_gather", "reduce_scatter", "send"):
        for backend, reason in cols.backends(coll).items():
            if reason:
                for _ in sizes:
                    prog.step(f"{coll} {backend}: skipped")
                continue
            def measure(nbytes: int) -> float:
                fn, settle = cols.runner(coll, backend, nbytes)
                dist.barrier()
                return median_us(fn, args.iters, args.warmup, settle)

            pts = []
            for nbytes in sizes:
                pts.append([world * nbytes if coll == "reduce_scatter" else nbytes, measure(nbytes)])
                prog.step(f"{coll} {backend} {format_bytes(nbytes)}")
            remeasure_stalls(pts, sizes, measure)
            if coll == "send":
                m["collectives"].append({"collective": "send", "backend": backend, "group_size": world, "points": pts})
                m["collectives"].append({"collective": "recv", "backend": backend, "group_size": world,
                                         "points": [list(p) for p in pts]})
            else:
                m["collectives"].append({"collective": coll, "backend": backend, "group_size": world, "points": pts})
    torch.cuda.empty_cache()
    m["slowdowns"] = measure_slowdowns(cols, slow_bytes, args.iters, args.warmup, prog)
