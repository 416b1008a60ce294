"""What the GPU did during a run of collectives, from torch.profiler Chrome traces: per stream, its copies (count,
bytes, busy time, the rate of the large ones, the idle gaps between them) and kernels. Made to compare one variant with
the host issuing op by op against the same ops queued ahead of the GPU (bench/collectives.py SWEEP --trace-dir writes
both per rank: <coll>-<variant>-<size>-{paced,ahead}-rank<r>.json.gz). No GPU needed to summarize:

    python bench/copy_timeline.py out/traces/*.json.gz [--json summary.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
from typing import Callable

import timeline

LARGE_COPY_BYTES = 1 << 20  # copies from this size count toward a stream's copy rate (smaller ones are signals)


def load(path: str) -> list[dict]:
    """The GPU activities (kernels, copies, memsets) of a Chrome trace, sorted by start (bench/timeline.py's reader)."""
    return timeline.gpu_events(path)


def summarize(acts: list[dict]) -> dict:
    """Per stream: copies (count, bytes, busy us, median GB/s of the large ones, median / max gap between consecutive
    copies), signal copies (count, median us), kernels (count, busy us, the most frequent names); and the span."""
    if not acts:
        return {"span_us": 0.0, "streams": {}}
    t0 = min(float(a["ts"]) for a in acts)
    t1 = max(float(a["ts"]) + float(a.get("dur", 0.0)) for a in acts)
    streams: dict[str, dict] = {}
    for a in acts:
        args = a.get("args", {})
        s = streams.setdefault(str(args.get("stream", a.get("tid", "?"))), {"copies": [], "kernels": []})
        (s["copies"] if a["cat"] != "kernel" else s["kernels"]).append(a)
    out: dict[str, dict] = {}
    for sid, s in sorted(streams.items()):
        copies = s["copies"]
        large, small = [], []
        for c in copies:
            (large if int(c.get("args", {}).get("bytes", 0)) >= LARGE_COPY_BYTES else small).append(c)
        gaps = [float(b["ts"]) - (float(a["ts"]) + float(a.get("dur", 0.0))) for a, b in zip(large, large[1:])]
        rates = [int(c["args"]["bytes"]) / float(c["dur"]) / 1e3 for c in large if float(c.get("dur", 0)) > 0]
        names = collections.Counter(k.get("name", "")[:60] for k in s["kernels"])
        out[sid] = {
            "large_copies": len(large),
            "large_bytes": sum(int(c["args"]["bytes"]) for c in large),
            "large_busy_us": sum(float(c.get("dur", 0.0)) for c in large),
            "large_median_gbps": statistics.median(rates) if rates else None,
            "large_gap_median_us": statistics.median(gaps) if gaps else None,
            "large_gap_max_us": max(gaps) if gaps else None,
            "signal_copies": len(small),
            "signal_median_us": statistics.median(float(c.get("dur", 0.0)) for c in small) if small else None,
            "kernels": len(s["kernels"]),
            "kernel_busy_us": sum(float(k.get("dur", 0.0)) for k in s["kernels"]),
            "kernel_names": dict(names.most_common(4)),
        }
    return {"span_us": t1 - t0, "streams": out}


def capture(run: Callable[[], None], ops: int, path: str, ahead: bool, settle: Callable[[], None]) -> None:
    """Traces `ops` calls of `run` on this rank into `path` (Chrome trace, gzipped): issued one by one as the host
    goes (ahead=False), or all queued behind a GPU sleep first (ahead=True, as bench/_common.time_host_ahead times
    them). Call on every rank of the group alike."""
    from lib import kernel_profile as _kernel_profile
    import torch

    run()
    settle()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        if ahead:
            torch.cuda._sleep(int(20e-3 * 1.98e9))  # ~20 ms at the top SM clock: longer than queueing the ops
        for _ in range(ops):
            run()
        settle()
    _kernel_profile.write_trace(prof, path)


def print_summary(name: str, summary: dict) -> None:
    print(f"# {name}: span {summary['span_us'] / 1e3:.3f} ms")
    print(f"{'stream':>8}{'copies':>8}{'MiB':>10}{'busy ms':>10}{'GB/s med':>10}{'gap med us':>12}{'gap max us':>12}"
          f"{'signals':>9}{'sig us':>8}{'kernels':>9}{'kern ms':>9}  kernel names")

    def f(x, fmt):
        return format(x, fmt) if x is not None else "-"

    for sid, s in summary["streams"].items():
        print(f"{sid:>8}{s['large_copies']:>8}{s['large_bytes'] / 2**20:>10.1f}{s['large_busy_us'] / 1e3:>10.3f}"
              f"{f(s['large_median_gbps'], '.1f'):>10}{f(s['large_gap_median_us'], '.1f'):>12}"
              f"{f(s['large_gap_max_us'], '.1f'):>12}{s['signal_copies']:>9}{f(s['signal_median_us'], '.2f'):>8}"
              f"{s['kernels']:>9}{s['kernel_busy_us'] / 1e3:>9.3f}  {s['kernel_names'] or ''}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", help="Chrome traces (.json or .json.gz)")
    p.add_argument("--json", help="also write every summary here")
    args = p.parse_args(argv)
    summaries = {}
    for path in args.traces:
        try:
            summaries[path] = summarize(load(path))
        except (OSError, ValueError, KeyError) as e:
            print(f"bench/copy_timeline.py: {path}: cannot read the trace: {e}", file=sys.stderr)
            return 2
        print_summary(os.path.basename(path), summaries[path])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
