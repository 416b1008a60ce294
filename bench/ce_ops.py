"""What each copy-engine op of a training step did on the GPU, per rank, on one clock, and which op each of the compute
stream's waits ended with. From bench/train.py --trace-dir traces (every rank's; CPU and GPU activities). No GPU
needed.

    python bench/ce_ops.py out/traces/trace-ce_overlap.json.gz out/traces/trace-ce_overlap-rank1.json.gz \\
        --from-ms 280 --to-ms 300

Times are ms from the start of the first trace's last step (bench/timeline.py's step), for every trace: the
profiler's clock is the host's, the same for every rank of one machine, so a peer's copy that started late lines up
with the wait it caused. A ce_overlap op (a cpu_op `ce_overlap::...`, not the waits) owns the copies and memsets its
runtime calls enqueued (matched by the profiler's correlation ids); its line gives its host launch, the span from its
first copy's start to its last copy's end, and its bytes by kind (PtoP: between GPUs; DtoD: within one). A wait of
the compute stream is "ended by" the copy, of any op of any of the traces, that finished closest before the compute
stream went on (within --slack-us): the last bytes of the op it waited for, or a peer's signal (a ready or done flag
is a 4- or 32-byte copy into this rank) that let this rank's op complete. That is a proximity: a wait is a data wait
only if the host made the compute stream wait between launching the kernel before it and the one after it (a
cudaStreamWaitEvent outside the ce_overlap ops' own launches, which make their copy streams wait on the compute
stream). Where none was launched the line says so: the compute stream stalled beside the copies with nothing to wait
for (2x H100, 8 layers: most block-boundary waits, bench/results/step-prediction-2026-11-28).
"""
from __future__ import annotations

import argparse
import bisect
import os
import sys

from timeline import analyze, gpu_events, last_step, load, trace_events

SKIP_OPS = ("ce_overlap::stored", "ce_overlap::wait_tensor")
COPY_CATEGORIES = ("gpu_memcpy", "gpu_memset")


def runtime_calls(events: list[dict]) -> list[dict]:
    """The trace's CUDA runtime and driver API calls (host side), by start."""
    return sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")), key=lambda e: e["ts"])


def ce_ops(events: list[dict]) -> list[dict]:
    """Every ce_overlap op of the trace's events (Chrome trace dicts) that enqueued copies: {"name", "host_us",
    "start_us", "end_us", "bytes": {kind: bytes}, "streams", "copies": [(end_us, bytes)]}, by host launch."""
    runtime = runtime_calls(events)
    starts = [e["ts"] for e in runtime]
    copies: dict[int, list[dict]] = {}
    for e in events:
        if e.get("cat") in COPY_CATEGORIES:
            copies.setdefault(e.get("args", {}).get("correlation"), []).append(e)
    out = []
    for op in sorted((e for e in events if e.get("cat") == "cpu_op" and str(e.get("name", "")).startswith("ce_overlap::")
                      and e["name"] not in SKIP_OPS), key=lambda e: e["ts"]):
        lo = bisect.bisect_left(starts, op["ts"])
        hi = bisect.bisect_right(starts, op["ts"] + op.get("dur", 0.0))
        mine = [c for r in runtime[lo:hi] for c in copies.get(r.get("args", {}).get("correlation"), [])]
        if not mine:
            continue
        by_kind: dict[str, int] = {}
        ends = []  # (end_us, bytes) per copy
        for c in mine:
            nbytes = int(c.get("args", {}).get("bytes", 0))
            kind = "PtoP" if "PtoP" in c["name"] else "DtoD" if "DtoD" in c["name"] else c["name"].split()[0]
            by_kind[kind] = by_kind.get(kind, 0) + nbytes
            ends.append((float(c["ts"]) + float(c.get("dur", 0.0)), nbytes))
        out.append({"name": op["name"][len("ce_overlap::"):], "host_us": float(op["ts"]),
                    "start_us": min(float(c["ts"]) for c in mine), "end_us": max(end for end, _ in ends),
                    "bytes": by_kind, "streams": sorted({c.get("args", {}).get("stream", c.get("tid")) for c in mine}),
                    "copies": ends})
    return out


def ended_by(ops: list[dict], wait_end_us: float, slack_us: float) -> tuple[dict, float, int] | None:
    """(op, the copy's end, its bytes) of the copy, of any op, that ended closest before `wait_end_us` (at most slack_us
    before it), or None. A small copy is a signal (a ready or done flag written into a peer)."""
    best = None
    for op in ops:
        for end, nbytes in op["copies"]:
            gap = wait_end_us - end
            if 0.0 <= gap <= slack_us and (best is None or gap < wait_end_us - best[1]):
                best = (op, end, nbytes)
    return best


