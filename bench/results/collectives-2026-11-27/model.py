"""The cost model's busbw for NCCL and the copy engines at 2, 4 and 8 ranks (built-in profiles), beside what 2x and 4x
H200 measured in this folder (coll-2.json, coll-4.json: the best ce_overlap variant, host-paced). CPU only:
    python bench/results/collectives-2026-11-27/model.py > bench/results/collectives-2026-11-27/model.txt
The 8-rank rows are the paper model of an 8-GPU NVSwitch node (docs/cost_model.md, "8 ranks"): every GPU one port of
18 NVLink4 links (478 GB/s per direction), pulls one peer after another on one copy engine, the broadcast as the
runtime's scatter + all-gather."""
import json
import os

from ce_overlap import _core, profiles

HERE = os.path.dirname(os.path.abspath(__file__))
OPS = ("all_gather", "reduce_scatter", "all_to_all", "broadcast")
SIZES = (16, 64, 256)


def measured(n: int) -> dict:
    path = os.path.join(HERE, f"coll-{n}.json")
    best: dict = {}
    for r in json.load(open(path))["results"]:
        if "busbw_gbps" not in r:
            continue
        key = (r["coll"], r["bytes_per_rank"] >> 20)
        side = "nccl" if r["variant"] == "nccl" else ("ce" if r["variant"].startswith("ce") else None)
        if side:
            best[(side, *key)] = max(best.get((side, *key), 0.0), r["busbw_gbps"])
    return best


def busbw(p, op: str, mib: int, n: int, backend: str) -> float:
    size = mib << 20
    nbytes = n * size if op == "reduce_scatter" else size
    t_s = _core.estimate_collective(p, op, nbytes, n, backend) * 1e-6
    alg = (n * size if op in ("all_gather", "reduce_scatter") else size) / t_s / 1e9
    return alg if op == "broadcast" else alg * (n - 1) / n


for prof in ("h200-sxm", "h100-sxm"):
    p = profiles.load(prof)
    print(f"\n{prof}: busbw GB/s, predicted NCCL / CE (measured on H200 in brackets, best ce_overlap variant)")
    print(f"{'collective':<16}{'ranks':>6}" + "".join(f"{str(m) + ' MiB':>34}" for m in SIZES))
    for op in OPS:
        for n in (2, 4, 8):
            meas = measured(n) if prof == "h200-sxm" and n in (2, 4) else {}
            cells = []
            for mib in SIZES:
                cell = f"{busbw(p, op, mib, n, 'nccl'):.0f} / {busbw(p, op, mib, n, 'ce'):.0f}"
                if meas:
                    cell += f" ({meas[('nccl', op, mib)]:.0f} / {meas[('ce', op, mib)]:.0f})"
                cells.append(cell)
            print(f"{op:<16}{n:>6}" + "".join(f"{c:>34}" for c in cells))
