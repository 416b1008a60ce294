"""The analysis report of a real capture is self-consistent, and its renderings agree with it."""
from __future__ import annotations

import collections

import pytest

import ce_overlap
from ce_overlap.analyzer import report as render
from ce_overlap.ir import plan as plan_graph

_SUMMED = ["forward_all_gather_count", "forward_all_gather_bytes", "backward_all_gather_count",
           "backward_all_gather_bytes", "reduce_scatter_count", "reduce_scatter_bytes", "other_collective_count",
           "other_collective_bytes", "forward_flops", "backward_flops"]


@pytest.fixture(scope="module")
def tiny_report(tiny_ir):
    return ce_overlap.analyze(tiny_ir, "h100-sxm")


def test_totals_are_the_sum_of_rows(tiny_report):
    rows = tiny_report["blocks"] + [tiny_report["outside_blocks"]]
    for key in _SUMMED:
        assert tiny_report["totals"][key] == sum(r[key] for r in rows), key
    for key in ("compute_us", "comm_us", "exposed_comm_us"):
        assert tiny_report["totals"][key] == pytest.approx(sum(r[key] for r in rows)), key
    graphs = tiny_report["graphs"]
    assert tiny_report["totals"]["comm_us"] == pytest.approx(sum(g["comm_us"] for g in graphs))
    assert tiny_report["totals"]["exposed_comm_us"] == pytest.approx(sum(g["exposed_comm_us"] for g in graphs))


def test_exposed_never_exceeds_comm_and_makespan_bounds(tiny_report):
    for row in tiny_report["blocks"] + [tiny_report["outside_blocks"]]:
        assert 0 <= row["exposed_comm_us"] <= row["comm_us"] + 1e-6
    for g in tiny_report["graphs"]:
        assert g["makespan_us"] >= max(g["compute_us"], g["critical_path_us"]) - 1e-6
        assert g["makespan_us"] <= g["compute_us"] + g["comm_us"] + 1e-6
        # captured order waits right after each all-gather: compute + exposed is the whole step
        assert g["makespan_us"] == pytest.approx(g["compute_us"] + g["exposed_comm_us"])


def test_timeline_streams_never_overlap_themselves(tiny_report):
    by_stream = collections.defaultdict(list)
    for e in tiny_report["timeline"]:
        assert e["end_us"] >= e["start_us"]
        by_stream[e["stream"]].append(e)
    assert set(by_stream) == {"compute", "comm"}
    for events in by_stream.values():
        events.sort(key=lambda e: e["start_us"])
        for a, b in zip(events, events[1:]):
            assert b["start_us"] >= a["end_us"] - 1e-6
    comm = [e for e in tiny_report["timeline"] if e["stream"] == "comm"]
    assert len(comm) == sum(g["collectives"] for g in tiny_report["graphs"])


def test_h200_and_h100_share_nvlink_not_hbm(tiny_ir, tiny_report):
    # Same NVLink 4 (18 links) and NCCL, so the same collective times within what each board measured for NCCL's
    # bus efficiency per group size (nccl.bus_efficiency_scale: 4x H200 and 4x H100 agree within 3%); H200 has the
    # faster HBM.
    h200 = ce_overlap.analyze(tiny_ir, "h200-sxm")
    assert h200["totals"]["forward_all_gather_bytes"] == tiny_report["totals"]["forward_all_gather_bytes"]
    assert h200["totals"]["comm_us"] == pytest.approx(tiny_report["totals"]["comm_us"], rel=0.03)
    assert h200["totals"]["compute_us"] <= tiny_report["totals"]["compute_us"]  # tiny kernels sit at the launch floor
    assert ce_overlap.analyze(tiny_ir, "a100-sxm")["totals"]["comm_us"] > h200["totals"]["comm_us"]


def test_table_has_a_row_per_block_and_the_totals(tiny_report):
    table = render.format_table(tiny_report)
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["block", "module"]
    assert [l.split()[1] for l in lines[2:4]] == ["layers.0", "layers.1"]
    total = lines[-1].split()
    t = tiny_report["totals"]
    assert total[0] == "total"
    assert int(total[1]) == t["forward_all_gather_count"]
    assert float(total[2]) == pytest.approx(t["forward_all_gather_bytes"] / 2**20, abs=0.05)


