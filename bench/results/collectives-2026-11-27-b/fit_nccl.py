"""Fits the built-in profiles' nccl.bus_efficiency_scale (docs/profiles.md) to NCCL's busbw measured in this folder:
h200-sxm to d-defaults/coll-{2,3,4}.json (4x H200), h100-sxm to f-h100/coll-{2,4}.json (4x H100). Per collective and
group size, the factor on every protocol line's bus_efficiency that minimizes the largest relative error of the
model's busbw at 16, 64 and 256 MiB per rank (a grid of 0.005). CPU only:
    python bench/results/collectives-2026-11-27-b/fit_nccl.py > bench/results/collectives-2026-11-27-b/fit_nccl.txt
"""
import json
import os
import sys

from ce_overlap import _core, profiles

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from model import busbw, measured  # noqa: E402  (this folder's model.py: the measured busbw, the model's)

RUNS = {"h200-sxm": ("d-defaults", (2, 3, 4)), "h100-sxm": ("f-h100", (2, 4))}
OPS = ("all_gather", "reduce_scatter", "all_to_all", "broadcast")
SIZES = (16, 64, 256)



def with_scale(base: dict, op: str, n: int, scale: float):
    j = json.loads(json.dumps(base))
    j["nccl"]["bus_efficiency_scale"] = [{"collective": op, "group_size": n, "scale": scale}]
    return _core.Profile.from_json(json.dumps(j))


for prof, (run, ranks) in RUNS.items():
    base = json.loads(profiles.read_text(prof))
    base["nccl"].pop("bus_efficiency_scale", None)
    unscaled = _core.Profile.from_json(json.dumps(base))
    fitted = []
    print(f"\n{prof} against {run}/: NCCL busbw GB/s at 16 / 64 / 256 MiB, measured | unscaled model | fitted model")
    for op in OPS:
        for n in ranks:
            meas = {(op_, mib): v for (side, op_, mib), v in measured(run, n).items() if side == "nccl"}
            best = None
            for k in range(60, 401):
                s = k * 0.005
                p = with_scale(base, op, n, s)
                err = max(abs(busbw(p, op, m, n, 'nccl') / meas[(op, m)] - 1) for m in SIZES)
                if best is None or err < best[1]:
                    best = (s, err)
            s, err = best
            p = with_scale(base, op, n, s)
            cells = " / ".join(f"{meas[(op, m)]:.0f}" for m in SIZES)
            plain = " / ".join(f"{busbw(unscaled, op, m, n, 'nccl'):.0f}" for m in SIZES)
            fit = " / ".join(f"{busbw(p, op, m, n, 'nccl'):.0f}" for m in SIZES)
            print(f"{op:<16}{n:>3} ranks  scale {s:.3f}  {cells:>17} | {plain:>17} | {fit:>17}  (worst {100 * err:.1f}%)")
            fitted.append({"collective": op, "group_size": n, "scale": round(s, 3)})
    print(json.dumps(fitted))
