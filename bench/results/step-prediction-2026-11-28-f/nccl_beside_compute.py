"""Where the priced order's missing time is, from step-prediction-2026-11-28-e's rank-0 traces (2x H200, 8 layers,
two traced steps per mode): (1) each GEMM against the same GEMM of the no-comm trace (the n-th GEMM of one trace is
the n-th of the other where the kernel names agree), split by whether an NCCL kernel ran when it started, later, or
not at all; (2) each NCCL kernel of the overlap scheduler's step against the cost model's time for its collective
alone (h200-sxm), its size read from the code Inductor generated (issue order = the NCCL stream's order), split into
the part beside a GEMM or attention kernel and the part alone. Run from the repository root:

    python bench/results/step-prediction-2026-11-28-f/nccl_beside_compute.py > bench/results/step-prediction-2026-11-28-f/nccl-beside-compute.txt
"""
import collections
import gzip
import json
import math
import os
import re

from ce_overlap import _core, profiles
from ce_overlap.gpu_trace import kernel_class

E = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "step-prediction-2026-11-28-e")
TRACE = os.path.join(E, "a-2h200-8L-3modes", "traces", "trace-{}.json.gz")
COLL = re.compile(r"(\w+) = torch\.ops\._c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor)\.default\(")
SIZE = re.compile(r"assert_size_stride\((\w+), \(([\d, ]+)\)")


def kernels(mode: str) -> list[dict]:
    d = json.load(gzip.open(TRACE.format(mode), "rt"))
    return sorted((e for e in d["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def overlap(k: dict, others: list[dict]) -> float:
    s, e = k["ts"], k["ts"] + k["dur"]
    return sum(max(0.0, min(e, o["ts"] + o["dur"]) - max(s, o["ts"])) for o in others)


def gemms_beside_nccl() -> None:
    base = [k for k in kernels("no-comm") if kernel_class(k["name"]) == "gemm"]
    print("# 1. GEMMs beside NCCL kernels (two traced steps; slowdown against the same GEMM in the no-comm trace)")
    for mode in ("compile_inductor-overlap", "ce_overlap-nccl"):
        ks = kernels(mode)
        gemms = [k for k in ks if kernel_class(k["name"]) == "gemm"]
        coll = [k for k in ks if kernel_class(k["name"]) == "collective"]
        rows = []
        for i, g in enumerate(gemms):
            if i < len(base) and base[i]["name"] == g["name"]:
                at_start = any(c["ts"] <= g["ts"] < c["ts"] + c["dur"] for c in coll)
                rows.append((g["dur"] - base[i]["dur"], base[i]["dur"], overlap(g, coll), at_start))
        print(f"{mode}: {len(gemms)} GEMMs, {len(rows)} matched, {len(coll)} NCCL kernels")
        for label, pick in (("NCCL running at its start", lambda r: r[3]),
                            ("NCCL starting later", lambda r: not r[3] and r[2] > 0),
                            ("no NCCL beside", lambda r: r[2] == 0)):
            rs = [r for r in rows if pick(r)]
            if not rs:
                continue
            slow, alone, ov = (sum(r[j] for r in rs) / 1e3 for j in (0, 1, 2))
            ratio = f", slowdown / overlap {slow / ov:.2f}" if ov > 0 else ""
            print(f"  {label:26s} {len(rs):4d} GEMMs: {alone:7.2f} ms alone, slowdown {slow:6.2f} ms "
                  f"({100 * slow / alone:+5.1f}%), beside NCCL {ov:6.2f} ms{ratio}")


def issue_order(graph: str) -> list[tuple[str, int | None]]:
    text = gzip.open(os.path.join(E, "wrappers", f"scheduler-{graph}.py.gz"), "rt").read()
    body = text[text.index("def call(self, args)"):]
    issued, sizes = [], {}
    for line in body.splitlines():
        if m := COLL.search(line):
            issued.append((m.group(2), m.group(1)))
        elif m := SIZE.search(line):
            sizes.setdefault(m.group(1), math.prod(int(x) for x in m.group(2).replace(" ", "").split(",") if x))
    return [(typ, sizes.get(buf)) for typ, buf in issued]


def nccl_kernels_against_the_model() -> None:
    profile = _core.Profile.from_json(profiles.read_text("h200-sxm"))
    order = issue_order("forward") + issue_order("backward")
    ks = kernels("compile_inductor-overlap")
    coll = [k for k in ks if kernel_class(k["name"]) == "collective"]
    compute = [k for k in ks if kernel_class(k["name"]) in ("gemm", "attention")]
    by = collections.defaultdict(list)
    for i, k in enumerate(coll):
        typ, numel = order[i % len(order)]
        ag = typ.startswith("all_gather")
        if ("AllGather" if ag else "ReduceScatter") not in k["name"]:
            raise SystemExit(f"NCCL kernel {i} is {k['name']}, the generated code issues {typ} there")
        if numel is None:
            continue
        nbytes = numel if ag else numel * 4  # the IR's bytes (bf16): an all-gather's input, a reduce-scatter's input
        model = _core.estimate_collective(profile, "all_gather" if ag else "reduce_scatter", nbytes, 2, "nccl")
        by[("all-gather" if ag else "reduce-scatter", nbytes >> 20)].append((k["dur"], model, overlap(k, compute)))
    print(f"\n# 2. The overlap scheduler's NCCL kernels against the model's time alone ({len(coll)} kernels, "
          f"{len(order)} collectives per step)")
    print("| collective | MiB per rank in | kernels | measured us | model us alone | measured / model | "
          "beside GEMM or attention us | alone us |")
    print("|---|---|---|---|---|---|---|---|")
    tot = [0.0, 0.0, 0.0]
    for (typ, mib), rs in sorted(by.items()):
        n = len(rs)
        m, mo, ov = (sum(r[j] for r in rs) / n for j in (0, 1, 2))
        tot = [tot[0] + m * n, tot[1] + mo * n, tot[2] + ov * n]
        print(f"| {typ} | {mib} | {n} | {m:.1f} | {mo:.1f} | {m / mo:.2f} | {ov:.1f} | {m - ov:.1f} |")
    print(f"\nper step: measured {tot[0] / 2e3:.1f} ms of NCCL kernels, the model's time alone {tot[1] / 2e3:.1f} ms, "
          f"beside GEMM or attention {tot[2] / 2e3:.1f} ms")


if __name__ == "__main__":
    gemms_beside_nccl()
    nccl_kernels_against_the_model()
