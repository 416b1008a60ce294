"""GPU timelines from torch.profiler traces: busy, idle and waiting time of the kernels and copies a step ran.

Spans are (start, end) pairs in one unit (the profiler's microseconds). Used by `ce-overlap calibrate` (the GPU's
idle time between kernels, efficiency.kernel_gap_us) and by bench/train.py --kernel-profile.
"""
from __future__ import annotations

from typing import Iterable, Sequence

Span = tuple[float, float]

# Kernel classes by name (first match wins; names lower-cased). Triton templates ("triton_tem_") are Inductor's
# GEMMs; other Triton kernels are its fused pointwise / reduction kernels.
KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "triton_tem_", "splitk")),
    ("collective", ("nccl",)),
    # Copies run as SM kernels (FSDP2's all-gather copy-in / copy-out and reduce-scatter copy-in, casts): before
    # "optimizer", since a foreach copy is a multi_tensor_apply kernel too.
    ("copy_kernel", ("copyfunctor", "native::copy<", "copy_kernel", "split_with_sizes", "chunk_cat",
                     "catarraybatchedcopy")),
    ("optimizer", ("multi_tensor", "adam")),
    ("copy", ("memcpy", "memset")),
    ("fused", ("triton",)),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, needles in KERNEL_CLASSES:
        if any(n in low for n in needles):
            return cls
    return "other"


def gpu_activities(prof) -> list[tuple[float, float, str, int]]:
    """(start, end, name, stream) of every GPU kernel, copy and memset a torch.profiler run recorded (the stream is
    the profiler's device_resource_id, -1 where it has none)."""
    import torch

    return [(ev.time_range.start, ev.time_range.end, ev.name, getattr(ev, "device_resource_id", -1))
            for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]


def time_by_class(activities, steps: int = 1, classify=kernel_class) -> dict[str, float]:
    """Activity time per class, per step, in the activities' unit: the class `classify` gives a kernel's name
    (kernel_class by default; an activity it gives None is left out)."""
    out: dict[str, float] = {}
    for start, end, name, *_ in activities:
        cls = classify(name)
        if cls is not None:
            out[cls] = out.get(cls, 0.0) + (end - start) / steps
    return out


def covered(spans: Iterable[Span]) -> float:
    """Length of the union of the spans."""
    total, reach_start, reach = 0.0, None, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            if reach is not None:
                total += reach - reach_start
            reach_start, reach = start, end
        else:
            reach = max(reach, end)
    return total + (reach - reach_start if reach is not None else 0.0)


def idle_between(spans: Iterable[Span]) -> float:
    """Time inside [first start, last end] that no span covers: where the GPU ran nothing."""
    idle, reach = 0.0, None
    for start, end in sorted(spans):
        if reach is not None and start > reach:
            idle += start - reach
        reach = end if reach is None else max(reach, end)
    return idle


def compute_stream_wait(spans: Sequence[Span], by_stream: dict) -> float:
    """Time inside [first start, last end] of all `spans` when the compute stream (the stream in `by_stream` with
    the most span time) runs nothing while some other activity runs: the compute stream waiting on other streams.
    Same unit as the spans; 0 without a compute stream."""
    if not spans or not by_stream:
        return 0.0
    compute = max(by_stream.values(), key=covered)  # a subset of `spans`
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    return max(0.0, (last - first) - covered(compute) - idle_between(spans))


def largest_gaps(named: Sequence[tuple[float, float, str]], n: int = 8) -> list[dict]:
    """The n longest stretches with nothing running, each with the names of the activity that ended last before it
    and the one that starts it: where a timeline waits for the host (a synchronization, a slow launch)."""
    gaps: list[tuple[float, str, str]] = []
    reach, reach_name = None, ""
    for start, end, name in sorted(named):
        if reach is not None and start > reach:
            gaps.append((start - reach, reach_name, name))
        if reach is None or end >= reach:
            reach, reach_name = end, name
    gaps.sort(key=lambda g: -g[0])
    return [{"us": round(us, 1), "after": a[:120], "before": b[:120]} for us, a, b in gaps[:n]]
