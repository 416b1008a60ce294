"""Renders analysis reports (docs/analysis.md): the per-block table and a Chrome/Perfetto trace."""
from __future__ import annotations

import json
import re

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


_HEADER = ["block", "module", "fwd AG", "fwd AG out MiB", "bwd AG", "RS", "RS in MiB", "fwd GFLOP", "bwd GFLOP",
           "compute ms", "comm ms", "exposed ms"]


def table_units(report: dict) -> str:
    """The block table's byte columns, said in words (a line to print above it)."""
    ws = report.get("meta", {}).get("world_size")
    keeps = f"1/{ws}" if isinstance(ws, int) else "its share"
    return (f"per rank and step: fwd AG out MiB = the gathered parameters the forward's all-gathers produce; "
            f"RS in MiB = the full gradients the reduce-scatters take (each rank keeps {keeps})")


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


def format_notes(report: dict) -> list[str]:
    """What the capture assumed or added that changes the numbers (from the IR's meta; docs/ir.md), one line each:
    which output is the loss, FSDP's padding, the capture device, floating inputs cast to the gather dtype."""
    meta = report.get("meta", {})
    notes = []
    loss, unused = meta.get("loss"), meta.get("loss_unused_outputs", 0)
    if loss and (unused or not loss.endswith("a scalar") or loss.startswith("the sum")):
        text = f"the loss is {loss}"
        if unused:
            text += f"; the other {unused} tensor output{'s are' if unused > 1 else ' is'} not differentiated"
        notes.append(text)
    pad, padded = meta.get("fsdp_padding_bytes", 0), meta.get("fsdp_padded_params", 0)
    if pad:
        gathered = report.get("totals", {}).get("forward_all_gather_bytes") or 0
        share = f", {100 * pad / gathered:.2f}% of the forward all-gather bytes" if gathered else ""
        notes.append(
            f"world size {meta.get('world_size', '?')} does not divide dim 0 of {padded} parameter"
            f"{'s' if padded != 1 else ''} (largest: {meta.get('fsdp_padding_largest', '?')}): FSDP pads their shards, "
            f"and the all-gather and reduce-scatter bytes include the padding, {_bytes(pad)} per pass over them{share}")
    if meta.get("capture_device") == "cpu":  # the default is fake CUDA tensors: the GPU's graphs
        why = meta.get("capture_device_reason")
        notes.append("captured on the CPU: the graphs are Inductor's CPU graphs (SDPA as its CPU kernel, no flex "
                     f"attention), not a GPU's{f', because {why}' if why else ' (--device cpu)'}")
    cast = meta.get("forward_inputs_cast", 0)
    if cast:
        notes.append(f"{cast} floating-point forward input{'s' if cast != 1 else ''} cast to {meta.get('param_dtype')} "
                     "(FSDP2's MixedPrecisionPolicy default; --no-cast-inputs keeps the input dtype)")
    return notes


def format_summary(report: dict) -> str:
    meta = report.get("meta", {})
    lines = []
    head = f"model {meta.get('model', '?')}, world size {meta.get('world_size', '?')}, profile {report['profile']}"
    tp = meta.get("tp", 1)
    if tp > 1:
        ws = meta.get("world_size")
        dp = ws // tp if isinstance(ws, int) else "?"
        head += (f" (tensor parallelism over {tp} ranks inside, FSDP over {dp}"
                 f"{', torch async TP' if meta.get('async_tp') else ''})")
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
            f"peak activations {g['peak_memory_bytes'] / 2**30:.2f} GiB"
            + (f"; of the comm, tensor parallelism {_ms(g['tp_comm_us'])} ms (exposed {_ms(g['tp_exposed_comm_us'])})"
               if g.get("tp_comm_us") else ""))
    by_class: dict[str, float] = {}
    for g in report["graphs"]:
        for cls, us in (g.get("compute_by_class_us") or {}).items():
            by_class[cls] = by_class.get(cls, 0.0) + us
    if by_class:  # what to hold against a profiler's kernel table (torch.profiler, nsys) of one step
        names = {"matmul": "GEMMs", "attention": "attention", "memory_bound": "fused / memory-bound"}
        lines.append("kernel time per step by class (what a profiler's kernel table shows): " + ", ".join(
            f"{names.get(c, c)} {_ms(us)} ms" for c, us in sorted(by_class.items(), key=lambda kv: -kv[1]))
            + " (the optimizer and the GPU's gaps between kernels apart)")
    lines += [f"note: {n}" for n in format_notes(report)]
    return "\n".join(lines)


