"""Inductor's overlap scheduler inside a capture (ce_overlap.inductor.overlap_scheduler): its control_deps put back as
ordinary nodes, its compute estimates from the cost model, and its order priced as captured (step_model)."""
from __future__ import annotations

import argparse
import os
import sys

import pytest
import torch
import torch.fx

import ce_overlap
from ce_overlap.inductor.overlap_scheduler import inline_control_deps, unavailable_reason
from ce_overlap.inductor.to_ir import CaptureError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

needs_scheduler = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def _control_deps():
    from torch._inductor.fx_passes.control_dependencies import control_deps

    return control_deps


def _graph_with_control_deps(n_args: int = 2) -> torch.fx.GraphModule:
    """x, y -> mm(x, y); control_deps((mm,), add-subgraph, x, y) -> out: the add ordered after the mm."""
    sub = torch.fx.Graph()
    ps = [sub.placeholder(f"arg{i}") for i in range(2)]
    sub.output(sub.call_function(torch.ops.aten.add.Tensor, tuple(ps)))
    root = torch.nn.Module()
    root.subgraph_add = torch.fx.GraphModule(torch.nn.Module(), sub)
    g = torch.fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    mm = g.call_function(torch.ops.aten.mm.default, (x, y))
    attr = g.get_attr("subgraph_add")
    add = g.call_function(_control_deps(), ((mm,), attr, *([x, y][:n_args])))
    g.output((add, mm))
    return torch.fx.GraphModule(root, g)


@needs_scheduler
def test_inline_control_deps_puts_the_operation_back_in_its_place():
    gm = _graph_with_control_deps()
    x, y = torch.randn(3, 3), torch.randn(3, 3)
    assert inline_control_deps(gm) == 1
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.aten.mm.default, torch.ops.aten.add.Tensor]  # the order kept, no control_deps
    assert not [n for n in gm.graph.nodes if n.op == "get_attr"]
    add, mm = gm(x, y)  # the module runs the inlined graph
    torch.testing.assert_close(add, x + y)
    torch.testing.assert_close(mm, x @ y)
    assert inline_control_deps(gm) == 0  # nothing left


@needs_scheduler
def test_inline_control_deps_refuses_a_subgraph_it_cannot_read():
    with pytest.raises(CaptureError, match="passes 1 arguments to a subgraph of 2 inputs"):
        inline_control_deps(_graph_with_control_deps(n_args=1))


@needs_scheduler
def test_the_scheduler_captured_and_its_order_priced():
    """The step captured with the scheduler on holds its order as ordinary nodes (no control_deps, the IR reads every
    collective and wait), the meta says so, and step_model prices that order: compute, every collective on NCCL where
    the scheduler put it, each its own bucket (keep_order): at least its compute, at most the all-exposed compile."""
    import train
    from ce_overlap.analyzer.step_model import SCHEDULER_CAPTURED

    args = argparse.Namespace(model="llama3-tiny", layers=2, seq_len=64, batch=1, gqa="expand",
                              vocab_parallel_embeddings=False, in_graph_wrap="torchtitan", fsdp2_wrap="torchtitan")
    sched = train.capture_step(args, 2, overlap_scheduler="h200-sxm")
    assert sched.meta["overlap_scheduler"] == "h200-sxm"
    doc = sched.to_dict()
    ops = {n["op"] for g in doc["graphs"] for n in g["nodes"]}
    assert not any("control_deps" in op for op in ops)
    colls = [n for g in doc["graphs"] for n in g["nodes"] if n["kind"] == "collective"]
    assert {c["collective"]["type"] for c in colls} == {"all_gather", "reduce_scatter"}
    pieces, step_ms = train.predict_steps(args, 2, "h200-sxm", scheduler_ir=sched)
    kept = pieces["scheduler"]["plan"]
    assert sum(p["buckets"] for p in kept.values()) == len(colls)  # one bucket per collective, nothing merged
    compute_ms = sum(g["compute_us"] for g in pieces["scheduler"]["analyze"].values()) / 1e3
    assert compute_ms < step_ms[SCHEDULER_CAPTURED] <= step_ms["compile"]
    assert ce_overlap.analyzer.step_model.predicted_step_ms(pieces, SCHEDULER_CAPTURED) == step_ms[SCHEDULER_CAPTURED]


def test_a_bad_scheduler_profile_is_named_before_the_capture():
    with pytest.raises(ce_overlap.CeOverlapError, match="unknown profile 'h900'"):
        ce_overlap.capture(torch.nn.Linear(2, 2), (torch.zeros(1, 2),), world_size=2, overlap_scheduler="h900")


@needs_scheduler
def test_the_schedulers_collective_estimates_are_the_cost_models_nccl_times():
    """On a GPU the scheduler's collective estimates are NCCL's own (the NCCL group answers them); a capture's fake
    group cannot, so inside running() the cost model's NCCL time answers: the bytes the IR gives the collective, a
    size torch overrides scaled in proportion (0: the latency alone); torch's formula where a caller asks for it."""
    from torch._inductor import comm_analysis
    from torch.fx.experimental.proxy_tensor import make_fx

    from ce_overlap import _core, profiles
    from ce_overlap.inductor.capture import fake_process_group
    from ce_overlap.inductor.overlap_scheduler import running

    with fake_process_group(2, 0) as group:
        name = group.group_name

        def step(x, y):
            ag = torch.ops._c10d_functional.all_gather_into_tensor.default(x, 2, name)
            rs = torch.ops._c10d_functional.reduce_scatter_tensor.default(y, "sum", 2, name)
            wait = torch.ops._c10d_functional.wait_tensor.default
            return wait(ag), wait(rs)

        gm = make_fx(step, tracing_mode="fake")(torch.empty(2048, 4096, dtype=torch.bfloat16),
                                                torch.empty(4096, 4096, dtype=torch.bfloat16))
        ag, rs = [n for n in gm.graph.nodes if "all_gather" in str(n.target) or "reduce_scatter" in str(n.target)]
        estimate = comm_analysis.estimate_nccl_collective_runtime_from_fx_node
        formula_ms = estimate(ag, None, use_nccl_estimator=False)
        profile = _core.Profile.from_json(profiles.read_text("h200-sxm"))

        def model_ms(kind: str, nbytes: int) -> float:
            return _core.estimate_collective(profile, kind, nbytes, 2, "nccl") / 1e3

        with running("h200-sxm"):
            estimate = comm_analysis.estimate_nccl_collective_runtime_from_fx_node
            assert estimate(ag) == pytest.approx(model_ms("all_gather", 16 << 20))  # the IR's bytes: the input
            assert estimate(rs) == pytest.approx(model_ms("reduce_scatter", 32 << 20))
            total = comm_analysis.estimate_fx_collective_size(ag)  # torch's bytes: input and output
            assert estimate(ag, total // 2) == pytest.approx(model_ms("all_gather", 8 << 20))
            assert estimate(ag, 0) == pytest.approx(model_ms("all_gather", 0))
            assert estimate(ag, None, use_nccl_estimator=False) == formula_ms
        assert comm_analysis.estimate_nccl_collective_runtime_from_fx_node(ag) == pytest.approx(formula_ms)
