"""The cost model's step across nodes, per node count: flat FSDP on NCCL, hierarchical FSDP, HSDP on NCCL and HSDP with
copy engines inside each node, as a markdown table (no GPU).

    python bench/node_predictions.py --model llama3-8b --nodes 1,2,8,64 --profile h200-sxm
    python bench/node_predictions.py --model llama3-tiny --nodes 1,2 --gpus-per-node 4 --json out.json
    python bench/node_predictions.py --from-json out.json                     # the table again, from the rows

Per node count M: the zoo model captured over M x gpus-per-node ranks, once as FSDP over every rank and (M >= 2) once
as HSDP (shards inside each node, replicas across), each collective's group and its nodes in the IR; then
ce_overlap.analyzer.step_model's prediction of each mode (ce_overlap.analyzer.step_model.NODE_MODES: what `ce-overlap analyze MODEL
--world-size N --nodes M [--hsdp]` reports), and the no-communication bound. On one node the FSDP row's ce_overlap
column is the one-node plan (copy engines where they pay) and the HSDP columns do not apply. What the modes assume:
the profile's inter-node link (the built-in H200 profile: 8 x 400 Gb/s InfiniBand NICs per node, one per GPU on its
own rail, 5 us per inter-node ring step, 0.9 of the link), NCCL's flat ring driving the NICs of the group's ranks on
each node, the hierarchical collectives as ce_overlap.runtime.hierarchical runs them (the rail half on NCCL over one NIC
per rank, the node half on copy engines, one reordering copy on the compute stream). Steps are per GPU for one batch
per rank; the timing model does not ask whether the model fits in memory.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from lib import predict as _predict  # noqa: E402 (bench/, beside this script)

# Table columns: (label, capture, mode).
_COLUMNS = (("FSDP, NCCL", "flat", "fsdp"), ("FSDP, hierarchical", "flat", "fsdp-hierarchical"),
            ("FSDP, ce_overlap", "flat", "fsdp-ce_overlap"), ("HSDP, NCCL", "hsdp", "hsdp"),
            ("HSDP, CE inside nodes", "hsdp", "hsdp-ce_overlap"), ("no comm", "flat", "no-comm"))


def predict(model: str, nodes: int, per_node: int, profile: str, seq_len: int | None, batch: int) -> dict:
    """One row: each mode's predicted step (ms) at `nodes` nodes of `per_node` ranks."""
    from ce_overlap.analyzer import step_model as sm
    from ce_overlap.analyzer.model_capture import capture_named

    started = time.perf_counter()
    world = nodes * per_node
    steps: dict[str, float | None] = {}
    for capture in ("flat", "hsdp"):
        if capture == "hsdp" and nodes < 2:
            continue
        ir = capture_named(model, world_size=world, seq_len=seq_len, batch=batch, nodes=nodes,
                           hsdp=capture == "hsdp")
        pieces = sm.step_model(ir, profile)
        for _, cap, mode in _COLUMNS:
            if cap != capture:
                continue
            if nodes == 1 and mode in ("fsdp", "fsdp-hierarchical", "fsdp-ce_overlap"):  # one node: the 1-D modes
                mode_1d = {"fsdp": "ce_overlap-nccl", "fsdp-ce_overlap": "ce_overlap"}.get(mode)
                steps[mode] = sm.predicted_step_ms(pieces, mode_1d) if mode_1d else None
            else:
                steps[mode] = sm.predicted_step_ms(pieces, mode)
        seq = int(ir.meta["seq_len"])
    return {"model": model, "nodes": nodes, "gpus_per_node": per_node, "world_size": world, "seq_len": seq,
            "batch": batch, "profile": profile, "predicted_step_ms": steps,
            "seconds": round(time.perf_counter() - started, 1)}


def table(rows: list[dict]) -> str:
    head = "| model | nodes x GPUs | " + " | ".join(f"{label} ms" for label, _, _ in _COLUMNS) + \
        " | best, vs FSDP on NCCL |"
    lines = [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"]
    for r in rows:
        s = r["predicted_step_ms"]
        cells = ["-" if s.get(mode) is None else f"{s[mode]:.1f}" for _, _, mode in _COLUMNS]
        usable = {label: s[mode] for label, _, mode in _COLUMNS if mode != "no-comm" and s.get(mode) is not None}
        best = min(usable, key=usable.get)
        gain = s["fsdp"] / usable[best] if s.get("fsdp") else float("nan")
        lines.append(f"| {r['model']} | {r['nodes']} x {r['gpus_per_node']} | " + " | ".join(cells)
                     + f" | {best}, {gain:.3f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = _predict.table_script_parser(__doc__.split("\n\n")[0], "llama3-8b", "per rank")
    p.add_argument("--nodes", default="1,2,8,64", help="comma list of node counts")
    p.add_argument("--gpus-per-node", type=int, default=8)

    def rows_of(args) -> list[dict]:
        counts = _predict.int_list(p, "--nodes", args.nodes)
        if not counts or any(m < 1 for m in counts) or args.gpus_per_node < 1:
            p.error(f"--nodes and --gpus-per-node must be >= 1, got {args.nodes!r} and {args.gpus_per_node}")
        rows = []
        for m in counts:
            rows.append(predict(args.model, m, args.gpus_per_node, args.profile, args.seq_len, args.batch))
            print(f"{m} nodes: captured and predicted in {rows[-1]['seconds']} s", file=sys.stderr)
        return rows

    return _predict.run_table_script(p, argv, table, "ce_overlap.bench.node_predictions/1", rows_of)


if __name__ == "__main__":
    sys.exit(main())