class LaunchOrder:
    """Which host calls came between two GPU activities' launches, from one trace's events: the launch time of an
    activity (by its correlation id) and the cudaStreamWaitEvent calls that are not a ce_overlap op's own (an op's
    launch makes its copy streams wait on the caller's stream; its wait_tensor makes the caller's stream wait)."""

    def __init__(self, path: str, events: list[dict]):
        runtime = runtime_calls(events)
        self.launch = {e.get("args", {}).get("correlation"): float(e["ts"]) for e in runtime}
        ops = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
                     if e.get("cat") == "cpu_op" and str(e.get("name", "")).startswith("ce_overlap::")
                     and e["name"] != "ce_overlap::wait_tensor")
        starts = [a for a, _ in ops]

        def inside_op(t: float) -> bool:
            i = bisect.bisect_right(starts, t) - 1
            return i >= 0 and t <= ops[i][1]

        self.waits = [float(e["ts"]) for e in runtime
                      if e.get("name") == "cudaStreamWaitEvent" and not inside_op(float(e["ts"]))]
        self.gpu = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("tid"),
                     e.get("args", {}).get("correlation")) for e in gpu_events(path, events)]

    def gap_kind(self, end_before_us: float, start_after_us: float, tol_us: float = 1.0) -> str | None:
        """Why a stream sat idle between the activity that ended at `end_before_us` and the one of the same stream
        that started at `start_after_us`: "host" (the next one was launched only after the gap began), "stall" (launched
        in time, and no stream wait launched between the two: nothing to wait for), or None (a stream wait came
        between them, or either activity or its launch is not in the trace)."""
        after = next((g for g in self.gpu if abs(g[0] - start_after_us) <= tol_us), None)
        if after is None:
            return None
        before = max((g for g in self.gpu if g[2] == after[2] and abs(g[1] - end_before_us) <= tol_us),
                     key=lambda g: g[0], default=None)
        if before is None or before[3] not in self.launch or after[3] not in self.launch:
            return None
        lo, hi = self.launch[before[3]], self.launch[after[3]]
        if hi > end_before_us:
            return "host"
        waits = bisect.bisect_left(self.waits, hi) - bisect.bisect_right(self.waits, lo)
        return "stall" if waits == 0 else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="train.py --trace-dir traces; the first one's step sets the clock's zero")
    p.add_argument("--from-ms", type=float, default=0.0, help="window start, ms into the step (default 0)")
    p.add_argument("--to-ms", type=float, default=float("inf"), help="window end (default: the step's end)")
    p.add_argument("--min-wait-ms", type=float, default=0.05, help="compute-stream waits shorter than this are left out")
    p.add_argument("--slack-us", type=float, default=60.0,
                   help="a wait is ended by a copy, of any op of any rank, that finished at most this long before it "
                        "(default 60)")
    p.add_argument("--step-gap-ms", type=float, default=20.0, help="as bench/timeline.py's (default 20)")
    args = p.parse_args(argv)
    for flag, value in (("--min-wait-ms", args.min_wait_ms), ("--slack-us", args.slack_us)):
        if value < 0:
            p.error(f"{flag} must be >= 0, got {value:g}")
    if args.from_ms > args.to_ms:
        p.error(f"--from-ms {args.from_ms:g} is after --to-ms {args.to_ms:g}")
    loaded = []
    for path in args.traces:
        try:
            events = trace_events(path)  # read once: the GPU activities and the ops' runtime calls
            step, start, end = last_step(load(path, events), args.step_gap_ms)
            loaded.append((path, step, start, end, ce_ops(events), LaunchOrder(path, events)))
        except (OSError, ValueError, KeyError) as e:
            print(f"ce_ops: {path}: {e}", file=sys.stderr)
            return 2
    zero = loaded[0][2]
    ms = lambda t: (t - zero) / 1e3  # noqa: E731
    inside = lambda t: args.from_ms <= ms(t) <= args.to_ms  # noqa: E731
    # A peer's op can end a wait too: its last copy is the signal that lets this rank's op complete.
    every_op = [dict(op, trace=i) for i, (*_, ops, _) in enumerate(loaded) for op in ops]
    for i, (path, step, start, end, ops, order) in enumerate(loaded):
        print(f"# [{i}] {os.path.basename(path)}: its step starts at {ms(start):.3f} ms; ce_overlap ops whose copies "
              f"start in [{args.from_ms:g}, {args.to_ms:g}] ms")
        for op in ops:
            if inside(op["start_us"]):
                moved = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(op["bytes"].items()))
                print(f"  {op['name']:<36} host {ms(op['host_us']):9.3f}  copies {ms(op['start_us']):9.3f} .. "
                      f"{ms(op['end_us']):9.3f} ({(op['end_us'] - op['start_us']) / 1e3:6.3f} ms)  {moved}  "
                      f"streams {op['streams']}")
        r = analyze(step, start, end)
        for w in sorted(r["compute_waits"], key=lambda w: w["at_ms"]):
            t0 = start + w["at_ms"] * 1e3
            t1 = t0 + w["ms"] * 1e3
            if w["ms"] < args.min_wait_ms or not inside(t0):
                continue
            hit = ended_by(every_op, t1, args.slack_us)
            if hit:
                op, copy_end, nbytes = hit
                why = (f"ended by a {nbytes:,}-byte copy at {ms(copy_end):.3f} of [{op['trace']}] {op['name']} (host "
                       f"{ms(op['host_us']):.3f}, copies {ms(op['start_us']):.3f} .. {ms(op['end_us']):.3f})")
            else:
                why = "no copy ended just before it"
            kind = order.gap_kind(t0, t1)
            if kind == "host":
                why = f"the host launched the next kernel after the gap began (not a data wait); {why}"
            elif kind == "stall":
                why = f"no stream wait launched between the two kernels (a stall, not a data wait); {why}"
            print(f"  wait {w['ms']:6.3f} ms at {ms(t0):9.3f} before {w['before'][:40]}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
