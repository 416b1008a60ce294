"""One training step's GPU timeline from a torch.profiler Chrome trace (bench/train.py --trace-dir): per stream the
busy time by kernel class, the compute stream's waits (what ran elsewhere while it idled, and where the whole GPU
idled: the host), and a one-line-per-stream picture of the step. No GPU needed.

    python bench/timeline.py out/traces/trace-fsdp2.json.gz out/traces/trace-fsdp2-ce.json.gz [--ms-per-char 2]

The step is the last complete one in the trace: it ends with the last optimizer kernel and starts after the
optimizer kernels of the step before (clusters of them, apart by more than --step-gap-ms).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

from ce_overlap.gpu_trace import covered, kernel_class

# One letter per kernel class in the picture (upper case: the compute classes).
LETTERS = {"gemm": "G", "attention": "A", "fused": "F", "optimizer": "O", "collective": "n", "copy": "c",
           "copy_kernel": "k", "other": "o"}
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def trace_events(path: str) -> list[dict]:
    """Every event of a Chrome trace (.json or .json.gz), as the trace's dicts."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def gpu_events(path: str, events: list[dict] | None = None) -> list[dict]:
    """The GPU activities (kernels, copies, memsets) of a Chrome trace (.json or .json.gz), as the trace's event
    dicts, sorted by start; from `events` (trace_events') where the caller has read them already."""
    events = trace_events(path) if events is None else events
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES),
                  key=lambda e: float(e["ts"]))


def load(path: str, events: list[dict] | None = None) -> list[tuple[float, float, str, int]]:
    """(start_us, end_us, name, stream) of every GPU activity in the trace (or in its already read `events`)."""
    return sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("name", ""), int(e.get("tid", -1)))
                  for e in gpu_events(path, events))


def last_step(acts, step_gap_ms: float = 20.0):
    """The activities of the last complete step and its (start, end), or raises ValueError when the trace holds fewer
    than two optimizer clusters."""
    opt = [a for a in acts if kernel_class(a[2]) == "optimizer"]
    clusters: list[list] = []
    for a in opt:
        if clusters and a[0] - clusters[-1][-1][1] <= step_gap_ms * 1e3:
            clusters[-1].append(a)
        else:
            clusters.append([a])
    if len(clusters) < 2:
        raise ValueError(f"found {len(clusters)} optimizer step(s) in the trace; need 2 (trace 2 steps)")
    start, end = max(a[1] for a in clusters[-2]), max(a[1] for a in clusters[-1])
    return [a for a in acts if a[0] >= start and a[1] <= end], start, end


def analyze(acts, start: float, end: float) -> dict:
    streams: dict[int, list] = {}
    for a in acts:
        streams.setdefault(a[3], []).append(a)
    compute = max(streams, key=lambda s: sum(a[1] - a[0] for a in streams[s] if kernel_class(a[2]) == "gemm"))
    out = {"step_ms": (end - start) / 1e3, "compute_stream": compute, "streams": {}}
    for s, lst in sorted(streams.items(), key=lambda kv: kv[0] != compute):
        by = {}
        for a in lst:
            cls = kernel_class(a[2])
            by[cls] = by.get(cls, 0.0) + (a[1] - a[0]) / 1e3
        out["streams"][s] = {"busy_ms": covered([(a[0], a[1]) for a in lst]) / 1e3,
                             "by_class_ms": dict(sorted(by.items(), key=lambda kv: -kv[1]))}
    # The compute stream's idle stretches: what else ran (by class, time-weighted), or nothing at all (the host),
    # and between which of its own kernels.
    busy = sorted((a[0], a[1], a[2]) for a in streams[compute])
    idle, reach, last = [], start, "the step's start"
    for s0, s1, name in busy:
        if s0 > reach:
            idle.append((reach, s0, last, name))
        if s1 > reach:
            reach, last = s1, name
    if end > reach:
        idle.append((reach, end, last, "the step's end"))
    others = [a for a in acts if a[3] != compute]
    waits, host, stretches = {}, 0.0, []
    for i0, i1, after, before in idle:
        inside = [(max(a[0], i0), min(a[1], i1), kernel_class(a[2])) for a in others if a[1] > i0 and a[0] < i1]
        host += ((i1 - i0) - covered([(x0, x1) for x0, x1, _ in inside])) / 1e3
        beside = {}
        for cls in {c for _, _, c in inside}:
            beside[cls] = covered([(x0, x1) for x0, x1, c in inside if c == cls]) / 1e3
            waits[cls] = waits.get(cls, 0.0) + beside[cls]
        stretches.append({"at_ms": (i0 - start) / 1e3, "ms": (i1 - i0) / 1e3, "after": after, "before": before,
                          "beside_ms": dict(sorted(beside.items(), key=lambda kv: -kv[1]))})
    # The longest first: where a step model's exposed communication has to show up.
    out["compute_waits"] = sorted(stretches, key=lambda w: -w["ms"])
    out["compute_idle_ms"] = sum(i1 - i0 for i0, i1, _, _ in idle) / 1e3
    out["compute_idle_beside_ms"] = dict(sorted(waits.items(), key=lambda kv: -kv[1]))
    out["gpu_idle_ms"] = host
    return out


