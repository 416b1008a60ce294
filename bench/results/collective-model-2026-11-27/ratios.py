"""The cost model's CE / NCCL busbw ratio per collective at 2, 4 and 8 ranks (built-in profiles), beside issue 30's
measured ratios on 2x / 4x H200. CPU only: python bench/results/collective-model-2026-11-27/ratios.py"""
from ce_overlap import _core, profiles
MEAS = {  # issue 30's table: best ce_overlap variant / NCCL busbw at 16 / 64 / 256 MiB per rank (bench/collectives.py all)
    ("all_gather", 2): (1.34, 1.42, 1.46), ("all_gather", 4): (1.04, 1.15, 1.17),
    ("reduce_scatter", 2): (1.03, 1.12, 1.15), ("reduce_scatter", 4): (0.88, 0.96, 0.74),
    ("all_to_all", 2): (1.17, 1.13, 1.18), ("all_to_all", 4): (0.78, 0.92, 1.10),
    ("broadcast", 2): (0.88, 1.01, 1.05), ("broadcast", 4): (0.43, 0.39, 0.37)}
for prof in ("h200-sxm", "h100-sxm"):
    p = profiles.load(prof)
    print(f"\n{prof}: CE / NCCL busbw predicted by the cost model (measured on 2x / 4x H200 where there is a number)")
    print(f"{'collective':<16}{'ranks':>6}  {'16 MiB':>14}{'64 MiB':>14}{'256 MiB':>14}")
    for op in ("all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        for n in (2, 4, 8):
            cells = []
            for i, mib in enumerate((16, 64, 256)):
                size = mib << 20
                b = n * size if op == "reduce_scatter" else size
                r = _core.estimate_collective(p, op, b, n, "nccl") / _core.estimate_collective(p, op, b, n, "ce")
                m = MEAS.get((op, n)) if prof == "h200-sxm" else None
                cells.append(f"{r:.2f}" + (f" ({m[i]:.2f})" if m else ""))
            print(f"{op:<16}{n:>6}  " + "".join(f"{c:>14}" for c in cells))
