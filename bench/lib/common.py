"""Shared by the subcommands of bench/collectives.py and by bench/train.py: process setup, the Variant a benchmarked
op is, CUDA event timing (an op alone, compute beside a side-stream op), nccl-tests' tables, and the run header
(versions, GPU). Not a benchmark itself."""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

# Multicast (NVLS) must stay off on the lent machines; set before torch/NCCL read them.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def log0(msg: str = "") -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def size_sweep(lo: str, hi: str, factor: int) -> list[int]:
    """The sizes of a sweep: lo, lo * factor, ... up to hi (nccl-tests' -b / -e / -f); sizes like '64K', '1G'."""
    from ce_overlap.calibrate import parse_size

    sizes, s = [], parse_size(lo)
    while s <= parse_size(hi):
        sizes.append(s)
        s *= factor
    return sizes


def pool_env(max_bytes_per_rank: int, world_size: int) -> dict[str, str]:
    """The runtime settings a benchmark asks for: a pool that holds the largest in-place output (world * size) in its
    user region plus one staging round of the largest input, and a 30 s timeout."""
    size_mb = -(-max_bytes_per_rank // (1 << 20))
    return {"CE_OVERLAP_STAGING_MB": str(size_mb), "CE_OVERLAP_POOL_MB": str((world_size + 1) * size_mb + 64),
            "CE_OVERLAP_TIMEOUT_S": "30"}


def apply_env_defaults(env: dict[str, str]) -> None:
    """Sets each variable that is not set yet (explicit CE_OVERLAP_* settings win), before the runtime reads them."""
    for key, value in env.items():
        os.environ.setdefault(key, value)


def start(todo: dict):
    """A collective subcommand's start: its pool settings (todo["pool_env"], unless set), the NCCL process group.
    Returns (rank, world size, the world group)."""
    apply_env_defaults(todo["pool_env"])
    rank, world, _ = init()
    return rank, world, dist.group.WORLD


def init() -> tuple[int, int, int]:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=timedelta(seconds=300))
    return dist.get_rank(), dist.get_world_size(), local_rank


# Always recorded (unset: None): what the device drivers set, and the CUDA setting that decides whether the copy
# streams and the compute stream can share a hardware queue.
RUN_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "CUDA_DEVICE_MAX_CONNECTIONS")


def run_env(environ=None) -> dict:
    """The environment a run's numbers depend on: RUN_ENV, and every ce_overlap override that is set
    (ce_overlap.environment's table, the one list of them)."""
    from ce_overlap import environment

    environ = os.environ if environ is None else environ
    return {**{k: environ.get(k) for k in RUN_ENV},
            **{k: v for k, v in sorted(environ.items()) if k.startswith("CE_OVERLAP_") and environment.known(k)}}