_PLAN_HEADER = ["id", "block", "type", "members", "input MiB", "backend", "NCCL us", "CE us", "window us", "reason"]

PLAN_UNITS = ("input MiB: what each rank puts in (an all-gather bucket: the parameter shards; a reduce-scatter "
              "bucket: the full gradients)")


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
        f"  {PLAN_UNITS}",
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
    lines += format_overlaps(plan, max_rows=max_rows)
    return "\n".join(lines)


def format_overlaps(plan: dict, *, max_rows: int | None = None) -> list[str]:
    """Which tensor-parallel collectives each FSDP bucket runs beside, and what sharing NVLink costs each side
    (the plan's buckets[].overlaps); [] when none does."""
    with_overlaps = [b for b in plan["buckets"] if b.get("overlaps")]
    if not with_overlaps:
        return []
    added_tp = sum(o["collective_added_us"] for b in with_overlaps for o in b["overlaps"])
    added_b = sum(o["bucket_added_us"] for b in with_overlaps for o in b["overlaps"])
    out = [f"  {len(with_overlaps)} FSDP bucket{'s' if len(with_overlaps) != 1 else ''} share NVLink with "
           f"tensor-parallel collectives: +{added_tp:.1f} us to those, +{added_b:.1f} us to the buckets"]
    shown = with_overlaps if max_rows is None else with_overlaps[:max(1, max_rows // 2)]
    for b in shown:
        where = b["block_path"] or "outside blocks"
        beside = ", ".join(f"{o['collective']} ({o['overlap_us']:.0f} us together, +{o['collective_added_us']:.1f} us "
                           f"to it, +{o['bucket_added_us']:.1f} us to the bucket)" for o in b["overlaps"])
        out.append(f"    bucket {b['id']} ({b['type']} {where}, {b['backend']}): {beside}")
    if len(shown) < len(with_overlaps):
        out.append(f"    ... {len(with_overlaps) - len(shown)} more (--all-blocks, or the plan JSON's overlaps)")
    return out


def _reason_kind(reason: str) -> str:
    """A bucket's reason without its numbers and notes: what groups buckets decided alike."""
    head = reason.split("; ")[0]
    return re.sub(r"\d+(\.\d+)?( ?(ms|us|KiB|MiB|GiB|B|%))?", "#", head)


def format_recommendation(report: dict, plans: list[dict], baseline_plans: list[dict], profile: str) -> str:
    """The plans' conclusion in a few lines: which collectives go to the copy engines and why (the cost model's
    reasons, grouped), then the exposed communication and the step against the user's own baseline: Inductor's
    overlap scheduler, modelled by `baseline_plans` (the same planner's order with every bucket on NCCL: ce "off"),
    the step from ce_overlap.analyzer.step_model (compute, exposed communication, the slowdown of the kernels beside the
    collectives, bucket copies, the optimizer). Never against the captured order with every collective exposed,
    which no torch.compile user runs. Ends with what to do (`recommendation`)."""
    buckets = [(p["graph"], b) for p in plans for b in p["buckets"]]
    ce = [(g, b) for g, b in buckets if b["backend"] == "ce"]
    n_coll = sum(len(b["members"]) for _, b in buckets)
    ce_coll = sum(len(b["members"]) for _, b in ce)
    lines = [f"recommendation ({plans[0]['profile'] if plans else report['profile']}): "
             f"{ce_coll} of {n_coll} collectives to the copy engines, in {len(ce)} of {len(buckets)} buckets"]
    groups: dict[tuple[str, str], list] = {}
    for g, b in buckets:
        groups.setdefault((b["backend"], _reason_kind(b["reason"])), []).append((g, b))
    ranked = sorted(groups.items(), key=lambda kv: (kv[0][0] != "ce", -len(kv[1])))
    for (backend, _), members in ranked[:4]:
        g, b = members[0]
        where = b["block_path"] or ("outside blocks" if b["block"] is None else f"block {b['block']}")
        lines.append(f"  {len(members):>4} {'bucket' if len(members) == 1 else 'buckets'} on {backend.upper()}, e.g. "
                     f"{g} bucket {b['id']} ({b['type']}, {where}): {b['reason'].split('; ')[0]}")
    if len(ranked) > 4:
        rest = sum(len(m) for _, m in ranked[4:])
        lines.append(f"  {rest:>4} more bucket{'s' if rest != 1 else ''} (the tables above)")
    r = report.get("recommendation") or recommendation(report, plans, baseline_plans, profile)
    lines.append(f"  exposed communication {r['baseline_exposed_ms']:.2f} ms per step with Inductor's overlap "
                 f"scheduler, {r['ce_overlap_exposed_ms']:.2f} ms with ce_overlap")
    if r["gain_percent"] is not None:
        gain = r["gain_percent"]
        change = f"{gain:.1f}% shorter" if gain >= 0 else f"{-gain:.1f}% longer"
        lines.append(f"  predicted step {r['baseline_step_ms']:.2f} ms with Inductor's overlap scheduler -> "
                     f"{r['ce_overlap_step_ms']:.2f} ms with ce_overlap: {change}")
        lines.append("    (the overlap scheduler modelled as this order with every bucket on NCCL; over torch.compile "
                     "without it, at least as much)")
        lines.append("  " + r["advice"])
    if r.get("host_advice"):
        lines.append("  " + r["host_advice"])
    return "\n".join(lines)


# Under this predicted gain (percent of the step) the advice says the gain is within the cost model's error.
SMALL_GAIN_PERCENT = 2.0


def advice(gain_percent: float, baseline: str, baseline_ms: float, same_plan: bool = False) -> tuple[str, str]:
    """("ce_overlap" or "baseline", one line saying what to do) for a predicted gain over the user's baseline; the one
    rule for every section of the report (one rank group, tensor parallelism, several nodes)."""
    if gain_percent > 0.05:
        small = (f" (small: within the cost model's error, docs/analysis.md; measure it before relying on it)"
                 if gain_percent < SMALL_GAIN_PERCENT else "")
        return "ce_overlap", (f"-> use ce_overlap's pass: {gain_percent:.1f}% shorter than {baseline} "
                              f"({baseline_ms:.2f} ms){small}")
    if same_plan or gain_percent >= -0.05:
        return "baseline", (f"-> don't enable it here: ce_overlap's plan is the same step as {baseline} "
                            f"({baseline_ms:.2f} ms); keep {baseline}")
    return "baseline", (f"-> don't enable it here: ce_overlap's plan is not predicted faster than {baseline} "
                        f"({baseline_ms:.2f} ms, {-gain_percent:.1f}% longer); keep {baseline}")


def recommendation(report: dict, plans: list[dict], baseline_plans: list[dict], profile: str) -> dict:
    """What to do, for the JSON and the text: ce_overlap's plans against the user's own baseline, Inductor's overlap
    scheduler (modelled by `baseline_plans`: the same order with every bucket on NCCL), each step from
    ce_overlap.analyzer.step_model."""
    from .step_model import plans_step_us

    ours, base = plans_step_us(report, plans, profile), plans_step_us(report, baseline_plans, profile)
    r = {"baseline": "Inductor's overlap scheduler", "baseline_step_ms": base["step_us"] / 1e3,
         "ce_overlap_step_ms": ours["step_us"] / 1e3, "baseline_exposed_ms": base["exposed_us"] / 1e3,
         "ce_overlap_exposed_ms": ours["exposed_us"] / 1e3, "gain_percent": None, "use": None, "advice": None,
         "host_ms": None if ours["host_us"] is None else ours["host_us"] / 1e3, "gpu_ms": ours["gpu_us"] / 1e3,
         "host_bound": None}
    if base["step_us"] > 0:
        gain = 100 * (base["step_us"] - ours["step_us"]) / base["step_us"]
        any_ce = any(b["backend"] != "nccl" for p in plans for b in p["buckets"])
        r["gain_percent"] = gain
        r["use"], r["advice"] = advice(gain, r["baseline"], r["baseline_step_ms"], same_plan=not any_ce)
    if r["host_ms"] is not None:
        r["host_bound"] = r["host_ms"] > r["gpu_ms"]
        r["host_advice"] = host_advice(r["host_ms"], r["gpu_ms"])
    return r


def host_advice(host_ms: float, gpu_ms: float) -> str:
    """One line on the host's time to issue a step against the GPU's to run it (step_model.host_step_us, gpu_step_ms):
    what a host-bound step costs and what shortens it."""
    if host_ms <= gpu_ms:
        return (f"host: {host_ms:.2f} ms to issue a step, under the GPU's {gpu_ms:.2f} ms: the GPU bounds the step "
                f"({100 * (1 - host_ms / gpu_ms):.0f}% headroom)")
    idle = host_ms - gpu_ms
    return (f"-> host-bound: the host needs {host_ms:.2f} ms to issue a step the GPU runs in {gpu_ms:.2f} ms, so the "
            f"GPU waits {idle:.2f} ms per step ({100 * idle / host_ms:.0f}% of it) and no plan shortens that: a larger "
            f"batch or sequence per step, or fewer, larger parameters (fewer kernels and graph inputs), does")


_TP_LABELS = {"fsdp2+tp": "FSDP2 + TP on NCCL", "fsdp2+tp+async-tp": "FSDP2 + TP with torch's async TP",
              "ce_overlap+tp": "ce_overlap + TP", "no-comm+tp": "no FSDP communication (bound)"}


def format_tensor_parallel(report: dict) -> str:
    """The tensor-parallel modes' predicted steps (report["tensor_parallel"]: the CLI's) against the faster of FSDP2 +
    TP with and without torch's async TP, what a user runs today; and what to do."""
    t = report["tensor_parallel"]
    steps = t["predicted_step_ms"]
    lines = [f"tensor parallelism over {t['tp']} ranks, FSDP over {t['data_parallel']} "
             f"(bench/train.py --tp {t['tp']}; predicted steps):"]
    for mode, ms in steps.items():
        what = "not predicted (no async-TP capture: --no-async-tp or an IR file)" if ms is None else f"{ms:.2f} ms"
        lines.append(f"  {_TP_LABELS.get(mode, mode):<34} {what}")
    baselines = {m: steps[m] for m in ("fsdp2+tp", "fsdp2+tp+async-tp") if steps.get(m) is not None}
    ours = steps.get("ce_overlap+tp")
    if baselines and ours is not None:
        best = min(baselines, key=baselines.get)
        gain = 100 * (baselines[best] - ours) / baselines[best]
        lines.append("  " + advice(gain, _TP_LABELS[best], baselines[best])[1])
    if not t.get("async_tp_captured"):
        lines.append("  (ce_overlap + TP over the step as captured, TP on NCCL: without an async-TP capture)")
    return "\n".join(lines)


_NODE_LABELS = {"fsdp": "FSDP, flat, NCCL", "fsdp-hierarchical": "FSDP, hierarchical everywhere",
                "fsdp-ce_overlap": "FSDP, ce_overlap (cost model's choice)", "hsdp": "HSDP, NCCL",
                "hsdp-ce_overlap": "HSDP, copy engines inside each node", "no-comm": "no communication (bound)"}


def format_nodes(report: dict) -> str:
    """The multi-node modes' predicted steps (report["nodes"]: the CLI's) and what to do: ce_overlap's plan against
    the same step all on NCCL, the user's baseline."""
    n = report["nodes"]
    steps = n["predicted_step_ms"]
    kind = "HSDP: shards inside each node, replicas across" if n["hsdp"] else "FSDP over every rank"
    lines = [f"{n['nodes']} nodes x {n['ranks_per_node']} ranks, {kind} (predicted steps):"]
    for mode, ms in steps.items():
        lines.append(f"  {_NODE_LABELS.get(mode, mode):<40} {'-' if ms is None else f'{ms:.2f} ms'}")
    base, ours = ("hsdp", "hsdp-ce_overlap") if n["hsdp"] else ("fsdp", "fsdp-ce_overlap")
    if steps.get(base) is not None and steps.get(ours) is not None:
        gain = 100 * (steps[base] - steps[ours]) / steps[base]
        lines.append("  " + advice(gain, _NODE_LABELS[base], steps[base])[1])
    return "\n".join(lines)


def to_chrome_trace(report: dict) -> dict:
    """Chrome/Perfetto trace: one track for compute, one per process group's collectives, times in microseconds."""
    events = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"ce_overlap estimate ({report['profile']})"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "compute stream"}},
    ]
    tracks: dict[str, int] = {}
    for e in report["timeline"]:
        if e["stream"] == "comm" and e.get("group", "") not in tracks:
            tracks[e.get("group", "")] = len(tracks) + 1
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tracks[e.get("group", "")],
                           "args": {"name": f"comm stream, group {e['group']}" if e.get("group") else "comm stream"}})
    for e in report["timeline"]:
        events.append({
            "name": e["name"], "cat": e["kind"], "ph": "X", "pid": 0,
            "tid": tracks[e.get("group", "")] if e["stream"] == "comm" else 0,
            "ts": e["start_us"], "dur": max(e["end_us"] - e["start_us"], 0.0),
            "args": {"op": e["op"], "graph": e["graph"], "block": e["block"]},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(report: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_chrome_trace(report), f)
