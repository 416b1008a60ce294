"""The GPUs' SM clock, power and temperature while each mode of a bench/train.py run ran, from the samples
bench/train_device.sh takes beside it (CE_TRAIN_CLOCKS=1: OUT/clocks.csv, one line per GPU and sample: host epoch
seconds, GPU index, SM MHz, W, C) and the windows train.py records per mode (train.json `windows`: its timed steps and
its kernel profile). Says whether the timed steps ran at the clocks the kernel profile (and the cost model's
efficiencies, fitted to profiles) saw: a board at its power limit lowers its clock under sustained load.

    python bench/clocks.py RUN            # RUN/train.json and RUN/clocks.csv (or clocks.csv.gz)
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys


def read_samples(path: str) -> list[tuple[float, int, float, float, float]]:
    """(epoch s, GPU, SM MHz, W, C) per line of clocks.csv (or .csv.gz); lines nvidia-smi could not fill ([N/A]) are
    skipped."""
    out = []
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 5:
                continue
            try:
                out.append((float(parts[0]), int(parts[1]), float(parts[2]), float(parts[3]), float(parts[4])))
            except ValueError:
                continue
    return out


def window_stats(samples: list, window: list | None) -> dict[int, dict]:
    """Per GPU, the mean SM clock, power and temperature of the samples inside `window` ([from, to] epoch s)."""
    if not window or window[0] is None or window[1] is None:
        return {}
    per_gpu: dict[int, list] = {}
    for t, gpu, mhz, watts, temp in samples:
        if window[0] <= t <= window[1]:
            per_gpu.setdefault(gpu, []).append((mhz, watts, temp))
    return {gpu: {"mhz": statistics.mean(s[0] for s in v), "w": statistics.mean(s[1] for s in v),
                  "c": statistics.mean(s[2] for s in v), "samples": len(v)} for gpu, v in sorted(per_gpu.items())}


def report(run: dict, samples: list) -> list[dict]:
    """One row per mode and window (timed, profiled) with its per-GPU stats."""
    rows = []
    for r in run.get("results", []):
        for name in ("timed", "profiled"):
            stats = window_stats(samples, (r.get("windows") or {}).get(name))
            if stats:
                rows.append({"mode": r["mode"], "window": name, "median_ms": r.get("median_ms"), "gpus": stats})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a device run's folder holding train.json and clocks.csv")
    args = ap.parse_args(argv)
    csv = os.path.join(args.run, "clocks.csv")
    paths = [os.path.join(args.run, "train.json"), next((p for p in (csv, csv + ".gz") if os.path.isfile(p)), csv)]
    for p in paths:
        if not os.path.isfile(p):
            print(f"clocks: {p} not found (bench/train_device.sh writes it with CE_TRAIN_CLOCKS=1)", file=sys.stderr)
            return 2
    with open(paths[0]) as f:
        run = json.load(f)
    rows = report(run, read_samples(paths[1]))
    if not rows:
        print("clocks: no sample falls in any mode's window (train.json from a train.py without `windows`?)",
              file=sys.stderr)
        return 2
    print(f"{'mode':<26}{'window':<10}{'step ms':>8}  per GPU: SM MHz / W / C (samples)")
    for row in rows:
        gpus = "  ".join(f"{g['mhz']:.0f} / {g['w']:.0f} / {g['c']:.0f} ({g['samples']})" for g in row["gpus"].values())
        step = f"{row['median_ms']:.1f}" if row["window"] == "timed" and row["median_ms"] else ""
        print(f"{row['mode']:<26}{row['window']:<10}{step:>8}  {gpus}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
