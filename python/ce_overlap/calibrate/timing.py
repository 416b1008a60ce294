"""Timing on the GPU (torch, imported lazily so the package loads on a CPU machine): per-op device times from CUDA
events with the stream given a head start, medians max over ranks, and a kernel's time beside a second stream's
work. Every rank runs the same sequence; times are medians per rank, then the max over ranks."""
from __future__ import annotations

import math
import statistics
from typing import Callable

class NotAvailable(Exception):
    """A backend or op that cannot run here; the reason is reported and the run goes on without it."""


def torch_module():
    """torch, imported on first use (the package itself must import without it)."""
    import torch

    return torch


def dist_if_initialized():
    """torch.distributed when a process group is up, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def sm_clock_and_power() -> dict | None:
    """This GPU's SM clock (MHz) and board power (W) now, from NVML through torch where pynvml is installed, else from
    nvidia-smi; None where neither answers. A board at its power limit holds a lower clock under sustained load than
    in a burst (4x H200, 32-layer steps: 1465-1850 MHz by what runs beside the compute, bench/results/
    step-prediction-2026-11-27-c), so a measurement of kernel speed says at which clock it ran."""
    import subprocess

    torch = torch_module()
    try:
        return {"sm_mhz": float(torch.cuda.clock_rate()), "power_w": round(torch.cuda.power_draw() / 1e3, 1)}
    except Exception:  # noqa: BLE001 (no pynvml here: ask nvidia-smi)
        pass
    try:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        bus = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"  # as nvidia-smi names it
        out = subprocess.run(["nvidia-smi", f"--id={bus}", "--query-gpu=clocks.sm,power.draw",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout
        mhz, watts = (float(v) for v in out.strip().split(","))
        return {"sm_mhz": mhz, "power_w": watts}
    except Exception:  # noqa: BLE001 (no nvidia-smi, or an answer that is not two numbers)
        return None


def max_over_ranks(value: float) -> float:
    torch, dist = torch_module(), dist_if_initialized()
    if dist is None:
        return value
    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_ranks_ok(ok: bool) -> bool:
    torch, dist = torch_module(), dist_if_initialized()
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
    torch = torch_module()
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
    torch = torch_module()
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


def kernel_medians_us(fns: list[Callable[[], None]], iters: int, warmup: int) -> list[float]:
    """Per function of `fns`, the median over `iters` calls of the summed durations of the GPU kernels a call ran
    (torch.profiler's CUDA activity; copies and memsets left out), us, max over ranks: what a training step's kernel
    profile times per kernel. CUDA events around an op also time the ~2.6 us between the events and the kernel (H200,
    bench/results/compute-grid-2026-12-04), which the cost model charges once per kernel as
    efficiency.kernel_gap_us; a grid timed by events counts it twice. Each function is warmed up first, then all are
    recorded in one profile, each behind a head start (its sleep kernel marks where its calls begin); every call of a
    function must run the same number of kernels (they are attributed to calls in order)."""
    torch = torch_module()
    from torch.profiler import ProfilerActivity, profile

    for fn in fns:
        for _ in range(warmup):
            fn()
    gpu_head_start(1.0)  # its first call on a device calibrates with sleeps of its own: not inside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for fn in fns:
            gpu_head_start(HEAD_START_US_PER_OP * iters + 500.0)  # the host enqueues ahead: no call waits
            for _ in range(iters):
                fn()
        torch.cuda.synchronize()
    events = [(e.time_range.start, e.device_time, e.name) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA]
    return [max_over_ranks(statistics.median(calls)) for calls in kernel_us_per_call(events, len(fns), iters)]


# torch.cuda._sleep's kernel (ATen's Sleep.cu): in a trace, the head start before each function's calls.
SLEEP_KERNEL = "spin_kernel"


def kernel_us_per_call(events: list[tuple[float, float, str]], functions: int, iters: int) -> list[list[float]]:
    """Per function, per call, its kernels' summed durations: `events` are a trace's GPU activities (start, duration
    us, name) of `functions` functions run `iters` times each, each run behind a head start (SLEEP_KERNEL); copies and
    memsets are left out. Raises NotAvailable where the trace does not split that way."""
    runs: list[list[float]] = []
    for _, us, name in sorted(events):
        if SLEEP_KERNEL in name:
            runs.append([])
        elif runs and "Memcpy" not in name and "Memset" not in name:
            runs[-1].append(us)
    if len(runs) != functions:
        raise NotAvailable(f"kernel timing: {len(runs)} head starts in the trace for {functions} functions")
    out = []
    for i, kernels in enumerate(runs):
        if not kernels or len(kernels) % iters:
            raise NotAvailable(f"kernel timing: function {i} ran {len(kernels)} kernels in {iters} calls (not the "
                               "same number per call)")
        per = len(kernels) // iters
        out.append([sum(kernels[c * per:(c + 1) * per]) for c in range(iters)])
    return out


def kernel_median_us(fn: Callable[[], None], iters: int, warmup: int) -> float:
    """kernel_medians_us of one function."""
    return kernel_medians_us([fn], iters, warmup)[0]


def measure_beside(compute_fn, coll_fn, settle, compute_alone_us: float, coll_alone_us: float,
                   iters: int) -> tuple[float, float]:
    """Compute kernels on the current stream, the collective back to back on a side stream, both timed per op with
    CUDA events; enqueued interleaved so the side stream always has work queued ahead of the compute. Returns
    (median compute us among the kernels that ran entirely beside collectives, median collective us among those
    that ran entirely beside compute), max over ranks."""
    torch = torch_module()
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