def test_the_summary_gives_the_kernel_time_per_class_of_one_step(tiny_report):
    """What a user holds against a profiler's kernel table: the analysis's compute by class, both graphs summed."""
    text = render.format_summary(tiny_report)
    line = next(l for l in text.splitlines() if l.startswith("kernel time per step by class"))
    total = {c: sum(g["compute_by_class_us"][c] for g in tiny_report["graphs"]) / 1e3
             for c in ("matmul", "attention", "memory_bound")}
    assert f"GEMMs {total['matmul']:.2f} ms" in line
    assert f"attention {total['attention']:.2f} ms" in line
    assert f"fused / memory-bound {total['memory_bound']:.2f} ms" in line


def test_byte_columns_say_what_they_count(tiny_ir, tiny_report):
    header = render.format_table(tiny_report).splitlines()[0]
    assert "fwd AG out MiB" in header and "RS in MiB" in header
    assert render.table_units(tiny_report) == (
        "per rank and step: fwd AG out MiB = the gathered parameters the forward's all-gathers produce; "
        "RS in MiB = the full gradients the reduce-scatters take (each rank keeps 1/8)")
    plan = ce_overlap.ir.plan(tiny_ir, "backward", "h100-sxm")
    lines = render.format_plan(plan).splitlines()
    assert lines[2] == "  " + render.PLAN_UNITS and "input MiB" in lines[3].split("  ")
    # the numbers under those labels: a reduce-scatter bucket's input is the full gradient, an all-gather's the
    # shards (1/8 of the gathered bytes)
    rs = next(b for b in plan["buckets"] if b["type"] == "reduce_scatter" and b["block_path"] == "layers.0")
    ag = next(b for b in plan["buckets"] if b["type"] == "all_gather" and b["block_path"] == "layers.0")
    row = tiny_report["blocks"][0]
    assert rs["bytes"] == row["reduce_scatter_bytes"]
    assert ag["bytes"] * 8 == row["backward_all_gather_bytes"]


def test_recommendation_sums_the_plans(tiny_ir, tiny_report):
    from ce_overlap.analyzer.step_model import plans_step_us

    plans = [ce_overlap.ir.plan(tiny_ir, g, "h100-sxm", {"ce": "on", "min_ce_bytes": 0}) for g in tiny_ir.graph_names]
    baseline = [ce_overlap.ir.plan(tiny_ir, g, "h100-sxm", {"ce": "off"}) for g in tiny_ir.graph_names]
    assert all(b["backend"] == "nccl" for p in baseline for b in p["buckets"])
    text = render.format_recommendation(tiny_report, plans, baseline, "h100-sxm")
    lines = text.splitlines()
    buckets = [b for p in plans for b in p["buckets"]]
    collectives = sum(len(b["members"]) for b in buckets)
    assert lines[0] == (f"recommendation (h100-sxm): {collectives} of {collectives} collectives to the copy engines, "
                        f"in {len(buckets)} of {len(buckets)} buckets")
    assert sum(int(line.split()[0]) for line in lines[1:] if line.strip()[0].isdigit()) == len(buckets)
    ms = lambda us: f"{us / 1000:.2f}"  # noqa: E731
    ours, base = plans_step_us(tiny_report, plans, "h100-sxm"), plans_step_us(tiny_report, baseline, "h100-sxm")
    # The baseline is the user's: Inductor's overlap scheduler (the same order, every bucket on NCCL), never the
    # captured order with every collective exposed.
    assert (f"  exposed communication {ms(base['exposed_us'])} ms per step with Inductor's overlap scheduler, "
            f"{ms(ours['exposed_us'])} ms with ce_overlap") in text
    gain = 100 * (base["step_us"] - ours["step_us"]) / base["step_us"]
    change = f"{gain:.1f}% shorter" if gain >= 0 else f"{-gain:.1f}% longer"
    assert (f"  predicted step {ms(base['step_us'])} ms with Inductor's overlap scheduler -> {ms(ours['step_us'])} ms "
            f"with ce_overlap: {change}\n") in text
    everything_exposed = sum(p["summary"]["exposed_comm_us_before"] for p in plans)
    assert ms(everything_exposed) not in text or everything_exposed == base["exposed_us"]
    # The step: compute and exposed communication per graph, the kernels' slowdown, bucket copies and the optimizer.
    compute = sum(g["compute_us"] for g in tiny_report["graphs"])
    assert ours["step_us"] >= compute + ours["exposed_us"] + ours["optimizer_us"] > compute > 0
    # The same plans as the baseline: no gain.
    same = render.format_recommendation(tiny_report, baseline, baseline, "h100-sxm")
    assert ": 0.0% shorter\n" in same