def picture(acts, start: float, end: float, compute: int, ms_per_char: float) -> list[str]:
    """One line per stream: per slice of ms_per_char, the letter of the class that ran longest in it ('.': idle)."""
    n = max(1, int((end - start) / 1e3 / ms_per_char + 0.999))
    streams = sorted({a[3] for a in acts}, key=lambda s: s != compute)
    lines = []
    for s in streams:
        cells = [dict() for _ in range(n)]
        for a in acts:
            if a[3] != s:
                continue
            cls = kernel_class(a[2])
            t = a[0]
            while t < a[1]:
                i = min(n - 1, int((t - start) / 1e3 / ms_per_char))
                cell_end = start + (i + 1) * ms_per_char * 1e3
                seg = min(a[1], cell_end) - t
                cells[i][cls] = cells[i].get(cls, 0.0) + seg
                t = min(a[1], cell_end) if cell_end > t else a[1]
        row = "".join(LETTERS.get(max(c, key=c.get), "?") if c and max(c.values()) > 0.1 * ms_per_char * 1e3 else "."
                      for c in cells)
        lines.append(f"{'compute' if s == compute else f'stream {s}':>10} |{row}|")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="Chrome traces (.json or .json.gz) from bench/train.py --trace-dir")
    p.add_argument("--ms-per-char", type=float, default=2.0, help="time per character of the picture (default 2)")
    p.add_argument("--step-gap-ms", type=float, default=20.0,
                   help="optimizer kernels further apart than this belong to different steps (default 20)")
    p.add_argument("--waits", type=int, default=5, metavar="N",
                   help="list the compute stream's N longest idle stretches: when, how long, between which of its "
                        "kernels and what ran beside (default 5; 0: none)")
    p.add_argument("--json", default=None, help="write the numbers per trace to this file")
    args = p.parse_args(argv)
    if args.ms_per_char <= 0:
        p.error(f"--ms-per-char must be > 0, got {args.ms_per_char}")
    if args.waits < 0:
        p.error(f"--waits must be >= 0, got {args.waits}")
    results = {}
    for path in args.traces:
        try:
            acts = load(path)
            step, start, end = last_step(acts, args.step_gap_ms)
        except (OSError, ValueError, KeyError) as e:
            print(f"timeline: {path}: {e}", file=sys.stderr)
            return 2
        r = analyze(step, start, end)
        results[os.path.basename(path)] = r
        print(f"# {os.path.basename(path)}: step {r['step_ms']:.1f} ms; compute stream idle {r['compute_idle_ms']:.1f} ms"
              f" (GPU idle, the host: {r['gpu_idle_ms']:.1f} ms; beside it ran: "
              + ", ".join(f"{k} {v:.1f}" for k, v in r["compute_idle_beside_ms"].items()) + ")")
        for s, d in r["streams"].items():
            name = "compute" if s == r["compute_stream"] else f"stream {s}"
            print(f"  {name:>10}: busy {d['busy_ms']:6.1f} ms  " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                                         d["by_class_ms"].items()))
        for line in picture(step, start, end, r["compute_stream"], args.ms_per_char):
            print("  " + line)
        for w in r["compute_waits"][:max(0, args.waits)]:
            beside = ", ".join(f"{k} {v:.2f}" for k, v in w["beside_ms"].items()) or "nothing (the host)"
            print(f"  wait {w['ms']:6.2f} ms at {w['at_ms']:7.2f} after {w['after'][:48]} before {w['before'][:48]}; "
                  f"beside: {beside}")
    print("# letters: " + ", ".join(f"{v} {k}" for k, v in LETTERS.items()) + ", . idle; one character = "
          f"{args.ms_per_char:g} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
