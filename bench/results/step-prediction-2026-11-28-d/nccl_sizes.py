"""NCCL kernels of the two traces in a-2h200-8L-scheduler/traces by collective and size: how long one takes beside the
step's compute, per size (rank 0, the two traced steps). Prints nccl-sizes.txt:

    python bench/results/step-prediction-2026-11-28-d/nccl_sizes.py > bench/results/step-prediction-2026-11-28-d/nccl-sizes.txt
"""
import collections
import gzip
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))

for mode in ("compile_inductor-overlap", "ce_overlap-nccl"):
    with gzip.open(os.path.join(HERE, "a-2h200-8L-scheduler", "traces", f"trace-{mode}.json.gz")) as f:
        events = json.load(f)["traceEvents"]
    rows = collections.defaultdict(list)
    for e in events:
        if e.get("cat") != "kernel" or "nccl" not in e["name"].lower():
            continue
        a = e["args"]
        name = a["Collective name"].split("_tensor")[0]
        nbytes = 2 * (a["Out msg nelems"] if "gather" in name else a["In msg nelems"])  # bf16, the unsharded size
        rows[(name, 1 << max(0, (nbytes - 1).bit_length() - 1))].append((e["dur"], nbytes))
    print(f"# {mode}: {sum(len(v) for v in rows.values())} NCCL kernels in 2 steps")
    print(f"{'collective':16s} {'MiB':>9s} {'count':>5s} {'median us':>10s} {'algbw GB/s':>10s}")
    for (name, _), v in sorted(rows.items()):
        us = statistics.median(d for d, _ in v)
        nbytes = statistics.median(b for _, b in v)
        print(f"{name:16s} {nbytes / 2**20:9.2f} {len(v):5d} {us:10.1f} {nbytes / us / 1e3:10.1f}")
