"""Inductor's own order against the captured (post-grad FX) order, for the overlap scheduler's step: where each
collective is issued and waited for, counted in matrix multiplies (the GEMMs, the step's compute), in the wrapper
code Inductor generated on the GPU (wrappers/, the call() of the compiled module) and in the capture ce_overlap prices
(its IR, captured on the CPU with torch 2.11: bench/_predict.py capture_step with overlap_scheduler). Collectives are
matched by type and size in order of issue. Run from the repository root with torch 2.11 and the IR saved with
Ir.save (README, "Commands"):

    python bench/results/step-prediction-2026-11-28-e/order_compare.py IR.json > .../order-compare.txt
"""
import collections
import gzip
import math
import os
import re
import sys

from ce_overlap.ir import Ir

HERE = os.path.dirname(os.path.abspath(__file__))
GEMM = re.compile(r"extern_kernels\.(mm|addmm|bmm)\(")
COLL = re.compile(r"(\w+) = torch\.ops\._c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor)\.default\(")
WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)\)")
SIZE = re.compile(r"assert_size_stride\((\w+), \(([\d, ]+)\)")


def wrapper_events(path: str) -> list[tuple]:
    """In call() order: ("mm",), ["issue", type, output elements, buf], ("wait", buf)."""
    text = gzip.open(path, "rt").read()
    body = text[text.index("def call(self, args)"):]
    events = []
    for line in body.splitlines():
        if GEMM.search(line):
            events.append(("mm",))
        elif m := COLL.search(line):
            events.append(["issue", m.group(2), None, m.group(1)])
        elif m := SIZE.search(line):
            dims = [int(x) for x in m.group(2).replace(" ", "").split(",") if x]
            for e in events[::-1]:
                if e[0] == "issue" and e[3] == m.group(1) and e[2] is None:
                    e[2] = math.prod(dims)
                    break
        elif m := WAIT.search(line):
            events.append(("wait", m.group(1)))
    return events


def ir_events(ir: Ir, graph: str) -> list[tuple]:
    g = next(x for x in ir.to_dict()["graphs"] if x["name"] == graph)
    events = []
    for n in g["nodes"]:
        op = n.get("op", "")
        if n.get("kind") == "compute" and op.startswith(("aten.mm", "aten.addmm", "aten.bmm")):
            events.append(("mm",))
        elif n.get("kind") == "collective" and n.get("collective"):
            c = n["collective"]
            events.append(["issue", {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}
                           .get(c["type"], c["type"]), None, n["id"], c])
        elif n.get("kind") == "wait":
            events.append(("wait", n["inputs"][0] if n.get("inputs") else None))
    return events


def windows(events, numel_of) -> list[tuple]:
    """Per collective in issue order: (type, size key, GEMMs before its issue, GEMMs before its wait)."""
    mm, out, issued = 0, {}, []
    for e in events:
        if e[0] == "mm":
            mm += 1
        elif e[0] == "issue":
            key = (e[1], numel_of(e))
            out[e[3]] = [key, mm, None]
            issued.append(e[3])
        elif e[0] == "wait" and e[1] in out and out[e[1]][2] is None:
            out[e[1]][2] = mm
    return [out[b] for b in issued]


def compare(graph: str, wrapper: str, ir: Ir) -> None:
    w = windows(wrapper_events(os.path.join(HERE, "wrappers", wrapper)), lambda e: e[2])
    # the IR's element count: an all-gather's output (bytes x group / 2 for bf16), a reduce-scatter's output
    i = windows(ir_events(ir, graph), lambda e: (e[4]["bytes"] * (e[4]["group_size"] if e[4]["type"] == "all_gather" else 1)
                                                 // e[4]["group_size"] ** (e[4]["type"] == "reduce_scatter") // 2))
    by_key = collections.defaultdict(list)
    for k, a, b in i:
        by_key[k].append((a, b))
    seen = collections.Counter()
    moved, rows = collections.Counter(), []
    for k, a, b in w:
        j = seen[k]
        seen[k] += 1
        if j >= len(by_key[k]):
            rows.append(f"  {k}: not in the capture")
            continue
        ia, ib = by_key[k][j]
        d_issue, d_win = a - ia, (b - a) - (ib - ia) if b is not None and ib is not None else None
        moved["issue later" if d_issue > 0 else "issue earlier" if d_issue < 0 else "issue in place"] += 1
        if d_win:
            rows.append(f"  {k[0]:24s} {k[1] * 2 / 2**20:8.1f} MiB: issued after GEMM {a:3d} (captured {ia:3d}), "
                        f"waited after {b} ({ib}): window {b - a} GEMMs (captured {ib - ia})")
    print(f"# {graph}: {len(w)} collectives in Inductor's code, {len(i)} in the capture; issue relative to the "
          f"GEMMs: {dict(moved)}; collectives whose window (GEMMs between issue and wait) differs:")
    print("\n".join(rows) or "  none")


if __name__ == "__main__":
    ir = Ir.load(sys.argv[1])
    compare("forward", "scheduler-forward.py.gz", ir)
    compare("backward", "scheduler-backward.py.gz", ir)