def header(title: str) -> dict:
    import ce_overlap.runtime as rt

    # This rank's GPU, current or not (a parent that only coordinates child processes never makes it current)
    local = os.environ.get("LOCAL_RANK")
    props = torch.cuda.get_device_properties(int(local) if local is not None else torch.cuda.current_device())
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001
        nccl = "unknown"
    info = {
        "gpu": props.name, "sms": props.multi_processor_count, "world_size": dist.get_world_size(),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl, "host": platform.node(),
        "ce_runtime": rt.available().reason,
        "env": run_env(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    log0(f"# {title}")
    ranks = (f"{info['world_size']} x {info['gpu']}" if info["gpus"] >= info["world_size"] else
             f"{info['world_size']} ranks sharing {info['gpus']} x {info['gpu']} (correctness only, not speed)")
    log0(f"# {ranks} ({info['sms']} SMs), torch {info['torch']}, CUDA {info['cuda']}, "
         f"NCCL {nccl}, host {info['host']}")
    log0(f"# ce_overlap runtime: {info['ce_runtime']}")
    log0(f"# env: {info['env']}")
    return info


@dataclass
class Variant:
    """One implementation of a collective set up for one size (bench/lib/ce_variants.py makes them): `run()` enqueues
    one op on the current stream."""

    name: str
    run: Callable[[], None] | None = None
    output: Callable[[], torch.Tensor] | None = None
    na_reason: str = ""
    keep: list = field(default_factory=list)  # tensors that must outlive the benchmark of this variant
    is_ce: bool = False


def ce_unavailable(group) -> str:
    """'' when the CE runtime can run here (the group is then rendezvoused), else why it cannot."""
    import ce_overlap.runtime as rt

    ok, reason = rt.available()
    if not ok:
        return reason
    rt.rendezvous(group)
    return ""


def settle(v: Variant, group) -> None:
    """Waits for the variant's work; CE ops go through ce_overlap's synchronize so a stuck op raises its timeout
    error here instead of hanging in a CUDA call."""
    if v.is_ce:
        import ce_overlap.runtime as rt

        rt.synchronize(group)
    torch.cuda.synchronize()


def time_op_ms(fn: Callable[[], None], iters: int, warmup: int, settle: Callable[[], None]) -> list[float]:
    """Per-iteration times on the current stream (CUDA events around each op), ms. `settle` waits for the work
    (and raises a CE timeout instead of blocking in a CUDA call)."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    settle()
    return [start.elapsed_time(end) for start, end in events]


def time_host_ahead(fn: Callable[[], None], group, iters: int, warmup: int,
                    settle: Callable[[], None]) -> tuple[float, float]:
    """(median per-op ms with the host ahead of the GPU, host enqueue ms per op), max over ranks. time_op_ms times
    ops as the host issues them, so an op whose enqueue takes longer than its GPU work is timed at the host's pace;
    here a GPU sleep holds the stream until every op is queued (as in a training step, where the host runs ahead),
    so the events time the GPU's work alone. Same for every variant, NCCL included."""
    for _ in range(warmup):
        fn()
    settle()
    t0 = time.perf_counter()
    for _ in range(warmup or 1):
        fn()
    host_ms = (time.perf_counter() - t0) * 1e3 / (warmup or 1)
    settle()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    dist.barrier(group=group)
    # ~1.98 GHz upper bound of the SM clock: at least the host's time for every op, plus 2 ms.
    torch.cuda._sleep(int((2.0 * iters * host_ms + 2.0) * 1.98e6))
    for start, end in events:
        start.record()
        fn()
        end.record()
    settle()
    return max_over_ranks(median([a.elapsed_time(b) for a, b in events])), max_over_ranks(host_ms)


def time_alone(fn: Callable[[], None], iters: int, warmup: int, settle: Callable[[], None],
               skip_first: int = 0) -> float:
    """Median per-op ms of `fn` alone (time_op_ms), max over ranks; `skip_first` leading ops are left out of the
    median when more than twice as many were timed."""
    times = time_op_ms(fn, iters, warmup, settle)
    if skip_first and len(times) > 2 * skip_first:
        times = times[skip_first:]
    return max_over_ranks(median(times))


def time_variant_ms(v: Variant, group, iters: int, warmup: int) -> float:
    """A variant's op alone, every rank starting together: median per-op ms, max over ranks."""
    dist.barrier()
    return time_alone(v.run, iters, warmup, lambda: settle(v, group))


def _beside_setup(compute: Callable[[], None], iters: int, warmup: int) -> tuple:
    """time_beside's and time_beside_fed's start: (main stream, side stream, per-compute (start, end) events, the side
    stream's start and end events, the first timed compute), after `warmup` computes."""
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(main)
    for _ in range(warmup):
        compute()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    return main, side, events, torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), \
        min(2, iters - 1)


def _beside_result(events: list, first: int, s_start, s_end, n_side: int, info: dict | None,
                   window: list) -> tuple[float, float]:
    """(median compute ms, mean side-op ms), max over ranks; `info` gets the window and the compute's duty."""
    times = [s.elapsed_time(e) for s, e in events]
    if info is not None:
        info["window"] = window
        span = events[first][0].elapsed_time(events[-1][1])
        info["duty_pct"] = 100.0 * sum(times[first:]) / span if span > 0 else 100.0
    return max_over_ranks(median(times[2:])), max_over_ranks(s_start.elapsed_time(s_end) / max(1, n_side))


def time_beside(compute: Callable[[], None], side_fn: Callable[[], None], iters: int, warmup: int,
                per_launch: float, lead_in: int, settle: Callable[[], None],
                info: dict | None = None) -> tuple[float, float]:
    """`compute` on the current stream, `side_fn` (a collective, a copy, a kernel) on a side stream, launched
    interleaved so the side stream always has queued work while the compute runs: `lead_in` side ops first, then
    `per_launch` (may be fractional: 1.4 is 7 side ops per 5 computes) before every compute launch. Returns (median
    compute ms, mean side-op ms over the whole window), max over ranks. The first two compute launches may start before
    the side stream has ramped up: left out.

    `info` (a dict) receives, for this rank:
    - "window": [t0, t1] in time.monotonic(), from when the timed computes started running to when the last one ended,
      as a thread polling their events saw it (for ClockSampler.stats: the side ops may run on past it);
    - "duty_pct": the computes' own time over that stretch on the GPU. Under 100 the compute stream had gaps, so the
      board rested between computes and they ran at a higher clock than back to back: the host blocks once a stream's
      launch queue is full, and a side op of many launches (a paced copy: two per ~25 us chunk) then holds back the
      compute launches behind it."""
    main, side, events, s_start, s_end, first = _beside_setup(compute, iters, warmup)
    seen: list = []
    enqueued = threading.Event()

    def poll() -> None:  # host times of the first timed compute's start and the last one's end
        while not events[first][0].query():
            time.sleep(0.0005)
        seen.append(time.monotonic())
        enqueued.wait()
        while not events[-1][1].query():
            time.sleep(0.0005)
        seen.append(time.monotonic())

    poller = None
    n_side, credit = 0, 0.0
    with torch.cuda.stream(side):
        s_start.record()
        for _ in range(lead_in):
            side_fn()
            n_side += 1
    for i, (start, end) in enumerate(events):
        credit += per_launch
        with torch.cuda.stream(side):
            while credit >= 1:
                side_fn()
                n_side += 1
                credit -= 1
        start.record()
        if i == first and info is not None:
            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
        compute()
        end.record()
    with torch.cuda.stream(side):
        s_end.record()
    enqueued.set()
    main.wait_stream(side)
    settle()
    if poller is not None:
        poller.join()
    return _beside_result(events, first, s_start, s_end, n_side, info, seen if len(seen) == 2 else [])


def time_beside_fed(compute: Callable[[], None], side_fn: Callable[[], None], iters: int, warmup: int,
                    side_ops: int, settle: Callable[[], None], info: dict | None = None, side_depth: int = 2,
                    compute_depth: int = 4) -> tuple[float, float]:
    """time_beside for a sustained measurement: the host feeds both streams from one loop, keeping at most
    `compute_depth` computes and `side_depth` side ops queued ahead of the GPU, so it never blocks in a launch (a full
    launch queue would hold the compute launches back behind a side op of many launches, a paced copy's, and leave
    the compute stream with gaps). Exactly `side_ops` side ops are issued (a collective must be issued the same number
    of times on every rank; size it to outlast the computes): those left when the last compute is enqueued follow it.
    Returns and fills `info` as time_beside does (duty_pct near 100 means the computes ran back to back)."""
    import collections  # noqa: PLC0415

    main, side, events, s_start, s_end, first = _beside_setup(compute, iters, warmup)
    side_pending: collections.deque = collections.deque()
    n_side, issued, t0 = 0, 0, None
    with torch.cuda.stream(side):
        s_start.record()
    while issued < iters:
        while side_pending and side_pending[0].query():
            side_pending.popleft()
        progressed = False
        if len(side_pending) < side_depth and n_side < side_ops:
            with torch.cuda.stream(side):
                side_fn()
                done = torch.cuda.Event()
                done.record()
            side_pending.append(done)
            n_side += 1
            progressed = True
        ahead = sum(1 for k in range(max(0, issued - compute_depth), issued) if not events[k][1].query())
        if ahead < compute_depth:
            start, end = events[issued]
            start.record()
            compute()
            end.record()
            issued += 1
            progressed = True
        if t0 is None and issued > first and events[first][0].query():
            t0 = time.monotonic()
        if not progressed:
            time.sleep(0.00005)
    with torch.cuda.stream(side):
        while n_side < side_ops:
            side_fn()
            n_side += 1
        s_end.record()
    while not events[first][0].query():
        time.sleep(0.0005)
    t0 = t0 or time.monotonic()
    while not events[-1][1].query():
        time.sleep(0.0005)
    t1 = time.monotonic()
    main.wait_stream(side)
    settle()
    return _beside_result(events, first, s_start, s_end, n_side, info, [t0, t1])


def gemm(n: int = 8192) -> Callable[[], None]:
    """A bf16 n^3 GEMM into a preallocated output on the current stream (the compute every overlap test runs)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    c = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
    return lambda: torch.mm(a, b, out=c)


def unavailable(v: Variant) -> str:
    """'' when `v` was set up on every rank, else why not (every rank must agree on running a variant: one set up on
    some ranks only would deadlock)."""
    if sum_over_ranks(0 if v.run else 1):
        return v.na_reason or "not available on every rank"
    return ""


def size_table(title: str, rows: list[dict], extra: tuple = ()) -> None:
    """nccl-tests' table, a line per row: size (bytes per rank), count (elements), type, time (us), algbw and busbw
    (GB/s), #wrong, then the `extra` columns ((header, width, cell(row) -> str), ...). A row is a dict with the keys
    size, count, type and, where it was timed, time_us, algbw_gbps, busbw_gbps, wrong; else `why` (n/a or the error).
    Ends with nccl-tests' summary lines when any row was timed."""
    log0()
    log0(title)
    log0(f"#{'size(B/rank)':>14} {'count':>12} {'type':>9} {'time(us)':>11} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} "
         f"{'#wrong':>8}" + "".join(f" {head:>{width}}" for head, width, _ in extra))
    timed = [r for r in rows if r.get("time_us") is not None]
    for r in rows:
        head = f"{r['size']:>15} {r['count']:>12} {r['type']:>9}"
        if r.get("time_us") is None:
            log0(f"{head} {'n/a: ' + r.get('why', ''):>11}")
            continue
        log0(f"{head} {r['time_us']:>11.2f} {r['algbw_gbps']:>12.2f} {r['busbw_gbps']:>12.2f} {r['wrong']:>8}"
             + "".join(f" {cell(r):>{width}}" for _, width, cell in extra))
    if timed:
        wrong = sum(r["wrong"] for r in timed)
        log0(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        log0(f"# Avg bus bandwidth    : {sum(r['busbw_gbps'] for r in timed) / len(timed):.2f}")


def side_by_side(title: str, sizes: list[int], variants: list[str],
                 busbw_at: Callable[[int, str], float | None], ratio: bool = True) -> None:
    """busbw (GB/s) of every variant per size, and the best ce_overlap variant ('ce...') over NCCL in the last column
    (ratio=False: another per-variant number, and no ratio). busbw_at(size, variant) is None where that variant has no
    time at that size."""
    log0()
    log0(f"{title}: side by side" + ("; last column: best ce_overlap variant / nccl" if ratio else ""))
    log0(f"{'size/rank':>12} " + " ".join(f"{n:>18}" for n in variants) + f" {'best_ce/nccl':>13}")
    for nbytes in sizes:
        cells, best_ce, nccl_bw = [], 0.0, None
        for name in variants:
            bw = busbw_at(nbytes, name)
            if bw is None:
                cells.append(f"{'n/a':>18}")
                continue
            cells.append(f"{bw:>18.1f}")
            if name.startswith("ce"):
                best_ce = max(best_ce, bw)
            if name == "nccl":
                nccl_bw = bw
        last = f"{best_ce / nccl_bw:>13.2f}" if ratio and nccl_bw and best_ce else f"{'-':>13}"
        log0(f"{nbytes:>12} " + " ".join(cells) + " " + last)


# NVML's clock event reasons (nvmlClocksEventReason*): why the SM clock is below its maximum at a sample.
CLOCK_EVENTS = {0x4: "power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "power_brake"}
_NVML_FI_DEV_POWER_INSTANT = 186  # nvmlDeviceGetFieldValues: the board's power now, mW (GetPowerUsage averages ~1 s)


class ClockSampler:
    """SM clock (MHz), board power (W) and NVML's clock event reasons of this rank's GPU, sampled every `period_s`
    while the block runs (`with ClockSampler() as s: ...; s.stats()`). A slowdown beside a collective may come from the
    clocks (a board at its power limit lowers them for everything) rather than from SMs or HBM: these numbers tell
    which. `stats(window)` keeps the samples inside a host-time window (time_beside's info["window"]: while the compute
    ran, not the copies that outlast it). Power is the instantaneous reading where the driver has it (else NVML's
    ~1 s average). Without NVML (nvidia-ml-py) or where a query fails, stats() is {} and the benchmark runs unchanged."""

    def __init__(self, period_s: float = 0.005):
        self.period_s, self.samples, self._stop, self._thread = period_s, [], threading.Event(), None
        self.error = ""
        self._instant = True
        try:
            import pynvml  # noqa: PLC0415

            pynvml.nvmlInit()
            index = torch.cuda.current_device()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible:
                index = int(visible.split(",")[index])
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
            self._reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        except Exception as e:  # noqa: BLE001 (no NVML: no samples, nothing else changes)
            self._nvml = self._handle = None
            self.error = f"{type(e).__name__}: {e}"

    def _power_w(self) -> float:
        nv = self._nvml
        if self._instant:
            try:
                v = nv.nvmlDeviceGetFieldValues(self._handle, [_NVML_FI_DEV_POWER_INSTANT])[0]
                if v.nvmlReturn == 0 and v.value.uiVal > 0:
                    return v.value.uiVal / 1e3
            except Exception:  # noqa: BLE001 (an older driver or library: the averaged reading)
                pass
            self._instant = False
        return nv.nvmlDeviceGetPowerUsage(self._handle) / 1e3

    def _run(self) -> None:
        nv = self._nvml
        while not self._stop.wait(self.period_s):
            try:
                reasons = int(self._reasons(self._handle)) if self._reasons else 0
                self.samples.append((time.monotonic(), nv.nvmlDeviceGetClockInfo(self._handle, nv.NVML_CLOCK_SM),
                                     self._power_w(), reasons))
            except Exception as e:  # noqa: BLE001
                self.error = f"{type(e).__name__}: {e}"
                return

    def __enter__(self) -> ClockSampler:
        self.samples = []
        if self._handle is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def stats(self, window: list | None = None) -> dict:
        """Median / min clock, median / max power, and per clock event the share of samples (%) it was set in; only
        samples inside `window` ([t0, t1], time.monotonic()) when one is given."""
        samples = [x for x in self.samples if not window or window[0] <= x[0] <= window[1]]
        if not samples:
            return {}
        _, clocks, watts, reasons = zip(*samples)
        out = {"sm_clock_mhz": statistics.median(clocks), "sm_clock_min_mhz": min(clocks),
               "power_w": statistics.median(watts), "power_max_w": max(watts), "samples": len(clocks)}
        for bit, name in CLOCK_EVENTS.items():
            out[f"{name}_pct"] = 100.0 * sum(1 for r in reasons if r & bit) / len(reasons)
        return out


def clocks_over_ranks(stats: dict) -> dict:
    """A ClockSampler's stats over ranks: the slowest rank's SM clock, the highest power and, per clock event, the
    largest share of samples on any rank (one GPU held back holds a collective back); {} when any rank has no
    samples."""
    if sum_over_ranks(0 if stats else 1):
        return {}
    return {"sm_clock_mhz": -max_over_ranks(-stats["sm_clock_mhz"]), "power_w": max_over_ranks(stats["power_w"]),
            **{f"{name}_pct": max_over_ranks(stats[f"{name}_pct"]) for name in CLOCK_EVENTS.values()}}


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def sum_over_ranks(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64, device="cuda")
    dist.all_reduce(t)
    return int(t.item())


def count_wrong(got: torch.Tensor, want: torch.Tensor) -> int:
    itype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    return int((got.reshape(-1).view(itype) != want.reshape(-1).view(itype)).sum().item())


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def write_json(path: str | None, payload: dict) -> None:
    if not path or dist.get_rank() != 0:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    log0(f"# wrote {path}")


def finish(group, out: str | None, payload: dict, na: dict[str, str], info: dict) -> None:
    """The common end of a benchmark: n/a reasons, ce_overlap's group state, the JSON (rank 0)."""
    for name, reason in na.items():
        log0(f"# {name}: n/a -- {reason}")
    state = ce_state(group)
    log0(f"# ce_overlap group state (rank 0): {state}")
    info["ce_state_rank0"] = state
    write_json(out, {**payload, "info": info, "na": na})


def ce_state(group) -> str:
    """ce_overlap's one-line group state (pool sizes, epochs, local-copy mode), or why there is none."""
    try:
        import ce_overlap.runtime as rt

        if not torch.ops.ce_overlap._has_group(group.group_name):
            return "no ce_overlap pool for this group"
        return rt.describe(group)
    except Exception as e:  # noqa: BLE001
        return format_exc_line(e)


def format_exc_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def print_exc_rank() -> None:
    print(f"[rank {dist.get_rank()}] " + traceback.format_exc(), flush=True)
