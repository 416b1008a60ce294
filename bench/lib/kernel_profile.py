"""bench/train.py --kernel-profile: the GPU kernel time of a training step by class, and the per-mode table of the
GEMM time beside the collectives (from torch.profiler traces, through ce_overlap.gpu_trace)."""
from __future__ import annotations

import time

from lib.common import log0  # first: it sets the NCCL / symm-mem environment before torch loads

import torch  # noqa: E402
from ce_overlap.calibrate.timing import sm_clock_and_power  # noqa: E402
from ce_overlap.gpu_trace import (  # noqa: E402
    compute_stream_wait, gpu_activities, idle_between, kernel_class, largest_gaps, time_by_class)


def profile_kernels(run_step, steps: int, lead: int = 0) -> dict:
    """GPU kernel time per step by class (ms; kernels on different streams overlap, so the sum is busy time, not
    wall time), the steps' wall time, the 12 kernels that took longest and the time of the 200 longest by name.
    `lead`: steps run back to back, unrecorded, right before the recorded ones (and one more as the profiler's warm-up),
    so these run at the clock the board holds under sustained load, as the timed steps do; a step recorded after
    the GPU sat idle runs at its boost clock (on 4x H200 at its 700 W limit: 1480-1670 MHz in the timed steps)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA],
                 schedule=schedule(wait=lead, warmup=1, active=steps, repeat=1) if lead else None) as prof:
        t0 = time.perf_counter()
        clock = None
        for i in range(lead + 1 + steps if lead else steps):
            run_step()
            if i == (lead + steps if lead else steps - 1):
                clock = sm_clock_and_power()  # the recorded steps are queued: the GPU runs them meanwhile
            if lead and i in (lead, lead + steps):
                # The host runs a step ahead of the GPU, and prof.step() starts or stops recording at once: without
                # a sync the warm-up step's kernels would be counted (2026-11-27-c: busy 472 ms in a 381 ms no-comm
                # step) and the last recorded step's would be cut. The GPU idles for a sync, too short to change
                # its clock.
                torch.cuda.synchronize()
                if i == lead:
                    t0 = time.perf_counter()
                else:
                    t1 = time.perf_counter()
            if lead:
                prof.step()
        torch.cuda.synchronize()
        if not lead:
            t1 = time.perf_counter()
    wall_ms = 1e3 * (t1 - t0) / steps
    activities = gpu_activities(prof)
    by_class = {cls: us / 1e3 for cls, us in time_by_class(activities, steps).items()}
    by_name: dict[str, float] = {}
    by_stream: dict[int, list] = {}  # the compute classes' kernels per stream (device_resource_id: the stream)
    for start, end, name, stream in activities:
        by_name[name] = by_name.get(name, 0.0) + (end - start) / 1e3 / steps
        if kernel_class(name) in COMPUTE_CLASSES:
            by_stream.setdefault(stream, []).append((start, end))
    spans = [(start, end) for start, end, _, _ in activities]
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {"steps": steps, "wall_ms": round(wall_ms, 3), "by_class_ms": {k: round(v, 3) for k, v in
                                                                         sorted(by_class.items())},
            "busy_ms": round(sum(by_class.values()), 3),
            "clock": clock,  # SM MHz and board W while the recorded steps ran (None where nothing could say)
            "activities_per_step": round(len(spans) / steps, 1),
            "gpu_idle_ms": round(idle_between(spans) / 1e3 / steps, 3),
            # The compute stream (most compute-class kernel time) idle while another stream works: mostly waiting
            # for collectives (exposed communication), what the plan's exposed_comm_us predicts.
            "compute_wait_ms": round(compute_stream_wait(spans, by_stream) / 1e3 / steps, 3),
            # Where the GPU waited longest (steps after the first include the boundary between two steps).
            "largest_gaps": largest_gaps([a[:3] for a in activities], 8),
            "top": [{"name": n[:160], "class": kernel_class(n), "ms": round(v, 3)} for n, v in top],
            # Every kernel name's time (the 200 longest): maps a class's error in bench/step_prediction.py to ops.
            "by_name_ms": {n[:200]: round(v, 4) for n, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:200]}}


def rank_summary(r: dict) -> str:
    """One rank's entry of a kernel profile's `by_rank`: busy / GEMM ms per step, and the SM MHz and W it ran at."""
    clock = f" ({r['clock']['sm_mhz']:.0f}, {r['clock']['power_w']:.0f})" if r.get("clock") else ""
    return f"{r['busy_ms']:.1f} / {r['by_class_ms'].get('gemm', 0.0):.1f}{clock}"


def export_trace(run_step, steps: int, trace_dir: str, mode: str, rank: int) -> str:
    """`steps` steps under torch.profiler with CPU and GPU activities, written by every rank as Chrome trace JSON
    (gzip): rank 0 to trace_dir/trace-MODE.json.gz, rank R to trace-MODE-rankR.json.gz (a wait on a peer shows in
    both ranks' timelines); returns the path."""
    import os

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run_step()
        torch.cuda.synchronize()
    suffix = "" if rank == 0 else f"-rank{rank}"
    path = os.path.join(trace_dir, f"trace-{mode.replace('+', '_')}{suffix}.json.gz")
    write_trace(prof, path)
    return path


def write_trace(prof, path: str) -> None:
    """A finished torch.profiler run as Chrome trace JSON, gzipped, at `path` (its folder made as needed)."""
    import gzip
    import os
    import shutil
    import tempfile

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        raw = tmp.name
    try:
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    finally:
        os.remove(raw)


# Kernel classes that are the model's compute (what runs on the compute stream); copies and NCCL kernels are not.
COMPUTE_CLASSES = ("gemm", "attention", "fused", "optimizer")


def log_kernel_table(results: list) -> None:
    """With --kernel-profile: per mode, the GPU busy time per step of the GEMMs beside the collectives (NCCL kernels,
    copy-engine copies) and the time the compute stream waited on them (rank 0, ms per step)."""
    profiled = [r for r in results if r.ok and r.kernels]
    if not profiled:
        return
    log0("")
    log0(f"{'kernels, ms/step (rank 0)':<26}{'GEMM':>9}{'attention':>10}{'NCCL':>9}{'copies':>9}{'copy kern.':>11}"
         f"{'compute wait':>13}{'wall':>9}")
    for r in profiled:
        cls = r.kernels["by_class_ms"]
        log0(f"{r.mode:<26}{cls.get('gemm', 0.0):9.2f}{cls.get('attention', 0.0):10.2f}"
             f"{cls.get('collective', 0.0):9.2f}{cls.get('copy', 0.0):9.2f}{cls.get('copy_kernel', 0.0):11.2f}"
             f"{r.kernels['compute_wait_ms']:13.2f}{r.kernels['wall_ms']:9.1f}")
    log0("# copies: memcpy / memset (copy engines); copy kern.: copies run as SM kernels (FSDP2's copy-in / copy-out, "
         "casts)")
