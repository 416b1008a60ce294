"""bench/train.py's memory accounting: the CE runtime's pools (device memory torch's allocator does not see), where the
caching allocator's reserved memory sits per stream, and the live blocks by the line that allocated them."""
from __future__ import annotations

import os

import torch


def ce_pool_gib() -> float:
    """GiB of the CE runtime's symmetric pools this process holds (0 when it has none or no runtime)."""
    import ce_overlap.runtime as rt

    return sum(rt.config_of(name).pool_mb for name in rt.rendezvoused_groups()) / 1024


def memory_report() -> dict:
    """Where the caching allocator's reserved memory sits at the end of a mode (its peak, as nothing was released):
    per stream (a segment serves allocations of the stream it was created for: blocks reserved on a side stream do
    not serve the default stream's allocations), with the bytes in use, plus its cudaMalloc and retry counts."""
    default = torch.cuda.default_stream().cuda_stream
    by_stream: dict[str, dict] = {}
    for seg in torch.cuda.memory_snapshot():
        key = "default" if seg.get("stream", 0) in (0, default) else f"stream {seg['stream']:#x}"
        d = by_stream.setdefault(key, {"reserved_gib": 0.0, "allocated_gib": 0.0, "segments": 0})
        d["reserved_gib"] += seg["total_size"] / 2**30
        d["allocated_gib"] += seg["allocated_size"] / 2**30
        d["segments"] += 1
    stats = torch.cuda.memory_stats()
    extra = {}
    if hasattr(torch.ops, "ce_overlap_testing") and hasattr(torch.ops.ce_overlap_testing, "_stashed_tensors"):
        import ce_overlap.runtime.testing as rtt

        extra["ce_stashed_tensors"] = rtt.stashed_tensors()
        extra["ce_reaped_unwaited"] = rtt.reaped_unwaited()
    return {**extra, "reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 3),
            "by_stream": {k: {f: round(v, 3) if isinstance(v, float) else v for f, v in d.items()}
                          for k, d in sorted(by_stream.items(), key=lambda kv: -kv[1]["reserved_gib"])},
            "device_allocs": int(stats.get("num_device_alloc", 0)),
            "alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "inactive_split_peak_gib": round(stats.get("inactive_split_bytes.all.peak", 0) / 2**30, 3),
            # active: allocated plus blocks freed but waiting for another stream's recorded use (recordStream)
            "active_peak_gib": round(stats.get("active_bytes.all.peak", 0) / 2**30, 3),
            "allocated_peak_gib": round(stats.get("allocated_bytes.all.peak", 0) / 2**30, 3),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}


def _site_of(frames: list) -> tuple[str, str]:
    """The innermost frame outside torch itself (Inductor's generated code, the model, this script), and its line."""
    import linecache

    for f in frames or []:
        fn = f.get("filename", "")
        if "/torch/" in fn and "torchinductor" not in fn and "/_inductor/" not in fn:
            continue
        return f"{fn}:{f.get('line')} {f.get('name', '')}", linecache.getline(fn, int(f.get("line", 0))).strip()
    return "unknown (no frames)", ""


def _by_site(blocks, top: int) -> list:
    """[(size, frames)] grouped by _site_of, largest first."""
    sites: dict[str, dict] = {}
    for size, frames in blocks:
        site, code = _site_of(frames)
        d = sites.setdefault(site, {"site": site, "code": code[:300], "gib": 0.0, "blocks": 0})
        d["gib"] += size / 2**30
        d["blocks"] += 1
    out = sorted(sites.values(), key=lambda d: -d["gib"])[:top]
    for d in out:
        d["gib"] = round(d["gib"], 3)
    return out


def replay_peak(events: list, allocated_now: int) -> tuple[int, int, int, list]:
    """(peak bytes, its event index or -1, bytes allocated before the first event, [(size, frames)] live at the peak
    among the recorded blocks) from the allocator's trace events (torch.cuda.memory._snapshot()'s device_traces) and
    the bytes allocated now. Allocated bytes fall when a block is freed (free_requested), as torch counts them."""
    delta = sum(e["size"] if e["action"] == "alloc" else -e["size"]
                for e in events if e["action"] in ("alloc", "free_requested"))
    base = allocated_now - delta  # allocated when the record's first event came
    live: dict[int, tuple] = {}
    cur, peak, at_peak, peak_index = base, base, {}, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames") or [])
            cur += e["size"]
            if cur > peak:
                peak, peak_index, at_peak = cur, i, dict(live)
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
            cur -= e["size"]
    return peak, peak_index, base, list(at_peak.values())


def live_at_peak_by_site(top: int = 15) -> dict:
    """What was allocated at this process's peak of allocated bytes (needs _record_memory_history since before it):
    replay_peak's live blocks grouped by allocating line (live_blocks_by_site's rule); blocks allocated before the
    record's first event (or dropped from its ring) are one line, "before the record"."""
    device = torch.cuda.current_device()
    traces = torch.cuda.memory._snapshot().get("device_traces", [])
    events = traces[device] if device < len(traces) else []
    peak, peak_index, base, blocks = replay_peak(events, torch.cuda.memory_allocated())
    sites = _by_site(blocks, top)
    if base > 0:
        sites.append({"site": "before the record", "code": "", "gib": round(base / 2**30, 3), "blocks": None})
    return {"peak_gib": round(peak / 2**30, 3), "events": len(events), "peak_event": peak_index,
            "torch_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3), "sites": sites}


def live_blocks_by_site(top: int = 15) -> list:
    """The allocator's live blocks (needs _record_memory_history), grouped by the innermost Python frame that
    allocated them outside torch itself (Inductor's generated code, the model, this script), largest first, each
    with that source line (generated code is not kept after the run)."""
    blocks = []
    for seg in torch.cuda.memory._snapshot().get("segments", []):
        for blk in seg.get("blocks", []):
            if blk.get("state") != "active_allocated":
                continue
            frames = blk.get("frames") or [f for h in blk.get("history", [])[-1:] for f in h.get("frames", [])]
            blocks.append((blk.get("size", 0), frames))
    return _by_site(blocks, top)
