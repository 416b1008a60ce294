"""Each order scheduler_order.py wrote against the order the GPU ran: the code Inductor generated for the overlap
scheduler's step on 2x H200 (step-prediction-2026-11-28-e/wrappers, its call()). Per collective in issue order:
how many GEMMs ran before its issue and before its wait; a collective is "exact" when both equal the generated code's,
and the mean differences are in GEMMs. Run from the repository root (no torch needed):

    python bench/results/step-prediction-2026-11-28-f/order_windows.py bench/results/step-prediction-2026-11-28-f/orders/*.json.gz
"""
import gzip
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
WRAPPER = os.path.join(HERE, "..", "step-prediction-2026-11-28-e", "wrappers", "scheduler-{}.py.gz")
GEMM = re.compile(r"extern_kernels\.(mm|addmm|bmm)\(")
COLL = re.compile(r"(\w+) = torch\.ops\._c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor)\.default\(")
WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)\)")


def generated(graph: str) -> list:
    text = gzip.open(WRAPPER.format(graph), "rt").read()
    events = []
    for line in text[text.index("def call(self, args)"):].splitlines():
        if GEMM.search(line):
            events.append(("mm", ""))
        elif m := COLL.search(line):
            events.append(("issue", m.group(1)))
        elif m := WAIT.search(line):
            events.append(("wait", m.group(1)))
    return events


def windows(events) -> list[tuple[int, int]]:
    """(GEMMs before the issue, GEMMs before the wait) per collective, in issue order."""
    mm, out, order = 0, {}, []
    for e in events:
        if e[0] == "mm":
            mm += 1
        elif e[0] == "issue":
            out[e[1]] = [mm, None]
            order.append(e[1])
        elif e[0] == "wait" and e[1] in out and out[e[1]][1] is None:
            out[e[1]][1] = mm
    return [tuple(out[b]) for b in order]


def main(paths: list[str]) -> None:
    gpu = {g: windows(generated(g)) for g in ("forward", "backward")}
    print("| order | estimates | collectives | Inductor's peak-memory reorder | graph | order read | exact | "
          "mean issue diff | mean wait diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        d = json.load(gzip.open(path, "rt") if path.endswith(".gz") else open(path))
        name = re.sub(r"\.json(\.gz)?$", "", os.path.basename(path))
        coll = d.get("collectives", "formula (the fake group)")
        if d.get("scale", 1) != 1:
            coll += f" x{d['scale']:g}"
        for graph, w in gpu.items():
            for kind in ("fx", "inductor"):
                s = windows(d["graphs"][graph][kind])
                if len(s) != len(w):
                    print(f"| {os.path.basename(path)} | {graph}: {len(s)} collectives, the generated code {len(w)} |")
                    continue
                exact = sum(a == b for a, b in zip(w, s))
                di = sum(abs(a[0] - b[0]) for a, b in zip(w, s)) / len(w)
                dw = sum(abs(a[1] - b[1]) for a, b in zip(w, s)) / len(w)
                print(f"| {name} | {d['estimates']} ({d['device']}) | {coll} | "
                      f"{d['peak_memory_reorder']} | {graph} | {kind} | {exact}/{len(w)} | {di:.2f} | {dw:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