def test_chrome_trace_matches_timeline(tiny_report):
    trace = render.to_chrome_trace(tiny_report)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(tiny_report["timeline"])
    assert spans[0]["ts"] == tiny_report["timeline"][0]["start_us"]


def test_the_recommendation_says_what_to_do_with_the_plan_it_was_given(tiny_ir):
    """The plan as the user asked for it against their baseline (the same order, every bucket on NCCL): where it is
    predicted slower (every bucket forced onto the copy engines on a model this small) the advice is to keep the
    baseline; where the cost model chooses (ce auto) it is within a hair of it or faster (the planner prices each bucket
    alone, not the whole order: 0.06% slower on this model since 2026-12-01's fusion rule), and a gain under 2% says it
    is small."""
    report = ce_overlap.analyze(tiny_ir, "h100-sxm")
    base_config = {"min_ce_bytes": 0}
    plan = lambda config: [plan_graph(tiny_ir, g, "h100-sxm", config) for g in tiny_ir.graph_names]  # noqa: E731
    baseline = plan({**base_config, "ce": "off"})
    forced = render.recommendation(report, plan({**base_config, "ce": "on"}), baseline, "h100-sxm")
    assert forced["use"] == "baseline" and forced["gain_percent"] < 0
    assert forced["advice"].startswith("-> don't enable it here: ce_overlap's plan is not predicted faster than "
                                       "Inductor's overlap scheduler") and "keep Inductor's overlap scheduler" in \
        forced["advice"]
    text = render.format_recommendation({**report, "recommendation": forced}, plan({**base_config, "ce": "on"}),
                                        baseline, "h100-sxm")
    assert text.splitlines()[-1] == "  " + forced["advice"]
    chosen = render.recommendation(report, plan(base_config), baseline, "h100-sxm")
    assert chosen["gain_percent"] >= -0.1
    same = render.recommendation(report, baseline, baseline, "h100-sxm")
    assert same["use"] == "baseline" and "the same step as" in same["advice"]
    assert "(small: within the cost model's error" in render.advice(1.0, "X", 10.0)[1]
    assert render.advice(5.0, "X", 10.0) == ("ce_overlap", "-> use ce_overlap's pass: 5.0% shorter than X (10.00 ms)")


def test_the_host_advice_says_when_the_step_is_host_bound():
    """The recommendation's host line: under the GPU's step, the headroom; over it, host-bound, the GPU's wait per
    step and what shortens it (no plan does)."""
    assert render.host_advice(8.0, 10.0) == ("host: 8.00 ms to issue a step, under the GPU's 10.00 ms: the GPU bounds "
                                             "the step (20% headroom)")
    bound = render.host_advice(15.0, 10.0)
    assert bound.startswith("-> host-bound: the host needs 15.00 ms to issue a step the GPU runs in 10.00 ms, so the "
                            "GPU waits 5.00 ms per step (33% of it) and no plan shortens that")


def test_a_small_model_on_the_h200_profile_is_called_host_bound(tiny_ir):
    """h200-sxm prices the host (its `host` section, fitted to host-bound steps): the tiny model's step is the host's,
    the recommendation says so after its advice, and its predicted steps are the host's time, plan or no plan."""
    report = ce_overlap.analyze(tiny_ir, "h200-sxm")
    plans = [plan_graph(tiny_ir, g, "h200-sxm", {"ce": "auto"}) for g in tiny_ir.graph_names]
    baseline = [plan_graph(tiny_ir, g, "h200-sxm", {"ce": "off"}) for g in tiny_ir.graph_names]
    r = render.recommendation(report, plans, baseline, "h200-sxm")
    assert r["host_bound"] and r["host_ms"] > r["gpu_ms"] > 0
    assert r["ce_overlap_step_ms"] == pytest.approx(r["host_ms"])
    text = render.format_recommendation({**report, "recommendation": r}, plans, baseline, "h200-sxm")
    assert text.splitlines()[-1] == "  " + r["host_advice"] and "-> host-bound: the host needs" in text
