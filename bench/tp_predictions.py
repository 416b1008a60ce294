"""The cost model's step for each tensor-parallel mode of bench/train.py, per TP degree: a markdown table (no GPU).

    python bench/tp_predictions.py --model llama3-70b --world-size 8 --tp 2,4,8 --profile h200-sxm
    python bench/tp_predictions.py --model llama3-tiny --world-size 4 --tp 2 --json out.json
    python bench/tp_predictions.py --from-json out.json                     # the table again, from the rows

Per TP degree T: the zoo model captured over world-size ranks as T-way tensor parallelism inside (torchtitan's plan)
and world / T-way in-graph FSDP, once as captured and once with torch's micro-pipeline TP (async TP), then
ce_overlap.analyzer.step_model's prediction of fsdp2+tp, fsdp2+tp+async-tp, ce_overlap+tp and no-comm+tp, with what tensor
parallelism's collectives cost (their time, exposed as captured) and how many FSDP buckets of ce_overlap's plan share
NVLink with them. What `ce-overlap analyze MODEL --world-size N --tp T` reports, for several T in one table.
Steps are per GPU for one batch per data-parallel rank: with more TP ranks a step trains fewer tokens, so rows compare
by tokens/s/GPU (batch x seq / TP degree / step). The timing model does not ask whether the model fits in memory.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from lib import predict as _predict  # noqa: E402 (bench/, beside this script)

_MODES = ("fsdp2+tp", "fsdp2+tp+async-tp", "ce_overlap+tp", "no-comm+tp")


def predict(model: str, world: int, tp: int, profile: str, seq_len: int | None, batch: int) -> dict:
    """One row: the TP modes' predicted steps (ms) and what TP costs, from a capture and its async-TP twin."""
    from ce_overlap.analyzer import step_model as sm
    from ce_overlap.analyzer.model_capture import capture_named
    from ce_overlap.ir import plan
    from ce_overlap.models.llama import LLAMA_CONFIGS

    started = time.perf_counter()
    ir = capture_named(model, world_size=world, tp=tp, seq_len=seq_len, batch=batch)
    async_ir = capture_named(model, world_size=world, tp=tp, seq_len=seq_len, batch=batch, async_tp=True)
    seq = int(ir.meta["seq_len"])
    pieces = sm.step_model(ir, profile, async_ir=async_ir,
                           loss_logits=batch * seq * LLAMA_CONFIGS[model].vocab_size)
    plans = [plan(ir, g, profile) for g in ir.graph_names]
    overlapping = sum(1 for p in plans for b in p["buckets"] if b.get("overlaps"))
    tp_us = sum(g.get("tp_comm_us") or 0.0 for g in pieces["analyze"].values())
    fused = sum(1 for g in async_ir.to_dict()["graphs"] for n in g["nodes"] if n["op"].startswith("symm_mem.fused_"))
    steps = {m: sm.predicted_step_ms(pieces, m) for m in _MODES}
    best = min(steps["fsdp2+tp"], steps["fsdp2+tp+async-tp"])
    return {"model": model, "world_size": world, "tp": tp, "data_parallel": world // tp, "seq_len": seq,
            "batch": batch, "profile": profile, "predicted_step_ms": steps,
            "ce_overlap_vs_best_fsdp2": best / steps["ce_overlap+tp"], "tp_comm_ms": tp_us / 1e3,
            "async_tp_fused_ops": fused, "fsdp_buckets_sharing_nvlink": overlapping,
            "seconds": round(time.perf_counter() - started, 1)}


def table(rows: list[dict]) -> str:
    head = ("| model | GPUs | TP x FSDP | fsdp2+tp ms | fsdp2+tp+async-tp ms | ce_overlap+tp ms | no-comm+tp ms | "
            "ce_overlap+tp vs the faster FSDP2 | tokens/s/GPU: faster FSDP2, ce_overlap+tp | TP comm ms | "
            "async-TP fused ops | FSDP buckets sharing NVLink |")
    lines = [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"]
    for r in rows:
        s = r["predicted_step_ms"]
        tokens = r["batch"] * r["seq_len"] / r["tp"]  # per GPU and step
        best = min(s["fsdp2+tp"], s["fsdp2+tp+async-tp"])
        lines.append(f"| {r['model']} | {r['world_size']} | {r['tp']} x {r['data_parallel']} | "
                     + " | ".join(f"{s[m]:.1f}" for m in _MODES)
                     + f" | {r['ce_overlap_vs_best_fsdp2']:.3f}x | {1e3 * tokens / best:,.0f}, "
                       f"{1e3 * tokens / s['ce_overlap+tp']:,.0f} | {r['tp_comm_ms']:.1f} | "
                       f"{r['async_tp_fused_ops']} | {r['fsdp_buckets_sharing_nvlink']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = _predict.table_script_parser(__doc__.split("\n\n")[0], "llama3-70b", "per data-parallel rank")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--tp", default="2,4,8", help="comma list of TP degrees (each divides --world-size)")

    def rows_of(args) -> list[dict]:
        degrees = _predict.int_list(p, "--tp", args.tp)
        bad = [t for t in degrees if t < 1 or args.world_size % t]
        if bad or not degrees:
            p.error(f"--tp: each degree must divide --world-size {args.world_size}, got {bad or args.tp!r}")
        rows = []
        for t in degrees:
            rows.append(predict(args.model, args.world_size, t, args.profile, args.seq_len, args.batch))
            print(f"tp {t}: captured and predicted in {rows[-1]['seconds']} s", file=sys.stderr)
        return rows

    return _predict.run_table_script(p, argv, table, "ce_overlap.bench.tp_predictions/1", rows_of)


if __name__ == "__main__":
    sys.exit(main())
