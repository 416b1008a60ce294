"""The cost model's busbw for NCCL and the copy engines at 2, 3, 4 and 8 ranks (built-in profiles), beside what this
folder measured with the runtime's new defaults (peer_sync 2, peer_lanes 0; the best ce_overlap variant, host-paced):
4x H200 in d-defaults/coll-{2,3,4}.json, 4x H100 in f-h100/coll-{2,4}.json. CPU only:
    python bench/results/collectives-2026-11-27-b/model.py > bench/results/collectives-2026-11-27-b/model.txt
The 8-rank rows are the paper model of an 8-GPU NVSwitch node (docs/cost_model.md, "8 ranks")."""
import json
import os

from ce_overlap import _core, profiles

HERE = os.path.dirname(os.path.abspath(__file__))
OPS = ("all_gather", "reduce_scatter", "all_to_all", "broadcast")
SIZES = (16, 64, 256)
MEASURED = {"h200-sxm": "d-defaults", "h100-sxm": "f-h100"}


def measured(run: str, n: int) -> dict:
    """{(side, coll, MiB): busbw} of a run's coll-{n}.json, side "nccl" or "ce" (the best ce_overlap variant)."""
    path = os.path.join(HERE, run, f"coll-{n}.json")
    if not os.path.exists(path):
        return {}
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
    """The model's busbw (nccl-tests' definition) of `op` at `mib` MiB per rank on `n` ranks."""
    size = mib << 20
    nbytes = n * size if op == "reduce_scatter" else size
    t_s = _core.estimate_collective(p, op, nbytes, n, backend) * 1e-6
    alg = (n * size if op in ("all_gather", "reduce_scatter") else size) / t_s / 1e9
    return alg if op == "broadcast" else alg * (n - 1) / n


def main() -> None:
    for prof, run in MEASURED.items():
        p = profiles.load(prof)
        print(f"\n{prof}: busbw GB/s, predicted NCCL / CE (measured in {run}/ in brackets, best ce_overlap variant)")
        print(f"{'collective':<16}{'ranks':>6}" + "".join(f"{str(m) + ' MiB':>34}" for m in SIZES))
        for op in OPS:
            for n in (2, 3, 4, 8):
                meas = measured(run, n)
                cells = []
                for mib in SIZES:
                    cell = f"{busbw(p, op, mib, n, 'nccl'):.0f} / {busbw(p, op, mib, n, 'ce'):.0f}"
                    if ("nccl", op, mib) in meas and ("ce", op, mib) in meas:
                        cell += f" ({meas[('nccl', op, mib)]:.0f} / {meas[('ce', op, mib)]:.0f})"
                    cells.append(cell)
                print(f"{op:<16}{n:>6}" + "".join(f"{c:>34}" for c in cells))


if __name__ == "__main__":
    main()
