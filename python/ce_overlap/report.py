"""Renders analysis reports (docs/analysis.md): the per-block table and a Chrome/Perfetto trace."""
from __future__ import annotations

import json

_MIB = 1024 * 1024


def _ms(us: float) -> str:
    return f"{us / 1000:.2f}"


def _row_cells(row: dict, label: str, path: str) -> list[str]:
    return [
        label, path,
        str(row["forward_all_gather_count"]), f"{row['forward_all_gather_bytes'] / _MIB:.1f}",
        str(row["backward_all_gather_count"]),
        str(row["reduce_scatter_count"]), f"{row['reduce_scatter_bytes'] / _MIB:.1f}",
        f"{row['forward_flops'] / 1e9:.1f}", f"{row['backward_flops'] / 1e9:.1f}",
        _ms(row["compute_us"]), _ms(row["comm_us"]), _ms(row["exposed_comm_us"]),
    ]


_HEADER = ["block", "module", "fwd AG", "fwd AG MiB", "bwd AG", "RS", "RS MiB", "fwd GFLOP", "bwd GFLOP",
           "compute ms", "comm ms", "exposed ms"]


def format_table(report: dict, *, max_rows: int | None = None) -> str:
    blocks = report["blocks"]
    rows = [_row_cells(b, str(b["block"]), b["path"]) for b in blocks]
    if max_rows is not None and len(rows) > max_rows:
        keep = max_rows // 2
        rows = rows[:keep] + [["..."] + [""] * (len(_HEADER) - 1)] + rows[-keep:]
    rows.append(_row_cells(report["outside_blocks"], "-", "(outside blocks)"))
    total = _row_cells(report["totals"], "total", "")
    widths = [max(len(h), *(len(r[i]) for r in rows + [total])) for i, h in enumerate(_HEADER)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    rule = "-" * len(line(_HEADER))
    out = [line(_HEADER), rule, *(line(r) for r in rows), rule, line(total)]
    return "\n".join(out)


def format_summary(report: dict) -> str:
    meta = report.get("meta", {})
    lines = []
    head = f"model {meta.get('model', '?')}, world size {meta.get('world_size', '?')}, profile {report['profile']}"
    if "seq_len" in meta:
        head += f", batch {meta.get('batch', '?')} x seq {meta['seq_len']}"
    lines.append(head)
    blocks = report["blocks"]
    if blocks:
        types = sorted({b["type"] for b in blocks})
        lines.append(f"blocks: {len(blocks)} x {'/'.join(types)} ({blocks[0]['path']} .. {blocks[-1]['path']})")
    else:
        lines.append("blocks: none detected (no module type repeats)")
    for g in report["graphs"]:
        lines.append(
            f"{g['name']:<9} {g['nodes']:>6} nodes, {g['collectives']:>4} collectives: compute {_ms(g['compute_us'])} ms, "
            f"comm {_ms(g['comm_us'])} ms, exposed {_ms(g['exposed_comm_us'])} ms, step {_ms(g['makespan_us'])} ms, "
            f"peak activations {g['peak_memory_bytes'] / 2**30:.2f} GiB")
    return "\n".join(lines)


_PLAN_HEADER = ["id", "block", "type", "members", "MiB", "backend", "NCCL us", "CE us", "window us", "reason"]


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            text = f"{n:.0f}" if unit == "B" else f"{n:.2f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
        n /= 1024
    return ""


def format_plan(plan: dict, *, max_rows: int | None = None) -> str:
    """A Plan (docs/plan.md) as a per-bucket table under a summary."""
    c, s = plan["config"], plan["summary"]
    prefetch = c["prefetch_blocks"]
    lines = [
        f"plan {plan['graph']} ({plan['profile']}; cap {_bytes(c['bucket_cap_bytes'])}, prefetch {prefetch} "
        f"block{'' if prefetch == 1 else 's'}, ce {c['ce']}, memory budget {_bytes(c['memory_budget_bytes'])}): "
        f"{s['buckets']} buckets of {s['collectives']} collectives, {s['ce_buckets']} on CE, planned in "
        f"{s['plan_ms']:.0f} ms",
        f"  exposed comm {_ms(s['exposed_comm_us_before'])} -> {_ms(s['exposed_comm_us_after'])} ms, peak memory "
        f"{_bytes(s['peak_memory_bytes_before'])} -> {_bytes(s['peak_memory_bytes_after'])}",
    ]
    rows = []
    for b in plan["buckets"]:
        p = b["predicted"]
        block = b["block_path"] if b["block_path"] is not None else ("-" if b["block"] is None else str(b["block"]))
        rows.append([str(b["id"]), block, b["type"], str(len(b["members"])), f"{b['bytes'] / _MIB:.1f}",
                     b["backend"], f"{p['nccl_us']:.1f}", "-" if p["ce_us"] is None else f"{p['ce_us']:.1f}",
                     f"{p['window_us']:.1f}", b["reason"]])
    if max_rows is not None and len(rows) > max_rows:
        keep = max_rows // 2
        rows = rows[:keep] + [["..."] + [""] * (len(_PLAN_HEADER) - 1)] + rows[-keep:]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(_PLAN_HEADER)]
    widths[-1] = 0  # the reason runs to the end of the line

    def line(cells):
        return "  ".join(cell.ljust(w) if i in (1, 2, 5, 9) else cell.rjust(w)
                         for i, (cell, w) in enumerate(zip(cells, widths))).rstrip()

    lines += [line(_PLAN_HEADER), "-" * len(line(_PLAN_HEADER[:-1]) + "  reason"), *(line(r) for r in rows)]
    return "\n".join(lines)


def to_chrome_trace(report: dict) -> dict:
    """Chrome/Perfetto trace: one track for compute, one for communication, times in microseconds."""
    events = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"ce_overlap estimate ({report['profile']})"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "compute stream"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "comm stream"}},
    ]
    for e in report["timeline"]:
        events.append({
            "name": e["name"], "cat": e["kind"], "ph": "X", "pid": 0,
            "tid": 1 if e["stream"] == "comm" else 0,
            "ts": e["start_us"], "dur": max(e["end_us"] - e["start_us"], 0.0),
            "args": {"op": e["op"], "graph": e["graph"], "block": e["block"]},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(report: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_chrome_trace(report), f)
